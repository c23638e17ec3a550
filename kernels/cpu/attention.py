"""Softmax attention under an AttentionSpec (strict), one (sequence, query row, kv head) per task.

The arithmetic is kernels/reference/attention.py's, written per query row: keys in splits of
``kv_split`` anchored at key 0, blocks of ``kv_block`` inside a split; per block the visible
scores' max updates the running max m, p = exp(s - m), the block's l (sum) and acc (fma chain over
keys, per head dim) start from +0.0 and are folded into the split's running l / acc with
alpha = exp(m_prev - m); splits are merged in order. Blocks and splits with no visible key are
skipped (so how many splits a call computes at once, ``num_splits``, never matters: the reference
merges the same splits in the same order). Host-side layout (varlen <-> padded, paged gather,
key visibility) is the shared code in kernels/layout.py.

Speed without touching the order: a task runs all query heads of one kv head's group (GQA/MQA), since
they see the same keys: one visible-key list, and heads in pairs share each load of a key or value
(their chains stay separate). A split's scores are computed in one pass over its keys ([D, kv_split]
key tiles: the keys are independent chains, so the loop over them vectorises), four head dims per
nested fma expression; values go eight keys per nested expression. A nested expression
fma(x3, k3, fma(x2, k2, fma(x1, k1, fma(x0, k0, acc)))) is the chain's own order, one rounding per
step: it only reads and writes the partial once per four steps instead of each step.

The kernel sees float32 only (one compiled body for fp32, bf16 and fp16 instead of one per dtype): q
widened on the host, the keys in their transposing copy, 16-bit values gathered widened; every widening
is exact, so the values, and the bits, are those of the stored inputs.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from hal.kernels.layout import key_visibility, kv_rows, query_positions, varlen_via_rows

from . import pool
from .host import F32, array, finish, raw, wide
from .pool import parallel_worth
from .strict_math import NEG_INF, ZERO, canon, exp, fma, log, nanmax, round_bf16, round_f16, widen

P_FP32, P_BF16, P_FP16 = 0, 1, 2
_P_MODE = {torch.bfloat16: P_BF16, torch.float16: P_FP16}


@njit(inline="always", cache=True)
def _split_scores(qa, qb, two, tile, w, dt, scale, sa, sb, tmp):
    """sa[j] = (qa . k_j) * scale for the split's first w keys (and sb from qb when ``two``: the two
    query heads share each load of the keys), tile [D, >= w] their keys transposed (_keys_by_dim):
    per key the canonical tiled chain over the head dim (tile partials added in order from +0.0).
    Keys are independent chains advanced together, so the loop over a split's keys vectorises (a
    whole split per loop: a block's 64 keys made the loop set-up cost as much as the work); four
    head dims per pass as one nested fma expression (the chain's own order) read and write each
    partial once per four steps."""
    d = qa.shape[0]
    ta, tb = tmp[0], tmp[1]
    for j in range(w):
        sa[j] = ZERO
        sb[j] = ZERO
    for c0 in range(0, d, dt):
        c1 = min(c0 + dt, d)
        for j in range(w):
            ta[j] = ZERO
            tb[j] = ZERO
        c = c0
        while c + 4 <= c1:
            x0, x1, x2, x3 = qa[c], qa[c + 1], qa[c + 2], qa[c + 3]
            y0, y1, y2, y3 = qb[c], qb[c + 1], qb[c + 2], qb[c + 3]
            r0, r1, r2, r3 = tile[c], tile[c + 1], tile[c + 2], tile[c + 3]
            if two:
                for j in range(w):
                    k0, k1, k2, k3 = widen(r0[j]), widen(r1[j]), widen(r2[j]), widen(r3[j])
                    ta[j] = fma(x3, k3, fma(x2, k2, fma(x1, k1, fma(x0, k0, ta[j]))))
                    tb[j] = fma(y3, k3, fma(y2, k2, fma(y1, k1, fma(y0, k0, tb[j]))))
            else:
                for j in range(w):
                    ta[j] = fma(x3, widen(r3[j]), fma(x2, widen(r2[j]), fma(x1, widen(r1[j]),
                                                                              fma(x0, widen(r0[j]), ta[j]))))
            c += 4
        for c in range(c, c1):
            x, y, row = qa[c], qb[c], tile[c]
            for j in range(w):
                k = widen(row[j])
                ta[j] = fma(x, k, ta[j])
                tb[j] = fma(y, k, tb[j])
        for j in range(w):
            sa[j] = sa[j] + ta[j]
            sb[j] = sb[j] + tb[j]
    for j in range(w):
        sa[j] = sa[j] * scale
        sb[j] = sb[j] * scale


@njit(inline="always", cache=True)
def _block_values(v, rows, b, hk, idx, nv, p, b0, acc):
    """acc[c] = chain of fma(p_j, v_j[c], .) over the block's visible keys idx[:nv], in key order: eight
    (then four) keys per pass as one nested fma expression (each acc[c] still one chain, key after
    key), so each partial is read and written once per eight steps."""
    d = acc.shape[0]
    for c in range(d):
        acc[c] = ZERO
    n = 0
    while n + 8 <= nv:
        j0, j1, j2, j3 = idx[n], idx[n + 1], idx[n + 2], idx[n + 3]
        j4, j5, j6, j7 = idx[n + 4], idx[n + 5], idx[n + 6], idx[n + 7]
        p0, p1, p2, p3 = p[j0 - b0], p[j1 - b0], p[j2 - b0], p[j3 - b0]
        p4, p5, p6, p7 = p[j4 - b0], p[j5 - b0], p[j6 - b0], p[j7 - b0]
        v0, v1, v2, v3 = v[rows[b, j0], hk], v[rows[b, j1], hk], v[rows[b, j2], hk], v[rows[b, j3], hk]
        v4, v5, v6, v7 = v[rows[b, j4], hk], v[rows[b, j5], hk], v[rows[b, j6], hk], v[rows[b, j7], hk]
        for c in range(d):
            t = fma(p3, widen(v3[c]), fma(p2, widen(v2[c]), fma(p1, widen(v1[c]), fma(p0, widen(v0[c]), acc[c]))))
            acc[c] = fma(p7, widen(v7[c]), fma(p6, widen(v6[c]), fma(p5, widen(v5[c]), fma(p4, widen(v4[c]), t))))
        n += 8
    while n + 4 <= nv:
        j0, j1, j2, j3 = idx[n], idx[n + 1], idx[n + 2], idx[n + 3]
        p0, p1, p2, p3 = p[j0 - b0], p[j1 - b0], p[j2 - b0], p[j3 - b0]
        v0, v1, v2, v3 = v[rows[b, j0], hk], v[rows[b, j1], hk], v[rows[b, j2], hk], v[rows[b, j3], hk]
        for c in range(d):
            acc[c] = fma(p3, widen(v3[c]), fma(p2, widen(v2[c]), fma(p1, widen(v1[c]), fma(p0, widen(v0[c]), acc[c]))))
        n += 4
    for n in range(n, nv):
        j = idx[n]
        pj = p[j - b0]
        vr = v[rows[b, j], hk]
        for c in range(d):
            acc[c] = fma(pj, widen(vr[c]), acc[c])


@njit(cache=True)  # not inlined: inlined into the range loop it compiled slower
def _attend_task(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, task):
    """One (sequence, query row, kv head) triple: the output rows and lse of the kv head's group of
    query heads. The heads of a group see the same keys, so they share the visible-key list and, in
    pairs, each load of a key tile; each head's chain stays its own. Values are read in place: key j
    of sequence b is row rows[b, j] of v [R, Hkv, D] (a float32 paged cache needs no gather)."""
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
    tw = kt.shape[4]  # keys per tile: the split (or all keys when fewer)
    sc = np.empty((group + 1, tw), np.float32)  # row group: scratch for an odd group's last pair
    p = np.empty(kb, np.float32)
    tmp = np.empty((2, tw), np.float32)
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
        nvis = 0
        for j in range(s0, s1):
            nvis += vrow[j]
        if nvis == 0:  # an empty split changes nothing
            continue
        for g in range(0, group, 2):  # heads in pairs; a lone last head's pair slot is scratch (row group)
            _split_scores(qv[g], qv[min(g + 1, group - 1)], g + 1 < group, kth[s0 // ks], s1 - s0, dt, scale,
                          sc[g], sc[g + 1], tmp)
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
                sg, pg = sc[g], p
                m_blk = NEG_INF
                for n in range(nv):
                    m_blk = nanmax(m_blk, sg[idx[n] - s0])
                m_new = nanmax(m_run[g], m_blk)  # running max after this block (cummax)
                for j in range(b0, b1):  # every key (branch-free, vectorises); only visible ones are used
                    pg[j - b0] = exp(sg[j - s0] - m_new)
                l_blk = ZERO
                for n in range(nv):
                    l_blk = l_blk + pg[idx[n] - b0]
                if p_mode == P_BF16:
                    for j in range(b1 - b0):
                        pg[j] = round_bf16(pg[j])
                elif p_mode == P_FP16:
                    for j in range(b1 - b0):
                        pg[j] = round_f16(pg[j])
                _block_values(v, rows, b, hk, idx, nv, p, b0, acc_blk)
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


@njit(nogil=True, cache=True)
def _attend_tasks(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, work):
    """Tasks claimed from ``work`` (pool.run runs it on several threads; one compiled kernel for every thread count)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            _attend_task(q, kt, v, rows, vis, scale, kb, ks, dt, p_mode, out, lse, task)
        lo, hi = pool.claim(work)


@njit(cache=True)
def _keys_by_dim(k, rows, kt):
    """kt[b, h, n, c, i] = k[rows[b, n * tw + i], h, c] widened to float32 (k [R, Hkv, D] of any dtype, e.g.
    a paged cache read in place; tw = kt.shape[-1], the spec's kv_split or all keys when fewer): each
    (sequence, kv head)'s keys as one [D, tw] tile per split, so a split's scores vectorise over its
    keys and the copy writes one tile at a time (a [D, K] layout writes D streams K floats apart:
    twice the time at a 4k cache)."""
    bsz, nk = rows.shape
    hkv, d = k.shape[1], k.shape[2]
    tw = kt.shape[4]
    for task in range(bsz * hkv):  # a copy: one thread streams it about as fast as two
        b = task // hkv
        h = task % hkv
        for n in range(kt.shape[2]):
            j0 = n * tw
            w = min(tw, nk - j0)
            for c in range(d):
                dst = kt[b, h, n, c]
                for i in range(w):
                    dst[i] = widen(k[rows[b, j0 + i], h, c])


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
        kr, r = raw(k), array(rows.contiguous())
        tw = max(1, min(spec.kv_split, r.shape[1]))  # splits start at multiples of kv_split
        kt = np.empty((bsz, kr.shape[1], -(-r.shape[1] // tw), d, tw), np.float32)
        _keys_by_dim(kr, r, kt)
        if v.dtype is not F32:  # widened (exactly): same values, one compiled body for all dtypes
            if v.shape[0] <= r.size:  # packed values (varlen): no more rows than are read, widened as they are
                v = v.to(F32)
            else:  # a cache larger than what is read: the rows read, gathered
                v = v[rows.reshape(-1)].to(F32)
                r = np.arange(r.size, dtype=np.int64).reshape(r.shape)
        pool.run(_attend_tasks, bsz * n_q * kr.shape[1], wide(q), kt, raw(v), r, array(vis.contiguous()),
                 np.float32(scale), spec.kv_block, spec.kv_split, spec.dot_tile, p_mode, array(out), array(lse),
                 parallel=parallel_worth(out.numel() * vis.shape[-1]))
    return finish(out, q.dtype), lse


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
    """The packed keys and values are read in place through their rows (no padded copy of either)."""
    return varlen_via_rows(_attend, q, k, v, cu_q, cu_k, scale, causal, window, spec)


def flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window, num_splits, spec):
    """As hal.kernels.layout.kvcache_via_padded, but the cache is read in place (kv_rows: the row of each
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
