"""float64 oracles of the elementwise and rotary ops (accuracy level A, float64 calls)."""
from __future__ import annotations

import torch

F64 = torch.float64


def sigmoid(x):
    x = x.to(F64)
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x):
    x = x.to(F64)
    return torch.where(x == float("-inf"), -0.0, x / (1.0 + torch.exp(-x)))


def softplus(x):
    x = x.to(F64)
    pos = x > 0
    return torch.where(pos, x + torch.log1p(torch.exp(-x.abs())), torch.log1p(torch.exp(-x.abs())))


def silu_mul(a, b):
    return silu(a) * b.to(F64)


def inv_freq(rotary_dim: int, base: float):
    b = float(torch.tensor(base, dtype=torch.float32))  # the spec rounds base to float32 first
    return b ** (-(torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim))


def rotary_angles(positions, rotary_dim: int, base: float, inv_freq_=None):
    f = inv_freq(rotary_dim, base) if inv_freq_ is None else inv_freq_.to(F64)
    return positions.to(F64).unsqueeze(-1) * f


def rotary_cos_sin(positions, rotary_dim: int, base: float, inv_freq_=None):
    a = rotary_angles(positions, rotary_dim, base, inv_freq_)
    return torch.cos(a), torch.sin(a)


def apply_rotary(x, cos, sin, interleaved: bool):
    from hal.kernels.reference.elementwise import rotary_pairs
    half = cos.shape[-1]
    x64, c, s = x.to(F64), cos.to(F64), sin.to(F64)
    x1, x2 = rotary_pairs(x64, half, interleaved)
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    shape = torch.broadcast_shapes(x1.shape, c.shape)
    o1, o2 = o1.expand(shape), o2.expand(shape)
    out = x64.clone()
    rot = torch.stack([o1, o2], -1).reshape(*shape[:-1], 2 * half) if interleaved else torch.cat([o1, o2], -1)
    out[..., :2 * half] = rot
    return out
