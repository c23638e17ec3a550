"""Softmax attention under FastAttentionSpec: Q.K^T and P.V on tensor cores (``tl.dot``), structure fixed by the spec.

The program layout, paging, GQA, visibility and split workspace are the strict kernel's (attention_tiles.py),
and so is the host side (kernels/triton/attention.py: ``attend`` launches this kernel when the spec is fast); so
are the split merge (in split order, whatever ``num_splits``) and the finish (division, lse, rounding, canonical NaN):
they are per-row float32 steps, cheap next to the two dots. What this file changes is the block step:

* S = tl.dot(Q, K^T) from +0.0 (head dim zero-padded to a power of two >= 16), times float32(scale);
* a row's state (m, l, acc) changes only in a block where it sees a key (else an exact skip), so which
  blocks a row *tile* visits (it depends on its neighbours, hence on chunking) never reaches a row's bits;
* m' = max over the row's visible finite scores (exact); p = tl.exp(S - m') (vendor exp: fast), 0 for
  other keys; l = l * alpha + tl.sum(p); acc = tl.dot(p in the input dtype, V, acc * alpha);
* non-finite inputs: a visible non-finite score or a visible key with a non-finite V row poisons the row
  (l = NaN, so out and lse are the canonical NaN); V rows of invisible keys are zeroed where not finite,
  so 0 * inf never leaks into a row that cannot see that key.

Two codes compute that step (issue 49): the general one (:func:`_general_blocks`, every mask and finiteness test per
element) and, for prefill-sized tiles, the plain flash step (:func:`_interior_blocks`) on the run of blocks that every
valid row sees in full and in which no score can be non-finite or overflow (a pre-pass over K and V,
:func:`_key_bound_kernel`, and the tile's max |q| bound that), where each select of the general step is an identity.
The bits are the general step's in every case; ``FAST_BLOCK_PATH`` keeps the kernel before selectable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tiles import (_empty_state, _finish, _key_offsets, _key_range, _merge, _q_offsets, _rows,
                              _store_partial, _visible, _work_item, _ws_offsets)
from .launch import launch, next_power_of_2
from .workspace import workspace


@triton.jit
def _split_end(M, L, ACC, seen, m, l, acc, ne, bad, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Close a split: rows that saw a non-finite value get l = NaN, the partial is merged into (M, L, ACC) in split
    order (the spec's merge; an empty partial is an exact no-op), and the next split starts empty."""
    M, L, ACC, seen = _merge(M, L, ACC, seen, m, tl.where(bad > 0, float("nan"), l), acc, ne)
    m, l, acc, ne = _empty_state(BLOCK_M, BLOCK_D)
    return M, L, ACC, seen, m, l, acc, ne, tl.zeros([BLOCK_M], tl.int32)


