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
* ``_dots_*``: linear with one row, on the weight as stored: eight output columns are eight chains in the
  lanes of one vector (eight k steps of eight weight rows transposed in registers).
* ``_stream_*``: linear with 2 to 8 rows (decode), on the weight as stored ([N, K], bf16 / fp16 / float32
  read in place): a task owns 32 weight rows, whose 32 chains per x row run in the lanes of two
  sixteen-float vectors (simd.py's f32x16). A span of k steps of the 32 rows is widened and transposed
  in registers into a small float32 buffer in L1 (bf16 as 32-bit words, split after the transpose),
  then every x row (widened to float32 on the host: M x K values) runs over it, four rows at a time
  with eight chains in registers: the weight is read from memory once per call, whatever M.

Each phase is one compiled kernel over a range of tasks, split over threads by pool.run when the
product is large enough (pool.parallel_worth: handing ranges to threads costs tens of microseconds).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, types, uint64
from numba.extending import overload

from . import pool
from .host import F32, finish, raw
from .pool import parallel_worth
from .simd import (bf16_even, bf16_odd, transpose8, transpose8x2, transpose16, vadd, vcanon, vfma, vload,
                   vload16, vload16_wide, vload2_words, vload_wide, vsplat, vsplat16, vstore, vstore16, vzero)
from .strict_math import ZERO, canon, widen

_L = 16  # panel width: two eight-float vectors per row
_R = 8  # rows per task: 16 accumulator vectors (+2 panel vectors, a broadcast) of AVX-512's 32 registers
_PB = 16  # panels per task (256 columns): a task's panels stay in L2 while its rows pass over them


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


# ---------------------------------------------------------------- few rows: the weight streamed as stored

_SN = 32  # outputs (weight rows) per streaming task: two sixteen-lane vectors, two chains per x row
_STREAM_ROWS = 8  # up to this many x rows (decode) linear streams the weight once for all of them
_SPAN = 32  # steps of the 32 weight rows widened at a time: 4 KiB of float32, in L1


@njit(inline="always", cache=True)
def _fill_words(b, o, k, wbuf, w):
    """bf16: sixteen steps of a row are eight 32-bit words; transposed as words, split into floats after."""
    for g in range(2):
        q = 16 * g
        w0, w1, w2, w3, w4, w5, w6, w7 = transpose8x2(
            vload2_words(b, o[q] + k, o[q + 8] + k), vload2_words(b, o[q + 1] + k, o[q + 9] + k),
            vload2_words(b, o[q + 2] + k, o[q + 10] + k), vload2_words(b, o[q + 3] + k, o[q + 11] + k),
            vload2_words(b, o[q + 4] + k, o[q + 12] + k), vload2_words(b, o[q + 5] + k, o[q + 13] + k),
            vload2_words(b, o[q + 6] + k, o[q + 14] + k), vload2_words(b, o[q + 7] + k, o[q + 15] + k))
        vstore16(wbuf, w + 0 * _SN + q, bf16_even(w0))
        vstore16(wbuf, w + 1 * _SN + q, bf16_odd(w0))
        vstore16(wbuf, w + 2 * _SN + q, bf16_even(w1))
        vstore16(wbuf, w + 3 * _SN + q, bf16_odd(w1))
        vstore16(wbuf, w + 4 * _SN + q, bf16_even(w2))
        vstore16(wbuf, w + 5 * _SN + q, bf16_odd(w2))
        vstore16(wbuf, w + 6 * _SN + q, bf16_even(w3))
        vstore16(wbuf, w + 7 * _SN + q, bf16_odd(w3))
        vstore16(wbuf, w + 8 * _SN + q, bf16_even(w4))
        vstore16(wbuf, w + 9 * _SN + q, bf16_odd(w4))
        vstore16(wbuf, w + 10 * _SN + q, bf16_even(w5))
        vstore16(wbuf, w + 11 * _SN + q, bf16_odd(w5))
        vstore16(wbuf, w + 12 * _SN + q, bf16_even(w6))
        vstore16(wbuf, w + 13 * _SN + q, bf16_odd(w6))
        vstore16(wbuf, w + 14 * _SN + q, bf16_even(w7))
        vstore16(wbuf, w + 15 * _SN + q, bf16_odd(w7))


def _line_words(b, o, k, wbuf, w):
    _fill_words(b, o, k, wbuf, w)
    _fill_words(b, o, k + uint64(16), wbuf, w + 16 * _SN)


def _line_wide(b, o, k, wbuf, w):
    """float32 / fp16: a row's 16 steps (float32: one cache line, read by one load) widened, 16 rows at a
    time, one 16 x 16 transpose (two 8 x 8 halves per line, as bf16 does, measured 10-40 % slower: the
    rows, 4 KiB apart at K = 1024, share one L1 set, and a line read in two halves is read twice)."""
    for q in range(0, _SN, 16):
        t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15 = transpose16(
            vload16_wide(b, o[q] + k), vload16_wide(b, o[q + 1] + k), vload16_wide(b, o[q + 2] + k),
            vload16_wide(b, o[q + 3] + k), vload16_wide(b, o[q + 4] + k), vload16_wide(b, o[q + 5] + k),
            vload16_wide(b, o[q + 6] + k), vload16_wide(b, o[q + 7] + k), vload16_wide(b, o[q + 8] + k),
            vload16_wide(b, o[q + 9] + k), vload16_wide(b, o[q + 10] + k), vload16_wide(b, o[q + 11] + k),
            vload16_wide(b, o[q + 12] + k), vload16_wide(b, o[q + 13] + k), vload16_wide(b, o[q + 14] + k),
            vload16_wide(b, o[q + 15] + k))
        vstore16(wbuf, w + 0 * _SN + q, t0)
        vstore16(wbuf, w + 1 * _SN + q, t1)
        vstore16(wbuf, w + 2 * _SN + q, t2)
        vstore16(wbuf, w + 3 * _SN + q, t3)
        vstore16(wbuf, w + 4 * _SN + q, t4)
        vstore16(wbuf, w + 5 * _SN + q, t5)
        vstore16(wbuf, w + 6 * _SN + q, t6)
        vstore16(wbuf, w + 7 * _SN + q, t7)
        vstore16(wbuf, w + 8 * _SN + q, t8)
        vstore16(wbuf, w + 9 * _SN + q, t9)
        vstore16(wbuf, w + 10 * _SN + q, t10)
        vstore16(wbuf, w + 11 * _SN + q, t11)
        vstore16(wbuf, w + 12 * _SN + q, t12)
        vstore16(wbuf, w + 13 * _SN + q, t13)
        vstore16(wbuf, w + 14 * _SN + q, t14)
        vstore16(wbuf, w + 15 * _SN + q, t15)


def _stream_block(b, o, k, wbuf, w):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_stream_block, inline="always")
def _stream_block_for(b, o, k, wbuf, w):
    """wbuf[w + j * _SN + l] = the weight's row o[l] (element offsets of the task's 32 rows) at step k + j,
    widened to float32, for a block of :func:`_block_steps` steps: 64 bytes of each row, so that each
    cache line of a row is read whole at once (the 32 rows, 2-4 KiB apart at K = 1024, share few L1
    sets: a line left half read was evicted before its second half was used). Two rows per register,
    8x8 transposes in each 256-bit half (moves only)."""
    return _line_words if b.dtype == types.int16 else _line_wide


