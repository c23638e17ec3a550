"""The serving core: a serving engine's step on lockstep's bits, engine-neutral.

A serving engine packs requests into one varlen step (prefill chunks next to decode rows), keeps KV in
blocks of its own layout, and schedules, preempts and forks requests. What makes a request's bits
independent of all that lives here, over plain tensors, so every engine shim (transformers' engine in
hal/integrations/transformers/engine.py, vLLM) is a thin translation of its own metadata:

* :class:`ServingBatch`: one step's attention metadata as engines hold it (query start offsets, sequence
  lengths, block table, slot mapping), and what is derived from it, computed once per step;
* :class:`PagedKV`: the engine's KV cache addressed in place through views (``[block, offset, kv_head,
  dim]``, any strides; vLLM's CPU layout included), never copied whole; :func:`write_kv` stores a step's new
  keys at their slots, :func:`paged_attention` attends over it;
* :func:`varlen_attention`: ``hal.flash_attn_varlen_func`` over the step, each request's queries
  bottom-right aligned on its own keys (L1 + L2: neighbours, chunking and paging change no bit);
* :class:`GdnStates`: each request's Gated DeltaNet state beside the cache (engines page attention only),
  keyed by an opaque request key and the token position it was computed up to; :func:`gdn_step` runs a
  GDN layer's conv and gated delta rule over one step, each request from its own state.

The paged addressing is kernels/layout.py's (``slot_coords``, ``paged_token_coords``): moves and masks
only, so nothing here rounds. This module imports neither transformers nor vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import flash_attn_varlen_func
from .errors import InputError, UnsupportedError
from .kernels import layout

__all__ = ["ServingBatch", "PagedKV", "write_kv", "paged_attention", "varlen_attention", "request_kv",
           "decode_slot_mapping", "GdnStates", "gdn_step"]


# ---------------------------------------------------------------- batch metadata


@dataclass(frozen=True)
class ServingBatch:
    """One engine step's attention metadata, as serving engines hold it.

    ``query_start_loc [n+1]``: cumulative query tokens per request (the rows of ``q``);
    ``seq_lens [n]``: keys each request sees after this step (cached + new; its queries are the last ones);
    ``block_table [n, max_blocks]`` and ``slot_mapping [tokens]`` (paged engines): the cache blocks holding
    each request's keys in order, and the flat slot ``block * block_size + offset`` of each new token.

    What is derived from the metadata (key offsets, the paged coordinates of every request's keys, the checks
    on them) is computed on first use and kept: an engine that hands every attention layer of a step the same
    batch pays for it once per step, not once per layer. So a batch is one step's: its tensors must not change
    while it is in use (build a new batch for the next step).
    """
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _once(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def key_starts(self) -> torch.Tensor:
        """int32 ``[n+1]``: cumulative keys per request (the rows of the packed keys)."""
        def make():
            lens = self.seq_lens.to(torch.int32)
            return torch.cat([lens.new_zeros(1), lens.cumsum(0).to(torch.int32)])
        return self._once("key_starts", make)

    def query_lens(self) -> torch.Tensor:
        cu = self.query_start_loc.to(torch.int64)
        return cu[1:] - cu[:-1]

    def attention_shape(self, n_q_rows: int, n_k_rows: int, device) -> tuple:
        """``(cu_q int32, cu_k int32, queries, keys, longest query run, longest key run)`` of the step, checked
        against the rows an attention call was handed (``n_q_rows`` queries, ``n_k_rows`` packed keys)."""
        cu_q, cu_k, n_q, n_k, max_q, max_k = self._once(("attention", str(device)), lambda: self._attention(device))
        if n_q > n_q_rows or n_k > n_k_rows:
            raise InputError(f"engine batch describes {n_q} queries / {n_k} keys but got {n_q_rows} / {n_k_rows}")
        return cu_q, cu_k, n_q, n_k, max_q, max_k

    def _attention(self, device):
        cu_q = self.query_start_loc.to(torch.int32)
        cu_k = self.key_starts().to(device)
        q_lens = (cu_q[1:] - cu_q[:-1]).to(cu_k.device)
        if bool((q_lens > self.seq_lens.to(cu_k.device)).any()):
            raise InputError("an engine request has more new queries than keys (seq_lens must count the new tokens)")
        n_q = int(cu_q[-1])
        max_q, max_k = (int(q_lens.max()), int(self.seq_lens.max())) if n_q else (0, 0)
        return cu_q, cu_k, n_q, int(cu_k[-1]), max_q, max_k

    def paged_keys(self, cache: "PagedKV") -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block), int64 ``[sum(seq_lens)]``: where each request's keys lie in ``cache``,
        oldest first, requests packed in order (``layout.paged_token_coords``), checked against the cache."""
        blocks, offsets, (low, top) = self._once(("paged", cache.block_size, str(cache.keys.device)),
                                                 lambda: self._paged(cache.block_size, cache.keys.device))
        if low < 0 or top >= cache.num_blocks:
            raise InputError(f"block_table names a block outside the cache's {cache.num_blocks} blocks")
        return blocks, offsets

    def _paged(self, block_size: int, device):
        if self.block_table is None:
            raise InputError("paged attention needs batch.block_table (the engine's blocks of each request)")
        table, lens = self.block_table, self.seq_lens.to(device=device, dtype=torch.int64)
        if table.dim() != 2 or table.shape[0] < lens.shape[0]:
            raise InputError(f"block_table {tuple(table.shape)} must be [requests={lens.shape[0]}, max_blocks]")
        table = table[:lens.shape[0]].to(device)
        if bool((-(-lens // block_size) > table.shape[1]).any()):  # blocks each request reads
            raise InputError(f"a request's seq_lens {lens.tolist()} exceed its block_table's {table.shape[1]} blocks "
                             f"of {block_size}")
        blocks, offsets = layout.paged_token_coords(lens, table, block_size)
        span = (int(blocks.min()), int(blocks.max())) if blocks.numel() else (0, -1)  # the block ids read
        return blocks, offsets, span


# ---------------------------------------------------------------- the engine's paged cache


class PagedKV:
    """An engine's KV cache addressed in the engine's own layout, never copied whole.

    ``keys`` and ``values``: 4-D views indexed ``[block, offset_in_block, kv_head, dim]`` (any strides: a
    view of the engine's tensor, so writes land in the engine's storage). Keys and values may differ in
    their last dimension only.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InputError(f"PagedKV {name} must be a 4-D tensor [block, offset_in_block, kv_head, dim], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if keys.shape[:3] != values.shape[:3] or keys.device != values.device or keys.dtype != values.dtype:
            raise InputError(f"PagedKV keys {tuple(keys.shape)} {keys.dtype} and values {tuple(values.shape)} "
                             f"{values.dtype} must share blocks, block size, kv heads, dtype and device")
        self.keys, self.values = keys, values

    @classmethod
    def from_vllm_cpu(cls, kv_cache: torch.Tensor, head_dim: int, isa: str = "vec") -> "PagedKV":
        """vLLM's CPU attention cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` as its
        ``cpu_attn_reshape_and_cache`` fills it under ISA ``"vec"`` / ``"vec16"`` (vllm-cpu 0.32): for each
        block and kv head, the block's keys dimension-major (``[head_dim, block_size]``, the key of offset t
        in column t), then its values token-major (``[block_size, head_dim]``). Two strided views, no copy.

        Other ISAs pack their tiles (``"amx"``, vLLM's choice for bfloat16 on AMX machines, interleaves pairs
        of elements) and are refused by name: no 4-D view addresses them."""
        if isa not in ("vec", "vec16"):
            raise UnsupportedError(f"vLLM's CPU KV cache under ISA {isa!r}: only the 'vec' / 'vec16' layouts are "
                                   "addressed in place (run vLLM's CPU attention with one of them)")
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
            raise InputError(f"vLLM CPU KV cache must be [blocks, kv_heads, block_size, 2 * head_dim={2 * head_dim}], "
                             f"got {tuple(kv_cache.shape)}")
        blocks, heads, size = kv_cache.shape[:3]
        if kv_cache.stride(3) != 1 or kv_cache.stride(2) != 2 * head_dim:
            raise InputError(f"vLLM CPU KV cache: each block's kv-head rows must be contiguous, got strides "
                             f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}")
        # One strided view each (a chain of view / select / unflatten / permute is ~6 ops a view, twice per layer):
        # per block and kv head, key [offset t, dim c] at c * size + t, value [t, c] at size * head_dim + t * head_dim + c.
        by_block, by_head, at = kv_cache.stride(0), kv_cache.stride(1), kv_cache.storage_offset()
        shape = (blocks, size, heads, head_dim)
        keys = kv_cache.as_strided(shape, (by_block, 1, by_head, size), at)
        values = kv_cache.as_strided(shape, (by_block, head_dim, by_head, 1), at + size * head_dim)
        return cls(keys, values)

    @property
    def block_size(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.keys.shape[0])


def write_kv(cache: PagedKV, k_new: torch.Tensor, v_new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store a step's new ``k_new / v_new [tokens, Hkv, D]`` at their flat slots in the cache (in place).

    Negative slots (an engine's padding rows, vLLM's PAD_SLOT_ID) are skipped; rows of ``k_new`` past
    ``slot_mapping``'s length too. A slot outside the cache is refused before anything is written.
    """
    n = int(slot_mapping.shape[0])
    if slot_mapping.dim() != 1 or k_new.shape[0] < n or v_new.shape[0] < n:
        raise InputError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} must be 1-D with at most as many "
                         f"entries as k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} rows")
    if k_new.shape[1:] != cache.keys.shape[2:] or v_new.shape[1:] != cache.values.shape[2:]:
        raise InputError(f"write_kv: new keys {tuple(k_new.shape[1:])} / values {tuple(v_new.shape[1:])} per token "
                         f"do not fit the cache's {tuple(cache.keys.shape[2:])} / {tuple(cache.values.shape[2:])}")
    if k_new.dtype != cache.keys.dtype or v_new.dtype != cache.values.dtype:
        raise InputError(f"write_kv: new keys / values are {k_new.dtype} / {v_new.dtype} but the cache holds "
                         f"{cache.keys.dtype}: a cache of another dtype (e.g. fp8 KV) is not supported")
    if n == 0:
        return
    slots = slot_mapping.to(device=cache.keys.device, dtype=torch.int64)
    low, top = (int(x) for x in torch.aminmax(slots))
    if top >= cache.num_blocks * cache.block_size:
        raise InputError(f"write_kv: a slot is past the cache's {cache.num_blocks} blocks of {cache.block_size}")
    k_new, v_new = k_new[:n], v_new[:n]
    if low < 0:  # padding rows: only the real ones are written (no bool-mask copies when there are none)
        real = slots >= 0
        slots, k_new, v_new = slots[real], k_new[real], v_new[real]
    blocks, offsets = layout.slot_coords(slots, cache.block_size)
    cache.keys[blocks, offsets] = k_new
    cache.values[blocks, offsets] = v_new


