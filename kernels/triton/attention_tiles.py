"""The program layout every attention kernel shares: the jit helpers of the strict and fast forward kernels
(attention_kernel.py, fast_attention.py) and of the backward kernels (attention_backward.py).

Work items of the persistent grid, the tile rows of a program (query row, head), their absolute positions
and the keys any of them may see, key and query addressing (contiguous or paged), the split workspace,
and the spec's split merge and finish. Kept below the kernels so that none imports another's internals.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import strict_math as sm


@triton.jit
def _visible(kj, pos, valid, klen, causal, left, right):
    """bool tile: key kj (any shape broadcastable with pos) is visible to the query at pos. The window tests use the
    distance pos - kj (no overflow for positions and keys below 2^30): comparing kj with pos - left / pos + right made
    the compiler keep both per row and layout live across the key loops (decode spilled 8-48 B; docs/triton.md)."""
    vis = valid & (kj < klen)
    back = pos - kj  # how far the key lies behind the query (negative: ahead of it)
    if causal:
        vis = vis & (back >= 0)
    if left >= 0:
        vis = vis & (back <= left)
    if (right >= 0) & (causal == 0):
        vis = vis & (back >= -right)
    return vis


@triton.jit
def _key_offsets(kj, kmask, b, K_ROW0, BT, bt_stride, page, stride_kp, stride_kt, PAGED: tl.constexpr):
    """Element offsets of keys kj of sequence b (paged: through the block table)."""
    if PAGED:
        pg = tl.load(BT + b * bt_stride + kj // page, mask=kmask, other=0).to(tl.int64)
        return pg * stride_kp + (kj % page).to(tl.int64) * stride_kt
    else:
        row0 = tl.load(K_ROW0 + b).to(tl.int64)
        return (row0 + kj.to(tl.int64)) * stride_kt


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m, l, acc, nonempty) of no key: the start of a split and of the merge."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32), tl.zeros([BLOCK_M], tl.int32))


@triton.jit
def _work_item(item, n1, n2, NH: tl.constexpr):
    """(row tile, sequence x head group, sequence, head group) of a work item of the logical grid
    (row tile, n1, n2); NH head groups per sequence."""
    pid_m = item // (n1 * n2)
    bh = (item // n2) % n1
    return pid_m, bh, bh // NH, bh % NH


@triton.jit
def _q_offsets(Q_ROW0, b, i, h, stride_qt, stride_qh):
    """Element offsets of head h of query rows i of sequence b (also those of the output)."""
    return (tl.load(Q_ROW0 + b).to(tl.int64) + i.to(tl.int64)) * stride_qt + h * stride_qh


@triton.jit
def _ws_offsets(bh, i, sp, n_ws_rows, n_ws_splits):
    """Workspace index of split sp of rows i of (sequence x head) bh."""
    return (bh.to(tl.int64) * n_ws_rows + i) * n_ws_splits + sp


@triton.jit
def _store_partial(WM, WL, WA, WN, w, valid, m, l, acc, ne, BLOCK_D: tl.constexpr):
    """Write one split's partial (m, l, acc, nonempty) to the workspace for :func:`_merge_kernel`."""
    dcol = tl.arange(0, BLOCK_D)
    tl.store(WM + w, m, mask=valid)
    tl.store(WL + w, l, mask=valid)
    tl.store(WN + w, ne, mask=valid)
    tl.store(WA + w[:, None] * BLOCK_D + dcol[None, :], acc, mask=valid[:, None])


@triton.jit
def _merge(M, L, ACC, seen, m, l, acc, ne):
    """Fold one split partial into the running (M, L, ACC): the spec's merge step."""
    has = ne > 0
    m_new = tl.maximum(M, m)
    a = sm.exp(M - m_new)
    c = sm.exp(m - m_new)
    L = tl.where(has, tl.fma(L, a, l * c), L)
    ACC = tl.where(has[:, None], tl.fma(ACC, a[:, None], acc * c[:, None]), ACC)
    M = tl.where(has, m_new, M)
    return M, L, ACC, seen | ne


@triton.jit
def _finish(O, LSE, o_off, lse_off, valid, M, L, ACC, seen, D: tl.constexpr, BLOCK_D: tl.constexpr,
            OUT: tl.constexpr, NPU: tl.constexpr):
    dcol = tl.arange(0, BLOCK_D)
    has = seen > 0
    out = tl.where(has[:, None], sm.div(ACC, L[:, None], NPU), 0.0)
    lse = tl.where(has, M + sm.log(L, NPU), float("-inf"))
    tl.store(O + o_off[:, None] + dcol[None, :], sm.round_out(out, OUT, NPU), mask=valid[:, None] & (dcol[None, :] < D))
    tl.store(LSE + lse_off, sm.canonical_nan(lse), mask=valid)


@triton.jit
def _rows(pid_m, b, g, QLEN, KLEN, ROWS: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(query row i, head h, valid, position, qlen, klen) of the tile rows r of row tile pid_m, head group g:
    i = pid_m * ROWS + r // PACK, h = g * PACK + r % PACK; rows r >= ROWS * PACK pad BLOCK_M to a power of 2."""
    qlen = tl.load(QLEN + b)
    klen = tl.load(KLEN + b)
    r = tl.arange(0, BLOCK_M)
    i = pid_m * ROWS + r // PACK
    h = g * PACK + r % PACK
    valid = (r < ROWS * PACK) & (i < qlen)
    pos = klen - qlen + i
    return i, h, valid, pos, qlen, klen


@triton.jit
def _key_range(pid_m, qlen, klen, causal, left, right, ROWS: tl.constexpr):
    """[lo, hi): the keys some row of this tile (query rows pid_m * ROWS ...) may see (all others are
    invisible to every row)."""
    p_min = klen - qlen + pid_m * ROWS
    p_max = klen - qlen + tl.minimum(qlen, (pid_m + 1) * ROWS) - 1
    hi = klen
    if causal:
        hi = tl.minimum(hi, p_max + 1)
    elif right >= 0:
        hi = tl.minimum(hi, p_max + right + 1)
    lo = 0
    if left >= 0:
        lo = tl.maximum(p_min - left, 0)
    return lo, hi
