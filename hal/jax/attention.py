"""Attention under an AttentionSpec on jax.Arrays: kernels/reference/attention.py on strict_math.

The reference skips work that cannot change bits (query tiles, keys no query sees, empty splits);
here every key up to the padded length runs through the same selects, which is exact: an
invisible key, an empty block and an empty split are skipped by ``where``, never multiplied by 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hal import spec as specs
from hal.kernels.layout import mask_causal_window

from . import strict_math as sm
from ._api import bucket, strict_op

_NEG_INF = -jnp.inf
F32 = jnp.float32


def key_visibility(qlen, klen, n_q: int, n_k: int, causal: bool, window):
    """bool [b, n_q, n_k], as hal.kernels.layout.query_positions + key_visibility (bottom-right aligned)."""
    i = jnp.arange(n_q)[None, :]
    qpos = klen[:, None] - qlen[:, None] + i
    qvalid = i < qlen[:, None]
    j = jnp.arange(n_k)[None, None, :]
    vis = qvalid[..., None] & (j < klen[:, None, None])
    return mask_causal_window(vis, j, qpos[..., None], causal, window)


def _scan(body, init, xs):
    return lax.scan(lambda c, x: (body(c, x), None), init, xs)[0]


def _attend(q, k, v, vis, scale: float, spec, fmt: str):
    """q [b, Q, Hq, D], k, v [b, K, Hq, D] (F, kv heads already expanded), vis [b, Q, K] ->
    (out F [b, Q, Hq, D], lse F [b, Q, Hq])."""
    b, nq, hq, d = q.shape
    ks, kb = spec.kv_split, spec.kv_block
    n_keys = k.shape[1]
    ns, nb = max(1, -(-n_keys // ks)), ks // kb
    pad = ns * ks - n_keys
    s = sm.tiled_dot(q[:, :, :, None, :], jnp.transpose(k, (0, 2, 1, 3))[:, None], spec.dot_tile)
    s = sm.mul(s, sm.const(scale))                                     # [b, Q, Hq, K]
    s = jnp.pad(s, [(0, 0)] * 3 + [(0, pad)]).reshape(b, nq, hq, ns, nb, kb)
    vis = jnp.pad(vis, [(0, 0), (0, 0), (0, pad)]).reshape(b, nq, 1, ns, nb, kb)
    vb = jnp.pad(jnp.transpose(v, (0, 2, 1, 3)), [(0, 0), (0, 0), (0, pad), (0, 0)])
    vb = vb.reshape(b, 1, hq, ns, nb, kb, d)

    m_blk = jnp.max(jnp.where(vis, s, _NEG_INF), -1)                  # exact
    m_run = lax.cummax(m_blk, axis=m_blk.ndim - 1)
    nonempty_blk = jnp.any(vis, -1)
    p = sm.exp(sm.sub(s, m_run[..., None]))
    pv = sm.to_format(p, fmt) if spec.p_precision == "input" else p

    # block partials: a chain over the kb keys of every block at once
    def key_step(carry, j):
        l_blk, acc_blk = carry
        vj, pj, pvj, vbj = j
        l_blk = jnp.where(vj, sm.add(l_blk, pj), l_blk)
        acc_blk = jnp.where(vj[..., None], sm.fma(pvj[..., None], vbj, acc_blk), acc_blk)
        return l_blk, acc_blk
    shape = jnp.broadcast_shapes(m_blk.shape, vis.shape[:-1])
    l_blk, acc_blk = _scan(key_step, (sm.zeros(shape), sm.zeros((*shape, d))),
                           (jnp.moveaxis(jnp.broadcast_to(vis, (*shape, kb)), -1, 0), jnp.moveaxis(p, -1, 0),
                            jnp.moveaxis(pv, -1, 0), jnp.moveaxis(vb, -2, 0)))

    # running update over the blocks of each split, in block order (empty blocks skipped)
    m_prev = jnp.concatenate([jnp.full_like(m_run[..., :1], _NEG_INF), m_run[..., :-1]], -1)
    alpha = sm.exp(sm.sub(m_prev, m_run))

    def blk_step(carry, t):
        l, acc = carry
        ne, a, lb, ab = t
        l = jnp.where(ne, sm.fma(l, a, lb), l)
        acc = jnp.where(ne[..., None], sm.fma(acc, a[..., None], ab), acc)
        return l, acc
    ne_b = jnp.broadcast_to(nonempty_blk, shape)
    l, acc = _scan(blk_step, (sm.zeros(shape[:-1]), sm.zeros((*shape[:-1], d))),
                   (jnp.moveaxis(ne_b, -1, 0), jnp.moveaxis(alpha, -1, 0), jnp.moveaxis(l_blk, -1, 0),
                    jnp.moveaxis(acc_blk, -2, 0)))
    m_split, ne_split = m_run[..., -1], jnp.any(ne_b, -1)            # [b, Q, Hq, ns]

    # splits merged in split order (empty splits skipped)
    def split_step(carry, t):
        m_tot, l_tot, acc_tot, seen = carry
        m_i, l_i, acc_i, ne_i = t
        m_new = jnp.maximum(m_tot, m_i)
        a, c = sm.exp(sm.sub(m_tot, m_new)), sm.exp(sm.sub(m_i, m_new))
        l_new = sm.fma(l_tot, a, sm.mul(l_i, c))
        acc_new = sm.fma(acc_tot, a[..., None], sm.mul(acc_i, c[..., None]))
        return (jnp.where(ne_i, m_new, m_tot), jnp.where(ne_i, l_new, l_tot),
                jnp.where(ne_i[..., None], acc_new, acc_tot), seen | ne_i)
    base = m_split.shape[:-1]
    init = (jnp.full(base, _NEG_INF), sm.zeros(base), sm.zeros((*base, d)), jnp.zeros(base, bool))
    m, l, acc, seen = _scan(split_step, init, (jnp.moveaxis(m_split, -1, 0), jnp.moveaxis(l, -1, 0),
                                               jnp.moveaxis(acc, -2, 0), jnp.moveaxis(ne_split, -1, 0)))
    out = jnp.where(seen[..., None], sm.div(acc, l[..., None]), 0.0)
    lse = jnp.where(seen, sm.add(m, sm.log(l)), _NEG_INF)
    return out, lse


def expand_heads(x, hq: int):
    return jnp.repeat(x, hq // x.shape[2], axis=2)


def _stock_attend(q, k, v, qlen, klen, n_q=0, n_k=0, scale=1.0, causal=False, window=(-1, -1), spec=None):
    """Plain float32 attention with the same masks (for jax.grad, not bits): (out, lse)."""
    vis = key_visibility(qlen, klen, n_q, n_k, causal, window)[:, :, None, :]    # [b, Q, 1, K]
    hq = q.shape[2]
    qf, kf, vf = q.astype(F32), expand_heads(k.astype(F32), hq), expand_heads(v.astype(F32), hq)
    s = jnp.where(vis, jnp.einsum("bqhd,bkhd->bqhk", qf, kf) * scale, _NEG_INF)
    seen = jnp.any(vis, -1)
    m = jnp.where(seen, jnp.max(s, -1), 0.0)
    p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.where(seen, jnp.sum(p, -1), 1.0)  # a row that sees no key: out 0, lse -inf (no NaN gradient)
    out = jnp.einsum("bqhk,bkhd->bqhd", p, vf) / l[..., None]
    return out.astype(q.dtype), jnp.where(seen, m + jnp.log(l), _NEG_INF)


@strict_op(stock=_stock_attend, static=("n_q", "n_k", "scale", "causal", "window", "spec"))
def _attend_padded(q, k, v, qlen, klen, n_q=0, n_k=0, scale=1.0, causal=False, window=(-1, -1), spec=None):
    fmt = jnp.dtype(q.dtype).name
    vis = key_visibility(qlen.astype(jnp.int64), klen.astype(jnp.int64), n_q, n_k, causal, window)
    hq = q.shape[2]
    out, lse = _attend(sm.widen(q), expand_heads(sm.widen(k), hq), expand_heads(sm.widen(v), hq), vis,
                       scale, spec, fmt)
    return sm.narrow(out, fmt), sm.narrow(lse, "float32")


def _scale(softmax_scale, d: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else d ** -0.5


def to_padded(x, cu, max_len: int):
    lens = cu[1:] - cu[:-1]
    i = jnp.arange(max_len)[None, :]
    idx = jnp.clip(jnp.where(i < lens[:, None], cu[:-1, None] + i, 0), 0, max(0, x.shape[0] - 1))
    return x[idx], lens


def to_packed(xp, cu, total: int, fill):
    t = jnp.arange(total)
    bidx = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, xp.shape[0] - 1)
    i = t - cu[bidx]
    inside = (t < cu[-1]) & (i < xp.shape[1])
    got = xp[bidx, jnp.clip(i, 0, xp.shape[1] - 1)]
    return jnp.where(inside.reshape(-1, *([1] * (got.ndim - 1))), got, jnp.asarray(fill, xp.dtype))


# Shapes: the strict kernel (_attend_padded) is the one expensive compilation (seconds); it is
# keyed only by the padded layout (sequences, query rows, keys), each rounded up (:func:`_sizes`) so
# that calls of nearby sizes share it. Moving packed rows or cache pages into that layout and back
# is bits only, in small separately jitted programs that compile in a fraction of a second.


def _sizes(b: int, n_q: int, n_k: int, spec):
    """(sequences, query rows, keys) of the padded layout: powers of two, keys a power-of-two number
    of kv_split splits (the kernel pads the keys to whole splits anyway). Exact: a padded sequence
    has no query, a padded query row is invalid (its results are discarded) and a padded key is
    invisible to every query, skipped by ``where`` like any masked key."""
    return bucket(b), bucket(n_q), spec.kv_split * bucket(-(-max(1, n_k) // spec.kv_split))


def _pad_seqs(x, b: int, fill=0):
    """x [n, ...] with ``fill`` rows appended up to b."""
    return jnp.concatenate([x, jnp.full((b - x.shape[0], *x.shape[1:]), fill, x.dtype)]) if b > x.shape[0] else x


@functools.partial(jax.jit, static_argnames=("b", "n_q", "n_k"))
def _varlen_in(q, k, v, cq, ck, *, b: int, n_q: int, n_k: int):
    cq, ck = _pad_seqs(cq, b + 1, cq[-1]), _pad_seqs(ck, b + 1, ck[-1])  # empty sequences
    qp, qlen = to_padded(q, cq, n_q)
    kp, klen = to_padded(k, ck, n_k)
    vp, _ = to_padded(v, ck, n_k)
    return qp, kp, vp, qlen, klen


@functools.partial(jax.jit, static_argnames=("total",))
def _varlen_out(out, lse, cq, *, total: int):
    cq = _pad_seqs(cq, out.shape[0] + 1, cq[-1])
    return to_packed(out, cq, total, 0.0), to_packed(lse, cq, total, -jnp.inf).T


def _static(softmax_scale, d: int, causal, window_size, spec):
    return dict(scale=_scale(softmax_scale, d), causal=bool(causal), window=tuple(int(w) for w in window_size),
                spec=spec)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale=None, causal: bool = False, window_size=(-1, -1), return_lse: bool = False,
                           *, spec=None):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] with int32 cu_seqlens -> out [Tq, Hq, D] (and lse [Hq, Tq]).
    ``max_seqlen_q`` / ``max_seqlen_k`` must be Python ints (they fix shapes under jit)."""
    s = specs.resolve("attention", spec)
    cq, ck = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    b, n_q, n_k = _sizes(cq.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), s)
    qp, kp, vp, qlen, klen = _varlen_in(q, k, v, cq, ck, b=b, n_q=n_q, n_k=n_k)
    out, lse = _attend_padded(qp, kp, vp, qlen, klen, n_q=n_q, n_k=n_k,
                              **_static(softmax_scale, q.shape[-1], causal, window_size, s))
    out, lse = _varlen_out(out, lse, cq, total=q.shape[0])
    return (out, lse) if return_lse else out


