"""Softmax attention under an AttentionSpec (strict), one (sequence, query row, head) per task.

The arithmetic is kernels/reference/attention.py's, written per query row: keys in splits of
``kv_split`` anchored at key 0, blocks of ``kv_block`` inside a split; per block the visible
scores' max updates the running max m, p = exp(s - m), the block's l (sum) and acc (fma chain over
keys, per head dim) start from +0.0 and are folded into the split's running l / acc with
alpha = exp(m_prev - m); splits are merged in order. Blocks and splits with no visible key are
skipped (so how many splits a call computes at once, ``num_splits``, never matters: the reference
merges the same splits in the same order). Host-side layout (varlen <-> padded, paged gather,
key visibility) is the shared code in hal/attention.py and hal/kv_cache.py.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from hal.attention import key_visibility, query_positions, varlen_via_padded
from hal.kv_cache import kv_rows

from .host import F32, finish, parallel_worth, raw
from .strict_math import NEG_INF, ZERO, canon, exp, fma, log, nanmax, round_bf16, round_f16, widen

P_FP32, P_BF16, P_FP16 = 0, 1, 2
_P_MODE = {torch.bfloat16: P_BF16, torch.float16: P_FP16}


@njit(inline="always", cache=True)
def _block_scores(qv, tile, w, dt, scale, sc, tmp):
    """sc[j] = (q . k_j) * scale for the block's keys j < w, tile [D, kv_block] their keys transposed
    (_keys_by_dim): per key the canonical tiled chain over the head dim (tile partials added in order
    from +0.0). The keys of a block are independent chains advanced together, so the loop over keys
    vectorises; four head dims per pass (one nested fma expression: the chain's order) read the
    chain once per four steps instead of once per step."""
    d = qv.shape[0]
    for j in range(w):
        sc[j] = ZERO
    for c0 in range(0, d, dt):
        c1 = min(c0 + dt, d)
        for j in range(w):
            tmp[j] = ZERO
        c = c0
        while c + 4 <= c1:
            x0, x1, x2, x3 = qv[c], qv[c + 1], qv[c + 2], qv[c + 3]
            r0, r1, r2, r3 = tile[c], tile[c + 1], tile[c + 2], tile[c + 3]
            for j in range(w):
                tmp[j] = fma(x3, widen(r3[j]), fma(x2, widen(r2[j]), fma(x1, widen(r1[j]),
                                                                            fma(x0, widen(r0[j]), tmp[j]))))
            c += 4
        for c in range(c, c1):
            x = qv[c]
            row = tile[c]
            for j in range(w):
                tmp[j] = fma(x, widen(row[j]), tmp[j])
        for j in range(w):
            sc[j] = sc[j] + tmp[j]
    for j in range(w):
        sc[j] = sc[j] * scale


@njit(inline="always", cache=True)
def _block_values(v, rows, b, hk, idx, nv, p, b0, acc):
    """acc[c] = chain of fma(p_j, v_j[c], .) over the block's visible keys idx[:nv], in key order: four
    keys per pass as one nested fma expression (each acc[c] still one chain, key after key)."""
    d = acc.shape[0]
    for c in range(d):
        acc[c] = ZERO
    n = 0
    while n + 4 <= nv:
        j0, j1, j2, j3 = idx[n], idx[n + 1], idx[n + 2], idx[n + 3]
        p0, p1, p2, p3 = p[j0 - b0], p[j1 - b0], p[j2 - b0], p[j3 - b0]
        v0, v1, v2, v3 = v[rows[b, j0], hk], v[rows[b, j1], hk], v[rows[b, j2], hk], v[rows[b, j3], hk]
        for c in range(d):
            acc[c] = fma(p3, widen(v3[c]), fma(p2, widen(v2[c]), fma(p1, widen(v1[c]),
                                                                      fma(p0, widen(v0[c]), acc[c]))))
        n += 4
    for n in range(n, nv):
        j = idx[n]
        pj = p[j - b0]
        vr = v[rows[b, j], hk]
        for c in range(d):
            acc[c] = fma(pj, widen(vr[c]), acc[c])


@njit(inline="always", cache=True)
def _attend_task(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, task):
    """One (sequence, query row, kv head) triple: the output rows and lse of the kv head's group of
    query heads. The heads of a group see the same keys, so they share the visible-key list and the
    key / value loads (from cache); each head's chain stays its own. Values are read in place: key j
    of sequence b is row rows[b, j] of v [R, Hkv, D] (a paged cache needs no gather)."""
    bsz, nq, hq, d = q.shape
    hkv = kt.shape[1]
    group = hq // hkv
    b = task // (nq * hkv)
    i = (task // hkv) % nq
    hk = task % hkv
    h0 = hk * group
    vrow = vis[b, i]
    last = -1
    for j in range(vrow.shape[0] - 1, -1, -1):
        if vrow[j]:
            last = j
            break
    if last < 0:  # no visible key: out 0, lse -inf
        for g in range(group):
            out[b, i, h0 + g, :] = ZERO
            lse[b, i, h0 + g] = NEG_INF
        return
    qv = np.empty((group, d), np.float32)
    for g in range(group):
        for c in range(d):
            qv[g, c] = widen(q[b, i, h0 + g, c])
    sc = np.empty((group, kb), np.float32)
    p = np.empty((group, kb), np.float32)
    tmp = np.empty(kb, np.float32)
    idx = np.empty(kb, np.int64)
    kth = kt[b, hk]
    acc_blk = np.empty(d, np.float32)
    acc = np.empty((group, d), np.float32)
    acc_tot = np.zeros((group, d), np.float32)
    m_run = np.empty(group, np.float32)
    l_run = np.empty(group, np.float32)
    m_tot = np.full(group, NEG_INF, np.float32)
    l_tot = np.zeros(group, np.float32)
    seen = False
    for s0 in range(0, last + 1, ks):
        s1 = min(s0 + ks, last + 1)
        m_run[:] = NEG_INF
        l_run[:] = ZERO
        acc[:] = ZERO
        split_seen = False
        for b0 in range(s0, s1, kb):
            b1 = min(b0 + kb, s1)
            nv = 0
            for j in range(b0, b1):  # the block's visible keys, in key order
                if vrow[j]:
                    idx[nv] = j
                    nv += 1
            if nv == 0:  # m_run is unchanged by an empty block (cummax), nothing else moves
                continue
            for g in range(group):
                sg, pg = sc[g], p[g]
                _block_scores(qv[g], kth[b0 // kb], b1 - b0, dt, scale, sg, tmp)
                m_blk = NEG_INF
                for n in range(nv):
                    m_blk = nanmax(m_blk, sg[idx[n] - b0])
                m_new = nanmax(m_run[g], m_blk)  # running max after this block (cummax)
                for j in range(b1 - b0):  # every key (branch-free, vectorises); only visible ones are used
                    pg[j] = exp(sg[j] - m_new)
                l_blk = ZERO
                for n in range(nv):
                    l_blk = l_blk + pg[idx[n] - b0]
                if p_mode == P_BF16:
                    for j in range(b1 - b0):
                        pg[j] = round_bf16(pg[j])
                elif p_mode == P_FP16:
                    for j in range(b1 - b0):
                        pg[j] = round_f16(pg[j])
                _block_values(v, rows, b, hk, idx, nv, pg, b0, acc_blk)
                alpha = exp(m_run[g] - m_new)
                l_run[g] = fma(l_run[g], alpha, l_blk)
                ag = acc[g]
                for c in range(d):
                    ag[c] = fma(ag[c], alpha, acc_blk[c])
                m_run[g] = m_new
            split_seen = True
        if split_seen:  # merge this split into the total, in split order
            for g in range(group):
                m_new = nanmax(m_tot[g], m_run[g])
                a = exp(m_tot[g] - m_new)
                cc = exp(m_run[g] - m_new)
                l_tot[g] = fma(l_tot[g], a, l_run[g] * cc)
                ag, tg = acc[g], acc_tot[g]
                for c in range(d):
                    tg[c] = fma(tg[c], a, ag[c] * cc)
                m_tot[g] = m_new
            seen = True
    for g in range(group):
        o = out[b, i, h0 + g]
        if seen:
            tg = acc_tot[g]
            for c in range(d):
                o[c] = canon(tg[c] / l_tot[g])
            lse[b, i, h0 + g] = canon(m_tot[g] + log(l_tot[g]))
        else:
            o[:] = ZERO
            lse[b, i, h0 + g] = NEG_INF


@njit(parallel=True, cache=True)
def _attend_par(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse):
    bsz, nq = q.shape[:2]
    for task in prange(bsz * nq * kt.shape[1]):
        _attend_task(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, task)


@njit(cache=True)
def _attend_ser(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse):
    bsz, nq = q.shape[:2]
    for task in range(bsz * nq * kt.shape[1]):
        _attend_task(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, task)


@njit(cache=True)
def _keys_by_dim(k, rows, kt):
    """kt[b, h, n, c, i] = k[rows[b, n * kb + i], h, c] (stored values, any dtype; k [R, Hkv, D], e.g.
    a paged cache read in place; kb = kt.shape[-1], the spec's kv_block): each (sequence, kv head)'s
    keys as one [D, kb] tile per block (blocks start at multiples of kb: a split is a multiple of it),
    so a block's scores vectorise over keys and the copy writes one small tile at a time (a [D, K]
    layout writes D streams K floats apart: twice the time at a 4k cache)."""
    bsz, nk = rows.shape
    hkv, d = k.shape[1], k.shape[2]
    kb = kt.shape[4]
    for task in range(bsz * hkv):  # a copy: one thread streams it about as fast as two
        b = task // hkv
        h = task % hkv
        for n in range(kt.shape[2]):
            j0 = n * kb
            w = min(kb, nk - j0)
            for c in range(d):
                dst = kt[b, h, n, c]
                for i in range(w):
                    dst[i] = k[rows[b, j0 + i], h, c]


def _attend(q, k, v, rows, qlen, klen, scale, causal, window, spec):
    """As the reference's attend_padded, with key j of sequence b at row rows[b, j] of k, v [R, Hkv, D]:
    q [b, Q, Hq, D] -> out (q's dtype), lse f32 [b, Q, Hq]."""
    bsz, n_q, hq, d = q.shape
    qpos, qvalid = query_positions(qlen, klen, n_q)
    vis = key_visibility(qpos, qvalid, klen, rows.shape[1], causal, window)
    out = torch.empty((bsz, n_q, hq, d), dtype=F32)
    lse = torch.empty((bsz, n_q, hq), dtype=F32)
    p_mode = P_FP32 if spec.p_precision == "fp32" else _P_MODE.get(q.dtype, P_FP32)
    if out.numel():
        kr, r = raw(k), rows.contiguous().numpy()
        kb = spec.kv_block
        kt = np.empty((bsz, kr.shape[1], -(-r.shape[1] // kb), d, kb), kr.dtype)
        _keys_by_dim(kr, r, kt)
        attend = _attend_par if parallel_worth(out.numel() * vis.shape[-1]) else _attend_ser
        attend(raw(q), kt, raw(v), r, vis.contiguous().numpy(), np.float32(scale), spec.kv_block, spec.kv_split,
               spec.dot_tile, p_mode, out.numpy(), lse.numpy())
    return finish(out, q.dtype), lse


def attend_padded(q, k, v, qlen, klen, scale, causal, window, spec):
    """As the reference's attend_padded: q [b, Q, Hq, D], k, v [b, K, Hkv, D] -> out (q's dtype), lse f32."""
    bsz, nk = k.shape[:2]
    rows = torch.arange(bsz * nk, dtype=torch.int64).reshape(bsz, nk)
    return _attend(q, k.reshape(bsz * nk, *k.shape[2:]), v.reshape(bsz * nk, *v.shape[2:]), rows, qlen, klen,
                   scale, causal, window, spec)


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
    return varlen_via_padded(attend_padded, q, k, v, cu_q, cu_k, scale, causal, window, spec)


def flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window, num_splits, spec):
    """As hal.attention.kvcache_via_padded, but the cache is read in place (kv_rows: the row of each
    cached token) instead of gathered into a padded copy (two copies of the cache cost about as much
    as the decode itself). num_splits changes how a split-KV kernel schedules work, never the bits:
    the splits are merged in the spec's order either way, so this kernel ignores it."""
    bsz, sq = q.shape[:2]
    max_k = int(seqlens_k.max()) if bsz else 0
    rows = kv_rows(k_cache, seqlens_k, block_table, max_k)
    flat = (-1, *k_cache.shape[2:])
    out, lse = _attend(q, k_cache.reshape(flat), v_cache.reshape(flat), rows, torch.full((bsz,), sq, dtype=torch.int64),
                       seqlens_k, scale, causal, window, spec)
    return out, lse.transpose(1, 2).contiguous()
