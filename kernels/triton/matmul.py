"""matmul / linear under MatmulSpec (strict): one program computes a [BM, BN] tile of outputs.

Every output is its own sequential fma chain (common.dot_k_tiled), so the bits do not depend on
BM/BN, the grid or the batch: block sizes are chosen for speed only. No ``tl.dot``: on bf16/fp16
it is a tensor-core tree, and even fp32 ``ieee`` dots get fused across K tiles by Triton's combiner.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, strict_math as sm
from .launch import interpreting, launch
from .dtypes import tl_dtype


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K,
                   sa_m, sa_k, sb_k, sb_n, so_m, so_n,
                   HAS_BIAS: tl.constexpr, KT: tl.constexpr, OUT_DTYPE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    acc = common.dot_k_tiled(a_ptr, sa_m, sa_k, b_ptr, sb_k, sb_n, rows, cols, row_ok, col_ok, K, KT, BM, BN)
    if HAS_BIAS:  # added once, after the K reduction
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = sm.round_out(acc, OUT_DTYPE)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
    tl.store(ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def _blocks(m: int, n: int) -> tuple[int, int]:
    if interpreting():  # the interpreter pays per operation, not per element: few large programs
        return max(16, triton.next_power_of_2(min(m, 128))), max(16, triton.next_power_of_2(min(n, 256)))
    bm = 16 if m <= 16 else 64
    return bm, 64 if m <= 16 else 128


def _mm2d(a2: torch.Tensor, b_kn: torch.Tensor, bias, k_tile: int, out_dtype) -> torch.Tensor:
    """a2 [M, K] @ b_kn [K, N] (+ bias) -> [M, N] (b_kn may be a transposed view)."""
    m, k = a2.shape
    n = b_kn.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a2.device)
    if m == 0 or n == 0:
        return out
    bm, bn = _blocks(m, n)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    launch(_matmul_kernel, grid, a2, b_kn, bias if bias is not None else a2, out, m, n, k,
           a2.stride(0), a2.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1),
           HAS_BIAS=bias is not None, KT=k_tile, OUT_DTYPE=tl_dtype(out_dtype), BM=bm, BN=bn)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype."""
    lead, k = a.shape[:-1], a.shape[-1]
    out = _mm2d(a.reshape(-1, k), b, None, spec.k_tile, a.dtype)
    return out.reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = _mm2d(x.reshape(-1, k), weight.t(), bias, spec.k_tile, x.dtype)
    return out.reshape(*lead, weight.shape[0])
