"""matmul / linear (strict, k-tiled): register/cache-blocked numba kernels.

Both kernels compute each output as the spec's chain (reduce.py): per K tile a sequential fma chain
from +0.0 in k order, tile partials added into the zeroed output in tile order. Speed comes only
from running independent chains (other output columns / rows) together.

* ``_gemm_*``: a task owns up to ``_MG`` rows x ``_NC`` columns of C. Per K tile it packs B's tile
  panel as float32 [T, cols] (B stored [K, N] or, for linear's weight, [N, K]: the transpose and
  the bf16/fp16 widening happen here, so the host never copies the weight), then runs four rows
  at a time; the innermost loop runs over the panel's contiguous columns with independent
  accumulators (it vectorises) and advances every chain by two k steps per accumulator load/store.
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
from .strict_math import ZERO, fma, widen

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
def _gemm_task(A, B, nk, C, T, task, P, acc):
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
            while k + 2 <= k1:  # two steps of every chain per pass: fma(k+1) after fma(k), as the spec
                x0, x1, x2, x3 = widen(r0[k]), widen(r1[k]), widen(r2[k]), widen(r3[k])
                y0, y1, y2, y3 = widen(r0[k + 1]), widen(r1[k + 1]), widen(r2[k + 1]), widen(r3[k + 1])
                p, q = P[k - k0, :w], P[k + 1 - k0, :w]
                for n in range(w):
                    pn, qn = p[n], q[n]
                    a0[n] = fma(y0, qn, fma(x0, pn, a0[n]))
                    a1[n] = fma(y1, qn, fma(x1, pn, a1[n]))
                    a2[n] = fma(y2, qn, fma(x2, pn, a2[n]))
                    a3[n] = fma(y3, qn, fma(x3, pn, a3[n]))
                k += 2
            if k < k1:  # odd tile length: the last step alone
                x0, x1, x2, x3 = widen(r0[k]), widen(r1[k]), widen(r2[k]), widen(r3[k])
                p = P[k - k0, :w]
                for n in range(w):
                    pn = p[n]
                    a0[n] = fma(x0, pn, a0[n])
                    a1[n] = fma(x1, pn, a1[n])
                    a2[n] = fma(x2, pn, a2[n])
                    a3[n] = fma(x3, pn, a3[n])
            for i in range(min(4, m_hi - m0)):
                c = C[m0 + i, n0:n1]
                ai = acc[i, :w]
                for n in range(w):
                    c[n] += ai[n]


@njit(inline="always", cache=True)
def _gemm_tasks(M, N):
    return ((M + _MG - 1) // _MG) * ((N + _NC - 1) // _NC)


@njit(parallel=True, cache=True)
def _gemm_par(A, B, nk, C, T):
    for task in prange(_gemm_tasks(A.shape[0], C.shape[1])):
        P = np.empty((min(T, A.shape[1]), _NC), np.float32)  # one K tile's panel (a tile may exceed K)
        _gemm_task(A, B, nk, C, T, task, P, np.empty((4, _NC), np.float32))


@njit(cache=True)
def _gemm_ser(A, B, nk, C, T):
    P, acc = np.empty((min(T, A.shape[1]), _NC), np.float32), np.empty((4, _NC), np.float32)
    for task in range(_gemm_tasks(A.shape[0], C.shape[1])):
        _gemm_task(A, B, nk, C, T, task, P, acc)


@njit(inline="always", cache=True)
def _dots_task(a, b, c, M, N, K, T, blk):
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
    o = m * N + n0
    c[o] = t0
    if n0 + 7 < N:
        c[o + 1], c[o + 2], c[o + 3], c[o + 4], c[o + 5], c[o + 6], c[o + 7] = t1, t2, t3, t4, t5, t6, t7
    else:  # the last, short block of columns
        for i, ti in ((1, t1), (2, t2), (3, t3), (4, t4), (5, t5), (6, t6)):
            if n0 + i < N:
                c[o + i] = ti


@njit(parallel=True, cache=True)
def _dots_par(A, B, C, T):
    M, K = A.shape
    N = B.shape[0]
    a, b, c = A.ravel(), B.ravel(), C.ravel()
    for blk in prange(M * ((N + 7) // 8)):
        _dots_task(a, b, c, M, N, K, T, blk)


@njit(cache=True)
def _dots_ser(A, B, C, T):
    M, K = A.shape
    N = B.shape[0]
    a, b, c = A.ravel(), B.ravel(), C.ravel()
    for blk in range(M * ((N + 7) // 8)):
        _dots_task(a, b, c, M, N, K, T, blk)


def _gemm(a2: np.ndarray, b: np.ndarray, nk: bool, t: int) -> torch.Tensor:
    m, k = a2.shape
    n = b.shape[0] if nk else b.shape[1]
    out = torch.zeros((m, n), dtype=F32)
    if out.numel():
        (_gemm_par if parallel_worth(m * n * k) else _gemm_ser)(a2, b, nk, out.numpy(), t)
    return out


def dot_rows_kn(a2: np.ndarray, b_kn: np.ndarray, t: int) -> torch.Tensor:
    """[M, K] . [K, N] -> float32 tensor [M, N] in the canonical tiled order (operands from host.raw)."""
    return _gemm(a2, b_kn, False, t)


def dot_rows_nk(a2: np.ndarray, b_nk: np.ndarray, t: int) -> torch.Tensor:
    """[M, K] . [N, K]^T -> float32 tensor [M, N] in the canonical tiled order (operands from host.raw)."""
    m, k = a2.shape
    if m >= _FEW_ROWS:
        return _gemm(a2, b_nk, True, t)
    out = torch.zeros((m, b_nk.shape[0]), dtype=F32)
    if out.numel():
        (_dots_par if parallel_worth(out.numel() * k) else _dots_ser)(a2, b_nk, out.numpy(), t)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    lead, k = a.shape[:-1], a.shape[-1]
    out = dot_rows_kn(raw(a.reshape(math.prod(lead), k)), raw(b), spec.k_tile)
    return finish(out, a.dtype).reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    acc = dot_rows_nk(raw(x.reshape(math.prod(lead), k)), raw(weight), spec.k_tile)
    if bias is not None:
        acc += bias.to(F32)  # once, after the K reduction (as the reference)
    return finish(acc, x.dtype).reshape(*lead, weight.shape[0])
