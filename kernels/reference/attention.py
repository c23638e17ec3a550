"""Softmax attention under an AttentionSpec (strict): the canonical computation, written out.

For one query row and head (``AttentionSpec.describe`` says the same in words):

    keys are grouped in splits of S keys anchored at key 0, blocks of B keys inside a split;
    per split, blocks in order:  m' = max(m, max of the block's visible scores)
                                 p_j = exp(s_j - m')                        (visible keys only)
                                 l_blk = sum p_j, acc_blk = chain of fma(p_j, v_j, acc)  (key order)
                                 l = fma(l, exp(m - m'), l_blk); acc = fma(acc, exp(m - m'), acc_blk)
    splits merged in order:      M' = max(M, m_k); L = fma(L, exp(M - M'), l_k * exp(m_k - M')); same for ACC
    out = ACC / L; lse = M + log(L)

Invisible keys (causal, window, past the sequence) and blocks or splits without a visible key are
skipped with ``torch.where``, so a query's arithmetic is the same whether or not the keys after it
exist: a prefill, a chunk of a prefill and a decode step compute the same bits.

Vectorised over batch, query rows, heads, splits and blocks (independent by the spec); the loops
run over the B keys of a block, the blocks of a split and the splits -- the spec's orders. The
running max inside a split is a prefix max (``cummax``), exact and order-free, which lets all
blocks' p be computed at once. Queries are processed in tiles of rows so a causal prefill only
reads the keys a tile can see; trailing keys no query sees are skipped, which is exact.
"""
from __future__ import annotations

import torch

from hal.kernels.layout import key_visibility, kvcache_via_padded, query_positions, varlen_via_padded
from hal.spec import AttentionSpec
from .reduce import tiled_dot
from .strict_math import F32, exp, fma, log

_Q_TILE = 64  # rows per tile: only a speed knob (rows are independent)
_NEG_INF = float("-inf")


def _split_partials(q, k, v, vis, n_splits: int, scale32, spec: AttentionSpec, p_dtype):
    """(m, l, acc, nonempty) of ``n_splits`` consecutive splits whose keys are k, v [b, K, Hq, D].

    q [b, Qt, Hq, D] float32; vis [b, Qt, K] (key 0 of k is the first key of the first split).
    Shapes out: m, l [b, Qt, Hq, n]; acc [b, Qt, Hq, n, D]; nonempty [b, Qt, 1, n].
    """
    bsz, qt, hq, d = q.shape
    n_keys = k.shape[1]
    kb, ks = spec.kv_block, spec.kv_split
    n_blk = ks // kb if n_splits > 1 else max(1, -(-n_keys // kb))  # blocks per split
    padded = n_splits * n_blk * kb
    # scores [b, Qt, Hq, K]: the q.k dot over the head dim in the canonical tiled order, then * scale
    s = tiled_dot(q.unsqueeze(3), k.permute(0, 2, 1, 3).unsqueeze(1), spec.dot_tile) * scale32
    pad = padded - n_keys
    s = torch.nn.functional.pad(s, (0, pad))
    vis = torch.nn.functional.pad(vis, (0, pad), value=False)
    vpad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
    s = s.reshape(bsz, qt, hq, n_splits, n_blk, kb)
    vis = vis.reshape(bsz, qt, 1, n_splits, n_blk, kb)
    vb = vpad.permute(0, 2, 1, 3).reshape(bsz, 1, hq, n_splits, n_blk, kb, d)

    m_blk = torch.where(vis, s, _NEG_INF).amax(-1)        # exact
    m_run = torch.cummax(m_blk, dim=-1).values             # running max after each block
    nonempty_blk = vis.any(-1)
    p = exp(s - m_run.unsqueeze(-1))                       # used only where visible
    pv = p if spec.p_precision == "fp32" else p.to(p_dtype).to(F32)

    # Block partials, all blocks at once: a sequential chain over the B keys of each block.
    l_blk = torch.zeros(m_blk.shape, dtype=F32)
    acc_blk = torch.zeros((*m_blk.shape, d), dtype=F32)
    for j in range(kb):
        vj = vis[..., j]
        l_blk = torch.where(vj, l_blk + p[..., j], l_blk)
        acc_blk = torch.where(vj.unsqueeze(-1), fma(pv[..., j].unsqueeze(-1), vb[..., j, :], acc_blk), acc_blk)

    # Running update over the blocks of each split, in block order; empty blocks are skipped.
    m_prev = torch.cat([torch.full_like(m_run[..., :1], _NEG_INF), m_run[..., :-1]], dim=-1)
    alpha = exp(m_prev - m_run)
    l = torch.zeros(m_blk.shape[:-1], dtype=F32)
    acc = torch.zeros((*m_blk.shape[:-1], d), dtype=F32)
    for t in range(n_blk):
        ne = nonempty_blk[..., t]
        l = torch.where(ne, fma(l, alpha[..., t], l_blk[..., t]), l)
        acc = torch.where(ne.unsqueeze(-1), fma(acc, alpha[..., t].unsqueeze(-1), acc_blk[..., t, :]), acc)
    return m_run[..., -1], l, acc, nonempty_blk.any(-1)


