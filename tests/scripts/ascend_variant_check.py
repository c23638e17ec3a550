"""The Ascend variant with its NPU tiles, in the Triton interpreter, against the reference bits.

Run by tests/test_ascend.py in a subprocess (TRITON_INTERPRET=1, LOCKSTEP_ASCEND_NPU_LAYOUT=1): small
cases whose NPU-sized blocks give more work items than the interpreter's 3 fake cores, so programs
loop over several items (persistent grid), with the NPU substitutes (division, sqrt, fp16 rounding).
    --short-work   negative control: launch with n_work - 1 (the last work item is never computed);
                   softmax cases only
Prints one line per case and "same bits" when nothing differs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import ascend_launch, launch as launch_mod  # noqa: E402
from _variants import dropped_last_work_item  # noqa: E402


def cases(g):
    def r(*shape, dtype=torch.float32, scale=3.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    x = r(13, 40, dtype=torch.float16)
    x[2, 5] = float("nan")
    x[7] = float("-inf")
    yield "softmax[13x40 fp16]", lambda **kw: hal.softmax(x, **kw)
    yield "log_softmax[13x40 fp16]", lambda **kw: hal.log_softmax(x, **kw)
    h, res, w = r(9, 40, dtype=torch.float16), r(9, 40, dtype=torch.float16), r(40, dtype=torch.float16)
    yield "rms_norm+res[9x40 fp16]", lambda **kw: hal.rms_norm(h, w, 1e-6, residual=res, **kw)
    a, b = r(40, 70, dtype=torch.bfloat16), r(70, 130, dtype=torch.bfloat16)
    yield "matmul[40x70x130 bf16]", lambda **kw: hal.matmul(a, b, **kw)
    xd, wd, bias = r(3, 200), r(70, 200, scale=0.1), r(70)
    yield "linear gemv[3x200x70 fp32]", lambda **kw: hal.linear(xd, wd, bias, **kw)
    hid, lm, tok = r(20, 70), r(600, 70, scale=0.2), torch.randint(0, 600, (20,), generator=g)
    yield "token_logprobs[20, V600, H70, T0.7]", lambda **kw: hal.token_logprobs(hid, lm, tok, temperature=0.7, **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short-work", action="store_true")
    args = ap.parse_args()
    assert launch_mod.interpreting() and os.environ.get("LOCKSTEP_ASCEND_NPU_LAYOUT") == "1"
    with dropped_last_work_item() if args.short_work else contextlib.nullcontext():
        return _compare(args)


def _compare(args) -> int:
    g = torch.Generator().manual_seed(12)
    bad = []
    for i_case, (name, fn) in enumerate(cases(g)):
        if args.short_work and i_case >= 2:  # the control needs only to show that a dropped item is seen
            break
        want, got = fn(backend="reference"), fn(backend="ascend")
        pairs = zip(want, got) if isinstance(want, tuple) else [(want, got)]
        for i, (w, o) in enumerate(pairs):
            d = first_divergence(f"{name}#{i}", w, o)
            print(f"{name}#{i}: {'same bits' if d is None else d}")
            bad += [d] if d else []
    print("same bits" if not bad else f"{len(bad)} outputs differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
