"""Gated delta rule (Gated DeltaNet) under a GatedDeltaRuleSpec, strict: the readable definition.

Per value head the state S is d_k x d_v float32. Mathematically, token by token:

    alpha = exp(g);  S' = alpha S;  u = beta (v - S'^T k);  S = S' + k u^T;  o = S^T (scale q)

Two variants with their own ids (hal/spec.py ``GatedDeltaRuleSpec.describe`` says every step):

* ``serial``: exactly that loop; the state after every token is the state, so any split of a
  sequence into calls continues it exactly.
* ``chunked``: the WY/UT chunk form on a grid of C rows anchored at absolute position 0. Inside a
  chunk every quantity of row i is computed from rows <= i only (log-decays summed from row i
  downward, forward substitution in increasing j), so a chunk that is only partly present gives
  its present rows the bits they get in the full chunk. The state is materialised at chunk
  boundaries; the rows of the unfinished chunk travel in the recurrent state and are recomputed
  by the next call. Prefill split anywhere, decode one token at a time and training over the full
  sequence therefore all compute the same bits.

Every product that feeds a sum is an fma; reductions over d_k use the canonical tiled order.
Sequences, heads and rows are tensor dimensions; Python loops run over tokens (serial), chunk
rows and the d_k tile (chunked) only.
"""
from __future__ import annotations

import torch

from hal.kernels.layout import EPS_L2, Parts, gdn_from_padded as from_padded, gdn_to_padded as to_padded  # noqa: F401
from hal.spec import GatedDeltaRuleSpec
from .reduce import tiled_dot
from .strict_math import F32, F64, exp, fma_wide, sqrt


def dot(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """sum_i a[..., i, :] * b[..., i, :] over axis -2: the canonical tiled dot with that axis."""
    return tiled_dot(a.movedim(-2, -1), b.movedim(-2, -1), t)


# ---------------------------------------------------------------- pieces shared by both variants


def l2norm(x: torch.Tensor, t: int) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) along the last dim, float32, sum in the canonical order."""
    ss = dot(x.unsqueeze(-1), x.unsqueeze(-1), t)  # [..., 1]
    return x / sqrt(ss + torch.tensor(EPS_L2, dtype=F32))


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, d] -> [..., HV, d]: value head j reads q/k head j // (HV / H)."""
    h = x.shape[-2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float, l2: bool, t: int):
    """Widen, optionally L2-normalise, scale q: (qs, k) in float32 on the q/k heads."""
    q32, k32 = q.to(F32), k.to(F32)
    if l2:
        q32, k32 = l2norm(q32, t), l2norm(k32, t)
    return q32 * torch.tensor(scale, dtype=F32), k32


# ---------------------------------------------------------------- serial variant


def _serial(qs, kh, v32, alpha, b32, S, lengths, t):
    """qs, kh [N, L, HV, dk]; v32 [N, L, HV, dv]; alpha, b32 [N, L, HV]; S [N, HV, dk, dv]."""
    n, lmax = qs.shape[:2]
    out = torch.zeros(v32.shape, dtype=F32)
    ragged = bool((lengths != lmax).any())
    for i in range(lmax):
        k_i = kh[:, i].unsqueeze(-1)                                # [N, HV, dk, 1]
        Sp = S * alpha[:, i, :, None, None]                          # S' = alpha S
        w = dot(Sp, k_i, t)                                          # S'^T k  [N, HV, dv]
        u = (v32[:, i] - w) * b32[:, i, :, None]
        S_new = fma_wide(k_i.to(F64), u.unsqueeze(-2).to(F64), Sp)     # S = S' + k u^T
        out[:, i] = dot(S_new, qs[:, i].unsqueeze(-1), t)            # S^T qs
        S = torch.where((i < lengths).reshape(n, 1, 1, 1), S_new, S) if ragged else S_new
    return out, S


# ---------------------------------------------------------------- chunked variant


def _tril_maps(c: int, device):
    """Index maps into the packed lower triangle of D (entries (i, d), d <= i, row-major)."""
    ii, dd = torch.tril_indices(c, c, device=device)
    flat = lambda i, d: i * (i + 1) // 2 + d  # noqa: E731
    i = torch.arange(c, device=device)
    j = torch.arange(c, device=device)
    ij_i, ij_j = i[:, None].expand(c, c), j[None, :].expand(c, c)
    f_index = flat(ij_i, (ij_i - ij_j - 1).clamp_min(0))  # f_ij = exp(D[i, i-j-1]) for j < i
    gamma_index = flat(i, i)                               # gamma_i = exp(D[i, i])
    return ii, dd, f_index, gamma_index


