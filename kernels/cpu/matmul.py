"""matmul / linear (strict, k-tiled): register/cache-blocked numba kernels.

Both kernels compute each output as the spec's chain (reduce.py): per K tile a sequential fma chain
from +0.0 in k order, tile partials added into the zeroed output in tile order. Speed comes only
from running independent chains (other output columns / rows) together.

* ``_gemm_*``: a task owns up to ``_MG`` rows x ``_NC`` columns of C. Per K tile it packs B's tile
  panel as float32 [T, cols] (B stored [K, N] or, for linear's weight, [N, K]: the transpose and
  the bf16/fp16 widening happen here, so the host never copies the weight), then runs four rows
  at a time; the innermost loop runs over the panel's contiguous columns with independent
  accumulators (it vectorises) and advances every chain by four k steps per accumulator load/store.
* ``_dots_*``: B is [N, K] (the weight as stored); eight output columns are eight independent
  scalar chains in flight (latency hiding). For linear with few rows (decode), where packing the
  weight would cost as much as the product.

Each kernel has a parallel (prange over tasks) and a serial driver around one task body:
a parallel launch costs tens of microseconds, more than a small product (host.parallel_worth).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, uint64

from .host import F32, finish, parallel_worth, raw
from .strict_math import ZERO, canon, fma, widen

_NC = 128  # columns per task: a packed tile panel (T x 128 float32) stays in L1/L2
_MG = 64  # rows per task (a panel is packed once per task and K tile)
_FEW_ROWS = 4  # below this many rows linear runs on the weight as stored


@njit(inline="always", cache=True)
def _pack(B, nk, k0, k1, n0, n1, P):
    """P[k - k0, n - n0] = B's (k, n) value as float32; B is [N, K] when nk else [K, N]."""
    if nk:  # transposed in blocks of 8 columns: 8 sequential read streams, contiguous writes
        for nb in range(n0, n1, 8):
            if nb + 8 <= n1:
                b0, b1, b2, b3 = B[nb, k0:k1], B[nb + 1, k0:k1], B[nb + 2, k0:k1], B[nb + 3, k0:k1]
                b4, b5, b6, b7 = B[nb + 4, k0:k1], B[nb + 5, k0:k1], B[nb + 6, k0:k1], B[nb + 7, k0:k1]
                j = nb - n0
                for k in range(k1 - k0):
                    p = P[k]
                    p[j], p[j + 1], p[j + 2], p[j + 3] = widen(b0[k]), widen(b1[k]), widen(b2[k]), widen(b3[k])
                    p[j + 4], p[j + 5], p[j + 6], p[j + 7] = widen(b4[k]), widen(b5[k]), widen(b6[k]), widen(b7[k])
            else:
                for n in range(nb, n1):
                    row = B[n, k0:k1]
                    for k in range(k1 - k0):
                        P[k, n - n0] = widen(row[k])
    else:
        for k in range(k0, k1):
            row = B[k, n0:n1]
            p = P[k - k0]
            for n in range(n1 - n0):
                p[n] = widen(row[n])


@njit(inline="always", cache=True)
def _finish_row(c, bias, n0, has_bias):
    """c (row segment from column n0) after its last tile: + bias (once, after the K reduction, as
    the reference) and canonical NaNs (a select per element: the loop vectorises)."""
    if has_bias:
        for n in range(c.shape[0]):
            c[n] = canon(c[n] + bias[n0 + n])
    else:
        for n in range(c.shape[0]):
            c[n] = canon(c[n])


