"""The canonical tiled reductions (kernels/reference/reduce.py) as inlined numba helpers.

A row's tiles are independent chains, so they are advanced together (element j of every tile per
step): the same additions in the same order per tile, with the chains in flight at once instead
of one after another. Tile partials are then added in tile order from +0.0.
"""
from __future__ import annotations

from numba import njit

from .strict_math import ZERO, fma


@njit(inline="always", cache=True)
def tiled_sum(x, t, part):
    """sum of the float32 row x in the canonical order; ``part`` is scratch of >= ceil(n/t) floats."""
    n = x.shape[0]
    nt = (n + t - 1) // t
    for i in range(nt):
        part[i] = ZERO
    full = n // t  # tiles with all t elements
    for j in range(t):
        for i in range(full):
            part[i] = part[i] + x[i * t + j]
        if full < nt and full * t + j < n:  # the short last tile skips, never pads
            part[full] = part[full] + x[full * t + j]
    total = ZERO
    for i in range(nt):
        total = total + part[i]
    return total


@njit(inline="always", cache=True)
def tiled_dot(x, y, t, part):
    """sum_k x[k] * y[k] (float32 rows) in the canonical order (fma chains per tile)."""
    n = x.shape[0]
    nt = (n + t - 1) // t
    for i in range(nt):
        part[i] = ZERO
    full = n // t
    for j in range(t):
        for i in range(full):
            k = i * t + j
            part[i] = fma(x[k], y[k], part[i])
        if full < nt and full * t + j < n:
            k = full * t + j
            part[full] = fma(x[k], y[k], part[full])
    total = ZERO
    for i in range(nt):
        total = total + part[i]
    return total


def n_tiles(n: int, t: int) -> int:
    return max(1, -(-n // t))


