"""matmul / linear, rms_norm, softmax family and token log-probs on jax.Arrays (strict specs).

Each function is the reference kernel of the same name (kernels/reference/*.py) written with
:mod:`hal.jax.strict_math`: inputs widened exactly to F (float32 values in float64), every
float32 operation rounded by the helper, outputs narrowed through integer ops with the canonical NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hal import spec as specs

from hal.kernels.exact import core

from . import exact, strict_math as sm
from ._api import strict_op

F32 = jnp.float32


def checked_format(x) -> str:
    """The strict-math format name of ``x``'s dtype (float32, bfloat16, float16); any other dtype is refused by name.
    Shared by every hal.jax op module."""
    name = jnp.dtype(x.dtype).name
    if name not in sm.FORMATS:
        from hal.errors import InputError
        raise InputError(f"hal.jax: dtype {name} not supported (float32, bfloat16, float16)")
    return name


def _spec(family, spec):
    s = specs.resolve(family, spec)
    if specs.FAST in s.policies_used():  # tensor cores: the triton backend's; never run here as another policy
        from hal.errors import UnsupportedError
        raise UnsupportedError(f"hal.jax: spec {s.id} uses the fast policy (tensor cores: the triton backend); hal.jax "
                               "implements the strict and exact policies")
    return s


# ------------------------------------------------------------------ matmul / linear


def _stock_matmul(a, b, spec=None):
    return jnp.matmul(a.astype(F32), b.astype(F32)).astype(a.dtype)


@strict_op(stock=_stock_matmul, static=("spec",))
def _matmul(a, b, spec=None):
    acc = sm.tiled_dot(sm.widen(a)[..., :, None, :], sm.widen(b).T, spec.k_tile)
    return sm.narrow(acc, checked_format(a))


def matmul(a, b, *, spec=None):
    """``a [..., M, K] @ b [K, N]`` -> ``[..., M, N]`` in a's dtype (spec: MatmulSpec or ExactMatmulSpec)."""
    checked_format(a), checked_format(b)
    s = _spec("matmul", spec)
    if s.policy == specs.EXACT:
        core.check_k("a", a.shape[-1])
        return _exact_matmul(a, b, spec=s)
    return _matmul(a, b, spec=s)


def _stock_linear(x, w, spec=None):
    return jnp.matmul(x.astype(F32), w.astype(F32).T).astype(x.dtype)


def _stock_linear_bias(x, w, bias, spec=None):
    return (jnp.matmul(x.astype(F32), w.astype(F32).T) + bias.astype(F32)).astype(x.dtype)


def _linear_impl(x, w, bias, spec):
    acc = sm.tiled_dot(sm.widen(x)[..., None, :], sm.widen(w), spec.k_tile)
    if bias is not None:
        acc = sm.add(acc, sm.widen(bias))
    return sm.narrow(acc, checked_format(x))


@strict_op(stock=_stock_linear, static=("spec",))
def _linear(x, w, spec=None):
    return _linear_impl(x, w, None, spec)


@strict_op(stock=_stock_linear_bias, static=("spec",))
def _linear_bias(x, w, bias, spec=None):
    return _linear_impl(x, w, bias, spec)


def linear(x, weight, bias=None, *, spec=None):
    """``x [..., K] @ weight[N, K]^T + bias[N]`` -> ``[..., N]`` in x's dtype; bias added once in float32."""
    checked_format(x), checked_format(weight)
    s = _spec("matmul", spec)
    if s.policy == specs.EXACT:
        core.check_k("x", x.shape[-1])
        if bias is None:
            return _exact_linear(x, weight, spec=s)
        checked_format(bias)
        return _exact_linear_bias(x, weight, bias, spec=s)
    if bias is None:
        return _linear(x, weight, spec=s)
    checked_format(bias)
    return _linear_bias(x, weight, bias, spec=s)


# exact policy (hal/jax/exact.py): rows flattened to one [M, K] matrix; gradients as the strict ops'


def _exact_2d(x, w, bias, spec):
    out = exact.linear(x.reshape(-1, x.shape[-1]), w, bias, spec.slices, checked_format(x))
    return out.reshape(*x.shape[:-1], w.shape[0])


@strict_op(stock=_stock_matmul, static=("spec",))
def _exact_matmul(a, b, spec=None):
    return _exact_2d(a, b.T, None, spec)


@strict_op(stock=_stock_linear, static=("spec",))
def _exact_linear(x, w, spec=None):
    return _exact_2d(x, w, None, spec)


@strict_op(stock=_stock_linear_bias, static=("spec",))
def _exact_linear_bias(x, w, bias, spec=None):
    return _exact_2d(x, w, bias, spec)


# ------------------------------------------------------------------ rms_norm


def _rms_norm_impl(x, w, residual, eps, spec):
    fmt = checked_format(x)
    if residual is not None:
        # rounded to float32, then to x's dtype: the value an unfused `h = x + r` holds
        h = sm.to_format(sm.add(sm.widen(x), sm.widen(residual)), fmt)
    else:
        h = sm.widen(x)
    ss = sm.tiled_dot(h, h, spec.hidden_tile)
    ms = sm.div(ss, float(x.shape[-1]))
    inv = sm.div(1.0, sm.sqrt(sm.add(ms, sm.const(eps))))
    y = sm.narrow(sm.mul(sm.mul(h, inv[..., None]), sm.widen(w)), fmt)
    return (y, sm.narrow(h, fmt)) if residual is not None else y


