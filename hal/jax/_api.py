"""How a hal.jax op is exposed: environment check, scoped x64, jit, and a float32 gradient.

The forward of every op is the strict computation (bits of the spec). The backward is plain JAX
float32 math (``jax.vjp`` of a stock formula), as hal's torch ops use plain torch math for theirs:
correct and deterministic, but not part of any spec.
"""
from __future__ import annotations

import functools

import jax

from hal.errors import BackendUnavailable

from . import strict_math as sm


def bucket(n: int) -> int:
    """The smallest power of two >= n (at least 1): a static size rounded up so that calls whose
    sizes differ a little share one XLA compilation. Callers pad only with rows/keys/sequences
    that the spec computes independently and whose results are discarded (never multiplied by 0),
    so the bits of the real ones cannot change."""
    return 1 << max(0, int(n) - 1).bit_length()


def ensure_environment() -> None:
    why = sm.check_environment()
    if why:
        raise BackendUnavailable(f"hal.jax refuses to run: {why}")


def strict_op(stock=None, static=()):
    """Decorate ``impl(*arrays, **static_kwargs)``: run it jitted under scoped x64; if ``stock`` (a
    stock JAX formula with the same signature) is given, ``jax.grad`` differentiates through it."""
    def deco(impl):
        jitted = jax.jit(impl, static_argnames=static)
        if stock is not None:
            def _stock_vjp(xs, g, **kw):
                _, vjp = jax.vjp(lambda *ys: stock(*ys, **kw), *xs)
                return vjp(g)
            stock_vjp = jax.jit(_stock_vjp, static_argnames=static)  # compiled once per shape, as the forward

        def forward(*arrays, **kw):
            ensure_environment()
            with sm.x64():
                return jitted(*arrays, **kw)

        @functools.wraps(impl)
        def op(*arrays, **kw):
            @jax.custom_vjp
            def f(*xs):
                return forward(*xs, **kw)

            def fwd(*xs):
                return forward(*xs, **kw), xs

            def bwd(xs, g):
                if stock is None:  # never a silent zero gradient through the bit operations
                    raise NotImplementedError(f"hal.jax.{impl.__name__.lstrip('_')}: no gradient in hal.jax "
                                              "(forward only); differentiate a stock formula instead")
                return stock_vjp(xs, g, **kw)

            f.defvjp(fwd, bwd)
            return f(*arrays)
        return op
    return deco
