"""The canonical tiled reduction, written out.

A reduction of n elements with tile T (DESIGN.md principles 1-3):

* tiles of T consecutive elements, anchored at index 0 of the axis;
* inside a tile a sequential chain from +0.0 in increasing index (``acc = fma(a, b, acc)`` for a
  dot product, ``acc = acc + x`` for a sum);
* tile partials added sequentially from +0.0 in increasing tile index;
* elements at or past n are skipped: the accumulator keeps its value, an exact identity even for
  -0.0 and NaN (padding with zeros would turn an accumulated -0.0 into +0.0).

The loops below run T steps over all tiles at once and then n/T steps over the partials, so the
Python loop count is T + n/T; rows, columns and batch are plain tensor dimensions.
"""
from __future__ import annotations

import torch

from .strict_math import F32, fma


def _tiles(x: torch.Tensor, t: int) -> torch.Tensor:
    n = x.shape[-1]
    n_tiles = max(1, -(-n // t))
    pad = n_tiles * t - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], n_tiles, t)


def _valid(n: int, t: int, device) -> torch.Tensor:
    n_tiles = max(1, -(-n // t))
    return (torch.arange(n_tiles * t, device=device) < n).reshape(n_tiles, t)


def _combine_tiles(partials: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(partials.shape[:-1], dtype=F32, device=partials.device)
    for i in range(partials.shape[-1]):
        total = total + partials[..., i]
    return total


def tiled_dot(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """sum_k a[..., k] * b[..., k] (a, b float32, broadcastable) in the canonical order."""
    assert a.dtype == F32 and b.dtype == F32
    n = a.shape[-1]
    assert b.shape[-1] == n
    a_t, b_t = _tiles(a, t), _tiles(b, t)
    valid = _valid(n, t, a.device)
    shape = torch.broadcast_shapes(a_t.shape[:-1], b_t.shape[:-1])
    acc = torch.zeros(shape, dtype=F32, device=a.device)
    for j in range(t):
        acc = torch.where(valid[:, j], fma(a_t[..., j], b_t[..., j], acc), acc)
    return _combine_tiles(acc)


def tiled_sum(x: torch.Tensor, t: int) -> torch.Tensor:
    """sum_k x[..., k] (float32) in the canonical order."""
    assert x.dtype == F32
    n = x.shape[-1]
    x_t = _tiles(x, t)
    valid = _valid(n, t, x.device)
    acc = torch.zeros(x_t.shape[:-1], dtype=F32, device=x.device)
    for j in range(t):
        acc = torch.where(valid[:, j], acc + x_t[..., j], acc)
    return _combine_tiles(acc)
