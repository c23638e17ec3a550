"""Strict elementwise ops and rotary embedding on jax.Arrays (kernels/reference/elementwise.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hal import spec as specs

from . import strict_math as sm
from ._api import strict_op
from .ops import checked_format

F32 = jnp.float32


def sigmoid_f(x):
    return sm.div(1.0, sm.add(1.0, sm.exp(-x)))


def silu_f(x):
    y = sm.div(x, sm.add(1.0, sm.exp(-x)))
    return jnp.where(x == -jnp.inf, -0.0, y)


def softplus_f(x):
    m = jnp.where(x > 0, x, 0.0)
    e = sm.exp(-jnp.abs(x))
    w = sm.add(1.0, e)
    tiny = w == 1.0
    safe = jnp.where(tiny, 1.0, w)
    return jnp.where(tiny, sm.add(m, e), sm.fma(sm.log(safe), sm.div(e, sm.sub(safe, 1.0)), m))


def _unary(core, stock):
    @strict_op(stock=lambda x, spec=None: stock(x.astype(F32)).astype(x.dtype), static=("spec",))
    def impl(x, spec=None):
        return sm.narrow(core(sm.widen(x)), checked_format(x))

    def op(x, *, spec=None):
        checked_format(x)
        return impl(x, spec=specs.resolve("elementwise", spec))
    return op


sigmoid = _unary(sigmoid_f, jax.nn.sigmoid)
silu = _unary(silu_f, jax.nn.silu)
softplus = _unary(softplus_f, jax.nn.softplus)


@strict_op(stock=lambda a, b, spec=None: (jax.nn.silu(a.astype(F32)) * b.astype(F32)).astype(a.dtype),
           static=("spec",))
def _silu_mul(a, b, spec=None):
    return sm.narrow(sm.mul(silu_f(sm.widen(a)), sm.widen(b)), checked_format(a))


def silu_mul(a, b, *, spec=None):
    """silu(a) * b with one rounding to a's dtype."""
    checked_format(a), checked_format(b)
    return _silu_mul(a, b, spec=specs.resolve("elementwise", spec))


# ---------------------------------------------------------------- rotary


def _inv_freq(rotary_dim: int, base: float):
    lb = sm.log(sm.const(base))
    e = sm.div(jnp.arange(0, rotary_dim, 2).astype(jnp.float64), float(rotary_dim))
    return sm.exp(-sm.mul(e, lb))


def _stock_cos_sin(positions, inv_freq, rotary_dim=2, base=10000.0, spec=None):
    if inv_freq is None:
        inv_freq = 1.0 / base ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim)
    angle = positions.astype(F32)[..., None] * inv_freq.astype(F32)
    return jnp.cos(angle), jnp.sin(angle)


@strict_op(stock=_stock_cos_sin, static=("rotary_dim", "base", "spec"))
def _cos_sin(positions, inv_freq, rotary_dim=2, base=10000.0, spec=None):
    f = _inv_freq(rotary_dim, base) if inv_freq is None else sm.rnd(sm.widen(inv_freq))  # .to(float32)
    angle = sm.mul(sm.rnd(positions.astype(jnp.float64))[..., None], f)  # float32(pos): one rounding
    s, c = sm.sincos(angle)
    return sm.narrow(c), sm.narrow(s)


def rotary_cos_sin(positions, rotary_dim: int, base: float = 10000.0, inv_freq=None, *, spec=None):
    """float32 (cos, sin) [..., rotary_dim // 2] for integer positions."""
    s = specs.resolve("rotary", spec)
    return _cos_sin(jnp.asarray(positions), inv_freq, rotary_dim=int(rotary_dim), base=float(base), spec=s)


def _pairs(x, half: int, interleaved: bool):
    if interleaved:
        return x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    return x[..., :half], x[..., half:2 * half]


def _assemble(o1, o2, rest, interleaved: bool):
    """The rotated halves back in x's layout, then the dims past the rotary part (broadcast)."""
    shape = o1.shape
    rot = jnp.stack([o1, o2], -1).reshape(*shape[:-1], 2 * shape[-1]) if interleaved else jnp.concatenate([o1, o2], -1)
    return jnp.concatenate([rot, jnp.broadcast_to(rest, (*shape[:-1], rest.shape[-1]))], -1)


def _stock_apply_rotary(x, cos, sin, interleaved=False, spec=None):
    """Plain float32 rotation (for jax.grad, not bits)."""
    xf = x.astype(F32)
    x1, x2 = _pairs(xf, cos.shape[-1], interleaved)
    c, s = cos.astype(F32), sin.astype(F32)
    rest = xf[..., 2 * cos.shape[-1]:]
    return _assemble(x1 * c - x2 * s, x2 * c + x1 * s, rest, interleaved).astype(x.dtype)


@strict_op(stock=_stock_apply_rotary, static=("interleaved", "spec"))
def _apply_rotary(x, cos, sin, interleaved=False, spec=None):
    fmt = checked_format(x)
    half = cos.shape[-1]
    x1, x2 = _pairs(sm.widen(x), half, interleaved)
    c, s = sm.widen(cos), sm.widen(sin)
    shape = jnp.broadcast_shapes(x1.shape, c.shape)
    x1, x2, c, s = (jnp.broadcast_to(t, shape) for t in (x1, x2, c, s))
    o1 = sm.narrow(sm.fma(x1, c, -sm.mul(x2, s)), fmt)
    o2 = sm.narrow(sm.fma(x2, c, sm.mul(x1, s)), fmt)
    # dims past 2*half pass through as they are (bits copied; NaN canonical like every output)
    return _assemble(o1, o2, sm.narrow(sm.widen(x[..., 2 * half:]), fmt), interleaved)


def apply_rotary(x, cos, sin, interleaved: bool = False, *, spec=None):
    """Rotate the first 2 * cos.shape[-1] dims of x's last axis; the rest passes through."""
    checked_format(x)
    return _apply_rotary(x, cos, sin, interleaved=bool(interleaved), spec=specs.resolve("rotary", spec))