def decode_slot_mapping(cache: PagedKV, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the flat slot of each request's newest token (position ``seq_lens - 1``) through its
    block table -- the slot mapping of a decode step, for engines that hand over the block table only."""
    blocks, offsets = layout.token_slots(seq_lens.to(torch.int64) - 1, 1, cache.keys, block_table)
    return (blocks * cache.block_size + offsets).reshape(-1)


def request_kv(cache: PagedKV, batch: ServingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's ``seq_lens`` keys / values, oldest first, packed ``[sum(seq_lens), Hkv, D]`` (copies
    of the blocks the requests use, read through ``batch.block_table``): one gather each, straight into the
    packed layout, at coordinates the batch computes once (:meth:`ServingBatch.paged_keys`)."""
    blocks, offsets = batch.paged_keys(cache)
    return cache.keys[blocks, offsets], cache.values[blocks, offsets]


# ---------------------------------------------------------------- attention


def varlen_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ServingBatch, scale: float,
                     *, spec=None, backend=None) -> torch.Tensor:
    """``q [tokens, Hq, D]`` (requests packed as ``batch.query_start_loc`` says), ``keys / values
    [sum(seq_lens), Hkv, D]`` (each request's keys contiguous, oldest first) -> ``[tokens, Hq, Dv]``.
    Rows past ``query_start_loc[-1]`` (an engine's padding) are zeros."""
    cu_q, cu_k, n_q, n_k, max_q, max_k = batch.attention_shape(q.shape[0], keys.shape[0], q.device)
    if n_q == 0:
        return q.new_zeros((q.shape[0], q.shape[1], values.shape[-1]))
    out = flash_attn_varlen_func(q[:n_q], keys[:n_k], values[:n_k], cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                 causal=True, spec=spec, backend=backend)
    if n_q == q.shape[0]:  # no padding rows: the output as it is (no zeroed copy)
        return out
    return torch.cat([out, out.new_zeros((q.shape[0] - n_q, *out.shape[1:]))])


