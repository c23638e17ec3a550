"""Forward + backward time of the gated delta rule: lockstep's chunked backward (default), its
token-by-token recompute (LOCKSTEP_GDN_BACKWARD=recurrent), and transformers'
torch_chunk_gated_delta_rule forward + autograd backward (the stock comparison), same tensors, same run.
On CUDA the lockstep rows run the triton backend, whose chunked backward takes the Triton state-scan
kernels (kernels/triton/gdn_backward.py); one more row runs the same with the torch scan
(LOCKSTEP_GDN_BACKWARD=chunked-torch) for comparison.

    python -m benchmarks.gdn_backward [--device cpu|cuda] [--T 512 4096] [--repeats 3] [--no-recurrent]

B=1, H_v=4, H_qk=2, d_k=d_v=128, fp32, in-kernel L2 norm, loss = sum(o * do) + sum(final * dfinal).
Prints seconds per call (median and min over interleaved rounds; the token-by-token row is timed once)
and the ratio of the mins to the stock forward+backward row; forward-only rows for context. Figures are for this
machine only; compare ratios, not seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import hal


def _inputs(T, device, B=1, H=2, HV=4, d=128):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, d, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, d, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    do = torch.randn(B, T, HV, d, generator=gen)
    dfin = torch.randn(B, HV, d, d, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta)], do.to(device), dfin.to(device)


def _seconds(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _timed_rows(rows, repeats, device):
    """{name: [seconds...]}: one untimed warm-up call per row, then ``repeats`` rounds that call
    every row once in turn (so a busy machine slows all rows alike). A row marked single (the
    token-by-token backward: minutes at long T) is timed once, without warm-up, after the others
    have warmed the shared paths."""
    times = {name: [] for name, _, _ in rows}
    many = [(name, fn) for name, fn, single in rows if not single]
    for _, fn in many:
        fn()
    for _ in range(repeats):
        for name, fn in many:
            times[name].append(_seconds(fn, device))
    for name, fn, single in rows:
        if single:
            times[name].append(_seconds(fn, device))
    return times


def _step(forward, x, do, dfin):
    """One forward + backward of ``forward`` over fresh leaves; returns the gradients."""
    leaves = [t.detach().clone().requires_grad_(True) for t in x]
    o, fin = forward(*leaves)
    torch.autograd.backward((o, fin), (do, dfin))
    return [t.grad for t in leaves]


def _no_grad(forward, x):
    with torch.no_grad():
        return forward(*x)


BACKEND = None  # the lockstep rows' backend: "triton" on CUDA (set by main), automatic on the CPU


def _lockstep(q, k, v, g, beta):
    return hal.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      backend=BACKEND)


def _stock(q, k, v, g, beta):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)


def _with_form(form, fn):
    def run():
        old = os.environ.get("LOCKSTEP_GDN_BACKWARD")
        os.environ["LOCKSTEP_GDN_BACKWARD"] = form
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["LOCKSTEP_GDN_BACKWARD"]
            else:
                os.environ["LOCKSTEP_GDN_BACKWARD"] = old
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--T", nargs="*", type=int, default=[512, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-recurrent", action="store_true", help="skip the token-by-token backward (slow)")
    args = p.parse_args(argv)
    global BACKEND
    BACKEND = "triton" if args.device == "cuda" else None
    print(f"device {args.device}, lockstep backend {BACKEND or 'auto'}, torch threads {torch.get_num_threads()}, "
          f"B1 H2/4 D128 fp32, {args.repeats} interleaved rounds; seconds per call (median, min); ratio of the "
          "mins to stock forward+backward")
    print(f"{'T':>6} {'row':<28} {'median':>9} {'min':>9} {'/ stock':>8}")
    for T in args.T:
        x, do, dfin = _inputs(T, args.device)
        rows = [("stock (transformers chunk)", lambda: _step(_stock, x, do, dfin), False),
                ("stock forward only", lambda: _no_grad(_stock, x), False),
                ("lockstep forward only", lambda: _no_grad(_lockstep, x), False),
                ("lockstep chunked backward", _with_form("chunked", lambda: _step(_lockstep, x, do, dfin)), False)]
        if args.device == "cuda":  # the triton backend's scan kernels above; the torch scan here
            rows.append(("  same, torch state scan",
                         _with_form("chunked-torch", lambda: _step(_lockstep, x, do, dfin)), False))
        if not args.no_recurrent:
            rows.append(("lockstep token-by-token bwd",
                         _with_form("recurrent", lambda: _step(_lockstep, x, do, dfin)), True))
        times = _timed_rows(rows, args.repeats, args.device)
        stock = min(times[rows[0][0]])
        for name, ts in times.items():
            note = "  (1 sample)" if len(ts) == 1 else ""
            print(f"{T:>6} {name:<28} {statistics.median(ts):>9.4f} {min(ts):>9.4f} {min(ts) / stock:>8.2f}{note}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
