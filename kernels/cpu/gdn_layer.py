"""The Gated DeltaNet layer's pieces (kernels/reference/gdn_layer.py), compiled: gating and the causal
depthwise conv1d with its decode state. Per element / per (sequence, channel): independent tasks."""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from . import pool
from .elementwise import sigmoid_f32, silu_f32, softplus_f32
from .host import F32, array, canonical_nan, empty, finish, wide
from .pool import parallel_worth
from .strict_math import ZERO, canon, exp, fma, widen


@njit(inline="always", cache=True)
def _gating_row(A_log, a, dt_bias, b, g, beta, r):
    """Row r: a, b [rows, HV]; A_log, dt_bias [HV] -> g, beta [rows, HV] float32, NaNs canonical."""
    for h in range(a.shape[1]):
        A = exp(widen(A_log[h]))
        g[r, h] = canon(-(A * softplus_f32(widen(a[r, h]) + widen(dt_bias[h]))))
        beta[r, h] = canon(sigmoid_f32(widen(b[r, h])))


@njit(nogil=True, cache=True)
def _gating(A_log, a, dt_bias, b, g, beta, work):
    """Rows claimed from ``work`` (pool.run runs it on several threads)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            _gating_row(A_log, a, dt_bias, b, g, beta, r)
        lo, hi = pool.claim(work)


def gdn_gating(A_log, a, dt_bias, b):
    hv = A_log.shape[0]
    g, g2 = empty(*a.shape)
    beta, beta2 = empty(*a.shape)
    if a.numel():
        # float32 copies (exact): one compile, where raw inputs compiled once per mix of dtypes (A_log, dt_bias
        # float32 beside bf16 a, b: three signatures in the suite)
        rows = a.numel() // hv
        pool.run(_gating, rows, wide(A_log), wide(a).reshape(-1, hv), wide(dt_bias), wide(b).reshape(-1, hv),
                 g2.reshape(-1, hv), beta2.reshape(-1, hv), parallel=parallel_worth(a.numel() * 64))
    return g, beta


@njit(nogil=True, cache=True)
def _conv(x, starts, lengths, prev, w, bias, has_bias, silu, y, work):
    """Tasks (sequence, channel), claimed from ``work``, of x [tokens, D]; prev [N, K-1, D] (the previous inputs);
    w [D, K]; bias [D] -> y [tokens, D].

    Tap i of output t reads input t-K+1+i: the previous inputs for t-K+1+i < 0, else x."""
    d, kw = w.shape
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            s = task // d
            c = task % d
            b0 = widen(bias[c]) if has_bias else ZERO
            for t in range(lengths[s]):
                acc = b0
                for i in range(kw):
                    src = t - kw + 1 + i
                    xv = widen(x[starts[s] + src, c]) if src >= 0 else widen(prev[s, kw - 1 + src, c])
                    acc = fma(widen(w[c, i]), xv, acc)
                y[starts[s] + t, c] = silu_f32(acc) if silu else acc
        lo, hi = pool.claim(work)


def causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens):
    kw = weight.shape[1]
    b, tlen, d = x.shape
    if cu_seqlens is None:
        starts = np.arange(b, dtype=np.int64) * tlen
        lengths = np.full(b, tlen, dtype=np.int64)
    else:
        starts = np.asarray(cu_seqlens[:-1], dtype=np.int64)
        lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    n = starts.shape[0]
    prev = conv_state if conv_state is not None else x.new_zeros((n, kw - 1, d))
    x2 = x.reshape(b * tlen, d)
    y = torch.empty((b * tlen, d), dtype=F32)
    pool.run(_conv, n * d, wide(x2), starts, lengths, wide(prev), wide(weight),
             wide(bias if bias is not None else weight[:, 0]), bias is not None, activation == "silu", array(y),
             parallel=parallel_worth(b * tlen * d * kw * 4))
    # the new state: the last K-1 inputs of each sequence (older ones from the previous state), not rounded
    km = kw - 1
    src = torch.cat([prev.reshape(n * km, d), x2])            # previous inputs first, then x
    j = torch.arange(km)[None, :]
    p = torch.from_numpy(lengths)[:, None] + j                # position in [previous inputs ; sequence]
    idx = torch.where(p < km, torch.arange(n)[:, None] * km + p, n * km + torch.from_numpy(starts)[:, None] + p - km)
    state = src[idx.reshape(-1)].reshape(n, km, d)
    return finish(y, x.dtype).reshape(x.shape), canonical_nan(state)