def _stock_rms(x, w, eps=1e-6, spec=None):
    x32 = x.astype(F32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * w.astype(F32)
    return y.astype(x.dtype)


def _stock_rms_res(x, w, r, eps=1e-6, spec=None):
    h = (x.astype(F32) + r.astype(F32)).astype(x.dtype)
    return _stock_rms(h, w, eps), h


@strict_op(stock=_stock_rms, static=("eps", "spec"))
def _rms(x, w, eps=1e-6, spec=None):
    return _rms_norm_impl(x, w, None, eps, spec)


@strict_op(stock=_stock_rms_res, static=("eps", "spec"))
def _rms_res(x, w, r, eps=1e-6, spec=None):
    return _rms_norm_impl(x, w, r, eps, spec)


def rms_norm(x, weight, eps: float = 1e-6, residual=None, *, spec=None):
    """``x / sqrt(mean(x^2) + eps) * weight``; with ``residual`` returns ``(y, x + residual)``."""
    checked_format(x), checked_format(weight)
    s = _spec("rms_norm", spec)
    if residual is None:
        return _rms(x, weight, eps=float(eps), spec=s)
    return _rms_res(x, weight, residual, eps=float(eps), spec=s)


# ------------------------------------------------------------------ softmax family


def _row_stats(x, t: int):
    """(M, S, shifted, empty) exactly as kernels/reference/softmax.py::_row_stats, on F."""
    m = jnp.max(x, axis=-1, keepdims=True)
    poisoned = jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(poisoned, jnp.nan, m)
    empty = m == -jnp.inf
    m_safe = jnp.where(empty, 0.0, m)
    shifted = sm.sub(x, m_safe)
    s = sm.tiled_sum(sm.exp(shifted), t)
    return m_safe[..., 0], s, shifted, empty[..., 0]


@strict_op(stock=lambda x, spec=None: jax.nn.logsumexp(x.astype(F32), -1).astype(x.dtype), static=("spec",))
def _logsumexp(x, spec=None):
    m, s, _, empty = _row_stats(sm.widen(x), spec.tile)
    return sm.narrow(jnp.where(empty, -jnp.inf, sm.add(m, sm.log(s))), checked_format(x))


@strict_op(stock=lambda x, spec=None: jax.nn.log_softmax(x.astype(F32), -1).astype(x.dtype), static=("spec",))
def _log_softmax(x, spec=None):
    _, s, shifted, empty = _row_stats(sm.widen(x), spec.tile)
    out = sm.sub(shifted, sm.log(s)[..., None])
    return sm.narrow(jnp.where(empty[..., None], -jnp.inf, out), checked_format(x))


@strict_op(stock=lambda x, spec=None: jax.nn.softmax(x.astype(F32), -1).astype(x.dtype), static=("spec",))
def _softmax(x, spec=None):
    _, s, shifted, empty = _row_stats(sm.widen(x), spec.tile)
    out = sm.div(sm.exp(shifted), s[..., None])
    return sm.narrow(jnp.where(empty[..., None], 0.0, out), checked_format(x))


def softmax(x, *, spec=None):
    """softmax over the last axis (SoftmaxSpec), in x's dtype."""
    checked_format(x)
    return _softmax(x, spec=_spec("softmax", spec))


def log_softmax(x, *, spec=None):
    checked_format(x)
    return _log_softmax(x, spec=_spec("softmax", spec))


def logsumexp(x, *, spec=None):
    checked_format(x)
    return _logsumexp(x, spec=_spec("softmax", spec))


# ------------------------------------------------------------------ token log-probs


def _stock_tlp(hidden, weight, tokens, temperature=1.0, spec=None):
    logits = jnp.matmul(hidden.astype(F32), weight.astype(F32).T) / temperature
    lp = jax.nn.log_softmax(logits, -1)
    return _pick(lp, tokens)


def _pick(rows, tokens):
    """rows [N, V] at tokens [N] (one per row) or [N, K] (K per row)."""
    if tokens.ndim == 2:
        return jnp.take_along_axis(rows, tokens.astype(jnp.int32), -1)
    return jnp.take_along_axis(rows, tokens[:, None].astype(jnp.int32), -1)[:, 0]


@strict_op(stock=_stock_tlp, static=("temperature", "spec"))
def _token_logprobs(hidden, weight, tokens, temperature=1.0, spec=None):
    if spec.matmul is not None:  # the exact policy's order-free dot, rounded once to float32
        logits = exact.logits(hidden, weight, spec.matmul.slices)
    else:
        logits = sm.tiled_dot(sm.widen(hidden)[..., None, :], sm.widen(weight), spec.hidden_tile)
    if temperature != 1.0:
        logits = sm.div(logits, sm.const(temperature))
    _, s, shifted, empty = _row_stats(logits, spec.vocab_tile)
    picked = _pick(shifted, tokens)
    if tokens.ndim == 2:  # K tokens of each row: the row's one log(S) and empty flag, broadcast
        s, empty = s[:, None], empty[:, None]
    out = sm.sub(picked, sm.log(s))
    return sm.narrow(jnp.where(empty, -jnp.inf, out), "float32")


def token_logprobs(hidden, weight, tokens, temperature: float = 1.0, *, spec=None):
    """float32 log p(tokens[n] | hidden[n]) for hidden [N, H], weight [V, H], tokens [N] int; tokens [N, K]:
    K tokens of each row from its one log-softmax, out [N, K] (each the bits of that token alone)."""
    checked_format(hidden), checked_format(weight)
    s = _spec("token_logprobs", spec)
    if s.matmul is not None:
        core.check_k("hidden", hidden.shape[-1])
    return _token_logprobs(hidden, weight, tokens, temperature=float(temperature), spec=s)
