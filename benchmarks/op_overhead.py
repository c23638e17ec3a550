"""Per-call host cost of the torch-op routing on CPU: a tiny linear and rms_norm (issue 23 item 6).

    python -m benchmarks.op_overhead                  # this tree
    PYTHONPATH=/path/to/older/tree python -m benchmarks.op_overhead   # the same rows for another tree

Columns (µs per call, best of the repeats of ``--calls`` calls each; lower is better):

* ``public_us``: ``hal.linear`` / ``hal.rms_norm`` as a user calls them eagerly (with the routing check
  at the top of the op);
* ``torch_op_us``: ``torch.ops.lockstep.<op>`` called directly (what every eager call would cost if it
  went through the dispatcher: the design does not do that; "-" on a tree without the torch ops);
* ``check_us``: the routing check alone, as a linear's head makes it: ``hal.ops_registry.routing("linear",
  x, w, None)`` (one flag read, a type check per tensor); on an older tree ``tracing()`` followed by
  ``hal.tensor_parallel.has_dtensor(x, w, None)``, the two checks it replaced;
* ``stock_us``: ``F.linear`` / ``x * rsqrt(mean(x^2) + eps) * w`` (stock torch), and the ratios to it.
"""
from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F

import hal


def per_call_us(fn, calls: int, repeats: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def _stock_rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x, w, nw = torch.randn(1, 64), torch.randn(64, 64), torch.randn(64)
    lib = getattr(torch.ops, "lockstep", None)
    has_ops = lib is not None and hasattr(lib, "linear")
    rows = {
        "linear": (lambda: hal.linear(x, w), lambda: torch.ops.lockstep.linear(x, w, None, None, None),
                   lambda: F.linear(x, w)),
        "rms_norm": (lambda: hal.rms_norm(x, nw), lambda: torch.ops.lockstep.rms_norm(x, nw, 1e-6, None, None),
                     lambda: _stock_rms(x, nw)),
    }
    check = "-"
    try:
        from hal.ops_registry import routing

        def head():
            return routing("linear", x, w, None)
    except ImportError:
        try:
            from hal.ops_registry import tracing
            from hal.tensor_parallel import has_dtensor

            def head():
                return tracing() or has_dtensor(x, w, None)
        except ImportError:
            head = None
    if head is not None:
        check = f"{per_call_us(head, args.calls * 10, args.repeats):.2f}"
    print(f"hal from {hal.__file__}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    print(f"{'op':10s} {'public_us':>10s} {'torch_op_us':>12s} {'check_us':>9s} {'stock_us':>9s} "
          f"{'public/stock':>13s} {'torch_op/stock':>15s}")
    with torch.no_grad():
        for name, (public, op, stock) in rows.items():
            pub, st = per_call_us(public, args.calls, args.repeats), per_call_us(stock, args.calls, args.repeats)
            top = per_call_us(op, args.calls, args.repeats) if has_ops else None
            print(f"{name:10s} {pub:10.2f} {('-' if top is None else f'{top:.2f}'):>12s} {check:>9s} {st:9.2f} "
                  f"{pub / st:13.2f} {('-' if top is None else f'{top / st:.2f}'):>15s}")


if __name__ == "__main__":
    main()
