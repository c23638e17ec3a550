"""Triton GDN backward state-scan kernels: close to float64, deterministic, used by the triton backend's autograd.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_gdn_backward.py.
Usage: python tests/scripts/triton_gdn_backward_check.py CHECK...; prints "CHECK: ok ..." / "CHECK: FAIL ..." lines.
CI runs the first cases; LOCKSTEP_FULL=1 runs every case (more chunks, masked head dims, more heads).

* ``scan``: kernels/triton/gdn_backward.state_scan's outputs and gradients (float32) within TOL of
  hal.gdn_backward.state_scan (the torch loop) in float64, with and without a gradient into S_starts; a second
  run gives the same raw bits.
* ``e2e``: gradients of ``hal.chunk_gated_delta_rule(..., backend="triton")`` (varlen, GQA, initial state, L2
  norm) within TOL of the float64 token-by-token oracle under autograd; the Triton scan ran (counted); a second
  backward of the same forward gives the same raw bits.
* ``negative``: a scan whose backward drops the end_c decay of dS fails both closeness checks.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report as _report  # noqa: E402
from _variants import kernel_variant  # noqa: E402

import hal  # noqa: E402
from hal import gdn_backward  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.oracle.gated_delta_rule import gated_delta_rule as oracle  # noqa: E402
from hal.kernels.triton import gdn_backward as kb  # noqa: E402

FULL = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")
F32, F64 = torch.float32, torch.float64
#: max |got - float64| <= TOL * max |float64| per tensor (float32 compute; measured <= 3.9e-7)
TOL = 1e-5
SCAN_CASES = [  # n, hv, nc, dk, dv: d_v 32 has two column blocks in the interpreter (partial sums)
    (2, 2, 3, 16, 32),
    (1, 2, 2, 32, 16),
    (1, 3, 4, 20, 24),   # masked head dims
    (2, 1, 1, 32, 48),
]
E2E_CASES = [  # B, T, H, HV, dk, dv, cu_seqlens (chunks of 64: the first sequence crosses a chunk boundary)
    (1, 90, 1, 2, 16, 32, [0, 70, 90]),
    (2, 70, 2, 4, 32, 16, None),
    (1, 200, 1, 2, 32, 32, [0, 5, 140, 200]),
]


def _pick(cases):
    return cases if FULL else cases[:2]


def _close(names, got, want):
    """The first tensor farther than TOL (relative to its largest float64 value), as a message; None when all are."""
    for name, a, b in zip(names, got, want):
        scale = float(b.abs().max())
        err = float((a.detach().to(F64) - b).abs().max())
        if scale == 0 or not err <= TOL * scale:
            return f"{name}: max error {err:.3g} vs max |float64| {scale:.3g} (tolerance {TOL:g} relative)"
    return None


def _same(names, a, b):
    bad = [s for s in (first_divergence(n, x.detach(), y.detach()) for n, x, y in zip(names, a, b)) if s]
    return str(bad[0]) if bad else None


SCAN_NAMES = ("u", "S_starts", "S_end", "dU", "dW", "dkt", "dend", "dS0")


def _scan_inputs(seed, n, hv, nc, dk, dv):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(n, hv, nc, 64, dv, generator=g)
    W = torch.randn(n, hv, nc, 64, dk, generator=g) * 0.1
    kt = torch.randn(n, hv, nc, dk, 64, generator=g) * 0.1
    end = torch.rand(n, hv, nc, generator=g)
    S0 = torch.randn(n, hv, dk, dv, generator=g)
    cots = [torch.randn(s, generator=g) for s in ((n, hv, nc, 64, dv), (n, hv, nc, dk, dv), (n, hv, dk, dv))]
    return [U, W, kt, end, S0], cots


def _scan_run(fn, ins, cots, dtype, with_starts=True):
    """Outputs and gradients of ``fn`` (loss sum(u du) [+ sum(S_starts dS_starts)] + sum(S_end dS_end))."""
    leaves = [x.to(dtype).requires_grad_(True) for x in ins]
    outs = fn(*leaves)
    used = [(o, c.to(dtype)) for i, (o, c) in enumerate(zip(outs, cots)) if with_starts or i != 1]
    grads = torch.autograd.grad([o for o, _ in used], leaves, [c for _, c in used])
    return [o.detach() for o in outs] + list(grads)


def _scan_problem(ins, cots, with_starts):
    got = _scan_run(kb.state_scan, ins, cots, F32, with_starts)
    want = _scan_run(gdn_backward.state_scan, ins, cots, F64, with_starts)
    return got, _close(SCAN_NAMES, got, want)


def scan():
    for i, shape in enumerate(_pick(SCAN_CASES)):
        ins, cots = _scan_inputs(i, *shape)
        for with_starts in (True, False):
            label = f"scan[n,hv,nc,dk,dv={shape},dS_starts={with_starts}]"
            got, problem = _scan_problem(ins, cots, with_starts)
            _report(f"{label} close to float64 torch scan", problem)
            again = _scan_run(kb.state_scan, ins, cots, F32, with_starts)
            _report(f"{label} second run same bits", _same(SCAN_NAMES, got, again))


E2E_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dS0")


def _e2e_inputs(seed, B, T, H, HV, dk, dv, cu):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, HV, dv, generator=g)
    lg = -torch.rand(B, T, HV, generator=g)
    beta = torch.rand(B, T, HV, generator=g)
    n = B if cu is None else len(cu) - 1
    S0 = torch.randn(n, HV, dk, dv, generator=g)
    do = torch.randn(B, T, HV, dv, generator=g)
    dfin = torch.randn(n, HV, dk, dv, generator=g)
    return [q, k, v, lg, beta, S0], (do, dfin)


def _e2e_grads(x, cot, cu, runs=1):
    """Gradients through hal's API on the triton backend (the forward in the interpreter); ``runs`` backward
    passes of the one forward (each recomputes, the Triton scan included)."""
    leaves = [t.clone().requires_grad_(True) for t in x]
    o, fin = hal.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=None if cu is None else torch.tensor(cu), backend="triton")
    got = [torch.autograd.grad((o, fin), leaves, cot, retain_graph=True) for _ in range(runs)]
    return got if runs > 1 else got[0]


def _oracle_grads(x, cot, cu):
    ref = [t.double().requires_grad_(True) for t in x]
    o, fin = oracle(*ref[:5], x[0].shape[-1] ** -0.5, ref[5], cu, True, F64)
    return torch.autograd.grad((o, fin), ref, (cot[0].double(), cot[1].double()))


class _Counted:
    """Counts the triton backend's calls of the Triton scan (the hook in backends/triton_seq.py)."""

    def __enter__(self):
        self.calls, self.real = 0, kb.state_scan

        def counted(*a):
            self.calls += 1
            return self.real(*a)
        kb.state_scan = counted
        return self

    def __exit__(self, *exc):
        kb.state_scan = self.real


