"""matmul / linear (strict, k-tiled): register/cache-blocked numba kernels.

Two layouts, both computing each output as the spec's chain (reduce.py): per K tile a sequential fma
chain from +0.0 in k order, tile partials added into the zeroed output in tile order.

* ``_rows_kn``: B is [K, N] (contiguous along N). Four rows of A share each B row; the innermost
  loop runs over a contiguous chunk of N columns with independent accumulators, so it vectorises
  without reordering any chain. Used by matmul, and by linear when several rows amortise the
  weight transpose.
* ``_dots_nk``: B is [N, K] (the linear weight as stored). Four output columns are four independent
  scalar chains in flight (latency hiding); used for linear with few rows (decode), where
  transposing the weight would cost as much as the product.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, uint64

from .host import F32, finish, raw
from .strict_math import ZERO, fma, widen

_NC = 512  # columns per block of _rows_kn: 4 x 512 float32 accumulators stay in L1
_FEW_ROWS = 4  # below this many rows linear runs on the weight as stored


@njit(parallel=True, cache=True)
def _rows_kn(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    nmb = (M + 3) // 4
    nnb = (N + _NC - 1) // _NC
    for blk in prange(nmb * nnb):
        m0 = (blk // nnb) * 4
        n0 = (blk % nnb) * _NC
        n1 = min(n0 + _NC, N)
        w = n1 - n0
        m1, m2, m3 = min(m0 + 1, M - 1), min(m0 + 2, M - 1), min(m0 + 3, M - 1)  # clamped: computed, not stored
        acc = np.empty((4, w), np.float32)
        a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
        for k0 in range(0, K, T):
            k1 = min(k0 + T, K)
            acc[:] = ZERO
            for k in range(k0, k1):
                x0, x1, x2, x3 = widen(A[m0, k]), widen(A[m1, k]), widen(A[m2, k]), widen(A[m3, k])
                b = B[k, n0:n1]
                for n in range(w):
                    bn = widen(b[n])
                    a0[n] = fma(x0, bn, a0[n])
                    a1[n] = fma(x1, bn, a1[n])
                    a2[n] = fma(x2, bn, a2[n])
                    a3[n] = fma(x3, bn, a3[n])
            for i in range(min(4, M - m0)):
                c = C[m0 + i, n0:n1]
                ai = acc[i]
                for n in range(w):
                    c[n] += ai[n]


@njit(parallel=True, cache=True)
def _dots_nk(A, B, C, T):
    M, K = A.shape
    N = B.shape[0]
    a, b, c = A.ravel(), B.ravel(), C.ravel()
    nnb = (N + 3) // 4
    for blk in prange(M * nnb):
        m = blk // nnb
        n0 = (blk % nnb) * 4
        # unsigned offsets: numba then skips negative-index wraparound in the inner loop
        ra = uint64(m * K)
        b0, b1 = uint64(n0 * K), uint64(min(n0 + 1, N - 1) * K)
        b2, b3 = uint64(min(n0 + 2, N - 1) * K), uint64(min(n0 + 3, N - 1) * K)
        t0 = t1 = t2 = t3 = ZERO
        for k0 in range(0, K, T):
            k1 = min(k0 + T, K)
            s0 = s1 = s2 = s3 = ZERO
            for kk in range(k0, k1):
                k = uint64(kk)
                x = widen(a[ra + k])
                s0 = fma(x, widen(b[b0 + k]), s0)
                s1 = fma(x, widen(b[b1 + k]), s1)
                s2 = fma(x, widen(b[b2 + k]), s2)
                s3 = fma(x, widen(b[b3 + k]), s3)
            t0 += s0
            t1 += s1
            t2 += s2
            t3 += s3
        o = m * N + n0
        c[o] = t0
        if n0 + 1 < N:
            c[o + 1] = t1
        if n0 + 2 < N:
            c[o + 2] = t2
        if n0 + 3 < N:
            c[o + 3] = t3


def dot_rows_kn(a2: np.ndarray, b_kn: np.ndarray, t: int) -> torch.Tensor:
    """[M, K] . [K, N] -> float32 tensor [M, N] in the canonical tiled order (operands from host.raw)."""
    out = torch.zeros((a2.shape[0], b_kn.shape[1]), dtype=F32)
    if out.numel():
        _rows_kn(a2, b_kn, out.numpy(), t)
    return out


def dot_rows_nk(a2: np.ndarray, b_nk: np.ndarray, t: int) -> torch.Tensor:
    """[M, K] . [N, K]^T -> float32 tensor [M, N] in the canonical tiled order (operands from host.raw)."""
    out = torch.zeros((a2.shape[0], b_nk.shape[0]), dtype=F32)
    if out.numel():
        _dots_nk(a2, b_nk, out.numpy(), t)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    lead, k = a.shape[:-1], a.shape[-1]
    out = dot_rows_kn(raw(a.reshape(math.prod(lead), k)), raw(b), spec.k_tile)
    return finish(out, a.dtype).reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = raw(x.reshape(math.prod(lead), k))
    if x2.shape[0] < _FEW_ROWS:
        acc = dot_rows_nk(x2, raw(weight), spec.k_tile)
    else:
        acc = dot_rows_kn(x2, raw(weight.t()), spec.k_tile)
    if bias is not None:
        acc += bias.to(F32)  # once, after the K reduction (as the reference)
    return finish(acc, x.dtype).reshape(*lead, weight.shape[0])