def _chunk_factors(gg: torch.Tensor):
    """gg [N, HV, C] -> (f [N, HV, C, C] valid for j < i, gamma [N, HV, C])."""
    c = gg.shape[-1]
    D = torch.zeros((*gg.shape, c), dtype=F32)
    D[..., 0] = gg
    for d in range(1, c):  # D[i, d] = D[i, d-1] + g_(i-d): a chain from row i downward
        D[..., d:, d] = D[..., d:, d - 1] + gg[..., : c - d]
    ii, dd, f_index, gamma_index = _tril_maps(c, gg.device)
    E = exp(D[..., ii, dd])                                      # only entries with d <= i
    f = E[..., f_index.reshape(-1)].reshape(*gg.shape, c)
    return f, E[..., gamma_index]


def _chunk(S0, qs, kk, vv, gg, bb, t):
    """One chunk of C rows for N sequences x HV heads.

    S0 [N, HV, dk, dv]; qs, kk [N, HV, C, dk]; vv [N, HV, C, dv]; gg, bb [N, HV, C].
    Returns (o [N, HV, C, dv], u [N, HV, C, dv], f, gamma).
    """
    c = gg.shape[-1]
    f, gamma = _chunk_factors(gg)
    X = torch.cat([kk, qs], dim=-2)                                   # [N, HV, 2C, dk]
    gram = dot(X.unsqueeze(-1), kk.transpose(-1, -2).unsqueeze(-3), t)  # [N, HV, 2C, C]: KK ; QK
    reads = dot(X.unsqueeze(-1), S0.unsqueeze(-3), t)                   # [N, HV, 2C, dv]: S0^T k ; S0^T qs
    KK, QK = gram[..., :c, :], gram[..., c:, :]
    W, Y = reads[..., :c, :], reads[..., c:, :]
    coef = f * KK                                                    # used for j < i only
    eye = torch.eye(c, dtype=torch.bool, device=gg.device)
    P = torch.where(eye, QK, f * QK)                                 # used for j <= i only
    g_col = gamma.unsqueeze(-1)
    acc = fma_wide(-g_col.to(F64), W.to(F64), vv)                       # x_i = v_i - gamma_i w_i
    oacc = g_col * Y                                                 # gamma_i (S0^T qs_i)
    U = torch.zeros_like(vv)
    for j in range(c):
        u_j = bb[..., j, None] * acc[..., j, :]
        U[..., j, :] = u_j
        uj = u_j.unsqueeze(-2).to(F64)
        if j + 1 < c:
            acc[..., j + 1:, :] = fma_wide(-coef[..., j + 1:, j, None].to(F64), uj, acc[..., j + 1:, :])
        oacc[..., j:, :] = fma_wide(P[..., j:, j, None].to(F64), uj, oacc[..., j:, :])
    return oacc, U, f, gamma


def _state_at(S0, kk, U, f, gamma, last):
    """State after row ``last`` [N] of the chunk: gamma_L S0 + sum_(j<=L) f_Lj k_j u_j^T in row order."""
    n, hv, c, dk = kk.shape
    L = last.reshape(n, 1, 1).expand(n, hv, 1)
    gL = gamma.gather(-1, L)                                         # [N, HV, 1]
    fL = f.gather(-2, L.unsqueeze(-1).expand(n, hv, 1, c)).squeeze(-2)  # [N, HV, C]: f_Lj
    j = torch.arange(c)
    is_last = j.reshape(1, 1, c) == L
    kd = torch.where(is_last.unsqueeze(-1), kk, fL.unsqueeze(-1) * kk)  # f_LL = 1: k_L as is
    acc = S0 * gL.unsqueeze(-1)
    kd64, U64 = kd.to(F64), U.to(F64)
    for jj in range(c):
        upd = fma_wide(kd64[..., jj, :, None], U64[..., jj, None, :], acc)
        live = jj <= last
        if bool(live.all()):
            acc = upd
        elif bool(live.any()):
            acc = torch.where(live.reshape(n, 1, 1, 1), upd, acc)
    return acc


