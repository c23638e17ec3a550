"""The gated delta rule layer's pieces around the recurrence in Triton: the gates (g, beta) and the causal
conv1d, with the bits of kernels/reference/gdn_layer.py (every value alone in float32 from its own inputs;
the conv an fma chain from the bias over the taps, oldest first).

Both kernels are persistent (``launch(..., persistent=True)``), as every kernel of this package.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.layout import gdn_from_padded as from_padded, gdn_to_padded as to_padded
from hal.kernels.reference.strict_math import canonical_nan
from . import elementwise as ew, strict_math as sm  # ew: the one sigmoid / silu / softplus
from .launch import cdiv, launch, next_power_of_2

F32 = torch.float32
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["n", "n_work"])  # counts that change per call: no recompiles
def _gating_kernel(A_LOG, A, DT_BIAS, B, G_OUT, BETA_OUT, n, n_work, HV: tl.constexpr, BLOCK: tl.constexpr,
                   NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        i = item * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        hd = i % HV
        a_log = sm.widen(tl.load(A_LOG + hd, mask=ok, other=0.0))
        x = sm.widen(tl.load(A + i, mask=ok, other=0.0)) + sm.widen(tl.load(DT_BIAS + hd, mask=ok, other=0.0))
        g = -(sm.exp(a_log) * ew.softplus_f32(x, NPU))
        beta = ew.sigmoid_f32(sm.widen(tl.load(B + i, mask=ok, other=0.0)), NPU)
        tl.store(G_OUT + i, sm.canonical_nan(g), mask=ok)
        tl.store(BETA_OUT + i, sm.canonical_nan(beta), mask=ok)


def gdn_gating(A_log, a, dt_bias, b):
    """A_log, dt_bias [HV]; a, b [..., HV] -> (g, beta) float32 [..., HV] (kernels/reference/gdn_layer.py)."""
    hv = A_log.shape[0]
    a_, b_ = a.contiguous(), b.contiguous()
    g = torch.empty(a.shape, dtype=F32, device=a.device)
    beta = torch.empty(b.shape, dtype=F32, device=b.device)
    n = a_.numel()
    if n:
        block = 256
        launch(_gating_kernel, (cdiv(n, block),), A_log.contiguous(), a_, dt_bias.contiguous(), b_, g, beta, n,
               HV=hv, BLOCK=block, persistent=True)
    return g, beta


@triton.jit(do_not_specialize=["lmax", "n_rows", "n_work", "n1", "n2"])  # counts that change per call: no recompiles
def _conv_kernel(ROWS, W, BIAS, Y, lmax, n_rows, n_work, n1, n2, D: tl.constexpr, KW: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr, OUT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                 NPU: tl.constexpr):
    """ROWS [N, K-1+L, D] (state then inputs); y[n, t] = act(fma chain from bias over taps oldest first)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        n = item // (n1 * n2)       # logical grid (sequence, token block, channel block)
        t = ((item // n2) % n1) * BT + tl.arange(0, BT)
        d = (item % n2) * BD + tl.arange(0, BD)
        tm = t < lmax
        dm = d < D
        mask = tm[:, None] & dm[None, :]
        if HAS_BIAS:
            acc = sm.widen(tl.load(BIAS + d, mask=dm, other=0.0))[None, :] + tl.zeros([BT, BD], tl.float32)
        else:
            acc = tl.zeros([BT, BD], tl.float32)
        base = n.to(tl.int64) * n_rows
        for i in range(0, KW):
            w = sm.widen(tl.load(W + d * KW + i, mask=dm, other=0.0))
            x = sm.widen(tl.load(ROWS + (base + t + i)[:, None] * D + d[None, :], mask=mask, other=0.0))
            acc = tl.fma(w[None, :], x, acc)
        if SILU:
            acc = ew.silu_f32(acc, NPU)  # silu(-inf) = -0.0, the reference's limit
        tl.store(Y + (n.to(tl.int64) * lmax + t)[:, None] * D + d[None, :], sm.round_out(acc, OUT, NPU), mask=mask)


def causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens):
    """x [B, T, D] (or packed [1, total, D]); weight [D, K]; bias [D] | None; conv_state [N, K-1, D] | None.

    Returns (y like x, new conv_state [N, K-1, D] in x's dtype), as kernels/reference/gdn_layer.py.
    """
    kw = weight.shape[1]
    xp = to_padded(x, cu_seqlens)
    n, lmax, d = xp.shape
    lengths = torch.full((n,), lmax) if cu_seqlens is None else \
        torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n)])
    prev = xp.new_zeros((n, kw - 1, d)) if conv_state is None else conv_state.to(x.dtype)
    rows = torch.cat([prev, xp], dim=1).contiguous()
    y = torch.empty((n, lmax, d), dtype=x.dtype, device=x.device)
    if n and lmax and d:
        bt, bd = 16, min(128, next_power_of_2(d))
        launch(_conv_kernel, (n, cdiv(lmax, bt), cdiv(d, bd)), rows, weight.contiguous(),
               bias.contiguous() if bias is not None else rows, y, lmax, rows.shape[1], D=d, KW=kw,
               HAS_BIAS=bias is not None, SILU=activation == "silu", OUT=_TL[x.dtype], BT=bt, BD=bd, persistent=True)
    idx = (lengths[:, None] + torch.arange(kw - 1)[None, :]).to(x.device)
    state = rows[torch.arange(n, device=x.device)[:, None], idx]
    return from_padded(y, cu_seqlens), canonical_nan(state)