def _block_steps(b):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_block_steps, inline="always")
def _block_steps_for(b):
    """Steps per block: 64 bytes of a row (32 bf16 steps, 16 float32 steps; fp16 is widened as float32,
    16 steps: 32 bytes)."""
    steps = 32 if b.dtype == types.int16 else 16
    return lambda b: steps


@njit(inline="always", cache=True)
def _stream_steps(b, o, k, steps, wbuf, w):
    """As :func:`_stream_block` for ``steps`` steps, one value at a time (a tile's last steps)."""
    for j in range(steps):
        for l in range(_SN):
            wbuf[w + j * _SN + l] = widen(b[o[l] + k + uint64(j)])


@njit(inline="always", cache=True)
def _stream_rows(x, K, r, last, wbuf, steps, k, acc):
    """Four rows of x from r (clamped at ``last``: computed, never stored) over ``steps`` steps of the
    32 widened weight rows in wbuf: eight chains in registers, each step two weight vectors, four
    broadcast x values, eight fmas; the chains' partials come from and go back to acc."""
    uk = uint64(K)
    x0, x1 = uint64(r) * uk + k, uint64(min(r + 1, last)) * uk + k
    x2, x3 = uint64(min(r + 2, last)) * uk + k, uint64(min(r + 3, last)) * uk + k
    o = r * _SN
    a0, a1, a2, a3 = vload16(acc, o), vload16(acc, o + 16), vload16(acc, o + 32), vload16(acc, o + 48)
    a4, a5, a6, a7 = vload16(acc, o + 64), vload16(acc, o + 80), vload16(acc, o + 96), vload16(acc, o + 112)
    for j in range(steps):
        lo, hi = vload16(wbuf, j * _SN), vload16(wbuf, j * _SN + 16)
        uj = uint64(j)
        s = vsplat16(x[x0 + uj])
        a0, a1 = vfma(s, lo, a0), vfma(s, hi, a1)
        s = vsplat16(x[x1 + uj])
        a2, a3 = vfma(s, lo, a2), vfma(s, hi, a3)
        s = vsplat16(x[x2 + uj])
        a4, a5 = vfma(s, lo, a4), vfma(s, hi, a5)
        s = vsplat16(x[x3 + uj])
        a6, a7 = vfma(s, lo, a6), vfma(s, hi, a7)
    vstore16(acc, o, a0)
    vstore16(acc, o + 16, a1)
    vstore16(acc, o + 32, a2)
    vstore16(acc, o + 48, a3)
    vstore16(acc, o + 64, a4)
    vstore16(acc, o + 80, a5)
    vstore16(acc, o + 96, a6)
    vstore16(acc, o + 112, a7)