def e2e():
    for i, (B, T, H, HV, dk, dv, cu) in enumerate(_pick(E2E_CASES)):
        x, cot = _e2e_inputs(i, B, T, H, HV, dk, dv, cu)
        label = f"e2e[B{B},T{T},H{H}/{HV},dk{dk},dv{dv},cu={cu}]"
        with _Counted() as c:
            got, again = _e2e_grads(x, cot, cu, runs=2)
        _report(f"{label} triton scan ran", None if c.calls == 2 else f"{c.calls} calls of the Triton scan, not 2")
        _report(f"{label} close to float64 oracle", _close(E2E_NAMES, got, _oracle_grads(x, cot, cu)))
        _report(f"{label} second backward same bits", _same(E2E_NAMES, got, again))


def negative():
    """The backward that drops end_c from dS <- end_c dS - ...: the scan and end-to-end checks must both fail."""
    ins, cots = _scan_inputs(0, *SCAN_CASES[0])
    B, T, H, HV, dk, dv, cu = E2E_CASES[0]
    x, cot = _e2e_inputs(0, B, T, H, HV, dk, dv, cu)
    want = _oracle_grads(x, cot, cu)
    _report("negative-control[right kernels pass scan]", _scan_problem(ins, cots, True)[1])
    with kernel_variant(kb, "_scan_bwd_kernel", "dS = tl.load(END + ch) * dS", "dS = dS  # the decay forgotten"):
        scan_problem = _scan_problem(ins, cots, True)[1]
        e2e_problem = _close(E2E_NAMES, _e2e_grads(x, cot, cu), want)
    for what, problem in (("scan", scan_problem), ("e2e", e2e_problem)):
        _report(f"negative-control[decay dropped, {what} check]", None if problem else "wrong variant NOT caught")
        if problem:
            print(f"negative-control: wrong variant caught by the {what} check ({problem})", flush=True)


CHECKS = {"scan": scan, "e2e": e2e, "negative": negative}

if __name__ == "__main__":
    main(CHECKS)