def paged_attention(q: torch.Tensor, cache: PagedKV, batch: ServingBatch, scale: float, *, spec=None,
                    backend=None) -> torch.Tensor:
    """``q [tokens, Hq, D]`` against the engine's cache (the step's new keys already stored, :func:`write_kv`)
    -> ``[tokens, Hq, Dv]``: the bits of :func:`varlen_attention` on each request's keys alone."""
    keys, values = request_kv(cache, batch)
    return varlen_attention(q, keys, values, batch, scale, spec=spec, backend=backend)


# ---------------------------------------------------------------- Gated DeltaNet state beside the cache


class GdnStates:
    """Each request's Gated DeltaNet state per layer: ``(conv_state, rule_state)`` (the conv window and a
    :class:`hal.GatedDeltaRuleState`), kept beside an engine's paged cache, which holds attention only.

    Keyed by an opaque request key (any hashable: the engine's request id), never by batch row, so a
    request's state does not depend on the rows next to it. Every state carries the token position it was
    computed up to; a chunk continues only from the state at its own start position (0: a fresh state).
    The latest ``KEEP`` positions per layer are kept (an engine may roll a request back by one token).

    ``start(key)`` a new request (or one restarting from token 0); ``advance`` stores a layer's state after
    tokens ``start:end``; ``lookup`` the state a chunk starting at ``start`` continues; ``finish`` drops a
    finished request; ``preempt`` drops a preempted one (the engine recomputes it from token 0);
    ``fork(parent, children)`` starts each child from the parent's states (parallel sampling).
    ``states``: key -> {layer: {position: (conv_state, rule_state)}}.
    """

    KEEP = 2

    def __init__(self):
        self.states: dict = {}

    def __contains__(self, key) -> bool:
        return key in self.states

    def start(self, key) -> None:
        self.states[key] = {}

    def advance(self, key, layer: int, start: int, end: int, conv_state, rule_state) -> None:
        if key not in self.states:
            raise InputError(f"Gated DeltaNet state of request {key!r}: advance before start (call start(key) first)")
        if not 0 <= start < end:
            raise InputError(f"Gated DeltaNet state of request {key!r}: tokens {start}:{end} are no chunk")
        layers = self.states[key]
        if start == 0:  # a fresh prefill (first, or after a restart): older states are of another run
            layers.pop(layer, None)
        by_pos = layers.setdefault(layer, {})
        by_pos[end] = (conv_state, rule_state)
        for old in list(by_pos)[:-self.KEEP]:  # insertion order: the oldest stored go first
            del by_pos[old]

    def positions(self, key, layer: int) -> list[int]:
        """The token positions a state of ``key`` in ``layer`` is held at, ascending."""
        return sorted(self.states.get(key, {}).get(layer, {}))

    def lookup(self, key, layer: int, start: int):
        """(conv_state, rule_state) for ``key``'s chunk starting at token ``start`` in ``layer``; None: fresh."""
        if start == 0:
            return None
        by_pos = self.states.get(key, {}).get(layer, {})
        if start in by_pos:
            return by_pos[start]
        raise UnsupportedError(
            f"engine request {key!r} continues at token {start} in Gated DeltaNet layer {layer}, but lockstep holds "
            f"its state at {sorted(by_pos) or 'no position'}: the engine skipped or replayed tokens this state was "
            "not built from (shared prefixes are not supported on GDN models)")

    def finish(self, key) -> None:
        self.states.pop(key, None)

    def preempt(self, key) -> None:
        """The engine dropped the request's cache and will recompute it from token 0: its states go too."""
        self.states.pop(key, None)

    def fork(self, parent, children) -> None:
        """Each child starts from the parent's states (immutable: shared, not copied)."""
        src = self.states.get(parent, {})
        for child in children:
            self.states[child] = {layer: dict(by_pos) for layer, by_pos in src.items()}


