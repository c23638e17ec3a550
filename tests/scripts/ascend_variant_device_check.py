"""The Ascend variant (persistent grid of 3 programs, NPU tiles, NPU substitutes) compiled and run on a
CUDA GPU through community Triton, against the reference bits computed on CPU.

    LOCKSTEP_ASCEND_NPU_LAYOUT=1 python tests/scripts/ascend_variant_device_check.py --device cuda

Triton's real compiler instead of the interpreter: checks that the variant's source keeps its bits
when compiled (int64 tests, bit operations, persistent loops); it says nothing about triton-ascend's
compiler. Prints one line per output and "same bits" when nothing differs.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import ascend_launch, matmul, rms_norm, softmax, token_logprobs  # noqa: E402
from hal.spec import DEFAULTS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    dev = ap.parse_args().device
    assert os.environ.get("LOCKSTEP_ASCEND_NPU_LAYOUT") == "1"
    g = torch.Generator().manual_seed(5)

    def r(*shape, dtype=torch.float32, scale=3.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    sx = r(37, 1000, dtype=torch.float16)
    sx[3, 7] = float("nan")
    sx[9] = float("-inf")
    sf = r(21, 700)
    h, res, w = r(33, 700, dtype=torch.float16), r(33, 700, dtype=torch.float16), r(700, dtype=torch.float16)
    a, b = r(100, 300, dtype=torch.bfloat16), r(300, 200, dtype=torch.bfloat16)
    xd, wd, bias = r(5, 1000), r(300, 1000, scale=0.05), r(300)
    hid, lm = r(40, 256), r(3000, 256, scale=0.1)
    tok = torch.randint(0, 3000, (40,), generator=g)
    cases = [
        ("softmax fp16", lambda **k: hal.softmax(sx, **k), lambda t: softmax.softmax(t(sx), DEFAULTS["softmax"])),
        ("log_softmax fp32", lambda **k: hal.log_softmax(sf, **k),
         lambda t: softmax.log_softmax(t(sf), DEFAULTS["softmax"])),
        ("logsumexp fp16", lambda **k: hal.logsumexp(sx, **k), lambda t: softmax.logsumexp(t(sx), DEFAULTS["softmax"])),
        ("rms_norm+res fp16", lambda **k: hal.rms_norm(h, w, 1e-6, residual=res, **k),
         lambda t: rms_norm.rms_norm(t(h), t(w), 1e-6, t(res), DEFAULTS["rms_norm"])),
        ("matmul bf16", lambda **k: hal.matmul(a, b, **k), lambda t: matmul.matmul(t(a), t(b), DEFAULTS["matmul"])),
        ("linear gemv fp32", lambda **k: hal.linear(xd, wd, bias, **k),
         lambda t: matmul.linear(t(xd), t(wd), t(bias), DEFAULTS["linear"] if "linear" in DEFAULTS else DEFAULTS["matmul"])),
        ("token_logprobs T0.7", lambda **k: hal.token_logprobs(hid, lm, tok, temperature=0.7, **k),
         lambda t: token_logprobs.token_logprobs(t(hid), t(lm), t(tok), 0.7, DEFAULTS["token_logprobs"])),
    ]
    bad = 0
    to_dev = lambda x: x.to(dev)  # noqa: E731
    for name, ref_fn, var_fn in cases:
        want = ref_fn(backend="reference")
        try:
            with ascend_launch.variant("cpu"):  # 3 programs: persistent loops over many items
                got = var_fn(to_dev)
        except Exception as exc:
            print(f"{name}: ERROR {type(exc).__name__}: {exc}"[:400], flush=True)
            bad += 1
            continue
        pairs = zip(want, got) if isinstance(want, tuple) else [(want, got)]
        for i, (wt, gt) in enumerate(pairs):
            d = first_divergence(f"{name}#{i}", wt, gt.cpu())
            print(f"{name}#{i}: {'same bits' if d is None else d}", flush=True)
            bad += d is not None
    print("same bits" if not bad else f"{bad} outputs differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
