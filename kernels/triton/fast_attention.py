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
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import (_empty_state, _finish, _key_offsets, _key_range, _merge, _q_offsets, _rows,
                              _store_partial, _visible, _work_item, _ws_offsets)
from .launch import next_power_of_2


@triton.jit
def _fast_split(q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt,
                scale, causal, left, right, k_lo, k_hi,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
                PAGED: tl.constexpr):
    """(m, l, acc, nonempty) of keys [k_lo, k_hi) of one split for the query tile q [BLOCK_M, BLOCK_D]."""
    cols = tl.arange(0, KB)
    dcol = tl.arange(0, BLOCK_D)
    m, l, acc, ne = _empty_state(BLOCK_M, BLOCK_D)
    bad = tl.zeros([BLOCK_M], tl.int32)
    for kb0 in range((k_lo // KB) * KB, k_hi, KB):
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
    l = tl.where(bad > 0, float("nan"), l)
    return m, l, acc, ne


# counts that change per call (lengths, splits, grid) are never specialised on: one binary for every call
@triton.jit(do_not_specialize=["n_ws_rows", "n_ws_splits", "n_work", "n1", "n2"])
def _fast_attn_kernel(Q, K, V, O, LSE, WM, WL, WA, WN,
                      Q_ROW0, QLEN, KLEN, K_ROW0, BT, LSE_ROW0,
                      stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_lh, bt_stride, page,
                      scale, causal, left, right, n_ws_rows, n_ws_splits, n_work, n1, n2,
                      HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      ROWS: tl.constexpr, PACK: tl.constexpr, BLOCK_D: tl.constexpr, KB: tl.constexpr,
                      KS: tl.constexpr, OUT: tl.constexpr, PAGED: tl.constexpr, ONE_SPLIT: tl.constexpr,
                      NPU: tl.constexpr):
    """The strict _attn_kernel's grid, tile rows (PACK query heads of a GQA group share a decode tile) and
    workspace contract with the tensor-core block step. A row's bits do not depend on the other rows of
    its tile (each output element of a tensor-core dot is its own row times its own column)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):
        pid_m, bg, b, g = _work_item(item, n1, n2, HQ // PACK)
        i, h, valid, pos, qlen, klen = _rows(pid_m, b, g, QLEN, KLEN, ROWS, PACK, BLOCK_M)
        if pid_m * ROWS < qlen:
            q_off = _q_offsets(Q_ROW0, b, i, h, stride_qt, stride_qh)
            qr_off = q_off  # where rows read q (out and lse go to q_off)
            dcol = tl.arange(0, BLOCK_D)
            q = tl.load(Q + qr_off[:, None] + dcol[None, :], mask=valid[:, None] & (dcol[None, :] < D), other=0.0)
            hk_off = ((g * PACK) // GROUP).to(tl.int64) * stride_kh  # the group's kv head (PACK divides GROUP)
            lo, hi = _key_range(pid_m, qlen, klen, causal, left, right, ROWS)
            if ONE_SPLIT:
                sp = item % n2
                m, l, acc, ne = _fast_split(q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                                            stride_kp, stride_kt, scale, causal, left, right,
                                            tl.maximum(lo, sp * KS), tl.minimum(hi, (sp + 1) * KS),
                                            D, BLOCK_M, BLOCK_D, KB, PAGED)
                _store_partial(WM, WL, WA, WN, _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits), valid,
                               m, l, acc, ne, BLOCK_D)
            else:
                M, L, ACC, seen = _empty_state(BLOCK_M, BLOCK_D)
                for s0 in range((lo // KS) * KS, hi, KS):
                    m, l, acc, ne = _fast_split(q, K, V, valid, pos, klen, b, hk_off, K_ROW0, BT, bt_stride, page,
                                                stride_kp, stride_kt, scale, causal, left, right,
                                                tl.maximum(lo, s0), tl.minimum(hi, s0 + KS),
                                                D, BLOCK_M, BLOCK_D, KB, PAGED)
                    M, L, ACC, seen = _merge(M, L, ACC, seen, m, l, acc, ne)
                lse_off = tl.load(LSE_ROW0 + b).to(tl.int64) + h * stride_lh + i
                _finish(O, LSE, q_off, lse_off, valid, M, L, ACC, seen, D, BLOCK_D, OUT, NPU)


def launch_config(spec, head_dim: int) -> dict:
    """What ``attention.attend`` needs to launch the fast kernel: kernel, tiles, spec constexprs, options."""
    return dict(kernel=_fast_attn_kernel, block_m=spec.block_m, block_d=max(16, next_power_of_2(head_dim)),
                constexprs=dict(KB=spec.kv_block, KS=spec.kv_split),
                options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
