"""Shared semantics below the ops: what every backend of an op family must agree on, in one place.

Public op modules (hal/attention.py, hal/kv_cache.py, hal/gated_delta_rule.py, ...) validate their
arguments and dispatch; backends and kernels compute. Neither may import the other's modules (the
rule tests/test_layering.py checks), so what both sides need lives here, below both:

* attention geometry: which absolute position a query row sits at and which keys it sees, and the
  packed (varlen) <-> padded moves with the adapters that run a padded attention on either layout;
* KV-cache moves: addressing a contiguous or paged cache, appending to it and gathering from it;
* the gated delta rule's state contract: the recurrent state as the kernels exchange it
  (:class:`Parts`) and the packed <-> padded moves of its inputs.

Everything here is either a mask or an exact copy: nothing rounds, so no backend's bits depend on
which of these moves it uses. Written with plain torch so the reference kernels stay readable.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


# ------------------------------------------------------------------ attention geometry and padding moves


def query_positions(qlen: torch.Tensor, klen: torch.Tensor, n_rows: int):
    """(absolute position [b, n_rows], row is a real query [b, n_rows]) for padded query rows.

    Bottom-right aligned as in flash-attn: the qlen queries are the last qlen positions of a
    sequence with klen keys, so row i sits at position klen - qlen + i.
    """
    i = torch.arange(n_rows, device=qlen.device).reshape(1, -1)
    qlen = qlen.to(torch.int64).reshape(-1, 1)
    return klen.to(torch.int64).reshape(-1, 1) - qlen + i, i < qlen


def key_visibility(qpos: torch.Tensor, qvalid: torch.Tensor, klen: torch.Tensor, n_keys: int, causal: bool,
                   window: tuple[int, int], key_offset: int = 0) -> torch.Tensor:
    """bool [b, Q, n_keys]: key ``key_offset + j`` is visible to the query at ``qpos[b, i]``.

    Visible: j < klen, and (causal) j <= qpos, and (window (left, right), -1 = unbounded)
    qpos - left <= j and, when not causal, j <= qpos + right.
    """
    j = torch.arange(key_offset, key_offset + n_keys, device=qpos.device).reshape(1, 1, -1)
    vis = qvalid.unsqueeze(-1) & (j < klen.to(torch.int64).reshape(-1, 1, 1))
    return mask_causal_window(vis, j, qpos.unsqueeze(-1), causal, window)


def mask_causal_window(vis, j, p, causal: bool, window: tuple[int, int]):
    """``vis`` narrowed by the causal and window rules for key position ``j`` and query position ``p``.

    Written with comparison operators only, so torch tensors and jax arrays (hal.jax) share it.
    """
    if causal:
        vis = vis & (j <= p)
    left, right = window
    if left >= 0:
        vis = vis & (j >= p - left)
    if right >= 0 and not causal:
        vis = vis & (j <= p + right)
    return vis


def _uniform(cu: torch.Tensor, lens: torch.Tensor, max_len: int, total: int) -> bool:
    """The packed rows are exactly [batch, max_len] (every sequence max_len long, in order, from row 0,
    no trailing rows): packed and padded layouts are then the same memory."""
    return total == lens.shape[0] * max_len and int(cu[0]) == 0 and bool((lens == max_len).all())


def varlen_rows(cu: torch.Tensor, max_len: int, n_rows: int):
    """(int64 ``[batch, max_len]``, lengths): the packed row (of ``n_rows``) holding element j of sequence b;
    positions past a sequence's end name row 0 (clamped to the rows there are), for callers that mask them.
    A kernel that reads its operand through these rows needs no padded copy of it (:func:`varlen_via_rows`)."""
    cu = cu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    i = torch.arange(max_len, device=cu.device).reshape(1, -1)
    return torch.where(i < lens.reshape(-1, 1), cu[:-1].reshape(-1, 1) + i, 0).clamp_max(max(n_rows - 1, 0)), lens


def varlen_to_padded(x: torch.Tensor, cu: torch.Tensor, max_len: int):
    """Packed ``x [total, ...]`` -> ``[batch, max_len, ...]`` and lengths; padding rows are copies (masked later)."""
    cu = cu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    bsz = lens.shape[0]
    if x.shape[0] == 0 or max_len == 0:
        return x.new_zeros((bsz, max_len, *x.shape[1:])), lens
    if _uniform(cu, lens, max_len, x.shape[0]):  # already padded: a view, no copy
        return x.reshape(bsz, max_len, *x.shape[1:]), lens
    return x[varlen_rows(cu, max_len, x.shape[0])[0]], lens


def padded_to_varlen(xp: torch.Tensor, cu: torch.Tensor, total: int, fill: float = 0.0) -> torch.Tensor:
    """Inverse of :func:`varlen_to_padded`; rows of no sequence get ``fill``."""
    cu = cu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    if xp.shape[1] and _uniform(cu, lens, xp.shape[1], total):  # every row is a real one: a view
        return xp.reshape(total, *xp.shape[2:])
    out = xp.new_full((total, *xp.shape[2:]), fill)
    if xp.shape[1] == 0:
        return out
    i = torch.arange(xp.shape[1], device=xp.device).reshape(1, -1)
    valid = i < lens.reshape(-1, 1)
    dest = (cu[:-1].reshape(-1, 1) + i)[valid]
    out[dest] = xp[valid]
    return out


def varlen_via_padded(attend_padded, q, k, v, cu_q, cu_k, *args, **kwargs):
    """A varlen attention from a padded one: packed q [Tq, Hq, D], k, v [Tk, Hkv, D] are padded to the real
    longest sequence (max_seqlen_* may be generous bounds), ``attend_padded(qp, kp, vp, qlen, klen, *args)``
    runs, and the rows go back packed: (out [Tq, Hq, D], lse [Hq, Tq]). Exact copies only."""
    def attend(qp, qlen, max_k):
        kp, klen = varlen_to_padded(k, cu_k, max_k)
        vp, _ = varlen_to_padded(v, cu_k, max_k)
        return attend_padded(qp, kp, vp, qlen, klen, *args, **kwargs)
    return _varlen_queries(attend, q, cu_q, cu_k)


def varlen_via_rows(attend_rows, q, k, v, cu_q, cu_k, *args, **kwargs):
    """As :func:`varlen_via_padded` for a kernel that reads keys and values through row indices:
    ``attend_rows(qp, k, v, rows, qlen, klen, *args)`` with the packed k, v as they are and ``rows [b, max_k]``
    (:func:`varlen_rows`), so the keys and values are never copied into a padded layout (two copies of each,
    there and back, per call); the queries and outputs still go through it."""
    def attend(qp, qlen, max_k):
        rows, klen = varlen_rows(cu_k, max_k, k.shape[0])
        return attend_rows(qp, k, v, rows, qlen, klen, *args, **kwargs)
    return _varlen_queries(attend, q, cu_q, cu_k)


def _varlen_queries(attend, q, cu_q, cu_k):
    """The query side of the varlen adapters: q padded to the real longest sequence, ``attend(qp, qlen,
    max_k)`` -> padded (out, lse), packed back: (out [Tq, Hq, D], lse [Hq, Tq])."""
    max_q, max_k = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k))
    qp, qlen = varlen_to_padded(q, cu_q, max_q)
    out, lse = attend(qp, qlen, max_k)
    return (padded_to_varlen(out, cu_q, q.shape[0]),
            padded_to_varlen(lse, cu_q, q.shape[0], float("-inf")).transpose(0, 1).contiguous())


def kvcache_via_padded(attend_padded, q, k_cache, v_cache, seqlens_k, block_table, *args, **kwargs):
    """q [B, Sq, Hq, D] against a contiguous or paged cache through a padded attention: the cached keys are
    gathered (an exact copy), the queries are the last Sq positions -> (out [B, Sq, Hq, D], lse [B, Hq, Sq])."""
    bsz, sq = q.shape[:2]
    max_k = int(seqlens_k.max()) if bsz else 0
    kp = gather_kv(k_cache, seqlens_k, block_table, max_k)
    vp = gather_kv(v_cache, seqlens_k, block_table, max_k)
    qlen = torch.full((bsz,), sq, dtype=torch.int64)
    out, lse = attend_padded(q, kp, vp, qlen, seqlens_k, *args, **kwargs)
    return out, lse.transpose(1, 2).contiguous()


# ------------------------------------------------------------------ KV-cache moves (inputs validated)


def capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Tokens one sequence can hold."""
    if block_table is None:
        return int(k_cache.shape[1])
    return int(block_table.shape[1]) * int(k_cache.shape[1])


