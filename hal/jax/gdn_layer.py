"""The Gated DeltaNet layer's pieces on jax.Arrays: gdn_gating and the causal conv1d
(kernels/reference/gdn_layer.py); the gated delta rule itself is in gated_delta_rule.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import strict_math as sm
from ._api import strict_op
from .elementwise import sigmoid_f, silu_f, softplus_f
from .gated_delta_rule import strict_spec
from .ops import checked_format

F32 = jnp.float32


def _stock_gating(A_log, a, dt_bias, b, spec=None):
    """Plain float32 gates (for jax.grad, not bits)."""
    g = -jnp.exp(A_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))
    return g, jax.nn.sigmoid(b.astype(F32))


@strict_op(stock=_stock_gating, static=("spec",))
def _gating(A_log, a, dt_bias, b, spec=None):
    A = sm.exp(sm.widen(A_log))
    g = -sm.mul(A, softplus_f(sm.add(sm.widen(a), sm.widen(dt_bias))))
    return sm.narrow(g), sm.narrow(sigmoid_f(sm.widen(b)))


def gdn_gating(A_log, a, dt_bias, b, *, spec=None):
    """A_log, dt_bias [HV]; a, b [..., HV] -> (g, beta) float32 [..., HV]."""
    return _gating(A_log, a, dt_bias, b, spec=strict_spec(spec))


def _windows(x, conv_state, kw: int, cu):
    """The conv's rows, bits only: (rows [N, K-1 + Lmax, D] = previous K-1 inputs then the sequence,
    zeros after its end; lengths; a function packing y [N, Lmax, D] back like x; the new conv state)."""
    if cu is None:
        xp, lengths = x, np.full((x.shape[0],), x.shape[1])
    else:  # packed [1, total, D] -> [N, Lmax, D], zeros after each end (static cu_seqlens)
        n = len(cu) - 1
        lengths = np.array([cu[i + 1] - cu[i] for i in range(n)])
        t = np.arange(int(lengths.max()))[None, :]
        idx = np.where(t < lengths[:, None], np.array(cu[:-1])[:, None] + t, 0)
        xp = jnp.where(jnp.asarray(t < lengths[:, None])[..., None], x[0][idx], jnp.zeros((), x.dtype))
    n, _, d = xp.shape
    prev = jnp.zeros((n, kw - 1, d), x.dtype) if conv_state is None else conv_state
    rows = jnp.concatenate([prev, xp], 1)
    state = rows[np.arange(n)[:, None], lengths[:, None] + np.arange(kw - 1)[None, :]]

    def pack(y):
        return y if cu is None else jnp.concatenate([y[i, : cu[i + 1] - cu[i]] for i in range(n)])[None]
    return rows, pack, state


def _stock_conv(x, weight, bias, conv_state, activation="silu", cu=None, spec=None):
    """Plain float32 conv (+ SiLU) (for jax.grad, not bits)."""
    kw = weight.shape[1]
    rows, pack, state = _windows(x, conv_state, kw, cu)
    lmax = rows.shape[1] - (kw - 1)
    r, w = rows.astype(F32), weight.astype(F32)
    acc = sum(w[:, i] * r[:, i: i + lmax] for i in range(kw))
    if bias is not None:
        acc = acc + bias.astype(F32)
    return pack((jax.nn.silu(acc) if activation == "silu" else acc).astype(x.dtype)), state


@strict_op(stock=_stock_conv, static=("activation", "cu", "spec"))
def _conv(x, weight, bias, conv_state, activation="silu", cu=None, spec=None):
    fmt = checked_format(x)
    kw = weight.shape[1]
    rows, pack, state = _windows(x, conv_state, kw, cu)
    n, lmax, d = rows.shape[0], rows.shape[1] - (kw - 1), rows.shape[2]
    r, w = sm.widen(rows), sm.widen(weight)
    acc = sm.zeros((n, lmax, d)) if bias is None else jnp.broadcast_to(sm.widen(bias), (n, lmax, d))
    for i in range(kw):                                        # oldest tap first
        acc = sm.fma(jnp.broadcast_to(w[:, i], (n, lmax, d)), r[:, i: i + lmax], acc)
    return pack(sm.narrow(silu_f(acc) if activation == "silu" else acc, fmt)), state


def gdn_causal_conv1d(x, weight, bias=None, conv_state=None, activation="silu", cu_seqlens=None, *, spec=None):
    """x [B, T, D] (or packed [1, total, D] with cu_seqlens, a list of ints); weight [D, K]; bias [D];
    conv_state [N, K-1, D] in x's dtype -> (y like x, new conv_state: the last K-1 inputs)."""
    cu = None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
    return _conv(x, weight, bias, conv_state, activation=activation, cu=cu,
                 spec=strict_spec(spec))
