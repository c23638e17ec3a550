"""The routing decision at a public op's head, before and after one helper (issue 23 review mend).

    python -m benchmarks.routing_head

Times, alternated in one process (best of 6 rounds x 5 repeats x 20000 calls, µs per call), for a
linear's arguments ``(x, w, None)``: ``old``: the two checks every op head made before
(``tracing()``, then ``has_dtensor(...)``; their logic copied here), ``new``:
``hal.ops_registry.routing("linear", x, w, None)``.
"""
from __future__ import annotations

import sys
import timeit

import torch

from hal.ops_registry import routing

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _old_has_dtensor(*tensors) -> bool:
    cls = None
    for t in tensors:
        if t is None or type(t) in _PLAIN:
            continue
        cls = cls or getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if cls is not None and isinstance(t, cls):
            return True
    return False


def main() -> None:
    x, w = torch.randn(1, 64), torch.randn(64, 64)

    def old_head():
        if torch.compiler.is_compiling():
            return 1
        return 2 if _old_has_dtensor(x, w, None) else 0

    def new_head():
        return routing("linear", x, w, None)

    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(6):
        for name, fn in (("old", old_head), ("new", new_head)):
            best[name] = min(best[name], min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 * 1e6)
    print("  ".join(f"{k}_us={v:.3f}" for k, v in best.items()))


if __name__ == "__main__":
    main()