@njit(inline="always", cache=True)
def _gemm_task(A, B, nk, C, T, bias, task, P, acc):
    M, K = A.shape
    N = C.shape[1]
    nnb = (N + _NC - 1) // _NC
    m_lo = (task // nnb) * _MG
    m_hi = min(m_lo + _MG, M)
    n0 = (task % nnb) * _NC
    n1 = min(n0 + _NC, N)
    w = n1 - n0
    a0, a1, a2, a3 = acc[0, :w], acc[1, :w], acc[2, :w], acc[3, :w]
    for k0 in range(0, K, T):
        k1 = min(k0 + T, K)
        _pack(B, nk, k0, k1, n0, n1, P)
        for m0 in range(m_lo, m_hi, 4):
            # rows past m_hi are clamped: computed, never stored
            r0, r1, r2, r3 = A[m0], A[min(m0 + 1, m_hi - 1)], A[min(m0 + 2, m_hi - 1)], A[min(m0 + 3, m_hi - 1)]
            a0[:] = ZERO
            a1[:] = ZERO
            a2[:] = ZERO
            a3[:] = ZERO
            k = k0
            # four steps of every chain per pass over the accumulators, in k order as the spec: the
            # 16 row values stay in registers, so each pass is 16 fmas per 4 panel loads and one
            # load / store of each accumulator (with fewer steps the stores bound the loop)
            while k + 4 <= k1:
                x0, x1, x2, x3 = widen(r0[k]), widen(r1[k]), widen(r2[k]), widen(r3[k])
                y0, y1, y2, y3 = widen(r0[k + 1]), widen(r1[k + 1]), widen(r2[k + 1]), widen(r3[k + 1])
                u0, u1, u2, u3 = widen(r0[k + 2]), widen(r1[k + 2]), widen(r2[k + 2]), widen(r3[k + 2])
                v0, v1, v2, v3 = widen(r0[k + 3]), widen(r1[k + 3]), widen(r2[k + 3]), widen(r3[k + 3])
                p, q, pu, pv = P[k - k0, :w], P[k + 1 - k0, :w], P[k + 2 - k0, :w], P[k + 3 - k0, :w]
                for n in range(w):
                    pn, qn, un, vn = p[n], q[n], pu[n], pv[n]
                    a0[n] = fma(v0, vn, fma(u0, un, fma(y0, qn, fma(x0, pn, a0[n]))))
                    a1[n] = fma(v1, vn, fma(u1, un, fma(y1, qn, fma(x1, pn, a1[n]))))
                    a2[n] = fma(v2, vn, fma(u2, un, fma(y2, qn, fma(x2, pn, a2[n]))))
                    a3[n] = fma(v3, vn, fma(u3, un, fma(y3, qn, fma(x3, pn, a3[n]))))
                k += 4
            while k < k1:  # the tile's last 1-3 steps, one at a time
                x0, x1, x2, x3 = widen(r0[k]), widen(r1[k]), widen(r2[k]), widen(r3[k])
                p = P[k - k0, :w]
                for n in range(w):
                    pn = p[n]
                    a0[n] = fma(x0, pn, a0[n])
                    a1[n] = fma(x1, pn, a1[n])
                    a2[n] = fma(x2, pn, a2[n])
                    a3[n] = fma(x3, pn, a3[n])
                k += 1
            for i in range(min(4, m_hi - m0)):
                c = C[m0 + i, n0:n1]
                ai = acc[i, :w]
                for n in range(w):
                    c[n] += ai[n]
    for m in range(m_lo, m_hi):
        _finish_row(C[m, n0:n1], bias, n0, bias.shape[0] > 0)


@njit(inline="always", cache=True)
def _gemm_tasks(M, N):
    return ((M + _MG - 1) // _MG) * ((N + _NC - 1) // _NC)


@njit(parallel=True, cache=True)
def _gemm_par(A, B, nk, C, T, bias):
    for task in prange(_gemm_tasks(A.shape[0], C.shape[1])):
        P = np.empty((min(T, A.shape[1]), _NC), np.float32)  # one K tile's panel (a tile may exceed K)
        _gemm_task(A, B, nk, C, T, bias, task, P, np.empty((4, _NC), np.float32))


@njit(cache=True)
def _gemm_ser(A, B, nk, C, T, bias):
    P, acc = np.empty((min(T, A.shape[1]), _NC), np.float32), np.empty((4, _NC), np.float32)
    for task in range(_gemm_tasks(A.shape[0], C.shape[1])):
        _gemm_task(A, B, nk, C, T, bias, task, P, acc)


@njit(inline="always", cache=True)
def _dots_task(a, b, c, M, N, K, T, bias, blk):
    nnb = (N + 7) // 8
    m = blk // nnb
    n0 = (blk % nnb) * 8
    # unsigned offsets: numba then skips negative-index wraparound in the inner loop; columns past
    # N are clamped (computed, never stored)
    ra = uint64(m * K)
    b0, b1 = uint64(n0 * K), uint64(min(n0 + 1, N - 1) * K)
    b2, b3 = uint64(min(n0 + 2, N - 1) * K), uint64(min(n0 + 3, N - 1) * K)
    b4, b5 = uint64(min(n0 + 4, N - 1) * K), uint64(min(n0 + 5, N - 1) * K)
    b6, b7 = uint64(min(n0 + 6, N - 1) * K), uint64(min(n0 + 7, N - 1) * K)
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = ZERO
    for k0 in range(0, K, T):
        k1 = min(k0 + T, K)
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = ZERO
        for kk in range(k0, k1):
            k = uint64(kk)
            x = widen(a[ra + k])
            s0 = fma(x, widen(b[b0 + k]), s0)
            s1 = fma(x, widen(b[b1 + k]), s1)
            s2 = fma(x, widen(b[b2 + k]), s2)
            s3 = fma(x, widen(b[b3 + k]), s3)
            s4 = fma(x, widen(b[b4 + k]), s4)
            s5 = fma(x, widen(b[b5 + k]), s5)
            s6 = fma(x, widen(b[b6 + k]), s6)
            s7 = fma(x, widen(b[b7 + k]), s7)
        t0 += s0
        t1 += s1
        t2 += s2
        t3 += s3
        t4 += s4
        t5 += s5
        t6 += s6
        t7 += s7
    if bias.shape[0] > 0:  # once, after the K reduction (columns past N read the clamped last one)
        t0 += bias[n0]
        t1, t2, t3 = t1 + bias[min(n0 + 1, N - 1)], t2 + bias[min(n0 + 2, N - 1)], t3 + bias[min(n0 + 3, N - 1)]
        t4, t5 = t4 + bias[min(n0 + 4, N - 1)], t5 + bias[min(n0 + 5, N - 1)]
        t6, t7 = t6 + bias[min(n0 + 6, N - 1)], t7 + bias[min(n0 + 7, N - 1)]
    t0, t1, t2, t3, t4, t5, t6, t7 = canon(t0), canon(t1), canon(t2), canon(t3), canon(t4), canon(t5), canon(t6), canon(t7)
    o = m * N + n0
    c[o] = t0
    if n0 + 7 < N:
        c[o + 1], c[o + 2], c[o + 3], c[o + 4], c[o + 5], c[o + 6], c[o + 7] = t1, t2, t3, t4, t5, t6, t7
    else:  # the last, short block of columns
        for i, ti in ((1, t1), (2, t2), (3, t3), (4, t4), (5, t5), (6, t6)):
            if n0 + i < N:
                c[o + i] = ti


@njit(parallel=True, cache=True)
def _dots_par(A, B, C, T, bias):
    M, K = A.shape
    N = B.shape[0]
    a, b, c = A.ravel(), B.ravel(), C.ravel()
    for blk in prange(M * ((N + 7) // 8)):
        _dots_task(a, b, c, M, N, K, T, bias, blk)


@njit(cache=True)
def _dots_ser(A, B, C, T, bias):
    M, K = A.shape
    N = B.shape[0]
    a, b, c = A.ravel(), B.ravel(), C.ravel()
    for blk in range(M * ((N + 7) // 8)):
        _dots_task(a, b, c, M, N, K, T, bias, blk)


_NO_BIAS = np.empty(0, np.float32)


def _gemm(a2: np.ndarray, b: np.ndarray, nk: bool, t: int, bias: np.ndarray) -> np.ndarray:
    m, k = a2.shape
    out = np.zeros((m, b.shape[0] if nk else b.shape[1]), np.float32)
    if out.size:
        (_gemm_par if parallel_worth(out.size * k) else _gemm_ser)(a2, b, nk, out, t, bias)
    return out


def dot_rows_kn(a2: np.ndarray, b_kn: np.ndarray, t: int, bias: np.ndarray = _NO_BIAS) -> np.ndarray:
    """[M, K] . [K, N] (+ bias [N]) -> float32 [M, N] in the canonical tiled order, NaNs canonical
    (operands from host.raw; bias float32, or empty for none)."""
    return _gemm(a2, b_kn, False, t, bias)


def dot_rows_nk(a2: np.ndarray, b_nk: np.ndarray, t: int, bias: np.ndarray = _NO_BIAS) -> np.ndarray:
    """[M, K] . [N, K]^T (+ bias [N]) -> float32 [M, N], as :func:`dot_rows_kn`."""
    m, k = a2.shape
    if m >= _FEW_ROWS:
        return _gemm(a2, b_nk, True, t, bias)
    out = np.zeros((m, b_nk.shape[0]), np.float32)
    if out.size:
        (_dots_par if parallel_worth(out.size * k) else _dots_ser)(a2, b_nk, out, t, bias)
    return out


# The host side is kept to a few cheap steps (a 16x256x256 product takes tens of microseconds):
# reshapes are numpy's, on arrays sharing the tensors' memory (torch's cost microseconds each), and
# the kernels store canonical NaNs, so a float32 result needs no further pass.
def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    out = dot_rows_kn(raw(a).reshape(math.prod(a.shape[:-1]), a.shape[-1]), raw(b), spec.k_tile)
    return finish(torch.from_numpy(out.reshape(*a.shape[:-1], b.shape[1])), a.dtype, nan_done=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    b32 = _NO_BIAS if bias is None else raw(bias.to(F32))
    acc = dot_rows_nk(raw(x).reshape(math.prod(x.shape[:-1]), x.shape[-1]), raw(weight), spec.k_tile, b32)
    return finish(torch.from_numpy(acc.reshape(*x.shape[:-1], weight.shape[0])), x.dtype, nan_done=True)
