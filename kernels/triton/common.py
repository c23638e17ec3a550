"""Device helpers shared by the strict kernels: exact column extraction, exact row max, k64 dot chains.

Triton has no sequential reduction: ``tl.sum`` is a tree (shuffles on the GPU, numpy pairwise in
the interpreter), so sums in spec order are explicit loops. Two exact tricks make them cheap:

* :func:`column` reads column j of a register tile through an *integer* masked sum of its bits:
  exactly one term is non-zero, so the integer sum is exact in any order and the float bits
  (including -0.0 and NaN payloads) come back unchanged.
* :func:`row_max` is ``tl.max`` (max is exact and order-free) with the spec's rules made explicit:
  NaN or +inf anywhere poisons the row (NaN); -0.0 < +0.0 so the result never depends on order.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import strict_math as sm


@triton.jit
def column(x, idx, j):
    """x[:, j] of a float32 [R, C] tile (idx = tl.arange(0, C)), exactly, as a [R] tensor."""
    bits = x.to(tl.int32, bitcast=True)
    picked = tl.where(idx[None, :] == j, bits, 0)
    return tl.sum(picked, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def add_columns_in_order(total, part, idx, n):
    """total + part[:, 0] + part[:, 1] + ... + part[:, n-1], each addition rounded, left to right."""
    for j in range(0, n):
        total = total + column(part, idx, j)
    return total


@triton.jit
def row_max(x, valid):
    """Exact max over axis 1 of a float32 [R, C] tile and its poisoned flag, over the valid elements.

    Returns (m, poisoned, pos_zero): m ignores NaN (-inf when nothing is valid); poisoned is 1 where
    a valid element is NaN or +inf; pos_zero is 1 where a valid element is +0.0 (so a zero max can
    be made +0.0 whenever a +0.0 is present, independent of the order tl.max combines in).
    """
    ok = valid & (x == x)
    m = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    bad = valid & ((x != x) | (x == float("inf")))
    poisoned = tl.max(bad.to(tl.int32), axis=1)
    pz = valid & (x.to(tl.int32, bitcast=True) == 0)
    pos_zero = tl.max(pz.to(tl.int32), axis=1)
    return m, poisoned, pos_zero


@triton.jit
def finish_max(m, poisoned, pos_zero):
    """The spec's row max from accumulated (m, poisoned, pos_zero): NaN if poisoned, +0.0 over -0.0."""
    m = tl.where((m == 0.0) & (pos_zero > 0), 0.0, m)
    return tl.where(poisoned > 0, float("nan"), m)


@triton.jit
def dot_k_tiled(a_ptr, sa_m, sa_k, b_ptr, sb_k, sb_n, rows, cols, row_ok, col_ok, K,
                KT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] float32 sum_k a[row, k] * b[k, col] in the canonical order with tile KT.

    Inside a K tile: a sequential fma chain from +0.0 over exactly the tile's valid k (the short
    last tile runs fewer steps: nothing is padded); tile partials added in order from +0.0.
    Inputs of any float dtype are widened exactly to float32 (strict_math.widen).
    """
    total = tl.zeros([BM, BN], dtype=tl.float32)
    a_p = a_ptr + rows.to(tl.int64) * sa_m
    b_p = b_ptr + cols.to(tl.int64) * sb_n
    for k0 in range(0, K, KT):
        part = tl.zeros([BM, BN], dtype=tl.float32)
        for _ in range(k0, tl.minimum(k0 + KT, K)):
            a = sm.widen(tl.load(a_p, mask=row_ok, other=0.0))
            b = sm.widen(tl.load(b_p, mask=col_ok, other=0.0))
            part = tl.fma(a[:, None], b[None, :], part)
            a_p += sa_k
            b_p += sb_k
        total = total + part
    return total


@triton.jit
def nonneg_sums_in_order(v, n, T: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr):
    """[BR, NTB] sequential sums from +0.0 over the last axis of v [BR, NTB, T], whose terms are all
    >= +0.0 (or NaN) and whose elements past the end hold +0.0. Adding such a +0.0 is then an exact
    identity (a partial is +0.0 or positive), so no skip mask is needed. Each element is read
    exactly through an integer masked sum (the interpreter's register layout)."""
    bits = v.to(tl.int32, bitcast=True)
    jidx = tl.arange(0, T)
    s = tl.zeros([BR, NTB], dtype=tl.float32)
    for j in range(0, tl.minimum(T, n)):
        s = s + tl.sum(tl.where(jidx[None, None, :] == j, bits, 0), axis=2).to(tl.float32, bitcast=True)
    return s
