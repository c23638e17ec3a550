"""Strict elementwise ops (ElementwiseSpec) and rotary embedding (RotarySpec), written out.

The one definition of sigmoid, SiLU and softplus in lockstep: the gated-delta-rule layer pieces
(``gdn_layer.py``) use these same functions. Each value is computed alone in float32 from its own
input, with lockstep's exp/log/sin/cos, so its bits cannot depend on where it sits in a tensor.

The ``*_f32`` functions take and return float32 (no final rounding, NaN left as it falls); the op
functions below them widen the input, round once to the input dtype and canonicalise NaN.
"""
from __future__ import annotations

import torch

from .strict_math import F32, canonical_nan, exp, fma, log, sincos

# ---------------------------------------------------------------- float32 cores


def sigmoid_f32(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): sigmoid(-inf) = 0, sigmoid(+inf) = 1."""
    return 1.0 / (1.0 + exp(-x))


def silu_f32(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)); silu(-inf) = -0.0 (the limit; the formula alone gives -inf / inf = NaN)."""
    y = x / (1.0 + exp(-x))
    return torch.where(x == float("-inf"), -0.0, y)


def softplus_f32(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0) + log1p(exp(-|x|)), with e = exp(-|x|), w = 1 + e:
    log1p(e) = log(w) * (e / (w - 1)) (Goldberg: accurate for small e), or e itself when w == 1;
    the product feeds the sum, so it is fma(log(w), e / (w - 1), m). m = x if x > 0 else +0.0.
    NaN gives NaN (exp(NaN) is NaN whatever max does with it)."""
    m = torch.where(x > 0, x, torch.zeros_like(x))
    e = exp(-x.abs())
    w = 1.0 + e
    tiny = w == 1.0
    safe = torch.where(tiny, torch.ones_like(w), w)
    return torch.where(tiny, m + e, fma(log(safe), e / (safe - 1.0), m))


def silu_mul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b: the float32 silu (not rounded to the input dtype) times b, one rounding."""
    return silu_f32(a) * b


# ---------------------------------------------------------------- ops (ElementwiseSpec)


def _finish(y32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return canonical_nan(y32.to(dtype))


def sigmoid(x, spec=None):
    return _finish(sigmoid_f32(x.to(F32)), x.dtype)


def silu(x, spec=None):
    return _finish(silu_f32(x.to(F32)), x.dtype)


def softplus(x, spec=None):
    return _finish(softplus_f32(x.to(F32)), x.dtype)


def silu_mul(a, b, spec=None):
    return _finish(silu_mul_f32(a.to(F32), b.to(F32)), a.dtype)


# ---------------------------------------------------------------- rotary (RotarySpec)


def inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """inv_freq_i = exp(-((2i / R) * log(base))), i < R/2: float32(2i) / float32(R) correctly rounded,
    times log(float32(base)) (lsm1 log) rounded once, negated (exact), lsm1 exp."""
    lb = log(torch.tensor([base], dtype=F32))
    e = torch.arange(0, rotary_dim, 2, dtype=F32) / float(rotary_dim)
    return exp(-(e * lb))


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float, inv_freq_: torch.Tensor | None,
                   spec=None):
    """float32 (cos, sin) of shape positions.shape + (R/2,): angle = float32(pos) * inv_freq_i (one
    rounding; float32(pos) is exact for |pos| < 2**24), then lsm1 sin/cos."""
    f = inv_freq(rotary_dim, base) if inv_freq_ is None else inv_freq_.to(F32)
    f = f.to(positions.device)
    angle = positions.to(F32).unsqueeze(-1) * f
    s, c = sincos(angle)
    return canonical_nan(c), canonical_nan(s)


def rotary_pairs(x: torch.Tensor, half: int, interleaved: bool):
    """The (x1, x2) halves of the pairs that rotate: (i, i + R/2) half-split, (2i, 2i + 1) interleaved."""
    if interleaved:
        return x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    return x[..., :half], x[..., half:2 * half]


def apply_rotary(x, cos, sin, interleaved: bool, spec=None):
    """out1 = fma(x1, cos, -(x2 * sin)), out2 = fma(x2, cos, x1 * sin) in float32, rounded once to x's
    dtype; dims >= R = 2 * cos.shape[-1] pass through."""
    half = cos.shape[-1]
    x32 = x.to(F32)
    c32, s32 = cos.to(F32), sin.to(F32)
    x1, x2 = rotary_pairs(x32, half, interleaved)
    shape = torch.broadcast_shapes(x1.shape, c32.shape)
    x1, x2, c32, s32 = (t.expand(shape) for t in (x1, x2, c32, s32))
    o1 = fma(x1, c32, -(x2 * s32))
    o2 = fma(x2, c32, x1 * s32)
    out = x.clone()
    if interleaved:
        rot = torch.stack([o1, o2], dim=-1).reshape(*shape[:-1], 2 * half)
    else:
        rot = torch.cat([o1, o2], dim=-1)
    out[..., :2 * half] = rot.to(x.dtype)
    return canonical_nan(out)
