"""matmul / linear under FastMatmulSpec: bf16/fp16 tensor cores (``tl.dot``), tiling fixed by the spec.

One program computes a [block_m, block_n] output tile with one float32 accumulator:
``acc = tl.dot(a_tile, b_tile, acc)`` over the K tiles of block_k in increasing order. Nothing here
looks at M (no split-K for small batches, no autotuner): a row's bits depend on its own row of A,
on B and on the spec, so any batch composition gives the same bits on one GPU model (L1). The
epilogue is the strict kernels' (bias added once in float32, integer round-to-nearest-even, canonical
NaN). This kernel is NOT a strict kernel: the strict lint rejects it (tensor cores), the fast lint
(kernels/checks/fast_lint.py) requires tensor cores instead. In the interpreter, ``tl.dot`` is the
deterministic stand-in of interpreter_dot.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import strict_math as sm
from .dtypes import tl_dtype
from .interpreter_dot import sequential_dot
from .launch import cdiv, launch

#: program order only (neighbouring programs share B tiles in L2); it does not change any bits
GROUP_M = 8


# M (the batch) is never specialised on: one compiled kernel for every batch size (Triton would otherwise
# compile separate variants for M == 1 and M % 16 == 0), so the batch cannot even pick the binary.
@triton.jit(do_not_specialize=["M"])
def _fast_matmul_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K, sa_m, sa_k, sb_k, sb_n, so_m, so_n,
                        HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(n_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < M
    col_ok = cols < N
    a_p = a_ptr + rows.to(tl.int64)[:, None] * sa_m + ks[None, :] * sa_k
    b_p = b_ptr + ks[:, None] * sb_k + cols.to(tl.int64)[None, :] * sb_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # one chain over K tiles in increasing order; the last tile zero-padded
        k_ok = (k0 + ks) < K
        a = tl.load(a_p, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_p, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_p += BK * sa_k
        b_p += BK * sb_k
    if HAS_BIAS:  # added once, after the K reduction
        acc = acc + sm.widen(tl.load(bias_ptr + cols, mask=col_ok, other=0.0))[None, :]
    out = sm.round_out(acc, OUT_DTYPE)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n, out,
             mask=row_ok[:, None] & col_ok[None, :])


def _mm2d(a2: torch.Tensor, b_kn: torch.Tensor, bias, spec, out_dtype) -> torch.Tensor:
    """a2 [M, K] @ b_kn [K, N] (+ bias) -> [M, N] (b_kn may be a transposed view)."""
    m, k = a2.shape
    n = b_kn.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a2.device)
    if m == 0 or n == 0:
        return out
    grid = (cdiv(m, spec.block_m) * cdiv(n, spec.block_n),)
    with sequential_dot():
        launch(_fast_matmul_kernel, grid, a2, b_kn, bias if bias is not None else a2, out, m, n, k,
               a2.stride(0), a2.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1),
               HAS_BIAS=bias is not None, OUT_DTYPE=tl_dtype(out_dtype), BM=spec.block_m, BN=spec.block_n,
               BK=spec.block_k, GROUP=GROUP_M, num_warps=spec.num_warps, num_stages=spec.num_stages)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype."""
    lead, k = a.shape[:-1], a.shape[-1]
    out = _mm2d(a.reshape(lead.numel(), k), b, None, spec, a.dtype)
    return out.reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = _mm2d(x.reshape(lead.numel(), k), weight.t(), bias, spec, x.dtype)
    return out.reshape(*lead, weight.shape[0])
