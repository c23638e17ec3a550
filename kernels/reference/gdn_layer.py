"""The Gated DeltaNet layer's pieces (Qwen3-Next, Qwen3.5), strict: gating and the causal depthwise conv1d.

Both are computed per token in float32 with a fixed order, so decode, chunked prefill and
training give the same bits by construction; the conv's decode state holds the previous K-1
*inputs* unrounded (in the input dtype), so nothing is rounded at a call boundary.

* gating: g = -(exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b), float32 out; softplus and
  sigmoid are the elementwise spec's float32 functions (``elementwise.py``: one definition).
* conv1d (kernel K, depthwise): y_t = act(bias + sum_i w_i x_(t-K+1+i)) as a sequential fma chain
  from bias (or +0.0) over taps i = 0..K-1 (oldest input first); SiLU as in ``elementwise.py``;
  rounded once to x's dtype.
"""
from __future__ import annotations

import torch

from .gated_delta_rule import from_padded, to_padded
from .elementwise import sigmoid_f32 as sigmoid, silu_f32 as silu, softplus_f32 as softplus
from .strict_math import F32, exp, fma


def gdn_gating(A_log, a, dt_bias, b):
    """A_log, dt_bias [HV]; a, b [..., HV] -> (g, beta) float32 [..., HV]."""
    A = exp(A_log.to(F32))
    g = -(A * softplus(a.to(F32) + dt_bias.to(F32)))
    return g, sigmoid(b.to(F32))


def causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens: list[int] | None):
    """x [B, T, D] (or packed [1, total, D]); weight [D, K]; bias [D] | None; conv_state [N, K-1, D] | None.

    Returns (y like x, new conv_state [N, K-1, D] in x's dtype: the last K-1 inputs of each sequence).
    """
    kw = weight.shape[1]
    xp = to_padded(x, cu_seqlens)                                # [N, L, D]
    n, lmax, d = xp.shape
    lengths = torch.full((n,), lmax) if cu_seqlens is None else \
        torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n)])
    prev = xp.new_zeros((n, kw - 1, d)) if conv_state is None else conv_state.to(x.dtype)
    rows = torch.cat([prev, xp], dim=1)                           # [N, K-1+L, D]
    r32, w32 = rows.to(F32), weight.to(F32)
    acc = torch.zeros((n, lmax, d), dtype=F32) if bias is None else bias.to(F32).expand(n, lmax, d)
    for i in range(kw):  # tap i reads input t-K+1+i: oldest first
        acc = fma(w32[:, i].expand(n, lmax, d), r32[:, i: i + lmax], acc)
    y = silu(acc) if activation == "silu" else acc
    idx = lengths[:, None] + torch.arange(kw - 1)[None, :]           # last K-1 rows of each sequence
    state = rows[torch.arange(n)[:, None], idx]
    return from_padded(y.to(x.dtype), cu_seqlens), state
