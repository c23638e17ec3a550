"""RMSNorm with optional fused residual add, under an RMSNormSpec (strict)."""
from __future__ import annotations

import torch

from hal.spec import RMSNormSpec
from .reduce import tiled_dot
from .strict_math import F32, sqrt


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             spec: RMSNormSpec):
    """Returns y, or (y, new_residual) when a residual is given. Shapes [..., H]; weight [H]."""
    if residual is not None:
        # Round the sum to the activation dtype first: that rounded value is what an unfused
        # `h = x + r; rms_norm(h)` would see, so fused and unfused paths agree bit for bit.
        h = (x.to(F32) + residual.to(F32)).to(x.dtype)
    else:
        h = x
    h32 = h.to(F32)
    ss = tiled_dot(h32, h32, spec.hidden_tile)
    ms = ss / float(h.shape[-1])
    inv = 1.0 / sqrt(ms + torch.tensor(eps, dtype=F32))
    y = ((h32 * inv.unsqueeze(-1)) * weight.to(F32)).to(x.dtype)
    return (y, h) if residual is not None else y
