"""matmul / linear under a MatmulSpec (strict)."""
from __future__ import annotations

import torch

from hal.spec import MatmulSpec
from .reduce import tiled_dot
from .strict_math import F32


def matmul(a: torch.Tensor, b: torch.Tensor, spec: MatmulSpec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype."""
    out_dtype = a.dtype
    a32 = a.to(F32).unsqueeze(-2)              # [..., M, 1, K]
    b32 = b.to(F32).transpose(0, 1)            # [N, K]
    return tiled_dot(a32, b32, spec.k_tile).to(out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: MatmulSpec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    acc = tiled_dot(x.to(F32).unsqueeze(-2), weight.to(F32), spec.k_tile)
    if bias is not None:
        acc = acc + bias.to(F32)
    return acc.to(x.dtype)
