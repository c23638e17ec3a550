"""matmul / linear (strict, k-tiled): register/cache-blocked numba kernels.

Both kernels compute each output as the spec's chain (reduce.py): per K tile a sequential fma chain
from +0.0 in k order, tile partials added into a zeroed total in tile order, bias once after.
Speed comes only from running independent chains (other rows / columns) together, and fma(a, b, c)
is symmetric in a and b, so which operand is broadcast and which is vectorised never changes a bit.

* ``_gemm_*``: C = A . P where P is the other operand packed once per call into float32 panels of
  ``_L`` columns ([panels, K, _L]: the transpose and the bf16/fp16 widening happen here, so the host
  never copies an operand). A task owns ``_R`` rows of A (read as stored, one value broadcast per
  row and k) and a block of panels; its ``_R`` x ``_L`` accumulators are eight-float vectors
  (simd.py) that stay in registers for a whole K tile: per k step two panel loads, ``_R``
  broadcasts, 2 ``_R`` vector fmas, no accumulator loads or stores. Linear packs the smaller
  operand: x (few rows) is packed and the product computed as C^T = W . x^T, then transposed once;
  with more rows than the weight, the weight is packed. matmul packs B.
* ``_dots_*``: B is [N, K] (the weight as stored); eight output columns are eight chains in the
  lanes of one vector (eight k steps of eight weight rows transposed in registers). For linear
  with one row (decode), where a 16-column panel of x would be mostly padding.

Each phase is one compiled kernel over a range of tasks, split over threads by pool.run when the
product is large enough (pool.parallel_worth: handing ranges to threads costs tens of microseconds).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, uint64

from . import pool
from .host import F32, finish, raw
from .pool import parallel_worth
from .simd import transpose8, vadd, vcanon, vfma, vload, vload_wide, vsplat, vstore, vzero
from .strict_math import ZERO, canon, widen

_L = 16  # panel width: two eight-float vectors per row
_R = 8  # rows per task: 16 accumulator vectors (+2 panel vectors, a broadcast) of AVX-512's 32 registers
_PB = 16  # panels per task (256 columns): a task's panels stay in L2 while its rows pass over them
_FEW_ROWS = 2  # below this many rows (decode) linear runs on the weight as stored: at 2 rows the gemm
# (x padded to a 16-row panel) was 2.4x faster than eight scalar chains at K = N = 4096 and even at 256;
# against the transposed-vector _dots about even (at 256 the gemm ~30% slower, at 4096 about the same)


@njit(inline="always", cache=True)
def _pack_panel(B, nk, P, b):
    """P[b, k, j] = B's (k, b * _L + j) value as float32, +0.0 past B's last column (computed,
    never stored); B is [cols, K] when nk else [K, cols]."""
    K = P.shape[1]
    c0 = b * _L
    w = min(_L, (B.shape[0] if nk else B.shape[1]) - c0)
    Pb = P[b]
    if nk:  # one column at a time: a sequential read of B's row
        for j in range(w):
            row = B[c0 + j]
            for k in range(K):
                Pb[k, j] = widen(row[k])
    else:
        for k in range(K):
            row = B[k]
            for j in range(w):
                Pb[k, j] = widen(row[c0 + j])
    for k in range(K):
        for j in range(w, _L):
            Pb[k, j] = ZERO


@njit(inline="always", cache=True)
def _fma2(x, lo, hi, a, b):
    """One k step of a row's 16 chains: (a, b) + x * (lo, hi)."""
    s = vsplat(x)
    return vfma(s, lo, a), vfma(s, hi, b)


@njit(inline="always", cache=True)
def _add_row(tot, i, a, b):
    """Row i of the task's running total (tile partials in tile order) += (a, b)."""
    o = i * _L
    vstore(tot, o, vadd(vload(tot, o), a))
    vstore(tot, o + 8, vadd(vload(tot, o + 8), b))


