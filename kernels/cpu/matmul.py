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
* ``_stream_*``: linear with 1 to 8 rows (decode), on the weight as stored ([N, K], bf16 / fp16 / float32
  read in place): a task owns 16 weight rows, whose chains per row of x are the lanes of one sixteen-float
  vector (simd.py's f32x16). A cache line of each of the 16 rows is loaded, widened and transposed in
  registers (simd.vsteps16) and applied to every row of x (widened to float32 on the host: M x K values),
  so the weight is read from memory once per call whatever M; two K tiles run at once where the rows of x
  alone give too few chains, and each task prefetches the next task's rows in memory order.

Each phase is one compiled kernel over a range of tasks, split over threads by pool.run when the
product is large enough (pool.parallel_worth: handing ranges to threads costs tens of microseconds).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import literal_unroll, njit, types, uint64
from numba.extending import overload

from . import pool
from .host import F32, finish, raw
from .pool import parallel_worth
from .simd import (prefetch, vadd, vcanon, vchains, vfma, vload, vload16, vsplat, vsteps16, vstore, vstore16, vzero,
                   vzero16)
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
def _pack_panels(B, nk, P, work):
    lo, hi = pool.claim(work)
    while lo < hi:
        for b in range(lo, hi):
            _pack_panel(B, nk, P, b)
        lo, hi = pool.claim(work)


@njit(nogil=True, cache=True)
def _gemm_tasks(a, rows, K, p, panels, c, ncols, T, bias, bias_rows, work):
    tot = np.empty(_R * _L, np.float32)
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            _gemm_task(a, rows, K, p, panels, c, ncols, T, bias, bias_rows, task, tot)
        lo, hi = pool.claim(work)


@njit(nogil=True, cache=True)
def _transpose_blocks(CT, C, work):
    lo, hi = pool.claim(work)
    while lo < hi:
        for blk in range(lo, hi):
            _transpose_rows(CT, C, blk * _L, min(blk * _L + _L, C.shape[0]))
        lo, hi = pool.claim(work)


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


# ---------------------------------------------------------------- few rows: the weight streamed as stored

_SN = 16  # outputs (weight rows) per streaming task: one sixteen-lane vector per row of x
_STREAM_ROWS = 8  # up to this many rows of x (decode) linear streams the weight once for all of them


def _block_steps(b):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_block_steps, inline="always")
def _block_steps_for(b):
    """Steps per :func:`simd.vsteps16` block: 32 for bf16, 16 for float32 / fp16."""
    steps = 32 if b.dtype == types.int16 else 16
    return lambda b: steps


@njit(inline="always", cache=True)
def _step_column(b, o, k, tmp):
    """Step k of the task's 16 weight rows (element offsets o) as one vector, through tmp (a tile's steps
    past its last whole block)."""
    for l in range(_SN):
        tmp[l] = widen(b[o[l] + k])
    return vload16(tmp, 0)


def _add(tot, a):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_add, inline="always")
def _add_for(tot, a):
    """tot[m] += a[m] (the task's running totals, [_STREAM_ROWS, _SN] flat: tile partials in tile order)."""
    rows = len(a)

    def add(tot, a):
        for m in literal_unroll(range(rows)):
            vstore16(tot, m * _SN, vadd(vload16(tot, m * _SN), a[m]))
    return add


def _prefetch_next(b, pf, pf_end):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_prefetch_next, inline="always")
def _prefetch_next_for(b, pf, pf_end):
    """Prefetch as many cache lines of b from element offset pf as a block of a task reads (16 for bf16 /
    float32, 8 for fp16) unless pf is at or past pf_end; the offset after them. (A few lines past pf_end
    may be prefetched at the end of a range: a hint, never a fault.)"""
    line = 512 // b.dtype.bitwidth  # elements per 64-byte line
    lines = _SN * (32 if b.dtype == types.int16 else 16) // line

    def pref(b, pf, pf_end):
        if pf < pf_end:
            for i in literal_unroll(range(lines)):
                prefetch(b, pf + uint64(i * line))
        return pf + uint64(lines * line)
    return pref


@njit(cache=True)  # not inlined, as _gemm_task
def _tile_pairs(x, xo, b, o, K, T, tmp, tot, pf, pf_end, zero):
    """The task's K for one, two or four rows of x (zero: a +0.0 vector per row), two K tiles at a time:
    their chains are independent, so twice as many are in flight. A tile without a next one as long runs
    beside a copy of itself whose partials are dropped. Prefetches the next task's rows (pf .. pf_end)."""
    kb = _block_steps(b)
    t0 = 0
    while t0 < K:
        n = min(T, K - t0)  # this tile's steps
        t1 = t0 + n
        pair = t1 < K and K - t1 >= n  # the next tile is as long: both at once
        u0 = t1 if pair else t0
        a, e = zero, zero  # the chains of the tile from t0, of the tile from u0
        j = 0
        second = False  # a block of each tile in turn: one block's vectors live at a time (both at once spilled)
        while j + kb <= n:
            pf = _prefetch_next(b, pf, pf_end)
            if second:
                u = uint64(u0 + j)
                e = vchains(x, xo, u, vsteps16(b, o, u), e)
                j += kb
            else:
                k = uint64(t0 + j)
                a = vchains(x, xo, k, vsteps16(b, o, k), a)
            second = not second
        while j < n:
            k, u = uint64(t0 + j), uint64(u0 + j)
            a = vchains(x, xo, k, _step_column(b, o, k, tmp), a)
            e = vchains(x, xo, u, _step_column(b, o, u, tmp), e)
            j += 1
        _add(tot, a)
        if pair:
            _add(tot, e)
            t1 += n
        t0 = t1


