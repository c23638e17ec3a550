"""The canonical tiled reductions (kernels/reference/reduce.py) as inlined numba helpers.

A row's tiles are independent chains, so eight of them are advanced together (element j of each
of the eight tiles per step, eight sequential read streams): the same additions in the same order
per tile, with eight chains in flight instead of one (an add's latency is hidden). Each tile's
partial is added to the total from +0.0 in tile order as soon as its group is done.
"""
from __future__ import annotations

from numba import njit

from .simd import LANES, transpose8, vadd, vlane, vload, vzero
from .strict_math import ZERO, fma


@njit(inline="always", cache=True)
def _sum_chain(x, y, lo, hi, dot):
    """One tile's chain over x[lo:hi]: a sequential sum from +0.0 (of x[k]*y[k], fused, when dot)."""
    s = ZERO
    for k in range(lo, hi):
        s = fma(x[k], y[k], s) if dot else s + x[k]
    return s


@njit(inline="always", cache=True)
def _tiled(x, y, t, dot):
    n = x.shape[0]
    full = n // t  # tiles with all t elements; the short last tile skips, never pads
    total = ZERO
    g = 0
    while g + 8 <= full:
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = ZERO
        b = g * t
        for j in range(b, b + t):
            if dot:
                s0 = fma(x[j], y[j], s0)
                s1 = fma(x[j + t], y[j + t], s1)
                s2 = fma(x[j + 2 * t], y[j + 2 * t], s2)
                s3 = fma(x[j + 3 * t], y[j + 3 * t], s3)
                s4 = fma(x[j + 4 * t], y[j + 4 * t], s4)
                s5 = fma(x[j + 5 * t], y[j + 5 * t], s5)
                s6 = fma(x[j + 6 * t], y[j + 6 * t], s6)
                s7 = fma(x[j + 7 * t], y[j + 7 * t], s7)
            else:
                s0 = s0 + x[j]
                s1 = s1 + x[j + t]
                s2 = s2 + x[j + 2 * t]
                s3 = s3 + x[j + 3 * t]
                s4 = s4 + x[j + 4 * t]
                s5 = s5 + x[j + 5 * t]
                s6 = s6 + x[j + 6 * t]
                s7 = s7 + x[j + 7 * t]
        total = total + s0
        total = total + s1
        total = total + s2
        total = total + s3
        total = total + s4
        total = total + s5
        total = total + s6
        total = total + s7
        g += 8
    for i in range(g, full):
        total = total + _sum_chain(x, y, i * t, i * t + t, dot)
    if full * t < n:
        total = total + _sum_chain(x, y, full * t, n, dot)
    return total


@njit(inline="always", cache=True)
def _tiled_sum_lanes(x, t):
    """_tiled(x, x, t, False) for a unit-stride row and t % 8 == 0, with the eight tiles of a group
    in the eight lanes of one vector: eight consecutive elements of each tile are loaded and
    transposed, so vector k holds element j + k of every tile and is added into the lane-wise
    chains in element order. Each lane is its tile's sequential chain (the same adds in the same
    order); the partials then go into the total in tile order, as in _tiled."""
    n = x.shape[0]
    full = n // t
    total = ZERO
    g = 0
    while g + LANES <= full:
        acc = vzero()
        b = g * t
        for j in range(b, b + t, LANES):
            c0, c1, c2, c3, c4, c5, c6, c7 = transpose8(
                vload(x, j), vload(x, j + t), vload(x, j + 2 * t), vload(x, j + 3 * t),
                vload(x, j + 4 * t), vload(x, j + 5 * t), vload(x, j + 6 * t), vload(x, j + 7 * t))
            acc = vadd(vadd(vadd(vadd(vadd(vadd(vadd(vadd(acc, c0), c1), c2), c3), c4), c5), c6), c7)
        for lane in range(LANES):
            total = total + vlane(acc, lane)
        g += LANES
    for i in range(g, full):
        total = total + _sum_chain(x, x, i * t, i * t + t, False)
    if full * t < n:
        total = total + _sum_chain(x, x, full * t, n, False)
    return total


@njit(inline="always", cache=True)
def tiled_sum(x, t, part=None):
    """sum of the float32 row x in the canonical order (``part``: unused, kept for old callers)."""
    if t % LANES == 0 and x.strides[0] == 4:
        return _tiled_sum_lanes(x, t)
    return _tiled(x, x, t, False)


@njit(inline="always", cache=True)
def tiled_dot(x, y, t, part=None):
    """sum_k x[k] * y[k] (float32 rows) in the canonical order (fma chains per tile; ``part``:
    unused, kept for old callers)."""
    return _tiled(x, y, t, True)


def n_tiles(n: int, t: int) -> int:
    return max(1, -(-n // t))
