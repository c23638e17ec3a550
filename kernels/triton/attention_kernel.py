"""Strict softmax attention kernels in Triton: ``AttentionSpec`` bits (kernels/reference/attention.py),
fast layout; launched by kernels/triton/attention.py (``attend``: tiles, grid, split workspace).

One program owns (row tile, sequence x head group) and either every split of its keys (splits
merged in-kernel, in split order) or, for split-KV decoding, one split (``num_splits`` > 1: the
partials go to a workspace and :func:`_merge_kernel` merges them in split order). A tile row is a
(query row, query head) pair: ``PACK`` heads of one GQA group share the tile (row r is query row
pid_m * ROWS + r // PACK of head group * PACK + r % PACK), so decode loads each K/V tile once for
the whole group; PACK = 1 is one head per program (prefill). The spec's reduction orders are the
loops here:

* score s_j = tiled dot over the head dim (a sequential fma chain from +0.0 per ``dot_tile``
  tile, tile partials added in order from +0.0), then one multiply by float32(scale);
* per block of ``kv_block`` keys: m' = max(m, block max over visible keys) (exact),
  p_j = exp(s_j - m'), l_blk and acc_blk sequential chains in key order over visible keys;
  l = fma(l, alpha, l_blk), acc = fma(acc, alpha, acc_blk) for a block with a visible key;
* split partials merged in split order; out = ACC / L (``div_rn``), lse = M + log(L).

Keys no row of the tile sees (before the window, after the causal diagonal or the sequence) are
never loaded: skipping them is exact because the spec skips invisible keys by select. Rows are
independent (each keeps its own q, out, lse, workspace offsets and visibility), so the row tile,
the head packing and the grid are speed knobs only.

The sequential chains need one score column per key; it is taken out of the [rows, keys] tile
by an integer sum of its bit patterns with every other column zeroed (exact, order-free), never
by a float reduction. Decode-sized tiles (the launcher's ``_score_layout``) take p = exp(s - m')
for the whole tile before the key loop (elementwise: the same operation per element) and extract
p; each key's V row offset comes from its index (paged: one block-table load), not from the tile.

Score chains: on the GPU, decode-sized tiles give each thread one key and load VEC = 16 bytes of
consecutive head dims of k (and of each row's q) per vector load, then run them through the chains
in head-dim order (``common.eight`` / ``four``: moves inside the thread); prefill tiles and the
Ascend variant (no ``tl.split``) load one head dim per step. Same operations, same order.

Both kernels are persistent (``launch(..., persistent=True)``): the logical grid (row tile, sequence x
head group[, split]) is flattened into work items, one per program on CUDA, at most the core count for the
Ascend variant, which also takes the NPU substitutes (division, log, fp16 rounding) and, through
the launcher's ``_tiles``, row tiles (packed heads counted) that fit the unified buffer.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import common, strict_math as sm
from .attention_tiles import (_empty_state, _finish, _key_offsets, _key_range, _merge, _q_offsets, _rows,
                              _store_partial, _visible, _work_item, _ws_offsets)


@triton.jit
def _round_trip(x, OUT: tl.constexpr, NPU: tl.constexpr):
    """x rounded to the input dtype and widened back exactly (p_precision "input")."""
    if OUT == tl.float32:
        return x
    else:
        return sm.widen(sm.round_out(x, OUT, NPU))


@triton.jit
def _col(x_bits, cols, j):
    """Column j of an int32 tile (bit patterns) as float32: exact, whatever the sum order."""
    return tl.sum(tl.where(cols[None, :] == j, x_bits, 0), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _dot_tile_elementwise(Q, K, q_off, valid, koff, kmask, t0: tl.constexpr, t1: tl.constexpr,
                          BLOCK_M: tl.constexpr, KB: tl.constexpr):
    """[rows, keys] chain from +0.0 over head dims [t0, t1): one element of q and of each key per step
    (prefill tiles and the Ascend variant: no tl.split)."""
    part = tl.zeros([BLOCK_M, KB], tl.float32)
    for d in range(t0, t1):
        qd = sm.widen(tl.load(Q + q_off + d, mask=valid, other=0.0))
        kd = sm.widen(tl.load(K + koff + d, mask=kmask, other=0.0))
        part = tl.fma(qd[:, None], kd[None, :], part)
    return part


@triton.jit
def _fma_vector(part, q, k, n: tl.constexpr, BLOCK_M: tl.constexpr, QK: tl.constexpr, KB: tl.constexpr,
                VEC: tl.constexpr):
    """The first n (static) steps of the chains part [rows, keys] over one vector of head dims: q [rows, QK, VEC]
    (each row's q: QK 1, broadcast across keys, or the same for every key), k [1, keys, VEC], in element order
    (common.eight / four: moves inside a thread)."""
    if VEC == 8:
        q0, q1, q2, q3, q4, q5, q6, q7 = common.eight(q, BLOCK_M, QK)
        k0, k1, k2, k3, k4, k5, k6, k7 = common.eight(k, 1, KB)
        part = common.fma_steps(part, q0, q1, q2, q3, k0, k1, k2, k3, 0 < n, 1 < n, 2 < n, 3 < n)
        part = common.fma_steps(part, q4, q5, q6, q7, k4, k5, k6, k7, 4 < n, 5 < n, 6 < n, 7 < n)
    else:
        q0, q1, q2, q3 = common.four(q, BLOCK_M, QK)
        k0, k1, k2, k3 = common.four(k, 1, KB)
        part = common.fma_steps(part, q0, q1, q2, q3, k0, k1, k2, k3, 0 < n, 1 < n, 2 < n, 3 < n)
    return part


@triton.jit
def _dot_tile_vectors(Q, K, q_off, valid, koff, kmask, t0: tl.constexpr, t1: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, KB: tl.constexpr, VEC: tl.constexpr, QB: tl.constexpr):
    """The same chain as :func:`_dot_tile_elementwise`, fed VEC consecutive head dims (16 bytes) per vector
    load: k as [1, keys, VEC] (keys across threads, each chain in the thread that loads its key), q as [rows, 1,
    VEC], each row's vector once, which the chains broadcast across keys. A vector that runs past t1 only feeds the
    tile's steps (its last elements belong to the next tile); only a vector past D masks elements, so full vectors
    keep a mask that is constant along them. The caller's ``valid`` must depend on the key block (see _split), or
    the compiler hoists every row's q out of the key loop and spills it.

    QB (attention.Q_BROADCAST_LOAD, the earlier kernel): q loaded as [rows, keys, VEC] with the same address along
    keys. Triton 3.6's coalescing gives such a load's threads to rows, and every step converted q to the chains'
    layout through shared memory (sm_90: 434 / 306 shared-memory instructions, 340 / 276 barriers, bf16 / fp32)."""
    e = tl.arange(0, VEC)[None, None, :]
    if QB:
        q_row = Q + q_off[:, None, None] + tl.zeros([1, KB, 1], tl.int64)
        q_lane = valid[:, None, None] & kmask[None, :, None]
    else:
        q_row = Q + q_off[:, None, None]
        q_lane = valid[:, None, None]
    k_row = K + koff[None, :, None]
    part = tl.zeros([BLOCK_M, KB], tl.float32)
    for c in tl.static_range(t0, t1, VEC):
        q_ok, k_ok = q_lane, kmask[None, :, None]
        if c + VEC > D:
            q_ok = q_ok & (c + e < D)
            k_ok = k_ok & (c + e < D)
        q = sm.widen(tl.load(q_row + c + e, mask=q_ok, other=0.0))
        k = sm.widen(tl.load(k_row + c + e, mask=k_ok, other=0.0))
        part = _fma_vector(part, q, k, t1 - c, BLOCK_M, KB if QB else 1, KB, VEC)
    return part


@triton.jit
def _scores(Q, K, q_off, valid, koff, kmask, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, KB: tl.constexpr,
            DT: tl.constexpr, VEC: tl.constexpr, NPU: tl.constexpr, QB: tl.constexpr):
    """[rows, keys] scores: the tiled dot over the head dim (tile partials added in order from +0.0; the last
    tile is short when DT does not divide D), then one multiply by scale."""
    s = tl.zeros([BLOCK_M, KB], tl.float32)
    for t0 in tl.static_range(0, D, DT):
        if NPU:  # the Ascend variant: no tl.split (its own branch: ascend_lint follows 'if NPU:')
            part = _dot_tile_elementwise(Q, K, q_off, valid, koff, kmask, t0, min(t0 + DT, D), BLOCK_M, KB)
        elif VEC == 1:
            part = _dot_tile_elementwise(Q, K, q_off, valid, koff, kmask, t0, min(t0 + DT, D), BLOCK_M, KB)
        else:
            part = _dot_tile_vectors(Q, K, q_off, valid, koff, kmask, t0, min(t0 + DT, D), D, BLOCK_M,
                                     KB, VEC, QB)
        s = s + part
    return s * scale


@triton.jit
def _scores_fma_dot(Q, K, q_off, valid, koff, kmask, scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    KB: tl.constexpr, DT: tl.constexpr, DTP: tl.constexpr, DK: tl.constexpr):
    """:func:`_scores`' bits with float32 ``ieee`` tl.dots per head-dim tile (NVIDIA: an fma chain per score over the
    tile's head dims in order, from the zero accumulator: the spec's in-tile chain), on [rows, DK] x [DK, keys] operand
    tiles instead of one scalar load per step. A tile's chain runs through one dot per DK head dims, each continuing
    the last one's accumulator (the same fma steps in the same order as one dot over the tile; DK = DTP is one dot per
    tile): the FMA lowering holds a dot's operands of all its K lanes in registers, so narrower dots keep the tile
    free of spills. A lane past the tile or past D is a padded step and adds a product equal to -0.0 (q -0.0 by
    sm.neg_zero_where, k +0.0): fma(-0, +0, c) = c for every c, where a +0.0 product would turn a chain at -0.0
    into +0.0. Tile partials are added in order from +0.0 by tl.fma(part, 1.0, s): s + part rounded once, and not
    an addf that Triton could fold into the next dot's accumulator."""
    dd = tl.arange(0, DK)
    s = tl.zeros([BLOCK_M, KB], tl.float32)
    for t0 in tl.static_range(0, D, DT):
        part = tl.zeros([BLOCK_M, KB], tl.float32)
        for c in tl.static_range(0, min(DT, D - t0), DK):  # the tile's lanes, DK per dot
            d = t0 + c + dd
            d_ok = (c + dd < DT) & (d < D)
            q_ok = valid[:, None] & d_ok[None, :]
            q = sm.neg_zero_where(q_ok, sm.widen(tl.load(Q + q_off[:, None] + d[None, :], mask=q_ok, other=0.0)))
            k = sm.widen(tl.load(K + koff[None, :] + d[:, None], mask=d_ok[:, None] & kmask[None, :], other=0.0))
            part = tl.dot(q, k, part, input_precision="ieee")
        s = tl.fma(part, 1.0, s)
    return s * scale


