"""The canonical tiled reduction, written out.

A reduction of n elements with tile T (docs/design.md, principles 1-3):

* tiles of T consecutive elements, anchored at index 0 of the axis;
* inside a tile a sequential chain from +0.0 in increasing index (``acc = fma(a, b, acc)`` for a
  dot product, ``acc = acc + x`` for a sum);
* tile partials added sequentially from +0.0 in increasing tile index;
* elements at or past n are skipped: the accumulator keeps its value, an exact identity even for
  -0.0 and NaN (padding with zeros would turn an accumulated -0.0 into +0.0).

The loops below run T steps over all tiles at once (element j of every tile is ``x[..., j::T]``)
and then n/T steps over the partials, so the Python loop count is T + n/T; rows, columns and
batch are plain tensor dimensions.
"""
from __future__ import annotations

import torch

from .strict_math import F32, F64, fma_wide


def _combine_tiles(partials: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(partials.shape[:-1], dtype=F32, device=partials.device)
    for i in range(partials.shape[-1]):
        total = total + partials[..., i]
    return total


def _n_tiles(n: int, t: int) -> int:
    return max(1, -(-n // t))


def tiled_dot(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """sum_k a[..., k] * b[..., k] (a, b float32, broadcastable) in the canonical order."""
    assert a.dtype == F32 and b.dtype == F32
    n = a.shape[-1]
    assert b.shape[-1] == n
    n_tiles = _n_tiles(n, t)
    a64, b64 = a.to(F64), b.to(F64)
    shape = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    acc = torch.zeros((*shape, n_tiles), dtype=F32, device=a.device)
    for j in range(min(t, n)):
        aj, bj = a64[..., j::t], b64[..., j::t]  # element j of every tile
        cnt = aj.shape[-1]
        if cnt == n_tiles:
            acc = fma_wide(aj, bj, acc)
        else:  # the last tile is short: its accumulator is kept as it is (skipped, not padded)
            acc = torch.cat([fma_wide(aj, bj, acc[..., :cnt]), acc[..., cnt:]], dim=-1)
    return _combine_tiles(acc)


def tiled_sum(x: torch.Tensor, t: int) -> torch.Tensor:
    """sum_k x[..., k] (float32) in the canonical order."""
    assert x.dtype == F32
    n = x.shape[-1]
    n_tiles = _n_tiles(n, t)
    acc = torch.zeros((*x.shape[:-1], n_tiles), dtype=F32, device=x.device)
    for j in range(min(t, n)):
        xj = x[..., j::t]
        cnt = xj.shape[-1]
        if cnt == n_tiles:
            acc = acc + xj
        else:
            acc = torch.cat([acc[..., :cnt] + xj, acc[..., cnt:]], dim=-1)
    return _combine_tiles(acc)