@njit(cache=True)  # not inlined, as _gemm_task
def _stream_task(x, M, b, N, K, T, bias, c, blk, o, wbuf, acc, tot):
    """Every row of x (x: [M, K] float32 flat, M <= _STREAM_ROWS) against 32 weight rows from blk * 32
    (b: [N, K] as stored, flat): 32 chains per x row in the lanes of two vectors, each advanced in k order.
    Up to _SPAN steps of the 32 rows are widened and transposed once into wbuf (4 KiB, in L1), then the
    rows of x run over it four at a time (eight chains in registers, one broadcast x value per row and
    step): the weight is read from memory once per call, whatever M. Weight rows past N are clamped
    (computed, never stored)."""
    n0 = blk * _SN
    uk = uint64(K)
    kb = _block_steps(b)
    for l in range(_SN):
        o[l] = uint64(min(n0 + l, N - 1)) * uk
    for i in range(M * _SN):
        tot[i] = ZERO
    for k0 in range(0, K, T):
        k1 = min(k0 + T, K)
        for i in range(_STREAM_ROWS * _SN):
            acc[i] = ZERO
        for s0 in range(k0, k1, _SPAN):  # a tile's chains go on across spans (partials kept in acc)
            s1 = min(s0 + _SPAN, k1)
            kk = s0
            while kk < s1:
                steps = min(kb, s1 - kk)
                if steps == kb:
                    _stream_block(b, o, uint64(kk), wbuf, (kk - s0) * _SN)
                else:
                    _stream_steps(b, o, uint64(kk), steps, wbuf, (kk - s0) * _SN)
                kk += steps
            for r in range(0, M, 4):
                _stream_rows(x, K, r, M - 1, wbuf, s1 - s0, uint64(s0), acc)
        for i in range(M * _SN):
            tot[i] += acc[i]
    has_bias = bias.shape[0] > 0
    for m in range(M):
        for l in range(min(_SN, N - n0)):
            v = tot[m * _SN + l]
            if has_bias:
                v += bias[n0 + l]  # once, after the K reduction
            c[m * N + n0 + l] = canon(v)