@njit(inline="always", cache=True)
def _store(c, ncols, tot, ni, r, c0, bias_rows, bias):
    """The totals of ni rows from r, columns from c0, into c (C [., ncols] flat) + bias once,
    canonical NaN. The bias follows C's column, or its row when ``bias_rows`` (C is then C^T of a
    linear: A is the weight). A full tile row moves as two vectors."""
    has_bias = bias.shape[0] > 0
    for i in range(ni):
        o = uint64(r + i) * uint64(ncols) + uint64(c0)
        if c0 + _L <= ncols:
            lo, hi = vload(tot, i * _L), vload(tot, i * _L + 8)
            if has_bias:
                if bias_rows:
                    b = vsplat(bias[r + i])
                    lo, hi = vadd(lo, b), vadd(hi, b)
                else:
                    lo, hi = vadd(lo, vload(bias, c0)), vadd(hi, vload(bias, c0 + 8))
            vstore(c, o, vcanon(lo))
            vstore(c, o + uint64(8), vcanon(hi))
        else:  # the last, short panel
            for j in range(ncols - c0):
                v = tot[i * _L + j]
                if has_bias:
                    v += bias[r + i] if bias_rows else bias[c0 + j]
                c[o + uint64(j)] = canon(v)


@njit(cache=True)  # not inlined (numba's inlining compiled slower than a call)
def _gemm_task(a, rows, K, p, panels, c, ncols, T, bias, bias_rows, task, tot):
    """_R rows of A (a: [rows, K] flat) times a block of panels (p: [panels, K, _L] flat) into C
    (c: [rows, ncols] flat). Flat arrays with unsigned offsets: a row view costs reference counting
    (~40 ns each, ~a third of a 16x256x256 product over its 32 tasks) and signed indices a
    negative-index check."""
    n_groups = (rows + _R - 1) // _R
    r = (task % n_groups) * _R
    b_lo = (task // n_groups) * _PB
    last = rows - 1  # rows past the end are clamped: computed, never stored
    uk = uint64(K)
    x0, x1, x2, x3 = uint64(r) * uk, uint64(min(r + 1, last)) * uk, uint64(min(r + 2, last)) * uk, uint64(min(r + 3, last)) * uk
    x4, x5, x6, x7 = uint64(min(r + 4, last)) * uk, uint64(min(r + 5, last)) * uk, uint64(min(r + 6, last)) * uk, uint64(min(r + 7, last)) * uk
    for b in range(b_lo, min(b_lo + _PB, panels)):
        for i in range(_R * _L):
            tot[i] = ZERO
        for k0 in range(0, K, T):
            l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = vzero()  # columns 0-7 of the panel, rows 0-7
            h0 = h1 = h2 = h3 = h4 = h5 = h6 = h7 = vzero()  # columns 8-15
            for kk in range(k0, min(k0 + T, K)):
                k = uint64(kk)
                o = (uint64(b) * uk + k) * uint64(_L)
                lo, hi = vload(p, o), vload(p, o + uint64(8))
                l0, h0 = _fma2(widen(a[x0 + k]), lo, hi, l0, h0)
                l1, h1 = _fma2(widen(a[x1 + k]), lo, hi, l1, h1)
                l2, h2 = _fma2(widen(a[x2 + k]), lo, hi, l2, h2)
                l3, h3 = _fma2(widen(a[x3 + k]), lo, hi, l3, h3)
                l4, h4 = _fma2(widen(a[x4 + k]), lo, hi, l4, h4)
                l5, h5 = _fma2(widen(a[x5 + k]), lo, hi, l5, h5)
                l6, h6 = _fma2(widen(a[x6 + k]), lo, hi, l6, h6)
                l7, h7 = _fma2(widen(a[x7 + k]), lo, hi, l7, h7)
            _add_row(tot, 0, l0, h0)
            _add_row(tot, 1, l1, h1)
            _add_row(tot, 2, l2, h2)
            _add_row(tot, 3, l3, h3)
            _add_row(tot, 4, l4, h4)
            _add_row(tot, 5, l5, h5)
            _add_row(tot, 6, l6, h6)
            _add_row(tot, 7, l7, h7)
        _store(c, ncols, tot, min(_R, rows - r), r, b * _L, bias_rows, bias)


@njit(inline="always", cache=True)
def _transpose_rows(CT, C, m0, m1):
    """C[m, :] = CT[:, m] for m in [m0, m1): each row of C written contiguously, once (tiles writing
    C^T straight into C hit one cache set per tile row when C's rows are 4 KiB apart; a version
    blocked over columns measured slower, numpy's transposing copy about the same plus a call)."""
    for m in range(m0, m1):
        c = C[m]
        for n in range(C.shape[1]):
            c[n] = CT[n, m]


@njit(nogil=True, cache=True)
def _pack_panels(B, nk, P, lo, hi):
    for b in range(lo, hi):
        _pack_panel(B, nk, P, b)


@njit(nogil=True, cache=True)
def _gemm_tasks(a, rows, K, p, panels, c, ncols, T, bias, bias_rows, lo, hi):
    tot = np.empty(_R * _L, np.float32)
    for task in range(lo, hi):
        _gemm_task(a, rows, K, p, panels, c, ncols, T, bias, bias_rows, task, tot)


@njit(nogil=True, cache=True)
def _transpose_blocks(CT, C, lo, hi):
    for blk in range(lo, hi):
        _transpose_rows(CT, C, blk * _L, min(blk * _L + _L, C.shape[0]))


def _gemm_into(A, B, nk, C, T, bias, xpacked):
    """C = A . B (B [cols, K] when nk, else [K, cols]) + bias: B packed into panels, the tasks (_R rows by
    a block of _PB panels, panel block by panel block over every row group), then, when ``xpacked``
    (A is a linear's weight, B its x), C^T transposed into C. Three phases, each split over threads."""
    panels = ((B.shape[0] if nk else B.shape[1]) + _L - 1) // _L
    tasks = ((A.shape[0] + _R - 1) // _R) * ((panels + _PB - 1) // _PB)
    par = parallel_worth(C.size * A.shape[1])
    P = np.empty((panels, A.shape[1], _L), np.float32)
    pool.run(_pack_panels, panels, B, nk, P, parallel=par)
    CT = np.empty((C.shape[1], C.shape[0]), np.float32) if xpacked else C  # tasks write C^T, then
    pool.run(_gemm_tasks, tasks, A.ravel(), A.shape[0], A.shape[1], P.ravel(), panels, CT.ravel(), CT.shape[1], T,
             bias, xpacked, parallel=par)
    if xpacked:
        pool.run(_transpose_blocks, (C.shape[0] + _L - 1) // _L, CT, C, parallel=par)


@njit(inline="always", cache=True)
def _column(b, o0, o1, o2, o3, o4, o5, o6, o7, k, tmp):
    """Step k of eight weight rows (row offsets o0..o7) as one vector, through tmp (a tile's last
    1-7 steps, when the tile is not a multiple of eight)."""
    tmp[0], tmp[1], tmp[2], tmp[3] = widen(b[o0 + k]), widen(b[o1 + k]), widen(b[o2 + k]), widen(b[o3 + k])
    tmp[4], tmp[5], tmp[6], tmp[7] = widen(b[o4 + k]), widen(b[o5 + k]), widen(b[o6 + k]), widen(b[o7 + k])
    return vload(tmp, 0)


@njit(cache=True)  # not inlined, as _gemm_task
def _dots_task(a, b, c, M, N, K, T, bias, blk, tmp):
    """Row m of A against eight weight rows n0..n0+7: eight chains in the lanes of one vector. Eight
    k steps of the eight rows are loaded as eight row vectors and transposed in registers, so each
    step is one vector fma in k order (the lanes never meet)."""
    nnb = (N + 7) // 8
    m = blk // nnb
    n0 = (blk % nnb) * 8
    # unsigned offsets: no negative-index wraparound in the inner loop; rows past N are clamped
    # (computed, never stored)
    uk, last = uint64(K), N - 1
    ra = uint64(m) * uk
    o0, o1, o2, o3 = uint64(n0) * uk, uint64(min(n0 + 1, last)) * uk, uint64(min(n0 + 2, last)) * uk, uint64(min(n0 + 3, last)) * uk
    o4, o5, o6, o7 = uint64(min(n0 + 4, last)) * uk, uint64(min(n0 + 5, last)) * uk, uint64(min(n0 + 6, last)) * uk, uint64(min(n0 + 7, last)) * uk
    tot = vzero()
    for k0 in range(0, K, T):
        k1 = min(k0 + T, K)
        acc = vzero()
        kk = k0
        while kk + 8 <= k1:
            k = uint64(kk)
            w0, w1, w2, w3, w4, w5, w6, w7 = transpose8(
                vload_wide(b, o0 + k), vload_wide(b, o1 + k), vload_wide(b, o2 + k), vload_wide(b, o3 + k),
                vload_wide(b, o4 + k), vload_wide(b, o5 + k), vload_wide(b, o6 + k), vload_wide(b, o7 + k))
            x = ra + k
            acc = vfma(vsplat(widen(a[x])), w0, acc)
            acc = vfma(vsplat(widen(a[x + uint64(1)])), w1, acc)
            acc = vfma(vsplat(widen(a[x + uint64(2)])), w2, acc)
            acc = vfma(vsplat(widen(a[x + uint64(3)])), w3, acc)
            acc = vfma(vsplat(widen(a[x + uint64(4)])), w4, acc)
            acc = vfma(vsplat(widen(a[x + uint64(5)])), w5, acc)
            acc = vfma(vsplat(widen(a[x + uint64(6)])), w6, acc)
            acc = vfma(vsplat(widen(a[x + uint64(7)])), w7, acc)
            kk += 8
        while kk < k1:
            k = uint64(kk)
            acc = vfma(vsplat(widen(a[ra + k])), _column(b, o0, o1, o2, o3, o4, o5, o6, o7, k, tmp), acc)
            kk += 1
        tot = vadd(tot, acc)
    vstore(tmp, 0, tot)
    for i in range(min(8, N - n0)):  # + bias once, after the K reduction
        v = tmp[i]
        if bias.shape[0] > 0:
            v += bias[n0 + i]
        c[m * N + n0 + i] = canon(v)


@njit(nogil=True, cache=True)
def _dots_tasks(a, b, c, M, N, K, T, bias, lo, hi):
    tmp = np.empty(8, np.float32)
    for blk in range(lo, hi):
        _dots_task(a, b, c, M, N, K, T, bias, blk, tmp)


def _dots_into(A, B, C, T, bias):
    """C = A . B^T + bias for B [N, K] as stored: tasks of one row by eight columns, split over threads."""
    M, K = A.shape
    N = B.shape[0]
    pool.run(_dots_tasks, M * ((N + 7) // 8), A.ravel(), B.ravel(), C.ravel(), M, N, K, T, bias,
             parallel=parallel_worth(C.size * K))


_NO_BIAS = np.empty(0, np.float32)


def _gemm(a2: np.ndarray, b: np.ndarray, nk: bool, t: int, bias: np.ndarray) -> np.ndarray:
    m = a2.shape[0]
    out = np.empty((m, b.shape[0] if nk else b.shape[1]), np.float32)  # every element is stored
    if out.size:
        if nk and m <= out.shape[1]:  # pack x, the smaller operand: C^T = W . x^T (bias along its rows)
            _gemm_into(b, a2, True, out, t, bias, True)
        else:
            _gemm_into(a2, b, nk, out, t, bias, False)
    return out


def dot_rows_kn(a2: np.ndarray, b_kn: np.ndarray, t: int, bias: np.ndarray = _NO_BIAS) -> np.ndarray:
    """[M, K] . [K, N] (+ bias [N]) -> float32 [M, N] in the canonical tiled order, NaNs canonical
    (operands from host.raw; bias float32, or empty for none)."""
    return _gemm(a2, b_kn, False, t, bias)


def dot_rows_nk(a2: np.ndarray, b_nk: np.ndarray, t: int, bias: np.ndarray = _NO_BIAS) -> np.ndarray:
    """[M, K] . [N, K]^T (+ bias [N]) -> float32 [M, N], as :func:`dot_rows_kn`."""
    m = a2.shape[0]
    if m >= _FEW_ROWS:
        return _gemm(a2, b_nk, True, t, bias)
    out = np.zeros((m, b_nk.shape[0]), np.float32)
    if out.size:
        _dots_into(a2, b_nk, out, t, bias)
    return out


# The host side is kept to a few cheap steps (a 16x256x256 product takes tens of microseconds):
# reshapes are numpy's, on arrays sharing the tensors' memory (torch's cost microseconds each), and
# the kernels store canonical NaNs, so a float32 result needs no further pass.
def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    out = dot_rows_kn(raw(a).reshape(math.prod(a.shape[:-1]), a.shape[-1]), raw(b), spec.k_tile)
    return finish(out.reshape(*a.shape[:-1], b.shape[1]), a.dtype, nan_done=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    b32 = _NO_BIAS if bias is None else raw(bias.to(F32))
    x2 = raw(x)
    if x2.ndim != 2:  # (a 2-D x skips both reshapes: ~1 us each)
        x2 = x2.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    acc = dot_rows_nk(x2, raw(weight), spec.k_tile, b32)
    if x.ndim != 2:
        acc = acc.reshape(*x.shape[:-1], weight.shape[0])
    return finish(acc, x.dtype, nan_done=True)
