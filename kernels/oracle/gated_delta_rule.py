"""float64 oracles of the gated delta rule and the Qwen3-Next layer pieces (gating, causal conv1d).

Plain differentiable torch operations, token by token: they give the mathematical value (for the
accuracy level A and float64 calls) and, run in float32/float64 under autograd, the backward
passes of the public ops. Operation order is not part of any spec here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The rule's q / k L2 norm over the last axis (``use_qk_l2norm_in_kernel``), as a plain torch formula: the oracle's
    and the GDN backward's recompute (hal/gdn_backward.py)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand(x: torch.Tensor, hv: int) -> torch.Tensor:
    h = x.shape[-2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def recurrence(q, k, v, g, beta, scale: float, S0=None, l2: bool = False, dtype=F64):
    """q, k [N, T, H, dk]; v [N, T, HV, dv]; g, beta [N, T, HV]; S0 [N, HV, dk, dv] or None.

    Returns (o [N, T, HV, dv], S after the last token), both in ``dtype``.
    """
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    n, T, _, dk = q.shape
    hv, dv = v.shape[2:]
    if l2:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = _expand(q, hv) * scale, _expand(k, hv)
    S = torch.zeros((n, hv, dk, dv), dtype=dtype, device=v.device) if S0 is None else S0.to(dtype)
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        k_t = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", S, k_t))
        S = S + k_t[..., None] * u[..., None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, q[:, t]))
    o = torch.stack(outs, 1) if outs else v.new_zeros((n, 0, hv, dv), dtype=dtype)
    return o, S


def gated_delta_rule(q, k, v, g, beta, scale: float, S0=None, cu_seqlens: list[int] | None = None,
                     l2: bool = False, dtype=F64):
    """Batched [B, T, ...] or packed [1, total, ...] with cu_seqlens: (o [B, T, HV, dv], final [N, HV, dk, dv])."""
    if cu_seqlens is None:
        return recurrence(q, k, v, g, beta, scale, S0, l2, dtype)
    outs, finals = [], []
    for i in range(len(cu_seqlens) - 1):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        s0 = None if S0 is None else S0[i: i + 1]
        o, s = recurrence(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, s0, l2, dtype)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x.to(F64))


def gdn_gating(A_log, a, dt_bias, b, dtype=F64):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    A_log, a, dt_bias, b = (x.to(dtype) for x in (A_log, a, dt_bias, b))
    return -torch.exp(A_log) * F.softplus(a + dt_bias), torch.sigmoid(b)


def conv_windows(x, conv_state, kw: int, cu_seqlens: list[int] | None, per_sequence):
    """Run ``per_sequence(rows, n)`` on each sequence's conv window and pack the results.

    ``rows`` = the previous K-1 inputs (``conv_state[i]``, zeros when None) followed by the
    sequence's n new inputs; ``per_sequence`` returns that sequence's y [n, D]. Returns (y packed
    like x, new conv_state [N, K-1, D]: the last K-1 rows of each window, in x's dtype).
    """
    seqs = [x[i] for i in range(x.shape[0])] if cu_seqlens is None else \
        [x[0, cu_seqlens[i]: cu_seqlens[i + 1]] for i in range(len(cu_seqlens) - 1)]
    ys, states = [], []
    for i, xs in enumerate(seqs):
        prev = xs.new_zeros((kw - 1, xs.shape[-1])) if conv_state is None else conv_state[i].to(xs.dtype)
        rows = torch.cat([prev, xs], 0)
        ys.append(per_sequence(rows, xs.shape[0]))
        states.append(rows[rows.shape[0] - (kw - 1):])
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys).unsqueeze(0)
    return y, torch.stack(states)


def causal_conv1d(x, weight, bias=None, conv_state=None, activation: str | None = "silu",
                  cu_seqlens: list[int] | None = None, dtype=F64):
    """Depthwise causal conv over time. x [B, T, D]; weight [D, K]; conv_state [N, K-1, D] (previous inputs).

    Returns (y [B, T, D], new conv_state [N, K-1, D] in x's dtype: the last K-1 inputs).
    """
    kw = weight.shape[1]
    w = weight.to(dtype)

    def one(rows, n):
        r = rows.to(dtype)
        y = sum(w[:, j] * r[j: j + n] for j in range(kw))
        if bias is not None:
            y = y + bias.to(dtype)
        return F.silu(y) if activation == "silu" else y
    return conv_windows(x, conv_state, kw, cu_seqlens, one)


def run_float64(q, k, v, g, beta, scale: float, parts, cu_seqlens, l2: bool):
    """A float64 call of the public ops (gradcheck path): (o, Parts) with the exact state after the last token."""
    from hal.kernels.layout import Parts
    S0 = parts.final if parts.final is not None else parts.S
    o, S = gated_delta_rule(q, k, v, g, beta, scale, S0, cu_seqlens, l2, F64)
    n = S.shape[0]
    lengths = torch.full((n,), q.shape[1]) if cu_seqlens is None else \
        torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n)])
    return o.to(v.dtype), Parts(parts.position + lengths, S, None, None, None, None, S)