def token_slots(start: torch.Tensor, n: int, k_cache: torch.Tensor, block_table: torch.Tensor | None):
    """Index tuples addressing tokens start[b] .. start[b]+n-1 of every sequence b in the cache."""
    bsz = start.shape[0]
    pos = start.to(torch.int64).reshape(bsz, 1) + torch.arange(n, device=start.device).reshape(1, n)
    if block_table is None:
        return torch.arange(bsz, device=start.device).reshape(bsz, 1).expand(bsz, n), pos
    page = int(k_cache.shape[1])
    pages = block_table.to(torch.int64).gather(1, pos // page)
    return pages, pos % page


def slot_coords(slots: torch.Tensor, block_size: int):
    """(block, offset in block) of each flat slot ``block * block_size + offset`` (a serving engine's slot
    mapping), as index tuples for a ``[blocks, block_size, ...]`` cache of any strides."""
    slots = slots.to(torch.int64)
    return slots // block_size, slots % block_size


def paged_token_coords(seqlens: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """(block, offset in block), int64 ``[sum(seqlens)]`` each: where token j of sequence b lies in a paged
    cache ``[blocks, block_size, ...]`` through its row of ``block_table``, sequences packed in order (the
    varlen layout). ``cache[blocks, offsets]`` is then every sequence's tokens packed, in one gather: no
    padded ``[batch, max_len]`` copy between (:func:`gather_kv` + :func:`padded_to_varlen` read and wrote
    each token three times). Table entries past a sequence's blocks are never read (they may be -1)."""
    lens = seqlens.to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    pos = torch.arange(seq.shape[0], device=lens.device) - (lens.cumsum(0) - lens)[seq]
    return block_table.to(torch.int64)[seq, pos // block_size], pos % block_size


def append_kv(k_cache, v_cache, k, v, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None) -> None:
    """Write ``k, v [batch, n, Hkv, D]`` into the cache at positions cache_seqlens[b] + 0..n-1 (in place)."""
    n = int(k.shape[1])
    if n == 0:
        return
    rows, cols = token_slots(cache_seqlens, n, k_cache, block_table)
    k_cache[rows, cols] = k
    v_cache[rows, cols] = v


def _used_pages(cache: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor, max_len: int):
    """(pages [batch, n_pages], page size): the physical page of each logical page of the first
    ``max_len`` tokens; pages at or past a sequence's length read page 0 (unused table entries may be -1)."""
    bsz = seqlens.shape[0]
    page = int(cache.shape[1])
    n_pages = -(-max_len // page)
    col = torch.arange(n_pages, device=cache.device).clamp_max(max(block_table.shape[1] - 1, 0))
    pages = block_table.to(torch.int64)[:, col] if n_pages else \
        torch.zeros((bsz, 0), dtype=torch.int64, device=cache.device)
    used = (col * page).reshape(1, -1) < seqlens.to(torch.int64).reshape(-1, 1)
    return torch.where(used, pages, 0).clamp(0, cache.shape[0] - 1), page


def gather_kv(cache: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor | None, max_len: int):
    """The first ``max_len`` tokens of every sequence as a contiguous ``[batch, max_len, Hkv, D]``.

    Positions at or past a sequence's length hold arbitrary cache contents (callers mask them).
    """
    bsz = seqlens.shape[0]
    if block_table is None:
        return cache[:bsz, :max_len]
    # whole pages, not tokens: one index per page (a per-token gather costs ~18 ms at a 4k cache here)
    pages, page = _used_pages(cache, seqlens, block_table, max_len)
    return cache[pages].reshape(bsz, pages.shape[1] * page, *cache.shape[2:])[:, :max_len]


def kv_rows(cache: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor | None, max_len: int):
    """int64 ``[batch, max_len]``: the row of ``cache.reshape(-1, Hkv, D)`` holding token j of sequence b
    (what :func:`gather_kv` would copy there), for kernels that read the cache in place."""
    bsz = seqlens.shape[0]
    j = torch.arange(max_len, device=cache.device)
    if block_table is None:
        return torch.arange(bsz, device=cache.device).reshape(-1, 1) * cache.shape[1] + j
    pages, page = _used_pages(cache, seqlens, block_table, max_len)
    return pages.repeat_interleave(page, 1)[:, :max_len] * page + j % page


# ------------------------------------------------------------------ gated delta rule: state contract and layout


EPS_L2 = 1e-6  # the L2 norm's epsilon on q and k: sum x^2 + EPS_L2 under the square root


class Parts(NamedTuple):
    """The recurrent state of N sequences as the kernels see it (hal wraps it with spec and layout).

    ``S``: the materialised state (serial: after the last token; chunked: at the last chunk
    boundary). ``open_*``: chunked only, the rows since that boundary (``position % C`` of them,
    then zeros), k after the L2 norm, all float32. ``final``: the state after the last token
    (FLA's ``final_state``); for serial it is ``S``.
    """
    position: torch.Tensor            # int64 [N], tokens consumed so far
    S: torch.Tensor                   # [N, HV, dk, dv]
    open_k: torch.Tensor | None       # [N, C, H, dk]
    open_v: torch.Tensor | None       # [N, C, HV, dv]
    open_g: torch.Tensor | None       # [N, C, HV]
    open_beta: torch.Tensor | None    # [N, C, HV]
    final: torch.Tensor | None        # [N, HV, dk, dv]


def gdn_to_padded(x: torch.Tensor, cu: list[int] | None):
    """[B, T, ...] -> itself, or packed [1, total, ...] -> [N, Lmax, ...] (zeros after each end)."""
    if cu is None:
        return x
    n = len(cu) - 1
    lmax = max(cu[i + 1] - cu[i] for i in range(n))
    out = x.new_zeros((n, lmax, *x.shape[2:]))
    for i in range(n):
        out[i, : cu[i + 1] - cu[i]] = x[0, cu[i]: cu[i + 1]]
    return out


def gdn_from_padded(x: torch.Tensor, cu: list[int] | None):
    """Inverse of :func:`gdn_to_padded`: [N, Lmax, ...] -> packed [1, total, ...] (or x itself when batched)."""
    if cu is None:
        return x
    return torch.cat([x[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)]).unsqueeze(0)