def gdn_step(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor, conv_bias,
             chunks, lookup, store, key_dim: int, head_k_dim: int, head_v_dim: int, *, spec=None,
             backend=None) -> torch.Tensor:
    """One engine step of a Gated DeltaNet layer's sequence part, engine-neutral (plain tensors, two callbacks).

    ``mixed [1, tokens, 2 key_dim + value_dim]`` (the conv input, requests packed), the gates ``g, beta
    [1, tokens, HV]``, the conv weight ``[C, kernel]`` (and bias or None); ``chunks``: one ``(t0, t1, start)``
    per request, its rows ``t0:t1`` of the step continuing its tokens from position ``start``.
    ``lookup(i, start)`` gives request ``i``'s ``(conv_state, rule_state)`` at ``start`` (None: fresh, start 0),
    ``store(i, start, end, conv_state, rule_state)`` keeps its states after the chunk (e.g. :class:`GdnStates`).

    Each request runs alone (``hal.gdn_causal_conv1d`` from its conv window, then the gated delta rule from
    its :class:`hal.GatedDeltaRuleState`: the chunked op for a prefill chunk, the recurrent op for one decode
    token after a state, the same bits), so neighbours and where the engine cut the prompt change no bit.
    ``spec`` / ``backend``: the gated delta rule's (e.g. a fast patch's ``hal.spec.GDN_FAST`` on triton; None: the
    default spec, dispatched per call); the conv keeps its strict default.
    Returns ``o [1, tokens, HV, dv]`` (rows of no chunk: zeros).
    """
    import hal
    n = mixed.shape[1]
    out = mixed.new_zeros((1, n, g.shape[-1], head_v_dim))
    for i, (t0, t1, start) in enumerate(chunks):
        if t1 == t0:
            continue
        prev = lookup(i, start)
        y, conv1 = hal.gdn_causal_conv1d(mixed[:, t0:t1], conv_weight, conv_bias,
                                         conv_state=None if prev is None else prev[0], activation="silu")
        yq, yk, yv = torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
        rule = hal.fused_recurrent_gated_delta_rule if prev is not None and t1 - t0 == 1 else hal.chunk_gated_delta_rule
        m = t1 - t0
        o, st = rule(yq.reshape(1, m, -1, head_k_dim), yk.reshape(1, m, -1, head_k_dim),
                     yv.reshape(1, m, -1, head_v_dim), g[:, t0:t1], beta[:, t0:t1],
                     initial_state=None if prev is None else prev[1], output_final_state="state",
                     use_qk_l2norm_in_kernel=True, spec=spec, backend=backend)
        store(i, start, start + m, conv1, st)
        out[:, t0:t1] = o
    return out
