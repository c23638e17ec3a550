"""Host cost of the float64 -> oracle routing (backends/float64.py) on small cpu-backend calls.

Times one backend method call three ways in one process: the routed method the backend has, the same
method without the routing wrapper (its innermost function), and torch's own op (stock) as the yardstick.

    python -m benchmarks.float64_routing [--n 64] [--calls 5000]
"""
from __future__ import annotations

import argparse
import time

import torch

import hal
from hal.backends.cpu import CpuBackend


def _innermost(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _per_call_us(fns: dict, calls: int, reps: int = 7) -> dict:
    """Best time per call of each function; the variants take turns in every repetition, so a busy machine
    slows them alike (the minimum over repetitions is the least disturbed run)."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    b = hal.get_backend("cpu")
    spec = hal.spec.DEFAULTS["elementwise"]
    x = torch.randn(args.n)
    bare = _innermost(CpuBackend.silu)
    # _innermost skips cpu's _strict wrapper too: time the unrouted method as the backend defines it
    strict_only = CpuBackend.silu.__wrapped__
    assert torch.equal(b.silu(x, spec), strict_only(b, x, spec))
    t = _per_call_us({"routed": lambda: b.silu(x, spec), "unrouted": lambda: strict_only(b, x, spec),
                      "kernel": lambda: bare(b, x, spec), "stock": lambda: torch.nn.functional.silu(x)}, args.calls)
    routed, unrouted, kernel, stock = t["routed"], t["unrouted"], t["kernel"], t["stock"]
    print(f"cpu silu, {args.n} float32 elements, best of 7 x {args.calls} calls, variants interleaved (us per call)")
    print(f"  routed (as dispatched)      {routed:8.2f}   {routed / stock:6.2f}x stock")
    print(f"  without the float64 routing {unrouted:8.2f}   {unrouted / stock:6.2f}x stock")
    print(f"  kernel call alone           {kernel:8.2f}   {kernel / stock:6.2f}x stock")
    print(f"  stock torch silu            {stock:8.2f}")
    print(f"  routing cost                {routed - unrouted:8.2f} us per call")


if __name__ == "__main__":
    main()