def _chunked(qs, k_rows, v32, g32, b32, parts: Parts, lengths, hv, spec, want_final):
    """qs [N, L, HV, dk] (new rows); k_rows [N, L, H, dk]; v32 [N, L, HV, dv]; g32, b32 [N, L, HV]."""
    C, t = spec.chunk, spec.dk_tile
    n, lmax = v32.shape[:2]
    h, dk = k_rows.shape[2:]
    dv = v32.shape[-1]
    # rows of the unfinished chunk; a state without them (a bare tensor) starts a fresh grid here
    start = parts.position if parts.open_k is not None else torch.zeros_like(parts.position)
    opened = start % C
    total = opened + lengths                                         # rows from the last boundary
    n_chunks = int(-(-int(total.max()) // C))
    R = n_chunks * C

    def rows(open_rows, new_rows):
        """[N, R, ...]: the open rows, then the new rows, then zeros (absent rows)."""
        if open_rows is None:
            open_rows = new_rows.new_zeros((n, C, *new_rows.shape[2:]))
        src = torch.cat([open_rows, new_rows, new_rows.new_zeros((n, 1, *new_rows.shape[2:]))], dim=1)
        r = torch.arange(R).unsqueeze(0)
        idx = torch.where(r < opened[:, None], r,
                          torch.where(r < total[:, None], C + r - opened[:, None], C + lmax))
        return src[torch.arange(n)[:, None], idx]

    K_rows = rows(parts.open_k, k_rows)
    V_rows = rows(parts.open_v, v32)
    G_rows = rows(parts.open_g, g32)
    B_rows = rows(parts.open_beta, b32)
    Q_rows = rows(None, qs)  # q of old rows is never needed: their outputs were given by earlier calls
    Kh = expand_heads(K_rows, hv)

    def heads_first(x, a, b):  # [N, R, HV, ...] rows a..b -> [N, HV, rows, ...]
        return x[:, a:b].transpose(1, 2)

    S = parts.S
    final = parts.S.clone() if want_final else None
    out = torch.zeros((n, R, hv, dv), dtype=F32)
    for ci in range(n_chunks):
        a, b = ci * C, (ci + 1) * C
        o_c, U, f, gamma = _chunk(S, heads_first(Q_rows, a, b), heads_first(Kh, a, b), heads_first(V_rows, a, b),
                                  heads_first(G_rows, a, b), heads_first(B_rows, a, b), t)
        out[:, a:b] = o_c.transpose(1, 2)
        complete = total >= b
        last_here = (total - 1) // C == ci
        need = complete | (last_here if want_final else torch.zeros_like(complete))
        if bool(need.any()):
            last = (total - 1 - a).clamp(0, C - 1)
            S_at = _state_at(S, heads_first(Kh, a, b), U, f, gamma, last)
            if want_final:
                final = torch.where(last_here.reshape(n, 1, 1, 1), S_at, final)
            S = torch.where(complete.reshape(n, 1, 1, 1), S_at, S)
    # outputs of the new rows only
    r = torch.arange(lmax).unsqueeze(0) + opened[:, None]
    o = out[torch.arange(n)[:, None], r.clamp_max(R - 1)]
    # the rows after the last boundary become the open chunk
    boundary = total - total % C
    left = total % C
    ridx = boundary[:, None] + torch.arange(C).unsqueeze(0)
    keep = torch.arange(C).unsqueeze(0) < left[:, None]

    def carry(x):
        got = x[torch.arange(n)[:, None], ridx.clamp_max(R - 1)]
        return torch.where(keep.reshape(n, C, *([1] * (got.dim() - 2))), got, torch.zeros((), dtype=F32))

    new = Parts(start + lengths, S, carry(K_rows), carry(V_rows), carry(G_rows), carry(B_rows), final)
    return o, new


# ---------------------------------------------------------------- entry point


def gated_delta_rule(q, k, v, g, beta, scale: float, parts: Parts, cu_seqlens: list[int] | None, l2: bool,
                     spec: GatedDeltaRuleSpec, want_final: bool):
    """q, k [B, T, H, dk]; v [B, T, HV, dv]; g, beta [B, T, HV] (or packed with cu_seqlens, B = 1).

    ``parts``: the incoming state of the N sequences. Returns (o like v, new Parts).
    """
    t = spec.dk_tile
    hv = v.shape[2]
    if cu_seqlens is None:
        lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64)
    else:
        lengths = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)])
    qs, k32 = prepare_qk(to_padded(q, cu_seqlens), to_padded(k, cu_seqlens), scale, l2, t)
    v32 = to_padded(v, cu_seqlens).to(F32)
    g32 = to_padded(g, cu_seqlens).to(F32)
    b32 = to_padded(beta, cu_seqlens).to(F32)
    qs_h = expand_heads(qs, hv)
    if spec.variant == "serial":
        o, S = _serial(qs_h, expand_heads(k32, hv), v32, exp(g32), b32, parts.S, lengths, t)
        new = Parts(parts.position + lengths, S, None, None, None, None, S)
    else:
        o, new = _chunked(qs_h, k32, v32, g32, b32, parts, lengths, hv, spec, want_final)
    return from_padded(o, cu_seqlens).to(v.dtype), new
