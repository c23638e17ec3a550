"""Forward + backward time of the gated delta rule: lockstep's chunked backward (default), its
token-by-token recompute (LOCKSTEP_GDN_BACKWARD=recurrent), and transformers'
torch_chunk_gated_delta_rule forward + autograd backward (the stock comparison), same tensors, same run.

    python -m benchmarks.gdn_backward [--device cpu|cuda] [--T 512 4096] [--repeats 3] [--no-recurrent]

B=1, H_v=4, H_qk=2, d_k=d_v=128, fp32, in-kernel L2 norm, loss = sum(o * do) + sum(final * dfinal).
Prints median seconds per forward+backward (a call over 20 s is timed once) and the ratios to the
stock forward+backward row; forward-only rows for context. Figures are for this
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


def _timed(fn, repeats, device):
    """(median seconds, samples)."""
    def once():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    first = once()  # warm-up (compiles, caches)
    if first > 20:  # the token-by-token backward at long T: one sample is enough
        return first, 1
    return statistics.median(once() for _ in range(repeats)), repeats


def _step(forward, x, do, dfin):
    """One forward + backward of ``forward`` over fresh leaves; returns the gradients."""
    leaves = [t.detach().clone().requires_grad_(True) for t in x]
    o, fin = forward(*leaves)
    torch.autograd.backward((o, fin), (do, dfin))
    return [t.grad for t in leaves]


def _no_grad(forward, x):
    with torch.no_grad():
        return forward(*x)


def _lockstep(q, k, v, g, beta):
    return hal.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


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
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, B1 H2/4 D128 fp32, median of "
          f"{args.repeats}, seconds per forward+backward")
    print(f"{'T':>6} {'row':<28} {'seconds':>9} {'/ stock':>8}")
    for T in args.T:
        x, do, dfin = _inputs(T, args.device)
        rows = [("stock (transformers chunk)", lambda: _step(_stock, x, do, dfin)),
                ("stock forward only", lambda: _no_grad(_stock, x)),
                ("lockstep forward only", lambda: _no_grad(_lockstep, x)),
                ("lockstep chunked backward", _with_form("chunked", lambda: _step(_lockstep, x, do, dfin)))]
        if not args.no_recurrent:
            rows.append(("lockstep token-by-token bwd", _with_form("recurrent", lambda: _step(_lockstep, x, do, dfin))))
        stock = None
        for name, fn in rows:
            t, n = _timed(fn, args.repeats, args.device)
            stock = stock or t
            print(f"{T:>6} {name:<28} {t:>9.4f} {t / stock:>8.2f}" + ("  (1 sample)" if n == 1 else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