def _merge_splits(parts, shape, d):
    """Merge split partials in split order (empty splits skipped) -> (M, L, ACC, any visible key)."""
    m_tot = torch.full(shape, _NEG_INF, dtype=F32)
    l_tot = torch.zeros(shape, dtype=F32)
    acc_tot = torch.zeros((*shape, d), dtype=F32)
    seen = torch.zeros((*shape[:2], 1), dtype=torch.bool)
    for m, l, acc, ne in parts:
        for i in range(m.shape[-1]):
            m_i, ne_i = m[..., i], ne[..., i]
            m_new = torch.maximum(m_tot, m_i)
            a, c = exp(m_tot - m_new), exp(m_i - m_new)
            l_new = fma(l_tot, a, l[..., i] * c)
            acc_new = fma(acc_tot, a.unsqueeze(-1), acc[..., i, :] * c.unsqueeze(-1))
            m_tot = torch.where(ne_i, m_new, m_tot)
            l_tot = torch.where(ne_i, l_new, l_tot)
            acc_tot = torch.where(ne_i.unsqueeze(-1), acc_new, acc_tot)
            seen = seen | ne_i
    return m_tot, l_tot, acc_tot, seen


def attend_padded(q, k, v, qlen, klen, scale: float, causal: bool, window, spec: AttentionSpec, num_splits: int = 0):
    """Attention on padded tensors: q [b, Q, Hq, D], k, v [b, K, Hkv, D] (any float dtype).

    Sequence b has qlen[b] queries (the last ones of its klen[b] keys). Returns out [b, Q, Hq, D]
    in q's dtype and lse [b, Q, Hq] float32. ``num_splits`` > 0 computes that many splits at a
    time (as a split-KV kernel would); the merge order is always the spec's, so bits never change.
    """
    bsz, n_q, hq, d = q.shape
    hkv = k.shape[2]
    heads = torch.arange(hq) // (hq // hkv)  # GQA: q head h reads kv head h // group
    q32 = q.to(F32)
    k32 = k.to(F32)[:, :, heads]
    v32 = v.to(F32)[:, :, heads]
    scale32 = torch.tensor(scale, dtype=F32)
    qpos, qvalid = query_positions(qlen, klen, n_q)
    out = torch.zeros((bsz, n_q, hq, d), dtype=F32)
    lse = torch.full((bsz, n_q, hq), _NEG_INF, dtype=F32)
    ks = spec.kv_split
    for r0 in range(0, n_q, _Q_TILE):
        rows = slice(r0, min(n_q, r0 + _Q_TILE))
        vis = key_visibility(qpos[:, rows], qvalid[:, rows], klen, k.shape[1], causal, window)
        # Only sequences with a query in this tile that sees a key, and only up to the last key any
        # of them sees: rows are independent and trailing invisible keys are skipped anyway.
        active = vis.any(-1).any(-1).nonzero()[:, 0]
        if active.numel() == 0:
            continue  # no query of the tile sees a key: out 0, lse -inf
        vis = vis[active]
        n_keys = int(vis.any(0).any(0).nonzero()[-1, 0]) + 1
        n_splits = -(-n_keys // ks)
        group = num_splits if num_splits > 0 else n_splits
        qa, ka, va = q32[active, rows], k32[active], v32[active]
        parts = []
        for s0 in range(0, n_splits, group):
            k0, k1 = s0 * ks, min(n_keys, (s0 + group) * ks)
            parts.append(_split_partials(qa, ka[:, k0:k1], va[:, k0:k1], vis[..., k0:k1],
                                         -(-(k1 - k0) // ks), scale32, spec, q.dtype))
        m, l, acc, seen = _merge_splits(parts, (active.numel(), rows.stop - r0, hq), d)
        out[active, rows] = torch.where(seen.unsqueeze(-1), acc / l.unsqueeze(-1), 0.0)
        lse[active, rows] = torch.where(seen, m + log(l), _NEG_INF)
    return out.to(q.dtype), lse


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, causal, window, spec):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] -> out [Tq, Hq, D], lse [Hq, Tq]."""
    return varlen_via_padded(attend_padded, q, k, v, cu_q, cu_k, scale, causal, window, spec)


def flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window, num_splits, spec):
    """q [B, Sq, Hq, D] against cached keys (contiguous or paged) -> out [B, Sq, Hq, D], lse [B, Hq, Sq]."""
    return kvcache_via_padded(attend_padded, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                              spec, num_splits)
