"""matmul / linear under an ExactMatmulSpec: the golden source of the exact policy.

The slice products are int64 torch matmuls (exact: |P| < 2**31 * 2**24 for K <= 2**24); slicing,
the wide combine and the one rounding are ``hal.kernels.exact.core`` (its docstring and
``ExactMatmulSpec.describe`` give the arithmetic).
"""
from __future__ import annotations

import torch

from hal.kernels.exact.core import exact_linear
from hal.kernels.exact.prepared import unpack


def products_int64(da: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """P[t, u] = A_t @ W_u^T summed in int64 (readable; no BLAS, no int32 limit)."""
    s = da.shape[0]
    a64, w64 = da.to(torch.int64), dw.to(torch.int64)
    return torch.stack([torch.stack([a64[t] @ w64[u].T for u in range(s)]) for t in range(s)])


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None, spec,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] -> [..., N] in x's dtype (or ``out_dtype``); ``weight``
    may be a prepared ``ExactWeight`` (its slices are the ones this call would cut)."""
    w, w_sliced = unpack(weight, spec)
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    out = exact_linear(x2, w, bias, spec.slices, products_int64, w_sliced, out_dtype=out_dtype)
    return out.reshape(*x.shape[:-1], w.shape[0])


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype (columns of b are the output channels)."""
    return linear(a, b.transpose(0, 1), None, spec)