@triton.jit
def _key_chunk(x, c: tl.constexpr, BLOCK_M: tl.constexpr, NC: tl.constexpr, KC: tl.constexpr):
    """Keys [c KC, (c + 1) KC) of a float32 [rows, NC KC] tile, exactly: an integer sum of bit patterns with one
    non-zero term per element (order-free), as :func:`_col`."""
    if NC == 1:
        return x
    else:
        bits = tl.reshape(x.to(tl.int32, bitcast=True), [BLOCK_M, NC, KC])
        pick = tl.arange(0, NC)[None, :, None] == c
        return tl.sum(tl.where(pick, bits, 0), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _block_fma_dot(V, p, valid, pos0, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, causal, left,
                   right, kb0, k_lo, k_hi, OUT: tl.constexpr, P_IN: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr, DK: tl.constexpr,
                   PAGED: tl.constexpr, NPU: tl.constexpr):
    """(l_blk, acc_blk) of a block whose keys each are seen by every valid row or by none, as float32 ``ieee``
    tl.dots from zero accumulators: acc_blk = P.V and l_blk = P.1 are fma chains over the keys in order (fma(p, 1, l)
    is l + p rounded once: the spec's sum). The chains run through one dot per DK keys, each continuing the last
    one's accumulator (as in :func:`_scores_fma_dot`; DK = KB is one dot per block): p's keys are taken out of the
    tile exactly (:func:`_key_chunk`), each chunk's V rows loaded by their own offsets. So a key is seen by the valid
    rows iff row 0 (valid in every running tile) sees it. A key no row sees must leave the chains as they are: its p
    is exactly +0.0 and its V row is not read (-0.0 by sm.neg_zero_where), so it adds +0 * -0 = -0.0 (and +0 * 1 =
    +0 to l, which is never -0.0: a sum of p >= 0 from +0.0). Its V row's values never reach the product, so a NaN /
    inf there cannot leak (0 * inf); a seen key's product is the spec's, whatever its values."""
    NC: tl.constexpr = KB // DK
    dcol = tl.arange(0, BLOCK_D)
    jj = tl.arange(0, DK)
    acc_blk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l16 = tl.zeros([BLOCK_M, 16], tl.float32)
    ones = tl.full([DK, 16], 1.0, tl.float32)
    for c in tl.static_range(NC):  # keys in order, DK per dot
        kj = kb0 + c * DK + jj
        on = _visible(kj, pos0, True, klen, causal, left, right) & (kj >= k_lo) & (kj < k_hi)  # => kj < klen
        koff = _key_offsets(kj, on, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED) + hk_off
        pz = tl.where(valid[:, None] & on[None, :], _key_chunk(p, c, BLOCK_M, NC, DK), 0.0)
        pv = _round_trip(pz, OUT, NPU) if P_IN else pz
        v_ok = on[:, None] & (dcol[None, :] < D)
        v = sm.neg_zero_where(v_ok, sm.widen(tl.load(V + koff[:, None] + dcol[None, :], mask=v_ok, other=0.0)))
        acc_blk = tl.dot(pv, v, acc_blk, input_precision="ieee")
        l16 = tl.dot(pz, ones, l16, input_precision="ieee")
    l_blk = _col(l16.to(tl.int32, bitcast=True), tl.arange(0, 16), 0)
    return l_blk, acc_blk


@triton.jit
def _block_chains(V, x_bits, m_new, pos, valid, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt,
                  causal, left, right, kb0, k_lo, k_hi, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, KB: tl.constexpr, VEC: tl.constexpr, P_IN: tl.constexpr, OUT: tl.constexpr,
                  PAGED: tl.constexpr, NPU: tl.constexpr):
    """(l_blk, acc_blk) of the block's keys in [k_lo, k_hi) as the spec's per-key chains (x_bits: the scores' bits,
    or decode tiles' p = exp(s - m'))."""
    cols = tl.arange(0, KB)
    dcol = tl.arange(0, BLOCK_D)
    l_blk = tl.zeros([BLOCK_M], tl.float32)
    acc_blk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    j_lo = tl.maximum(k_lo - kb0, 0)
    j_hi = tl.minimum(k_hi - kb0, KB)
    for j in range(j_lo, j_hi):  # keys in order: sequential chains
        kjj = kb0 + j  # < k_hi <= klen
        vis_j = _visible(kjj, pos, valid, klen, causal, left, right)
        p = sm.exp(_col(x_bits, cols, j) - m_new) if NPU or VEC == 1 else _col(x_bits, cols, j)
        l_blk = tl.where(vis_j, l_blk + p, l_blk)
        pv = _round_trip(p, OUT, NPU) if P_IN else p
        # this key's V row from its index (not taken out of koff: the load need not wait on a reduction)
        voff = _key_offsets(kjj, kjj < klen, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED) + hk_off
        vj = sm.widen(tl.load(V + voff + dcol[None, :], mask=dcol[None, :] < D, other=0.0))
        acc_blk = tl.where(vis_j[:, None], tl.fma(pv[:, None], vj, acc_blk), acc_blk)
    return l_blk, acc_blk


@triton.jit
def _split(Q, K, V, q_off, valid, pos, pos0, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt,
           scale, causal, left, right, k_lo, k_hi,
           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
           DT: tl.constexpr, VEC: tl.constexpr, P_IN: tl.constexpr, OUT: tl.constexpr, PAGED: tl.constexpr,
           NPU: tl.constexpr, FMA_DOT: tl.constexpr, DTP: tl.constexpr, DK: tl.constexpr, QB: tl.constexpr):
    """(m, l, acc, nonempty) of the keys [k_lo, k_hi) of one split, blocks of KB anchored at key 0.

    FMA_DOT (prefill tiles on NVIDIA, launch.fma_dot): scores by :func:`_scores_fma_dot`, and a block whose keys
    are each seen by all valid rows or by none (all but the few blocks on a causal diagonal or a window edge) by
    :func:`_block_fma_dot`; the other blocks keep the per-key chains (a key seen by some rows only would need a V
    row of -0.0 for the others)."""
    cols = tl.arange(0, KB)
    m, l, acc, ne = _empty_state(BLOCK_M, BLOCK_D)
    for kb0 in range((k_lo // KB) * KB, k_hi, KB):
        kj = kb0 + cols
        kmask = kj < klen
        koff = _key_offsets(kj, kmask, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED) + hk_off
        if NPU:  # Ascend: the explicit chains (a dot would run on the cube unit; ascend_lint follows 'if NPU:')
            s = _scores(Q, K, q_off, valid, koff, kmask, scale, D, BLOCK_M, KB, DT, VEC, NPU, QB)
        elif FMA_DOT:
            s = _scores_fma_dot(Q, K, q_off, valid, koff, kmask, scale, D, BLOCK_M, KB, DT, DTP, min(DK, DTP))
        elif VEC > 1 and not QB:
            # decode tiles' q rows masked by "the block holds a key of the sequence" (true in every block the loop
            # runs): the loads stay in the chain loop, where hoisted out of the key loop every row's q would spill. A
            # reduction over the block's keys, not klen > kb0, which left 16-24 B of stack in two variants under 3.6;
            # a select: the interpreter makes valid & (a scalar comparison) an int32 mask
            q_valid = tl.where(tl.sum(kmask.to(tl.int32), axis=0) > 0, valid, False)
            s = _scores(Q, K, q_off, q_valid, koff, kmask, scale, D, BLOCK_M, KB, DT, VEC, NPU, QB)
        else:
            s = _scores(Q, K, q_off, valid, koff, kmask, scale, D, BLOCK_M, KB, DT, VEC, NPU, QB)
        vis = _visible(kj[None, :], pos[:, None], valid[:, None], klen, causal, left, right)
        m_new = tl.maximum(m, tl.max(tl.where(vis, s, float("-inf")), axis=1))
        blk_ne = tl.max(vis.to(tl.int32), axis=1)
        # p_j = exp(s_j - m'): decode tiles take it for every key at once, out of the key loop (elementwise: the
        # same operation per element as per column); prefill tiles (registers) and the Ascend variant (unified
        # buffer: no [rows, keys] exp temporaries) per key
        x_bits = (s if NPU or VEC == 1 else sm.exp(s - m_new[:, None])).to(tl.int32, bitcast=True)
        if NPU:
            l_blk, acc_blk = _block_chains(V, x_bits, m_new, pos, valid, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                                           stride_kp, stride_kt, causal, left, right, kb0, k_lo, k_hi, D, BLOCK_M,
                                           BLOCK_D, KB, VEC, P_IN, OUT, PAGED, NPU)
        elif FMA_DOT:
            vis_s = vis & (kj[None, :] >= k_lo) & (kj[None, :] < k_hi)  # the split's keys only
            seen_any = tl.max(vis_s.to(tl.int32), axis=0)
            seen_all = tl.min((vis_s | ~valid[:, None]).to(tl.int32), axis=0)
            if tl.min((seen_any == seen_all).to(tl.int32), axis=0) > 0:  # every key: seen by all valid rows or none
                l_blk, acc_blk = _block_fma_dot(V, sm.exp(s - m_new[:, None]), valid, pos0, klen, b, hk_off, K_ROW0,
                                                BT, bt_stride, page, stride_kp, stride_kt, causal, left, right, kb0,
                                                k_lo, k_hi, OUT, P_IN, D, BLOCK_M, BLOCK_D, KB, min(DK, KB), PAGED,
                                                NPU)
            else:
                l_blk, acc_blk = _block_chains(V, x_bits, m_new, pos, valid, klen, b, hk_off, K_ROW0, BT, bt_stride,
                                               page, stride_kp, stride_kt, causal, left, right, kb0, k_lo, k_hi, D,
                                               BLOCK_M, BLOCK_D, KB, VEC, P_IN, OUT, PAGED, NPU)
        else:
            l_blk, acc_blk = _block_chains(V, x_bits, m_new, pos, valid, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                                           stride_kp, stride_kt, causal, left, right, kb0, k_lo, k_hi, D, BLOCK_M,
                                           BLOCK_D, KB, VEC, P_IN, OUT, PAGED, NPU)
        alpha = sm.exp(m - m_new)
        has = blk_ne > 0
        l = tl.where(has, tl.fma(l, alpha, l_blk), l)
        acc = tl.where(has[:, None], tl.fma(acc, alpha[:, None], acc_blk), acc)
        m = m_new
        ne = ne | blk_ne
    return m, l, acc, ne


@triton.jit(do_not_specialize=["n_ws_rows", "n_work", "n1", "n2"])  # counts that change per call: no recompiles
def _attn_kernel(Q, K, V, O, LSE, WM, WL, WA, WN,
                 Q_ROW0, QLEN, KLEN, K_ROW0, BT, LSE_ROW0,
                 stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_lh, bt_stride, page,
                 scale, causal, left, right, n_ws_rows, n_ws_splits, n_work, n1, n2,
                 HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 ROWS: tl.constexpr, PACK: tl.constexpr,
                 BLOCK_D: tl.constexpr, KB: tl.constexpr, KS: tl.constexpr, DT: tl.constexpr, VEC: tl.constexpr,
                 P_IN: tl.constexpr, OUT: tl.constexpr, PAGED: tl.constexpr, ONE_SPLIT: tl.constexpr,
                 NPU: tl.constexpr, FMA_DOT: tl.constexpr = False, DTP: tl.constexpr = 16, DK: tl.constexpr = 16,
                 QB: tl.constexpr = False):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        pid_m, bg, b, g = _work_item(item, n1, n2, HQ // PACK)  # grid (row tile, sequence x head group, split)
        i, h, valid, pos, qlen, klen = _rows(pid_m, b, g, QLEN, KLEN, ROWS, PACK, BLOCK_M)
        if pid_m * ROWS < qlen:
            q_off = _q_offsets(Q_ROW0, b, i, h, stride_qt, stride_qh)
            qr_off = q_off  # where rows read q (out and lse go to q_off)
            pos0 = klen - qlen + pid_m * ROWS  # row 0's position (row 0 is valid in every running tile)
            hk_off = ((g * PACK) // GROUP).to(tl.int64) * stride_kh  # the group's kv head (PACK divides GROUP)
            lo, hi = _key_range(pid_m, qlen, klen, causal, left, right, ROWS)
            if ONE_SPLIT:
                sp = item % n2
                s_lo = tl.maximum(lo, sp * KS)
                s_hi = tl.minimum(hi, (sp + 1) * KS)
                m, l, acc, ne = _split(Q, K, V, qr_off, valid, pos, pos0, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                                       stride_kp, stride_kt, scale, causal, left, right, s_lo, s_hi,
                                       D, BLOCK_M, BLOCK_D, KB, DT, VEC, P_IN, OUT, PAGED, NPU, FMA_DOT, DTP, DK, QB)
                _store_partial(WM, WL, WA, WN, _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits), valid,
                               m, l, acc, ne, BLOCK_D)
            else:
                M, L, ACC, seen = _empty_state(BLOCK_M, BLOCK_D)
                for s0 in range((lo // KS) * KS, hi, KS):
                    m, l, acc, ne = _split(Q, K, V, qr_off, valid, pos, pos0, klen, b, hk_off, K_ROW0, BT, bt_stride,
                                           page, stride_kp, stride_kt, scale, causal, left, right,
                                           tl.maximum(lo, s0), tl.minimum(hi, s0 + KS),
                                           D, BLOCK_M, BLOCK_D, KB, DT, VEC, P_IN, OUT, PAGED, NPU, FMA_DOT, DTP, DK,
                                           QB)
                    M, L, ACC, seen = _merge(M, L, ACC, seen, m, l, acc, ne)
                lse_off = tl.load(LSE_ROW0 + b).to(tl.int64) + h * stride_lh + i
                _finish(O, LSE, q_off, lse_off, valid, M, L, ACC, seen, D, BLOCK_D, OUT, NPU)


@triton.jit(do_not_specialize=["n_ws_rows", "n_work", "n1"])  # counts that change per call: no recompiles
def _merge_kernel(O, LSE, WM, WL, WA, WN, Q_ROW0, QLEN, KLEN, LSE_ROW0,
                  stride_qt, stride_qh, stride_lh, n_ws_rows, n_ws_splits, n_work, n1,
                  HQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                  PACK: tl.constexpr, BLOCK_D: tl.constexpr, KS: tl.constexpr, OUT: tl.constexpr,
                  NPU: tl.constexpr):
    """Merge the split partials of a row tile in split order and write out / lse (the attention kernel's
    tile rows: (query row, head) pairs). Only the sequence's own splits are read: a split past its klen keys
    holds no key (nonempty 0), and merging it is an exact no-op, so the workspace's other slots (sized for the
    longest sequence) are skipped."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        pid_m, bg, b, g = _work_item(item, n1, 1, HQ // PACK)  # logical grid (row tile, sequence x head group)
        i, h, valid, pos, qlen, klen = _rows(pid_m, b, g, QLEN, KLEN, ROWS, PACK, BLOCK_M)
        if pid_m * ROWS < qlen:
            dcol = tl.arange(0, BLOCK_D)
            M, L, ACC, seen = _empty_state(BLOCK_M, BLOCK_D)
            n_own = tl.minimum(n_ws_splits, (klen + KS - 1) // KS)
            for sp in tl.range(0, n_own, num_stages=common.STAGES):  # in split order
                w = _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits)
                m = tl.load(WM + w, mask=valid, other=float("-inf"))
                l = tl.load(WL + w, mask=valid, other=0.0)
                ne = tl.load(WN + w, mask=valid, other=0)
                acc = tl.load(WA + w[:, None] * BLOCK_D + dcol[None, :], mask=valid[:, None], other=0.0)
                M, L, ACC, seen = _merge(M, L, ACC, seen, m, l, acc, ne)
            q_off = _q_offsets(Q_ROW0, b, i, h, stride_qt, stride_qh)
            lse_off = tl.load(LSE_ROW0 + b).to(tl.int64) + h * stride_lh + i
            _finish(O, LSE, q_off, lse_off, valid, M, L, ACC, seen, D, BLOCK_D, OUT, NPU)
