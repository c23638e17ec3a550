"""Triton attention backward kernels: gradients close to a float64 oracle, deterministic, zero where they must be.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_attention_backward.py.
Usage: python tests/scripts/triton_attn_backward_check.py CHECK...; prints "CHECK: ok ..." / "CHECK: FAIL ..." lines.
CI runs the first cases; LOCKSTEP_FULL=1 runs every case (more dtypes, head dims, window modes).

The gradients go through hal's API (``hal.flash_attn_varlen_func(..., backend="triton")`` and autograd),
so the backend hook is what is tested. Correctness: each gradient within a dtype tolerance of
``hal.attention._backward_math`` run on the same inputs in float64 (backward bits are not a spec).
Determinism: a second run (a direct kernel call on the same forward results) gives the autograd
gradients' raw bits, which also shows that autograd ran the kernels. Zeros: padding rows, queries that see no key, keys of an empty batch tail.
Negative control: the same closeness check catches kernels that drop the dlse term.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report as _report  # noqa: E402

import hal  # noqa: E402
from hal.attention import _backward_math  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import attention_backward as bwd  # noqa: E402

FULL = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")
#: max |grad - oracle| <= TOL * max |oracle| per gradient (bf16: P and dS go to the tensor cores in bf16,
#: and the interpreter truncates fp32 -> bf16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
#: (lens_q, lens_k): an empty sequence, Tq < Tk, a sequence with more queries than keys (its first
#: causal rows see no key), and a trailing empty sequence; two padding rows / keys past the last one.
LENS = ((19, 3, 0, 5, 9, 0), (37, 3, 2, 2, 20, 0))
CASES = [  # dtype, causal, window, Hq, Hkv, D
    (torch.float32, True, (-1, -1), 2, 1, 10),
    (torch.bfloat16, True, (11, -1), 4, 2, 16),
    (torch.float16, False, (9, 5), 2, 1, 8),
    (torch.float32, False, (-1, -1), 3, 3, 24),
    (torch.bfloat16, False, (4, -1), 4, 1, 40),
    (torch.float16, True, (6, 3), 2, 2, 64),
]


def _pick(cases):
    return cases if FULL else cases[:3]


def _inputs(seed, dt, hq, hkv, d):
    g = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0, *torch.tensor(LENS[0]).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(LENS[1]).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cq[-1]) + 2, int(ck[-1]) + 2
    q, k, v = (torch.randn(n, h, d, generator=g).to(dt) for n, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    gout = torch.randn(tq, hq, d, generator=g).to(dt)
    glse = torch.randn(hq, tq, generator=g)
    return q, k, v, cq, ck, gout, glse


def _grads(q, k, v, cq, ck, causal, window, gout, glse):
    """((dq, dk, dv), out, lse) through hal's API on the triton backend, with an lse gradient."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = hal.flash_attn_varlen_func(q, k, v, cq, ck, max(LENS[0]), max(LENS[1]), 0.3, causal, window,
                                          return_lse=True, backend="triton")
    return torch.autograd.grad((out, lse), (q, k, v), (gout, glse)), out.detach(), lse.detach()


def _direct(q, k, v, out, lse, cq, ck, causal, window, gout, glse):
    return bwd.flash_attn_varlen_backward(q, k, v, out, lse, cq, ck, max(LENS[0]), max(LENS[1]), 0.3, causal,
                                          window, gout, glse)


def _oracle(q, k, v, cq, ck, causal, window, gout, glse):
    f = lambda x: x.to(torch.float64)  # noqa: E731
    return _backward_math(f(q), f(k), f(v), cq, ck, 0.3, causal, window, f(gout), f(glse))


def _close(got, want, dt):
    """The first gradient farther than TOL from the oracle, as a message; None when all are close."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        scale = float(b.abs().max())
        err = float((a.to(torch.float64) - b).abs().max())
        if scale == 0 or not err <= TOL[dt] * scale:
            return f"{name}: max error {err:.3g} vs max |oracle| {scale:.3g} (tolerance {TOL[dt]:g} relative)"
    return None


def _zero_rows(q, cq, causal, window, dq):
    """dq must be exactly +0.0 on padding rows and on queries that see no key."""
    zero = torch.zeros((), dtype=dq.dtype)
    rows = list(range(int(cq[-1]), q.shape[0]))  # padding rows
    if causal:  # sequence 3 (5 queries, 2 keys): rows at positions -3..-1 see nothing
        rows += [int(cq[3]) + i for i in range(3)]
    for r in rows:
        d = first_divergence(f"dq[{r}]", zero.expand_as(dq[r]).contiguous(), dq[r].contiguous())
        if d is not None:
            return str(d)
    return None


def grads():
    for i, (dt, causal, window, hq, hkv, d) in enumerate(_pick(CASES)):
        q, k, v, cq, ck, gout, glse = _inputs(i, dt, hq, hkv, d)
        label = f"grads[{dt},causal={causal},window={window},Hq{hq}/{hkv},D{d}]"
        got, out, lse = _grads(q, k, v, cq, ck, causal, window, gout, glse)
        _report(f"{label} close to float64 oracle", _close(got, _oracle(q, k, v, cq, ck, causal, window, gout, glse), dt))
        # a second run (the kernels called directly on the same forward results) gives the same bits: the
        # kernels are deterministic, and autograd ran them (not hal's torch backward)
        again = _direct(q, k, v, out, lse, cq, ck, causal, window, gout, glse)
        bad = [s for s in (first_divergence(n, a, b) for n, a, b in zip(("dq", "dk", "dv"), got, again)) if s]
        _report(f"{label} second run same bits", str(bad[0]) if bad else None)
        _report(f"{label} zero rows", _zero_rows(q, cq, causal, window, got[0]))


def negative():
    """Kernels that drop the dlse term: the closeness check must fail. The forward is the reference backend's
    (the same bits as the triton forward, and no interpreter time)."""
    dt, causal, window, hq, hkv, d = CASES[0]
    q, k, v, cq, ck, gout, glse = _inputs(0, dt, hq, hkv, d)
    out, lse = hal.flash_attn_varlen_func(q, k, v, cq, ck, max(LENS[0]), max(LENS[1]), 0.3, causal, window,
                                          return_lse=True, backend="reference")
    want = _oracle(q, k, v, cq, ck, causal, window, gout, glse)
    _report("negative-control[right kernels pass]", _close(_direct(q, k, v, out, lse, cq, ck, causal, window, gout,
                                                                   glse), want, dt))
    got = _direct(q, k, v, out, lse, cq, ck, causal, window, gout, None)  # the kernels never see glse: no dlse term
    problem = _close(got, want, dt)
    _report("negative-control[dlse term dropped]", None if problem else "wrong variant NOT caught")
    if problem:
        print(f"negative-control: wrong variant caught ({problem})", flush=True)


CHECKS = {"grads": grads, "negative": negative}

if __name__ == "__main__":
    main(CHECKS)
