"""Gated delta rule under a GatedDeltaRuleSpec on jax.Arrays: kernels/reference/gated_delta_rule.py
on strict_math (both variants, ``serial`` and ``chunked``), with its recurrent state.

The reference loops over tokens (serial) and over chunks and chunk rows (chunked) in Python; here
those loops are ``lax.scan``s (one compiled step each), and the reference's data-dependent skips
become ``where`` selects of values computed anyway: a masked value is never multiplied by 0.

Sequences are computed in a padded layout [N, L, ...] with a length per sequence; packed
``cu_seqlens`` inputs go through the attention module's gather (bits only). Shapes never depend
on values: the number of chunks is bounded statically (C - 1 open rows + L new rows).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hal import spec as specs
from hal.errors import InputError, UnsupportedError

from . import strict_math as sm
from ._api import strict_op
from .attention import expand_heads, to_packed, to_padded
from .ops import checked_format

EPS_L2 = 1e-6
F32 = jnp.float32


class GatedDeltaRuleState(NamedTuple):
    """The exact recurrent state of N sequences (a pytree of arrays: passes through jit, scan, vmap).

    Mirrors kernels/reference/gated_delta_rule.py ``Parts``: ``S`` is the materialised float32 state
    (serial: after the last token; chunked: at the last chunk boundary); ``open_*`` (chunked only,
    None for serial) are the rows since that boundary (``position % C`` of them, then zeros), k after
    the L2 norm, all float32; ``final`` is the state after the last token (FLA's final_state). The
    spec is not stored: a chunked state has open rows of C = spec.chunk, a serial one has none, and
    a call checks that against its spec.
    """
    position: jax.Array                # int32 [N], tokens consumed so far
    S: jax.Array                       # float32 [N, HV, dk, dv]
    open_k: Optional[jax.Array]        # float32 [N, C, H, dk]
    open_v: Optional[jax.Array]        # float32 [N, C, HV, dv]
    open_g: Optional[jax.Array]        # float32 [N, C, HV]
    open_beta: Optional[jax.Array]     # float32 [N, C, HV]
    final: jax.Array                   # float32 [N, HV, dk, dv]

    @property
    def final_state(self):
        return self.final


# ---------------------------------------------------------------- pieces shared by both variants


def _l2norm(x, t: int):
    """x / sqrt(sum x^2 + 1e-6) over the last axis (sum in the canonical order)."""
    ss = sm.tiled_dot(x, x, t)
    return sm.div(x, sm.sqrt(sm.add(ss, sm.const(EPS_L2)))[..., None])


def _prepare_qk(q, k, scale: float, l2: bool, t: int):
    """(scale * q, k) as F on the q/k heads, optionally L2-normalised first."""
    q, k = sm.widen(q), sm.widen(k)
    if l2:
        q, k = _l2norm(q, t), _l2norm(k, t)
    return sm.mul(q, sm.const(scale)), k


def _steps(x):
    """[N, L, ...] -> [L, N, ...]: the scan axis first."""
    return jnp.moveaxis(x, 1, 0)


# ---------------------------------------------------------------- serial variant


def _serial(qs, kh, v, alpha, b, S, lengths, t: int):
    """qs, kh [N, L, HV, dk]; v [N, L, HV, dv]; alpha, b [N, L, HV]; S [N, HV, dk, dv] (all F)."""
    live_len = lengths[:, None, None, None]

    def step(ST, x):  # ST = S^T [N, HV, dv, dk]: d_k last, the axis every dot reduces over
        i, q_i, k_i, v_i, a_i, b_i = x
        SpT = sm.mul(ST, a_i[..., None, None])                       # S' = alpha S
        w = sm.tiled_dot(SpT, k_i[..., None, :], t)                  # S'^T k
        u = sm.mul(sm.sub(v_i, w), b_i[..., None])
        newT = sm.fma(k_i[..., None, :], u[..., None], SpT)          # S = S' + k u^T
        o = sm.tiled_dot(newT, q_i[..., None, :], t)                 # S^T qs
        return jnp.where(i < live_len, newT, ST), o
    xs = (jnp.arange(qs.shape[1]), *map(_steps, (qs, kh, v, alpha, b)))
    ST, o = lax.scan(step, jnp.swapaxes(S, -1, -2), xs)
    return _steps(o), jnp.swapaxes(ST, -1, -2)


# ---------------------------------------------------------------- chunked variant


def _chunk_factors(gg):
    """gg [..., C] -> (f [..., C, C] valid for j < i, gamma [..., C]).

    D[i, d] = D[i, d-1] + g_(i-d): a chain from row i downward, one scan step per d. Entries
    d > i hold wrapped-around sums that are never read.
    """
    c = gg.shape[-1]
    i = np.arange(c)
    shifted = jnp.moveaxis(gg[..., (i[None, :] - i[:, None]) % c], -2, 0)   # [d, ..., i]: g_(i-d)
    _, cols = lax.scan(lambda prev, gd: (sm.add(prev, gd),) * 2, gg, shifted[1:])
    D = jnp.moveaxis(jnp.concatenate([gg[None], cols]), 0, -1)              # [..., i, d]
    E = sm.exp(D)
    f = E[..., i[:, None], np.clip(i[:, None] - i[None, :] - 1, 0, None)]  # f_ij = exp(D[i, i-j-1])
    return f, E[..., i, i]                                                  # gamma_i = exp(D[i, i])


def _chunk(S0, qs, kk, vv, gg, bb, t: int):
    """One chunk of C rows. S0 [N, HV, dk, dv]; qs, kk [N, HV, C, dk]; vv [N, HV, C, dv];
    gg, bb [N, HV, C]. Returns (o [N, HV, C, dv], U [N, HV, C, dv], f, gamma)."""
    c = gg.shape[-1]
    f, gamma = _chunk_factors(gg)
    X = jnp.concatenate([kk, qs], -2)[..., :, None, :]                       # [N, HV, 2C, 1, dk]
    gram = sm.tiled_dot(X, kk[..., None, :, :], t)                           # KK ; QK   [.., 2C, C]
    reads = sm.tiled_dot(X, jnp.swapaxes(S0, -1, -2)[..., None, :, :], t)    # S0^T k ; S0^T qs [.., 2C, dv]
    KK, QK = gram[..., :c, :], gram[..., c:, :]
    W, Y = reads[..., :c, :], reads[..., c:, :]
    coef = sm.mul(f, KK)                                                     # used for j < i only
    P = jnp.where(np.eye(c, dtype=bool), QK, sm.mul(f, QK))                  # used for j <= i only
    g_col = gamma[..., None]
    acc = sm.fma(-g_col, W, vv)                                              # x_i = v_i - gamma_i w_i
    oacc = sm.mul(g_col, Y)                                                  # gamma_i (S0^T qs_i)
    row = np.arange(c)[:, None]

    def step(carry, x):  # forward substitution, column j
        acc, oacc = carry
        j, b_j, coef_j, p_j = x
        u = sm.mul(b_j[..., None], lax.dynamic_index_in_dim(acc, j, -2, keepdims=False))
        acc = jnp.where(row > j, sm.fma(-coef_j[..., None], u[..., None, :], acc), acc)
        oacc = jnp.where(row >= j, sm.fma(p_j[..., None], u[..., None, :], oacc), oacc)
        return (acc, oacc), u
    cols = (jnp.arange(c), jnp.moveaxis(bb, -1, 0), jnp.moveaxis(coef, -1, 0), jnp.moveaxis(P, -1, 0))
    (_, oacc), U = lax.scan(step, (acc, oacc), cols)
    return oacc, jnp.moveaxis(U, 0, -2), f, gamma


def _state_at(S0, kk, U, f, gamma, last):
    """State after row ``last`` [N] of the chunk: gamma_L S0 + sum_(j<=L) f_Lj k_j u_j^T in row order."""
    c = kk.shape[-2]
    L = last[:, None, None]                                                  # [N, 1, 1]
    gL = jnp.take_along_axis(gamma, jnp.broadcast_to(L, (*gamma.shape[:-1], 1)), -1)[..., 0]
    fL = jnp.take_along_axis(f, jnp.broadcast_to(L[..., None], (*f.shape[:-2], 1, c)), -2)[..., 0, :]
    kd = jnp.where((np.arange(c) == L)[..., None], kk, sm.mul(fL[..., None], kk))  # f_LL = 1: k_L as is

    def step(acc, x):
        jj, k_j, u_j = x
        upd = sm.fma(k_j[..., :, None], u_j[..., None, :], acc)
        return jnp.where((jj <= last)[:, None, None, None], upd, acc), None
    acc, _ = lax.scan(step, sm.mul(S0, gL[..., None, None]),
                      (jnp.arange(c), jnp.moveaxis(kd, -2, 0), jnp.moveaxis(U, -2, 0)))
    return acc


class _Grid:
    """The rows since the last chunk boundary, per sequence: its ``opened`` open rows, then its
    new rows, then absent rows (zeros), on R rows. Gathers only: no arithmetic."""

    def __init__(self, opened, lengths, C: int, R: int, lmax: int):
        self.n, self.C, self.R, self.lmax = opened.shape[0], C, R, lmax
        self.opened, self.total = opened, opened + lengths
        r = jnp.arange(R)[None, :]
        o, t = opened[:, None], self.total[:, None]
        self.idx = jnp.where(r < o, r, jnp.where(r < t, C + r - o, C + lmax))
        self.nidx = jnp.arange(self.n)[:, None]

    def rows(self, open_rows, new_rows):
        """[N, C, ...] open rows (None: zeros) and [N, L, ...] new rows -> [N, R, ...]."""
        z = jnp.zeros((self.n, self.C + 1, *new_rows.shape[2:]), new_rows.dtype)
        src = jnp.concatenate([z[:, :self.C] if open_rows is None else open_rows, new_rows, z[:, :1]], 1)
        return src[self.nidx, self.idx]

    def new(self, x):
        """[N, R, ...] -> the new rows' entries [N, L, ...]."""
        return x[self.nidx, jnp.clip(jnp.arange(self.lmax)[None, :] + self.opened[:, None], 0, self.R - 1)]

    def still_open(self, x):
        """[N, R, ...] -> the rows after the last boundary [N, C, ...], zeros after them."""
        left = self.total % self.C
        got = x[self.nidx, jnp.clip((self.total - left)[:, None] + jnp.arange(self.C)[None, :], 0, self.R - 1)]
        keep = jnp.arange(self.C)[None, :] < left[:, None]
        return jnp.where(keep.reshape(*keep.shape, *([1] * (got.ndim - 2))), got, jnp.zeros((), got.dtype))


def _chunked(qs, k_rows, v, g, b, state, lengths, hv: int, spec, fresh: bool):
    """qs [N, L, HV, dk] (new rows); k_rows [N, L, H, dk]; v [N, L, HV, dv]; g, b [N, L, HV] (F);
    ``state``: (position, S, open_k, open_v, open_g, open_beta) with F values."""
    C, t = spec.chunk, spec.dk_tile
    n, lmax = v.shape[:2]
    position, S, open_k, open_v, open_g, open_beta = state
    n_chunks = max(1, math.ceil((lmax + (0 if fresh else C - 1)) / C))
    grid = _Grid(jnp.zeros_like(position) if fresh else position % C, lengths, C, n_chunks * C, lmax)
    total = grid.total
    K_rows, V_rows, G_rows, B_rows = (grid.rows(o, x) for o, x in ((open_k, k_rows), (open_v, v), (open_g, g),
                                                                      (open_beta, b)))
    Q_rows = grid.rows(None, qs)  # q of old rows is never needed: their outputs were given by earlier calls

    def chunks(x):  # [N, R, heads, ...] -> [n_chunks, N, heads, C, ...]
        return jnp.moveaxis(jnp.moveaxis(x.reshape(n, n_chunks, C, *x.shape[2:]), 1, 0), 2, 3)

    def step(carry, x):
        S, final = carry
        ci, q_c, k_c, v_c, g_c, b_c = x
        o_c, U, f, gamma = _chunk(S, q_c, k_c, v_c, g_c, b_c, t)
        S_at = _state_at(S, k_c, U, f, gamma, jnp.clip(total - 1 - ci * C, 0, C - 1))
        final = jnp.where(((total - 1) // C == ci)[:, None, None, None], S_at, final)
        S = jnp.where((total >= (ci + 1) * C)[:, None, None, None], S_at, S)
        return (S, final), o_c
    xs = (jnp.arange(n_chunks), *map(chunks, (Q_rows, expand_heads(K_rows, hv), V_rows, G_rows, B_rows)))
    (S, final), o = lax.scan(step, (S, S), xs)
    o = grid.new(jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1).reshape(n, grid.R, hv, -1))
    return o, (S, *map(grid.still_open, (K_rows, V_rows, G_rows, B_rows)), final)


# ---------------------------------------------------------------- the jitted core (padded layout)


def _strict_padded(q, k, v, g, beta, lengths, position, S, open_k, open_v, open_g, open_beta,
                   scale=1.0, l2=False, spec=None, fresh=True):
    """Padded [N, L, ...] inputs, ``lengths`` [N] -> (o [N, L, HV, dv] in v's dtype, S, open_k, open_v,
    open_g, open_beta, final) as float32 (open_* None for serial)."""
    t, hv = spec.dk_tile, v.shape[2]
    qs, k32 = _prepare_qk(q, k, scale, l2, t)
    v32, g32, b32 = sm.widen(v), sm.widen(g), sm.widen(beta)
    lengths = lengths.astype(jnp.int64)
    S = sm.widen(S)
    if spec.variant == "serial":
        o, S = _serial(expand_heads(qs, hv), expand_heads(k32, hv), v32, sm.exp(g32), b32, S, lengths, t)
        rest = (S, None, None, None, None, S)
    else:
        st = (position.astype(jnp.int64), S, *(None if x is None else sm.widen(x)
                                               for x in (open_k, open_v, open_g, open_beta)))
        o, rest = _chunked(expand_heads(qs, hv), k32, v32, g32, b32, st, lengths, hv, spec, fresh)
    return (sm.narrow(o, checked_format(v)), *(None if x is None else sm.narrow(x) for x in rest))


def _stock_padded(q, k, v, g, beta, lengths, position, S, open_k, open_v, open_g, open_beta,
                  scale=1.0, l2=False, spec=None, fresh=True):
    """The same outputs by the plain float32 token-by-token recurrence (for jax.grad, not bits):
    the open rows are replayed from the boundary state, then the new rows follow."""
    out_dtype = v.dtype
    q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
    if l2:
        q, k = (x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + EPS_L2) for x in (q, k))
    hv, C, L = v.shape[2], spec.chunk, v.shape[1]
    chunked = spec.variant == "chunked"
    opened = position % C if chunked and not fresh else jnp.zeros_like(position)
    grid = _Grid(opened, lengths, C, L + (C if chunked and not fresh else 0), L)
    Q, K, V, Gl, Bt = (grid.rows(o, x) for o, x in ((None, q * scale), (open_k, k), (open_v, v), (open_g, g),
                                                    (open_beta, beta)))

    def step(carry, x):
        S, Sb = carry
        r, q_r, k_r, v_r, g_r, b_r = x
        Sn = S * jnp.exp(g_r)[..., None, None]
        u = b_r[..., None] * (v_r - jnp.einsum("nhkv,nhk->nhv", Sn, k_r))
        Sn = Sn + k_r[..., :, None] * u[..., None, :]
        live = (r < grid.total)[:, None, None, None]
        S = jnp.where(live, Sn, S)
        Sb = jnp.where(live & ((r + 1) % C == 0), S, Sb)  # the state at each completed chunk boundary
        return (S, Sb), jnp.einsum("nhkv,nhk->nhv", Sn, q_r)
    xs = (jnp.arange(grid.R), *map(_steps, (expand_heads(Q, hv), expand_heads(K, hv), V, Gl, Bt)))
    (final, Sb), o = lax.scan(step, (S, S), xs)
    o = grid.new(_steps(o)).astype(out_dtype)
    if not chunked:
        return o, final, None, None, None, None, final
    return (o, Sb, *map(grid.still_open, (K, V, Gl, Bt)), final)


_STATIC = ("scale", "l2", "spec", "fresh")
_gdn_padded = strict_op(stock=_stock_padded, static=_STATIC)(_strict_padded)


def gated_delta_rule_padded(q, k, v, g, beta, lengths, state: GatedDeltaRuleState, *, scale: float, l2: bool, spec,
                            fresh: bool):
    """The core on padded inputs (used by the torch-facing backend): returns (o, new GatedDeltaRuleState)."""
    o, S, ok, ov, og, ob, final = _gdn_padded(q, k, v, g, beta, lengths, state.position, state.S, state.open_k,
                                              state.open_v, state.open_g, state.open_beta, scale=scale, l2=l2,
                                              spec=spec, fresh=fresh)
    position = (state.position + lengths.astype(state.position.dtype))
    return o, GatedDeltaRuleState(position, S, ok, ov, og, ob, final)


# ---------------------------------------------------------------- public ops (FLA signatures)


def _check(q, k, v, g, beta):
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if jnp.ndim(x) != nd:
            raise InputError(f"hal.jax gated delta rule: {name} must have {nd} dims, got shape {jnp.shape(x)}")
        checked_format(x)
    if q.shape != k.shape:
        raise InputError(f"k shape {k.shape} must equal q shape {q.shape} ([B, T, H, d_k])")
    B, T, H, dk = q.shape
    HV, dv = v.shape[2:]
    if v.shape[:2] != (B, T) or H < 1 or HV < 1 or HV % H or dk < 1 or dv < 1:
        raise InputError(f"v shape {v.shape} must be [B, T, HV, d_v] with B, T = {B}, {T} and HV a multiple "
                         f"of H = {H} (GVA), head dims >= 1")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            raise InputError(f"{name} shape {x.shape} must be [B, T, HV] = {(B, T, HV)}")
    if jnp.dtype(q.dtype) != jnp.dtype(v.dtype) or jnp.dtype(k.dtype) != jnp.dtype(v.dtype):
        raise InputError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return H, HV, dk, dv


def _lengths(cu_seqlens, B: int, T: int, max_seqlen):
    """(cu int32 or None, lengths int32 [N], padded length L: a Python int)."""
    if cu_seqlens is None:
        return None, jnp.full((B,), T, jnp.int32), T
    if B != 1:
        raise InputError(f"with cu_seqlens the inputs must be packed as [1, total_tokens, ...]; got batch {B}")
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise InputError(f"cu_seqlens must be 1-D with N+1 >= 2 offsets, got shape {cu.shape}")
    lengths = cu[1:] - cu[:-1]
    if not isinstance(cu, jax.core.Tracer):  # concrete: check it, and pad only to the longest sequence
        c = np.asarray(cu)
        if c[0] != 0 or c[-1] != T or np.any(np.diff(c) <= 0):
            raise InputError(f"cu_seqlens must start at 0, end at the token count {T} and be strictly "
                             f"increasing; got {c.tolist()}")
        return cu, lengths, int(np.diff(c).max()) if max_seqlen is None else int(max_seqlen)
    return cu, lengths, T if max_seqlen is None else int(max_seqlen)


def _start_state(initial_state, spec, n: int, layout) -> tuple[GatedDeltaRuleState, bool]:
    """(the incoming state, fresh: no open rows)."""
    H, HV, dk, dv = layout
    shape = (n, HV, dk, dv)
    C = spec.chunk

    def fresh_state(S):
        if spec.variant == "serial":
            opens = (None,) * 4
        else:
            opens = (jnp.zeros((n, C, H, dk), F32), jnp.zeros((n, C, HV, dv), F32), jnp.zeros((n, C, HV), F32),
                     jnp.zeros((n, C, HV), F32))
        return GatedDeltaRuleState(jnp.zeros((n,), jnp.int32), S, *opens, S), True
    if initial_state is None:
        return fresh_state(jnp.zeros(shape, F32))
    if not isinstance(initial_state, GatedDeltaRuleState):
        S = initial_state
        if jnp.shape(S) != shape or jnp.dtype(S.dtype) != jnp.float32:
            raise InputError(f"initial_state must be a float32 [N, HV, d_k, d_v] = {shape} array or a GatedDeltaRuleState, "
                             f"got {getattr(S, 'dtype', type(S).__name__)} {jnp.shape(S)}")
        return fresh_state(S)
    st = initial_state
    if st.S.shape != shape:
        raise InputError(f"initial_state.S has shape {st.S.shape}, this call needs [N, HV, d_k, d_v] = {shape}")
    if spec.variant == "serial":
        if st.open_k is not None:
            raise InputError("initial_state has open chunk rows (a chunked-spec state) but this call uses the "
                             f"serial spec {spec.id}; a state continues only under the spec that made it")
        return st, True
    if st.open_k is None or st.open_k.shape != (n, C, H, dk):
        raise InputError(f"initial_state must carry the open chunk rows of {spec.id} (open_k [N, C, H, d_k] = "
                         f"{(n, C, H, dk)}); got {None if st.open_k is None else st.open_k.shape}")
    return st, False


def strict_spec(spec):
    """The call's gated delta rule spec; a fast one (tensor cores, the triton backend's) is refused by name."""
    s = specs.resolve("gated_delta_rule", spec)
    if s.policy != specs.STRICT:
        raise UnsupportedError(f"hal.jax: spec {s.id} is {s.policy} (tensor cores on the triton backend); JAX runs "
                               f"the strict gated delta rule specs only, e.g. {specs.DEFAULTS['gated_delta_rule'].id}")
    return s


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, max_seqlen=None, spec=None):
    """Gated delta rule over q, k [B, T, H, d_k], v [B, T, HV, d_v], g, beta [B, T, HV] (hal.chunk_gated_delta_rule).

    Packed sequences: B = 1 and ``cu_seqlens`` (N+1 offsets); under jit with a traced cu_seqlens
    pass ``max_seqlen`` (a Python int bound on the lengths; default: T). ``initial_state``: None, a
    bare float32 [N, HV, d_k, d_v] array (a state at a chunk boundary, as in FLA) or a
    :class:`GatedDeltaRuleState` (exact continuation at any split). Returns (o like v, final): final is None,
    the float32 state after the last token (``output_final_state=True``), or a GatedDeltaRuleState
    (``"state"``, or True when ``initial_state`` is a GatedDeltaRuleState).
    """
    s = strict_spec(spec)
    layout = _check(q, k, v, g, beta)
    if output_final_state not in (False, True, "state"):
        raise InputError(f"output_final_state must be False, True or 'state', got {output_final_state!r}")
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise InputError(f"use_qk_l2norm_in_kernel must be a bool, got {use_qk_l2norm_in_kernel!r}")
    B, T = q.shape[:2]
    dk = layout[2]
    scale = dk ** -0.5 if scale is None else float(scale)
    if not scale > 0 or not math.isfinite(scale):
        raise InputError(f"scale must be a positive finite number, got {scale}")
    scale = float(np.float32(scale))  # the spec's scale is a float32 number
    cu, lengths, lmax = _lengths(cu_seqlens, B, T, max_seqlen)
    n = B if cu is None else cu.shape[0] - 1
    state, fresh = _start_state(initial_state, s, n, layout)
    as_state = output_final_state == "state" or (output_final_state is True and isinstance(initial_state, GatedDeltaRuleState))
    if T == 0:
        o, new = jnp.zeros(v.shape, v.dtype), state
    else:
        if cu is None:
            args = (q, k, v, g, beta)
        else:
            args = tuple(to_padded(x[0], cu, lmax)[0] for x in (q, k, v, g, beta))
        o, new = gated_delta_rule_padded(*args, lengths, state, scale=scale, l2=use_qk_l2norm_in_kernel, spec=s,
                                         fresh=fresh)
        if cu is not None:
            o = to_packed(o, cu, T, 0.0)[None]
    if as_state:
        return o, new
    return o, (new.final if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, max_seqlen=None, spec=None):
    """Same arguments, results and bits as :func:`chunk_gated_delta_rule` (``beta=None`` means 1)."""
    if beta is None:
        beta = jnp.ones(jnp.shape(g), g.dtype)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                  use_qk_l2norm_in_kernel, max_seqlen=max_seqlen, spec=spec)