@triton.jit
def _general_blocks(M, L, ACC, seen, m, l, acc, ne, bad, q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT,
                    bt_stride, page, stride_kp, stride_kt, scale, causal, left, right, k_lo, k_hi, b_lo, b_hi,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
                    KS: tl.constexpr, PAGED: tl.constexpr, FLAT: tl.constexpr):
    """The spec's block step for any block: key blocks starting at b_lo, b_lo + KB, ... < b_hi of keys [k_lo, k_hi),
    each key masked by visibility and every score and V row tested for finiteness (the edge blocks' step, and every
    block's where a non-finite or overflowing value may occur). FLAT: the blocks may cross split boundaries, where
    the split partial is closed (:func:`_split_end`); a block never crosses one (KS is a multiple of KB), so masking
    by [k_lo, k_hi) is masking by the split's keys."""
    cols = tl.arange(0, KB)
    dcol = tl.arange(0, BLOCK_D)
    for kb0 in range(b_lo, b_hi, KB):
        if FLAT:
            if kb0 % KS == 0:
                M, L, ACC, seen, m, l, acc, ne, bad = _split_end(M, L, ACC, seen, m, l, acc, ne, bad, BLOCK_M, BLOCK_D)
        kj = kb0 + cols
        kmask = kj < klen
        koff = _key_offsets(kj, kmask, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED) + hk_off
        kv_mask = kmask[:, None] & (dcol[None, :] < D)
        k = tl.load(K + koff[:, None] + dcol[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + koff[:, None] + dcol[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        vis = _visible(kj[None, :], pos[:, None], valid[:, None], klen, causal, left, right)
        vis = vis & (kj[None, :] >= k_lo) & (kj[None, :] < k_hi)
        v_fin = (v == v) & (tl.abs(v.to(tl.float32)) < float("inf"))
        v_bad = tl.max((~v_fin).to(tl.int32), axis=1)  # [KB]: key's V row holds NaN/inf
        v = tl.where(v_fin, v, 0.0)
        ok = vis & (s == s) & (tl.abs(s) < float("inf"))
        bad = bad | tl.max(((vis & ~ok) | (vis & (v_bad[None, :] > 0))).to(tl.int32), axis=1)
        blk_ne = tl.max(vis.to(tl.int32), axis=1)
        has = tl.max(ok.to(tl.int32), axis=1) > 0
        m_new = tl.maximum(m, tl.max(tl.where(ok, s, float("-inf")), axis=1))
        m_safe = tl.where(has, m_new, 0.0)
        p = tl.where(ok, tl.exp(s - m_safe[:, None]), 0.0)
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        l_new = l * alpha + tl.sum(p, axis=1)
        acc_new = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        l = tl.where(has, l_new, l)
        acc = tl.where(has[:, None], acc_new, acc)
        m = tl.where(has, m_new, m)
        ne = ne | blk_ne
    return M, L, ACC, seen, m, l, acc, ne, bad


@triton.jit
def _interior_blocks(M, L, ACC, seen, m, l, acc, ne, bad, q, K, V, valid, b, hk_off, K_ROW0, BT, bt_stride, page,
                     stride_kp, stride_kt, scale, b_lo, b_hi, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, KB: tl.constexpr, KS: tl.constexpr, PAGED: tl.constexpr,
                     FLAT: tl.constexpr):
    """The same step for interior blocks [b_lo, b_hi) (KB-aligned): every key of such a block exists, lies in the
    tile's key range and is visible to every valid row, and its scores and V rows are known finite (the key bounds,
    see :func:`_interior_run`), so the general step's selects are identities: ok = vis = (row valid), has = valid,
    m_safe = m', where(v_fin, v, 0) = v, nothing sets bad. What is left is the plain flash step, bit for bit the
    general one for the valid rows (padding rows compute values nobody stores). V goes to the dot as loaded."""
    cols = tl.arange(0, KB)
    dcol = tl.arange(0, BLOCK_D)
    row_ne = valid.to(tl.int32)
    for kb0 in range(b_lo, b_hi, KB):
        if FLAT:
            if kb0 % KS == 0:
                M, L, ACC, seen, m, l, acc, ne, bad = _split_end(M, L, ACC, seen, m, l, acc, ne, bad, BLOCK_M, BLOCK_D)
        kj = kb0 + cols
        koff = _key_offsets(kj, kj >= 0, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED) + hk_off
        if D == BLOCK_D:
            k = tl.load(K + koff[:, None] + dcol[None, :])
            v = tl.load(V + koff[:, None] + dcol[None, :])
        else:
            k = tl.load(K + koff[:, None] + dcol[None, :], mask=dcol[None, :] < D, other=0.0)
            v = tl.load(V + koff[:, None] + dcol[None, :], mask=dcol[None, :] < D, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
        ne = ne | row_ne
    return M, L, ACC, seen, m, l, acc, ne, bad


#: fp32 bound on |S| below which no score of an interior block can overflow: |q . k| * |scale| <= D max|q| max|k|
#: max(1, |scale|), 2^8 below FLT_MAX (the bound itself is computed in float32; inf or NaN compares false)
SCORE_BOUND = tl.constexpr(2.0 ** 120)


@triton.jit
def _interior_run(q_bound, KBND, k_lo, k_hi, klen, causal, left, right, p_min, p_max, start, KB: tl.constexpr,
                  NKB: tl.constexpr):
    """[f_lo, f_hi): the whole key blocks of [k_lo, k_hi) that every valid row of the tile (positions p_min..p_max)
    sees, when the key bounds of all of them (KBND: per key block, max |k|, +inf where a K or V element is not
    finite) times q_bound stay below SCORE_BOUND; else the empty run at ``start`` (every block takes the general
    step)."""
    i_lo = k_lo
    if left >= 0:
        i_lo = tl.maximum(i_lo, p_max - left)
    i_hi = tl.minimum(k_hi, klen)
    if causal:
        i_hi = tl.minimum(i_hi, p_min + 1)
    elif right >= 0:
        i_hi = tl.minimum(i_hi, p_min + right + 1)
    f_lo = ((i_lo + KB - 1) // KB) * KB  # whole blocks only
    f_hi = (i_hi // KB) * KB
    k_bound = tl.full([], 0.0, tl.float32)
    for c in range(f_lo // KB, f_hi // KB, NKB):  # NKB blocks' bounds per load
        blk = c + tl.arange(0, NKB)
        k_bound = tl.maximum(k_bound, tl.max(tl.load(KBND + blk, mask=blk < f_hi // KB, other=0.0)))
    run = (f_lo < f_hi) & (q_bound * k_bound < SCORE_BOUND)
    return tl.where(run, f_lo, start), tl.where(run, f_hi, start)


@triton.jit
def _tile_keys(q, q_bound, K, V, KBND, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp,
               stride_kt, scale, causal, left, right, k_lo, k_hi, p_min, p_max,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr, KS: tl.constexpr,
               NKB: tl.constexpr, PAGED: tl.constexpr, INTERIOR: tl.constexpr, FLAT: tl.constexpr):
    """The query tile q [BLOCK_M, BLOCK_D] (valid rows at positions p_min..p_max) over keys [k_lo, k_hi), its blocks
    in key order: (M, L, ACC, seen, m, l, acc, ne). FLAT: [k_lo, k_hi) is the tile's whole key range; each split's
    partial is merged into (M, L, ACC, seen) at the next split boundary, the last one left in (m, l, acc, ne) for the
    caller's merge, so the block loops (and their load pipelines) run across splits. Else [k_lo, k_hi) lies in one
    split and (m, l, acc, ne) is its partial. INTERIOR: the run of interior blocks (:func:`_interior_run`) takes
    :func:`_interior_blocks`, every other block :func:`_general_blocks`; which step a block takes never changes a
    valid row's bits."""
    M, L, ACC, seen = _empty_state(BLOCK_M, BLOCK_D)
    m, l, acc, ne = _empty_state(BLOCK_M, BLOCK_D)
    bad = tl.zeros([BLOCK_M], tl.int32)
    start = (k_lo // KB) * KB
    if INTERIOR:
        f_lo, f_hi = _interior_run(q_bound, KBND, k_lo, k_hi, klen, causal, left, right, p_min, p_max, start, KB, NKB)
        M, L, ACC, seen, m, l, acc, ne, bad = _general_blocks(
            M, L, ACC, seen, m, l, acc, ne, bad, q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
            stride_kp, stride_kt, scale, causal, left, right, k_lo, k_hi, start, f_lo,
            D, BLOCK_M, BLOCK_D, KB, KS, PAGED, FLAT)
        M, L, ACC, seen, m, l, acc, ne, bad = _interior_blocks(
            M, L, ACC, seen, m, l, acc, ne, bad, q, K, V, valid, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp,
            stride_kt, scale, f_lo, f_hi, D, BLOCK_M, BLOCK_D, KB, KS, PAGED, FLAT)
        start = f_hi
    M, L, ACC, seen, m, l, acc, ne, bad = _general_blocks(
        M, L, ACC, seen, m, l, acc, ne, bad, q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
        stride_kp, stride_kt, scale, causal, left, right, k_lo, k_hi, start, k_hi, D, BLOCK_M, BLOCK_D, KB, KS, PAGED,
        FLAT)
    return M, L, ACC, seen, m, tl.where(bad > 0, float("nan"), l), acc, ne


@triton.jit
def _key_bound_kernel(K, V, KBND, KLEN, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, stride_kh, n_kb,
                      HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
                      PAGED: tl.constexpr):
    """The pre-pass of the interior blocks: per (sequence x kv head, key block) of a sequence's keys, max |k| over
    the block's keys, or +inf where one of their K or V elements is NaN or +-inf. K and V are read once here
    instead of being tested element by element in every query tile's block loop."""
    bh = tl.program_id(0)
    nb = tl.program_id(1)
    b = bh // HKV
    klen = tl.load(KLEN + b)
    if nb * KB < klen:  # blocks past the sequence are never read
        kj = nb * KB + tl.arange(0, KB)
        kmask = kj < klen
        dcol = tl.arange(0, BLOCK_D)
        koff = (_key_offsets(kj, kmask, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED)
                + (bh % HKV).to(tl.int64) * stride_kh)
        mask = kmask[:, None] & (dcol[None, :] < D)
        k = tl.load(K + koff[:, None] + dcol[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + koff[:, None] + dcol[None, :], mask=mask, other=0.0).to(tl.float32)
        fin = (k == k) & (tl.abs(k) < float("inf")) & (v == v) & (tl.abs(v) < float("inf"))
        all_fin = tl.min(tl.min(fin.to(tl.int32), axis=1), axis=0) > 0
        bound = tl.where(all_fin, tl.max(tl.max(tl.abs(k), axis=1), axis=0), float("inf"))
        tl.store(KBND + bh.to(tl.int64) * n_kb + nb, bound)


@triton.jit
def _q_bound(q, scale, BLOCK_D: tl.constexpr):
    """The tile's part of the score bound: max |q| * BLOCK_D * max(1, |scale|) in float32, +inf where an element of q
    is NaN or +-inf (rows outside the tile's valid ones were loaded as 0)."""
    qf = q.to(tl.float32)
    fin = tl.min(tl.min(((qf == qf) & (tl.abs(qf) < float("inf"))).to(tl.int32), axis=1), axis=0) > 0
    q_max = tl.where(fin, tl.max(tl.max(tl.abs(qf), axis=1), axis=0), float("inf"))
    return q_max * BLOCK_D * tl.maximum(tl.abs(scale), 1.0)


# counts that change per call (lengths, splits, grid) are never specialised on: one binary for every call
@triton.jit(do_not_specialize=["n_ws_rows", "n_ws_splits", "n_work", "n1", "n2", "n_kb"])
def _fast_attn_kernel(Q, K, V, O, LSE, WM, WL, WA, WN,
                      Q_ROW0, QLEN, KLEN, K_ROW0, BT, LSE_ROW0,
                      stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_lh, bt_stride, page,
                      scale, causal, left, right, n_ws_rows, n_ws_splits, n_work, n1, n2, KBND, n_kb,
                      HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      ROWS: tl.constexpr, PACK: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
                      KS: tl.constexpr, NKB: tl.constexpr, OUT: tl.constexpr, PAGED: tl.constexpr,
                      ONE_SPLIT: tl.constexpr, INTERIOR: tl.constexpr, HEAVY_FIRST: tl.constexpr, FLAT: tl.constexpr,
                      NPU: tl.constexpr):
    """The strict _attn_kernel's grid, tile rows (PACK query heads of a GQA group share a decode tile) and
    workspace contract with the tensor-core block step. A row's bits do not depend on the other rows of
    its tile (each output element of a tensor-core dot is its own row times its own column).
    INTERIOR: interior key blocks take the plain flash step (KBND: :func:`_key_bound_kernel`'s bounds; NKB: the
    blocks of a split, KS // KB, to a power of two);
    HEAVY_FIRST: work items in reverse order, so the causal row tiles with the most keys start first; FLAT: without
    split-KV, one pass of block loops over the tile's keys, the splits merged at their boundaries (speed only)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):
        w = item
        if HEAVY_FIRST:
            w = n_work - 1 - item
        pid_m, bg, b, g = _work_item(w, n1, n2, HQ // PACK)
        i, h, valid, pos, qlen, klen = _rows(pid_m, b, g, QLEN, KLEN, ROWS, PACK, BLOCK_M)
        if pid_m * ROWS < qlen:
            q_off = _q_offsets(Q_ROW0, b, i, h, stride_qt, stride_qh)
            qr_off = q_off  # where rows read q (out and lse go to q_off)
            dcol = tl.arange(0, BLOCK_D)
            q = tl.load(Q + qr_off[:, None] + dcol[None, :], mask=valid[:, None] & (dcol[None, :] < D), other=0.0)
            hk = (g * PACK) // GROUP  # the group's kv head (PACK divides GROUP)
            hk_off = hk.to(tl.int64) * stride_kh
            lo, hi = _key_range(pid_m, qlen, klen, causal, left, right, ROWS)
            p_min = klen - qlen + pid_m * ROWS  # the tile's valid rows' first and last positions (row 0 is valid)
            p_max = klen - qlen + tl.minimum(qlen, (pid_m + 1) * ROWS) - 1
            if INTERIOR:
                q_bound = _q_bound(q, scale, BLOCK_D)
                kbnd = KBND + (b * (HQ // GROUP) + hk).to(tl.int64) * n_kb
            else:
                q_bound = 0.0
                kbnd = KBND
            if ONE_SPLIT:
                sp = w % n2
                _, _, _, _, m, l, acc, ne = _tile_keys(
                    q, q_bound, K, V, kbnd, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp,
                    stride_kt, scale, causal, left, right, tl.maximum(lo, sp * KS), tl.minimum(hi, (sp + 1) * KS),
                    p_min, p_max, D, BLOCK_M, BLOCK_D, KB, KS, NKB, PAGED, INTERIOR, False)
                _store_partial(WM, WL, WA, WN, _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits), valid,
                               m, l, acc, ne, BLOCK_D)
            else:
                if FLAT:  # one pass over the tile's keys, the splits merged at their boundaries
                    M, L, ACC, seen, m, l, acc, ne = _tile_keys(
                        q, q_bound, K, V, kbnd, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp,
                        stride_kt, scale, causal, left, right, lo, hi, p_min, p_max,
                        D, BLOCK_M, BLOCK_D, KB, KS, NKB, PAGED, INTERIOR, True)
                    M, L, ACC, seen = _merge(M, L, ACC, seen, m, l, acc, ne)
                else:  # a block loop per split (the kernel before)
                    M, L, ACC, seen = _empty_state(BLOCK_M, BLOCK_D)
                    for s0 in range((lo // KS) * KS, hi, KS):
                        _, _, _, _, m, l, acc, ne = _tile_keys(
                            q, q_bound, K, V, kbnd, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                            stride_kp, stride_kt, scale, causal, left, right, tl.maximum(lo, s0),
                            tl.minimum(hi, s0 + KS), p_min, p_max, D, BLOCK_M, BLOCK_D, KB, KS, NKB, PAGED, INTERIOR,
                            False)
                        M, L, ACC, seen = _merge(M, L, ACC, seen, m, l, acc, ne)
                lse_off = tl.load(LSE_ROW0 + b).to(tl.int64) + h * stride_lh + i
                _finish(O, LSE, q_off, lse_off, valid, M, L, ACC, seen, D, BLOCK_D, OUT, NPU)


#: True: prefill-sized tiles (more than attention.PACK_MAX_Q query rows) run interior key blocks as plain flash steps
#: after the key-bound pre-pass, work items heaviest first, tiles without split-KV in one pass over their splits
#: (FLAT_SPLITS), and split-KV merges on tiles of the rows that exist (issue 49); False: the general block step for
#: every block, light tiles first, a block loop per split, the merge on the spec's block_m rows (the kernel before).
#: The bits are the same either way; kept selectable for gpu_perf's old-vs-new rows ("/general")
FAST_BLOCK_PATH = True

#: with FAST_BLOCK_PATH, tiles without split-KV run their keys in one pass of block loops, each split's partial merged
#: at the next split boundary (the spec's merge in split order), so the K/V pipeline does not drain every kv_split keys;
#: False: a block loop per split (the merge after it). Speed only; under Triton 3.6 (sm_90) the one pass keeps the
#: interior block's hot path spill-free (the merge branch reloads the split state once per split) but adds spill
#: reloads to the edge blocks' path (docs/triton.md): gpu_perf times both (attention_prefill/fast/T*/per_split)
FLAT_SPLITS = True


def launch_config(spec, head_dim: int, prefill_sized: bool) -> dict:
    """What ``attention.attend`` needs to launch the fast kernel: kernel, tiles, spec constexprs, options, and
    whether the interior-block path (with its pre-pass) runs."""
    interior = FAST_BLOCK_PATH and prefill_sized  # decode: a pre-pass would read the K/V cache twice
    return dict(kernel=_fast_attn_kernel, block_m=spec.block_m, block_d=max(16, next_power_of_2(head_dim)),
                constexprs=dict(KB=spec.kv_block, KS=spec.kv_split,
                                NKB=next_power_of_2(spec.kv_split // spec.kv_block), INTERIOR=interior,
                                HEAVY_FIRST=FAST_BLOCK_PATH, FLAT=FAST_BLOCK_PATH and FLAT_SPLITS),
                options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages), interior=interior)


def key_bounds(k, v, klen, k_row0, block_table, page, kv_block: int, max_k: int, block_d: int):
    """(KBND, n_kb) for the interior blocks: :func:`_key_bound_kernel` over every sequence's keys, KBND float32
    [sequences x kv heads, n_kb key blocks] (a workspace: reused across calls of the same shape)."""
    n_seq, hkv, d = klen.shape[0], k.shape[-2], k.shape[-1]
    n_kb = max(1, -(-max_k // kv_block))
    kbnd = workspace("attention key bounds", (n_seq * hkv, n_kb), torch.float32, k.device)
    paged = block_table is not None
    bt = block_table if paged else klen
    stride_kp = k.stride(0) if paged else 0
    stride_kt, stride_kh = (k.stride(1), k.stride(2)) if paged else (k.stride(0), k.stride(1))
    launch(_key_bound_kernel, (n_seq * hkv, n_kb), k, v, kbnd, klen, klen if paged else k_row0, bt,
           bt.stride(0) if paged else 0, page, stride_kp, stride_kt, stride_kh, n_kb,
           HKV=hkv, D=d, BLOCK_D=block_d, KB=kv_block, PAGED=paged)
    return kbnd, n_kb
