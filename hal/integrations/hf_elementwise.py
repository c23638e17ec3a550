"""The elementwise ops the HF adapters need: lockstep's strict ones when this hal has them.

``hal.sigmoid`` / ``hal.silu`` / ``hal.silu_mul`` / ``hal.rotary_cos_sin`` / ``hal.apply_rotary``
are the canonical ops. This module only resolves them in one place so every adapter calls the same
functions; it adds no arithmetic of its own.
"""
from __future__ import annotations

import torch

import hal


def sigmoid(x):
    return hal.sigmoid(x)


def silu_mul(a, b):
    return hal.silu_mul(a, b)


def rotary_cos_sin(positions, rotary_dim, inv_freq):
    return hal.rotary_cos_sin(positions, rotary_dim, inv_freq=inv_freq)


def apply_rotary(x, cos, sin):
    return hal.apply_rotary(x, cos, sin)


def available() -> bool:
    return all(hasattr(hal, n) for n in ("sigmoid", "silu_mul", "rotary_cos_sin", "apply_rotary"))


# ---------------------------------------------------------------- interim (until hal's elementwise ops land)
# Deterministic stand-ins with the same signatures, used only when this hal lacks the strict ops:
# sigmoid from lockstep's lsm1 exp, plain float32 products (one IEEE rounding each, position
# independent), cos/sin in float64 rounded to float32. Backward is ordinary torch math.

class _Interim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.save_for_backward(x)
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return ctx.bwd(x, g), None, None


def _sig32(x):
    from hal.kernels.reference.strict_math import exp
    x32 = x.float()
    return 1.0 / (1.0 + exp(-x32))


def _sigmoid(x):
    def bwd(x, g):
        s = torch.sigmoid(x.float())
        return (g.float() * s * (1 - s)).to(x.dtype)
    return _Interim.apply(x, lambda t: _sig32(t).to(t.dtype), bwd)


def _silu_mul(a, b):
    s = _Interim.apply(a, lambda t: _sig32(t), lambda x, g: (g * (torch.sigmoid(x.float()) * (1 - torch.sigmoid(x.float())))).to(x.dtype))
    return ((a.float() * s) * b.float()).to(a.dtype)


def _rotary_cos_sin(positions, rotary_dim, inv_freq):
    f = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return f.cos().float(), f.sin().float()


def _apply_rotary(x, cos, sin):
    h = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :h], xf[..., h:2 * h], xf[..., 2 * h:]
    y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), -1)
    return y.to(x.dtype)


if not available():  # pragma: no cover - removed once the elementwise ops are merged
    sigmoid, silu_mul, rotary_cos_sin, apply_rotary = _sigmoid, _silu_mul, _rotary_cos_sin, _apply_rotary

    def available() -> bool:  # noqa: F811
        return True
