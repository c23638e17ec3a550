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


def linear_accumulation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        spec: MatmulSpec) -> torch.Tensor:
    """The float32 result :func:`linear` rounds once to x's dtype: the K reduction, bias added once in float32."""
    acc = tiled_dot(x.to(F32).unsqueeze(-2), weight.to(F32), spec.k_tile)
    if bias is not None:
        acc = acc + bias.to(F32)
    return acc


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: MatmulSpec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    return linear_accumulation(x, weight, bias, spec).to(x.dtype)


def linear_with_float32(x, weight, bias, spec: MatmulSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`linear`'s output, the float32 result it rounded): one K reduction for both."""
    acc = linear_accumulation(x, weight, bias, spec)
    return acc.to(x.dtype), acc
