"""Argument checks of the attention ops (hal/attention.py), kept apart so that module reads as the ops and their
autograd. Each raises an ``InputError`` naming the argument at fault; callers use them as
``attention_checks.<name>`` (the HF integration takes the default scale, ``softmax_scale``, from here too).
"""
from __future__ import annotations

import math

import torch

from . import validate as chk
from .errors import InputError
from .kernels.layout import token_slots


def window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise InputError(f"window_size must be a pair (left, right) of ints, -1 = unbounded; got {window_size!r}") from None
    left = chk.index_scalar("window_size[0] (left)", left, minimum=-1)
    right = chk.index_scalar("window_size[1] (right)", right, minimum=-1)
    return left, right


def softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return chk.scalar("softmax_scale", softmax_scale, positive=True)


def head_dim(head_dim: int) -> None:
    if head_dim < 1:
        raise InputError(f"head_dim (q.shape[-1]) must be >= 1, got {head_dim}")


def head_counts(q_heads: int, kv_heads: int) -> None:
    if kv_heads == 0 or q_heads % kv_heads:
        raise InputError(f"the number of query heads ({q_heads}) must be a multiple of the number of key/value "
                         f"heads ({kv_heads}) (GQA/MQA: query head h reads kv head h // (Hq/Hkv))")


def kv_pair(k_name: str, k: torch.Tensor, v_name: str, val: torch.Tensor) -> None:
    if tuple(k.shape) != tuple(val.shape):
        raise InputError(f"{k_name} shape {tuple(k.shape)} != {v_name} shape {tuple(val.shape)}; "
                         "keys and values must have the same shape")


def only_defaults(**kw) -> None:
    for name, (val, ok) in kw.items():
        if not ok(val):
            raise InputError(f"{name}={val!r} is not supported by lockstep attention (leave it at its default)")


def cu_seqlens(name: str, cu, total: int) -> list[int]:
    """The cumulative sequence lengths ``cu`` as Python ints, checked: ``[0, end_0, end_1, ...]``, non-decreasing,
    at most ``total`` packed rows. The values are read from the device once (one transfer, where a check per
    tensor expression would sync once each: a serving step runs this twice per attention layer)."""
    chk.tensor(name, cu, ndim=1)
    chk.integer(name, cu)
    c = cu.tolist()
    if len(c) < 2:
        raise InputError(f"{name} must have batch+1 >= 2 entries [0, end_0, end_1, ...], got {c}")
    if c[0] != 0:
        raise InputError(f"{name}[0] must be 0, got {c[0]}")
    for b in range(1, len(c)):
        if c[b] < c[b - 1]:
            raise InputError(f"{name} must be non-decreasing (cumulative sequence lengths), but {name}[{b}] = "
                             f"{c[b]} < {name}[{b - 1}] = {c[b - 1]}")
    if c[-1] > total:
        raise InputError(f"{name}[-1] = {c[-1]} exceeds the number of packed tokens ({total})")
    return c


def longest(cu: list[int]) -> int:
    """The longest sequence of checked cumulative lengths (:func:`cu_seqlens`)."""
    return max(b - a for a, b in zip(cu, cu[1:]))


def no_grad_needed(op: str, **tensors) -> None:
    if torch.is_grad_enabled():
        needing = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing:
            raise InputError(f"{op} has no backward pass ({', '.join(needing)} require grad); use "
                             "flash_attn_varlen_func for training, or call this under torch.no_grad()")


def pages(block_table, after, before, n_new, k_cache) -> None:
    """The pages a call uses must exist and be distinct within a sequence, and no sequence may append
    into a cache slot that another sequence of the call reads (its output would depend on the order)."""
    table = block_table.detach().cpu().to(torch.int64)
    page = int(k_cache.shape[1])
    num_pages = int(k_cache.shape[0])
    n_used = (after + page - 1) // page
    used = torch.arange(table.shape[1]).reshape(1, -1) < n_used.reshape(-1, 1)
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise InputError(f"block_table[{b}, {i}] = {int(table[b, i])} is out of range: the cache has {num_pages} pages "
                         f"(valid ids 0..{num_pages - 1}) and sequence {b} uses its first "
                         f"{int((after[b] + page - 1) // page)} entries")
    # A page listed twice in one row aliases two positions of that sequence onto one slot.
    cols = torch.arange(table.shape[1]).reshape(1, -1).expand_as(table)
    keyed = torch.where(used, table, -2 - cols)  # unused entries get distinct negative keys
    srt, order = keyed.sort(dim=1)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        b, j = (int(x) for x in dup.nonzero()[0])
        i0, i1 = sorted((int(order[b, j]), int(order[b, j + 1])))
        raise InputError(f"block_table[{b}, {i0}] and block_table[{b}, {i1}] are both page {int(srt[b, j])}: a "
                         f"sequence's pages must be distinct (sequence {b} uses its first {int(n_used[b])} entries)")
    if not n_new:
        return
    # Slots written (sequence b, positions before[b] ..) vs slots read (sequence b, positions 0 .. after[b]).
    bsz = table.shape[0]
    wp, ws = token_slots(before, n_new, k_cache, table)
    written = (wp * page + ws).reshape(-1)
    writer = torch.arange(bsz).reshape(-1, 1).expand(bsz, n_new).reshape(-1)
    wsorted, worder = written.sort()
    same = wsorted[1:] == wsorted[:-1]
    if bool(same.any()):
        j = int(same.nonzero()[0, 0])
        a, b = sorted((int(writer[worder[j]]), int(writer[worder[j + 1]])))
        raise InputError(f"sequences {a} and {b} would append into the same cache slot (page "
                         f"{int(wsorted[j]) // page}, slot {int(wsorted[j]) % page}); give each sequence its own "
                         "page for new tokens")
    max_len = int(after.max())
    pos = torch.arange(max_len).reshape(1, -1)
    live = pos < after.reshape(-1, 1)
    rp = table.gather(1, torch.where(live, pos // page, 0).clamp_max(table.shape[1] - 1))
    read = torch.where(live, rp * page + pos % page, -1)
    at = torch.searchsorted(wsorted, read).clamp_max(written.numel() - 1)
    owner = writer[worder[at]]
    reader = torch.arange(bsz).reshape(-1, 1).expand_as(read)
    clash = live & (wsorted[at] == read) & (owner != reader)
    if bool(clash.any()):
        b, j = (int(x) for x in clash.nonzero()[0])
        a = int(owner[b, j])
        raise InputError(f"sequence {a} appends into a cache slot that sequence {b} reads (page {int(rp[b, j])}, "
                         f"slot {j % page}, position {j} of sequence {b}): a shared page must not be written in the "
                         "same call; give the writer its own copy of the page (KVCache does copy-on-write)")