@njit(cache=True)  # not inlined, as _gemm_task
def _tiles(x, xo, b, o, K, T, tmp, tot, pf, pf_end, zero):
    """The task's K for eight rows of x, one K tile at a time (eight chains in flight), as :func:`_tile_pairs`."""
    kb = _block_steps(b)
    for k0 in range(0, K, T):
        k1 = min(k0 + T, K)
        a = zero
        kk = k0
        while kk + kb <= k1:
            pf = _prefetch_next(b, pf, pf_end)
            k = uint64(kk)
            a = vchains(x, xo, k, vsteps16(b, o, k), a)
            kk += kb
        while kk < k1:
            k = uint64(kk)
            a = vchains(x, xo, k, _step_column(b, o, k, tmp), a)
            kk += 1
        _add(tot, a)


@njit(cache=True)  # not inlined, as _gemm_task
def _stream_task(x, M, b, N, K, T, bias, c, blk, pf_end, o, xo, tmp, tot):
    """Every row of x (x: [M, K] float32 flat, M <= _STREAM_ROWS) against the 16 weight rows from blk * 16
    (b: [N, K] as stored, flat): per row of x, the 16 rows' chains in the lanes of one vector, advanced one
    k step at a time in k order for a whole K tile in registers; tile partials added in tile order into
    tot, bias once after. A block of steps (a cache line of each weight row, :func:`simd.vsteps16`) is
    loaded and transposed in registers once and applied to every row of x.

    The rows of x run as 1, 2, 4 or 8 (a missing row repeats the last: computed, never stored). A chain's
    fma waits ~4 cycles for the one before, so a core needs eight chains in flight to keep its two fma pipes
    busy: up to four rows run two K tiles at once (:func:`_tile_pairs`), eight one (:func:`_tiles`). The
    task prefetches the next task's weight rows (up to pf_end) in memory order, as fast as it reads its
    own: 16-32 row streams at once read ~30 GB/s of the ~42 a sequential read gets here, with the prefetch
    ~36. Weight rows past N are clamped (computed, never stored)."""
    n0 = blk * _SN
    uk = uint64(K)
    for l in range(_SN):
        o[l] = uint64(min(n0 + l, N - 1)) * uk
    for m in range(_STREAM_ROWS):
        xo[m] = uint64(min(m, M - 1)) * uk
    for i in range(_STREAM_ROWS * _SN):
        tot[i] = ZERO
    pf = uint64(min(n0 + _SN, N)) * uk  # the next task's first element
    z = vzero16()
    if M == 1:
        _tile_pairs(x, xo, b, o, K, T, tmp, tot, pf, pf_end, (z,))
    elif M == 2:
        _tile_pairs(x, xo, b, o, K, T, tmp, tot, pf, pf_end, (z, z))
    elif M <= 4:
        _tile_pairs(x, xo, b, o, K, T, tmp, tot, pf, pf_end, (z, z, z, z))
    else:
        _tiles(x, xo, b, o, K, T, tmp, tot, pf, pf_end, (z, z, z, z, z, z, z, z))
    has_bias = bias.shape[0] > 0
    for m in range(M):
        for l in range(min(_SN, N - n0)):
            v = tot[m * _SN + l]
            if has_bias:
                v += bias[n0 + l]  # once, after the K reduction
            c[m * N + n0 + l] = canon(v)


@njit(nogil=True, cache=True)
def _stream_tasks(x, M, b, N, K, T, bias, c, work):
    o = np.empty(_SN, np.uint64)
    xo = np.empty(_STREAM_ROWS, np.uint64)
    tmp = np.empty(_SN, np.float32)
    tot = np.empty(_STREAM_ROWS * _SN, np.float32)
    lo, hi = pool.claim(work)
    while lo < hi:
        pf_end = uint64(min(hi * _SN, N)) * uint64(K)  # past the range's last weight row: prefetch nothing
        for blk in range(lo, hi):
            _stream_task(x, M, b, N, K, T, bias, c, blk, pf_end, o, xo, tmp, tot)
        lo, hi = pool.claim(work)


def _stream_into(x32, B, C, T, bias):
    """C = x . B^T + bias for x [M <= _STREAM_ROWS, K] float32 and B [N, K] as stored: tasks of 16 weight
    rows, split over threads."""
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
    """[M, K] . [N, K]^T (+ bias [N]) -> float32 [M, N], as :func:`dot_rows_kn`. Up to _STREAM_ROWS rows
    (decode) stream the weight as stored (:func:`_stream_into`), more run the gemm."""
    m = a2.shape[0]
    if m > _STREAM_ROWS:
        return _gemm(a2, b_nk, True, t, bias)
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