@njit(nogil=True, cache=True)
def _stream_tasks(x, M, b, N, K, T, bias, c, lo, hi):
    o = np.empty(_SN, np.uint64)
    wbuf = np.empty(_SPAN * _SN, np.float32)
    acc = np.empty(_STREAM_ROWS * _SN, np.float32)
    tot = np.empty(_STREAM_ROWS * _SN, np.float32)
    for blk in range(lo, hi):
        _stream_task(x, M, b, N, K, T, bias, c, blk, o, wbuf, acc, tot)


def _stream_into(x32, B, C, T, bias):
    """C = x . B^T + bias for x [M <= _STREAM_ROWS, K] float32 and B [N, K] as stored: tasks of 32
    weight rows, split over threads."""
    M, K = x32.shape
    N = B.shape[0]
    pool.run(_stream_tasks, (N + _SN - 1) // _SN, x32.ravel(), M, B.ravel(), N, K, T, bias, C.ravel(),
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


def _widened(a2: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy of raw operand values (bf16 / fp16 bits widened exactly, as ``widen``);
    float32 as it is. For the few x rows of the streaming kernel: M x K values against its M x N x K."""
    if a2.dtype == np.float32:
        return np.ascontiguousarray(a2)
    if a2.dtype == np.int16:  # bf16: its bits are a float32's high half
        return (a2.astype(np.int32) << 16).view(np.float32)
    return a2.view(np.float16).astype(np.float32)  # fp16: every value is a float32 (exact)


def dot_rows_nk(a2: np.ndarray, b_nk: np.ndarray, t: int, bias: np.ndarray = _NO_BIAS) -> np.ndarray:
    """[M, K] . [N, K]^T (+ bias [N]) -> float32 [M, N], as :func:`dot_rows_kn`. One row runs
    :func:`_dots_into`, 2 to _STREAM_ROWS rows (decode) stream the weight as stored (:func:`_stream_into`),
    more run the gemm."""
    m = a2.shape[0]
    if m > _STREAM_ROWS:
        return _gemm(a2, b_nk, True, t, bias)
    if m == 1:  # one row: eight chains in a vector, no buffer (faster from memory than streaming at one row)
        out = np.zeros((m, b_nk.shape[0]), np.float32)
        if out.size:
            _dots_into(a2, b_nk, out, t, bias)
        return out
    out = np.empty((m, b_nk.shape[0]), np.float32)  # every element is stored
    if out.size:
        _stream_into(_widened(a2), b_nk, out, t, bias)
    return out


# The host side is kept to a few cheap steps (a 16x256x256 product takes tens of microseconds):
# reshapes are numpy's, on arrays sharing the tensors' memory (torch's cost microseconds each), and
# the kernels store canonical NaNs, so a float32 result needs no further pass.
def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    out = dot_rows_kn(raw(a).reshape(math.prod(a.shape[:-1]), a.shape[-1]), raw(b), spec.k_tile)
    return finish(out.reshape(*a.shape[:-1], b.shape[1]), a.dtype, nan_done=True)


def _linear_accumulation(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> np.ndarray:
    """The float32 result (canonical NaNs) :func:`linear` rounds once to x's dtype, shaped [..., N]."""
    b32 = _NO_BIAS if bias is None else raw(bias.to(F32))
    x2 = raw(x)
    if x2.ndim != 2:  # (a 2-D x skips both reshapes: ~1 us each)
        x2 = x2.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    acc = dot_rows_nk(x2, raw(weight), spec.k_tile, b32)
    if x.ndim != 2:
        acc = acc.reshape(*x.shape[:-1], weight.shape[0])
    return acc


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    return finish(_linear_accumulation(x, weight, bias, spec), x.dtype, nan_done=True)


def linear_with_float32(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`linear`'s output, the float32 result it rounded): one K reduction for both."""
    acc = finish(_linear_accumulation(x, weight, bias, spec), F32, nan_done=True)
    return finish(acc, x.dtype, nan_done=True), acc