def gather_kv(cache, seqlens, block_table, max_len: int):
    """[batch, max_len, Hkv, D] of every sequence's keys (paged or contiguous); positions at or past a
    sequence's length hold arbitrary cache entries (they are invisible)."""
    j = jnp.arange(max_len)
    if block_table is None:
        return cache[: seqlens.shape[0], jnp.clip(j, 0, cache.shape[1] - 1)]
    page = cache.shape[1]
    pages = block_table[:, jnp.clip(j // page, 0, block_table.shape[1] - 1)]
    valid = j[None, :] < seqlens[:, None]
    pages = jnp.clip(jnp.where(valid, pages, 0), 0, cache.shape[0] - 1)  # unused entries may be -1
    return cache[pages, jnp.broadcast_to(j % page, pages.shape)]


@functools.partial(jax.jit, static_argnames=("b", "n_q", "n_k"))
def _kvcache_in(q, k_cache, v_cache, seqlens, block_table, *, b: int, n_q: int, n_k: int):
    kp = gather_kv(k_cache, seqlens, block_table, n_k)
    vp = gather_kv(v_cache, seqlens, block_table, n_k)
    pad = lambda x: _pad_seqs(x, b)  # noqa: E731  (sequences without queries or keys)
    qp = jnp.pad(q, [(0, 0), (0, n_q - q.shape[1]), (0, 0), (0, 0)])
    qlen = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    return pad(qp), pad(kp), pad(vp), pad(qlen), pad(seqlens)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
                            causal: bool = True, window_size=(-1, -1), num_splits: int = 0,
                            return_lse: bool = False, *, max_seqlen_k: int | None = None, spec=None):
    """q [B, Sq, Hq, D] against a cache already holding its keys: contiguous [B, cap, Hkv, D] or paged
    [pages, page_size, Hkv, D] with ``block_table`` [B, max_pages]. ``cache_seqlens`` [B] keys per
    sequence (the queries are the last Sq of them). Appending new keys is the caller's functional
    update (``cache.at[...].set``). ``num_splits`` never changes the bits (accepted, unused).
    ``max_seqlen_k``: a static bound on cache_seqlens (default: the cache's capacity)."""
    s = specs.resolve("attention", spec)
    seq = jnp.asarray(cache_seqlens, jnp.int32)
    bsz, sq = q.shape[:2]
    cap = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    b, n_q, n_k = _sizes(bsz, sq, int(max_seqlen_k) if max_seqlen_k is not None else int(cap), s)
    qp, kp, vp, qlen, klen = _kvcache_in(q, k_cache, v_cache, seq, block_table, b=b, n_q=n_q, n_k=n_k)
    out, lse = _attend_padded(qp, kp, vp, qlen, klen, n_q=n_q, n_k=n_k,
                              **_static(softmax_scale, q.shape[-1], causal, window_size, s))
    out, lse = out[:bsz, :sq], lse[:bsz, :sq]
    return (out, jnp.transpose(lse, (0, 2, 1))) if return_lse else out
