"""Per-instance forwards that route an HF model's computation through lockstep's ops.

Each function here is installed as ``module.__dict__["forward"]`` (see transformers.py) and mirrors the
HF class's forward line by line, with every op that rounds replaced by lockstep's: linears
(hal.linear under the patch's matmul spec, matmul.py), norms (hal.rms_norm), activations
(hal.silu_mul, hal.sigmoid), rotary
(hal.rotary_cos_sin, hal.apply_rotary), attention (the "lockstep" attention function), and the
Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (hal.gdn_causal_conv1d, hal.gdn_gating,
hal.*_gated_delta_rule; one forward, the two differ only in how the projections are laid out).
What stays torch is exact: reshapes, gathers, concatenation, residual adds and products of two
rounded numbers (one IEEE rounding each, the same wherever the element sits).
"""
from __future__ import annotations

import torch

import hal
from ...errors import UnsupportedError
from ...ops_registry import TORCH_OP, route, routing, tracing
from ...torch_ops import Refused, TorchOp, register
from .attention import (attend, check_attention_args, masked_attention, segments_from_cu,
                           segments_from_positions, several_sequences_per_row, visibility)
from .matmul import DEFAULT
from ...serving import gdn_step
from .engine import gdn_engine_states, hf_paged_attention, is_engine_cache

# A patch's record on each module it owns; verify.py reads it too, so it lives here, below both.
OWNER_ATTR = "_lockstep_patch"  # every module of a patched tree holds its Patch under this name in __dict__


def patch_owner(mod):
    """The active Patch that ``mod`` belongs to, or None."""
    p = mod.__dict__.get(OWNER_ATTR)
    return p if p is not None and p.active else None


def refresh_stale(model) -> None:
    """Bring every patch over ``model``'s modules up to date (what the next forward would do)."""
    for p in {id(p): p for p in map(patch_owner, model.modules()) if p is not None and p.stale}.values():
        p.refresh()


# ---------------------------------------------------------------- linear, norms, MLP, rotary


def linear(mod, x, *, mm=DEFAULT):
    """``nn.Linear`` under the patch's matmul spec (``mm``: matmul.PatchMatmul; weights prepared once if exact)."""
    return mm.linear(x, mod.weight, mod.bias, key=(id(mod), "weight"))


def rms_norm(mod, x):
    """``w * norm(x)`` (Llama, Qwen2/3, Mistral)."""
    w = mod.weight
    return hal.rms_norm(x, w if w.dtype == x.dtype else w.to(x.dtype), _eps(mod))


def rms_norm_one_plus(mod, x):
    """``(1 + w) * norm(x)`` (Qwen3NextRMSNorm): 1 + w is one exact-per-element float32 add."""
    w = 1.0 + mod.weight.float()
    y = hal.rms_norm(x.float(), w, _eps(mod))
    return y.to(x.dtype)


def rms_norm_gated(mod, x, gate):
    """Qwen3NextRMSNormGated: ``w * norm(x) * silu(gate)`` in float32, rounded to x's dtype."""
    if getattr(mod, "activation", "silu") != "silu":
        raise UnsupportedError(f"{type(mod).__name__} with activation {mod.activation!r}: only silu is supported")
    y = hal.rms_norm(x.float(), mod.weight.float(), _eps(mod))
    return hal.silu_mul(gate.float(), y).to(x.dtype)


def _eps(mod) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(mod, name):
            return float(getattr(mod, name))
    raise UnsupportedError(f"{type(mod).__name__}: cannot find the norm's epsilon (variance_epsilon / eps)")


def mlp(mod, x):
    """gate/up/down MLP with SiLU: ``down(silu(gate(x)) * up(x))``, the product rounded once."""
    return mod.down_proj(hal.silu_mul(mod.gate_proj(x), mod.up_proj(x)))


def _rotary_tables(mod, position_ids):
    """float32 half-width ``(cos, sin)`` ``position_ids.shape + (rotary_dim // 2,)`` from the module's inv_freq."""
    inv_freq = mod.inv_freq.float()
    cos, sin = hal.rotary_cos_sin(position_ids, 2 * inv_freq.shape[0], inv_freq=inv_freq)
    scale = float(getattr(mod, "attention_scaling", 1.0))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotary(mod, x, position_ids):
    """cos/sin for HF's attention, float32 ``[..., rotary_dim]`` (the two halves repeated, as HF's).

    Kept in float32: lockstep's attention forward hands the first half to hal.apply_rotary.
    """
    cos, sin = _rotary_tables(mod, position_ids)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def rotary_mrope(mod, x, position_ids):
    """Qwen3.5's interleaved multimodal RoPE (Qwen3_5TextRotaryEmbedding): one table per position row
    (temporal, height, width: ``position_ids [3, B, T]``, or ``[B, T]`` used for all three), then
    frequency ``i`` taken from row 1 when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, from row 2 when
    ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, else from row 0. The pick is a copy (exact); for
    text the three rows are equal and this is plain RoPE over the partial rotary dims.
    """
    cos, sin = _rotary_tables(mod, position_ids.expand(3, -1, -1))
    section = list(mod.mrope_section)
    if len(section) != 3:
        raise UnsupportedError(f"{type(mod).__name__}: mrope_section {section} (expected 3 sections: t, h, w)")
    cos, sin = mrope_interleave(cos, section), mrope_interleave(sin, section)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def mrope_interleave(table, section):
    """Qwen3.5's interleaved mRoPE pick from per-row half tables ``table [3, ..., rotary_dim // 2]`` (t, h, w):
    frequency ``i`` from row 1 when ``i % 3 == 1`` and ``i < 3 * section[1]``, from row 2 when ``i % 3 == 2``
    and ``i < 3 * section[2]``, else row 0 (copies only; the vLLM shim uses it too)."""
    out = table[0].clone()
    for row in (1, 2):
        pick = slice(row, 3 * section[row], 3)
        out[..., pick] = table[row][..., pick]
    return out


# ---------------------------------------------------------------- attention module


def _check_cache_layer(cache, layer_idx):
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        name = type(layers[layer_idx]).__name__
        if "Sliding" in name or "Chunked" in name:
            raise UnsupportedError(f"cache layer {layer_idx} is a {name}: caches that evict keys are not supported "
                                   "by lockstep's transformers integration (use DynamicCache or StaticCache)")


# Attention classes whose q_proj also yields a per-head output gate: ``out * sigmoid(gate)`` before o_proj.
GATED_ATTENTION = {"Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention"}


def attention(mod, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *,
              attention_choice=(None, None), **kwargs):
    """Llama / Qwen2 / Qwen3 / Mistral / Qwen3-Next and Qwen3.5 (gated) self-attention. ``attention_choice``: the
    patch's (spec, backend) of its attention (policy.PatchPolicy; None, None: the default spec, dispatched per call)."""
    spec, backend = attention_choice
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    else:
        kwargs.pop("past_key_values", None)
    if getattr(mod, "sliding_window", None) is not None:
        raise UnsupportedError(f"{type(mod).__name__} layer {mod.layer_idx} uses sliding-window attention, which "
                               "lockstep's transformers integration does not support")
    shape = hidden_states.shape[:-1]
    hd = mod.head_dim
    gated = type(mod).__name__ in GATED_ATTENTION
    q = mod.q_proj(hidden_states)
    if gated:
        q, gate = torch.chunk(q.view(*shape, -1, hd * 2), 2, dim=-1)
        gate = gate.reshape(*shape, -1)
    q = q.reshape(*shape, -1, hd)
    k = mod.k_proj(hidden_states).view(*shape, -1, hd)
    v = mod.v_proj(hidden_states).view(*shape, -1, hd)
    if hasattr(mod, "q_norm"):
        q, k = mod.q_norm(q), mod.k_norm(k)
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(-2).float(), sin[..., :half].unsqueeze(-2).float()
    q, k = hal.apply_rotary(q, c, s), hal.apply_rotary(k, c, s)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None and is_engine_cache(cache):  # transformers' continuous-batching engine
        out = hf_paged_attention(mod, q, k, v, cache, kwargs, spec=spec, backend=backend)
        return mod.o_proj(out * hal.sigmoid(gate) if gated else out), None
    if cache is not None and tracing():
        raise UnsupportedError("a KV cache in a patched forward under torch.compile / torch.export is not supported "
                               "yet (lockstep marks caches filled by packed rows, a check that reads the mask's "
                               "values); compile the forward with use_cache=False")
    if cache is not None:
        _check_cache_layer(cache, mod.layer_idx)
        if getattr(cache, "_lockstep_packed", False) and cache.get_seq_length(mod.layer_idx) > 0:
            raise UnsupportedError("this cache was filled by a packed forward (several sequences in one row); "
                                   "continuing it would let them attend to each other. Decode from per-row caches.")
        k, v = cache.update(k, v, mod.layer_idx, kwargs=kwargs)
    dropout = 0.0 if not mod.training else float(getattr(mod, "attention_dropout", 0.0))
    check_attention_args(dropout)
    masks = (attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    causal = bool(getattr(mod, "is_causal", True))
    if cache is None:
        out = masked_attention(q, k, v, *masks, causal, mod.scaling, spec=spec, backend=backend)
    else:  # eager only (refused above under tracing): the cache is marked from the visibility
        vis = visibility(q.shape[0], q.shape[2], k.shape[2], *masks, causal)
        if several_sequences_per_row(vis):
            cache._lockstep_packed = True
        out = attend(q, k, v, vis, mod.scaling, spec=spec, backend=backend)
    out = out.reshape(*shape, -1)
    if gated:
        out = out * hal.sigmoid(gate)
    return mod.o_proj(out), None


# ---------------------------------------------------------------- Gated DeltaNet (Qwen3-Next, Qwen3.5)


def _runs(B, T, mask2d, position_ids, cu):
    """Sequences in a padded / packed batch: list of (row, t0, t1) runs of real tokens."""
    keep = torch.ones(B, T, dtype=torch.bool) if mask2d is None else mask2d.to("cpu").bool()
    if keep.shape != (B, T):
        raise UnsupportedError(f"GatedDeltaNet: padding mask of shape {tuple(keep.shape)}, expected [{B}, {T}]")
    if cu is not None:
        seg = segments_from_cu(cu, T, "cu_seq_lens_q").expand(B, T)
    elif position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == T and T > 1:
        seg = segments_from_positions(position_ids).expand(B, T)
    else:
        seg = torch.zeros(B, T, dtype=torch.int64)
    runs = []
    K, S = keep.tolist(), seg.tolist()
    for b in range(B):
        t = 0
        while t < T:
            if not K[b][t]:
                t += 1
                continue
            t1 = t + 1
            while t1 < T and K[b][t1] and S[b][t1] == S[b][t]:
                t1 += 1
            runs.append((b, t, t1))
            t = t1
    return runs


# Qwen3.5's GDN: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a with heads laid out flat.
# Qwen3-Next's: fused in_proj_qkvz / in_proj_ba grouped per key head (fix_query_key_value_ordering).
SPLIT_PROJECTION_GDN = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}


def gdn_projections(mod, h):
    """``(mixed_qkv [1, n, 2 key_dim + value_dim], z [1, n, Hv, dv], b [1, n, Hv], a [1, n, Hv])`` of packed
    tokens ``h [1, n, hidden]``: the conv input in the flat [q | k | v] order both models convolve."""
    n = h.shape[1]
    if type(mod).__name__ in SPLIT_PROJECTION_GDN:
        z = mod.in_proj_z(h).reshape(1, n, -1, mod.head_v_dim)
        return mod.in_proj_qkv(h), z, mod.in_proj_b(h), mod.in_proj_a(h)
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(h), mod.in_proj_ba(h))
    return torch.cat([x.reshape(1, n, -1) for x in (q, k, v)], dim=-1), z, b, a


def gated_delta_net(mod, hidden_states, cache=None, attention_mask=None, *, rule_choice=(None, None), **kwargs):
    """Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet: every sequence (padded row or packed run) computed
    as if alone. ``rule_choice``: the patch's (spec, backend) of its gated delta rule (policy.PatchPolicy; None,
    None: the default spec, dispatched per call); the conv and the gates take the strict default always.

    Real tokens are gathered into one packed row with ``cu_seqlens`` (padding dropped, packed
    sequences split), so the conv window and the gated-delta-rule chunk grid start at each
    sequence's first token. With a cache, lockstep's exact state (conv window and
    :class:`hal.GatedDeltaRuleState`) is kept beside HF's in ``cache._lockstep_gdn[layer]``; HF's own
    tensors are still updated for its bookkeeping but are never read back.
    """
    if cache is None:
        cache = kwargs.pop("cache_params", None)
    if getattr(mod, "activation", "silu") != "silu":
        raise UnsupportedError(f"GatedDeltaNet activation {mod.activation!r}: only silu is supported")
    if cache is not None and tracing():
        raise UnsupportedError("a cached GatedDeltaNet forward under torch.compile / torch.export is not supported yet "
                               "(its exact states live in Python objects beside the cache); compile the forward "
                               "with use_cache=False")
    if tracing():
        return _traced_gated_delta_net(mod, hidden_states, attention_mask, kwargs.get("cu_seq_lens_q"), rule_choice)
    if cache is not None and is_engine_cache(cache):  # transformers' continuous-batching engine
        return _engine_gated_delta_net(mod, hidden_states, gdn_engine_states(cache), kwargs["cu_seq_lens_q"],
                                       rule_choice)
    B, T, H = hidden_states.shape
    pos = mod.__dict__.get("_lockstep_position_ids")
    runs = _runs(B, T, attention_mask, pos, kwargs.get("cu_seq_lens_q"))
    one_per_row = [r[0] for r in runs] == list(range(B))
    store = cache.__dict__.setdefault("_lockstep_gdn", {}) if cache is not None else None
    prev = store.get(mod.layer_idx) if store is not None else None
    if prev is not None:
        if prev["packed"]:
            raise UnsupportedError("this cache was filled by a packed forward; its GatedDeltaNet states belong to "
                                   "packed sequences, not rows, and cannot be continued")
        if not one_per_row:
            raise UnsupportedError("continuing a cached GatedDeltaNet needs exactly one run of real tokens per row "
                                   f"(got runs {runs}); padding inside a continuation chunk is not supported")
    out = hidden_states.new_zeros((B, T, mod.out_proj.weight.shape[0]))
    if not runs:
        return out
    dev = hidden_states.device
    bi = torch.cat([torch.full((t1 - t0,), b) for b, t0, t1 in runs]).to(dev)
    ti = torch.cat([torch.arange(t0, t1) for b, t0, t1 in runs]).to(dev)
    lens = [t1 - t0 for _, t0, t1 in runs]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(dev)
    n = int(cu[-1])
    h = hidden_states[bi, ti].unsqueeze(0)
    mixed, z, b, a = gdn_projections(mod, h)
    conv0 = prev["conv"] if prev is not None else None
    y, conv1 = hal.gdn_causal_conv1d(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, conv_state=conv0,
                                     activation="silu", cu_seqlens=cu)
    q, k, v = torch.split(y, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(1, n, -1, mod.head_k_dim)
    k = k.reshape(1, n, -1, mod.head_k_dim)
    v = v.reshape(1, n, -1, mod.head_v_dim)
    g, beta = hal.gdn_gating(mod.A_log, a, mod.dt_bias, b)
    decode = prev is not None and all(x == 1 for x in lens)
    rule = hal.fused_recurrent_gated_delta_rule if decode else hal.chunk_gated_delta_rule
    o, state = rule(q, k, v, g, beta, initial_state=prev["state"] if prev is not None else None,
                    output_final_state="state" if cache is not None else False, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True, spec=rule_choice[0], backend=rule_choice[1])
    if cache is not None:
        store[mod.layer_idx] = dict(conv=conv1, state=state, packed=not one_per_row)
        _hf_bookkeeping(mod, cache, mixed, bi, ti, B, T, state if one_per_row else None)
    dv = mod.head_v_dim
    o = mod.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, n, -1)
    return out.index_put((bi, ti), mod.out_proj(o)[0])


def _traced_gated_delta_net(mod, hidden_states, attention_mask, cu_seq_lens_q, rule_choice=(None, None)):
    """:func:`gated_delta_net` without a cache, as torch.compile / torch.export trace it: no host read.

    Which tokens form which sequence is read from the mask and positions, values only the op's kernel may
    read (:func:`packed_conv_and_rule`, one ``torch.ops.lockstep.hf_gated_delta_net``). Everything per
    token runs over all B x T tokens, padding included (projections, gates, the gated norm, out_proj:
    lockstep gives each row the bits it has alone); padding's outputs are then zeroed, as eagerly.
    """
    B, T, _ = hidden_states.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
        raise UnsupportedError(f"GatedDeltaNet: padding mask of shape {tuple(attention_mask.shape)}, "
                               f"expected [{B}, {T}]")
    pos = mod.__dict__.get("_lockstep_position_ids")
    mixed, z, b, a = gdn_projections(mod, hidden_states.reshape(1, B * T, -1))
    g, beta = hal.gdn_gating(mod.A_log, a, mod.dt_bias, b)
    o = packed_conv_and_rule(mixed.reshape(B, T, -1), g.reshape(B, T, -1), beta.reshape(B, T, -1),
                             mod.conv1d.weight.squeeze(1), mod.conv1d.bias, attention_mask, pos, cu_seq_lens_q,
                             mod.key_dim, mod.head_k_dim, mod.head_v_dim, *rule_choice)
    dv = mod.head_v_dim
    out = mod.out_proj(mod.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, T, -1))
    if attention_mask is None:
        return out
    return torch.where(attention_mask.bool().unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))


def packed_conv_and_rule(mixed, g, beta, conv_weight, conv_bias, attention_mask, position_ids, cu_seq_lens_q,
                         key_dim, head_k_dim, head_v_dim, spec=None, backend=None):
    """The kernel of ``torch.ops.lockstep.hf_gated_delta_net``: the real tokens of ``mixed [B, T, C]`` (the conv
    input) and the gates ``g, beta [B, T, HV]`` packed as :func:`gated_delta_net` packs them (from the mask and
    positions), the conv and the chunk rule over the packed sequences, then ``o [B, T, HV, dv]`` scattered
    back (zeros at padding). While tracing, the call is that op. ``spec`` / ``backend``: the rule's; the conv takes
    them only when the spec is strict (its companion), else its strict default (it has no fast spec)."""
    if routing("hf_gated_delta_net", mixed, g, beta, conv_weight, conv_bias, attention_mask, position_ids) is TORCH_OP:
        return route("hf_gated_delta_net", mixed, g, beta, conv_weight, conv_bias, attention_mask, position_ids,
                     cu_seq_lens_q, key_dim, head_k_dim, head_v_dim, spec=spec, backend=backend)
    B, T, _ = mixed.shape
    out = mixed.new_zeros((B, T, g.shape[-1], head_v_dim))
    runs = _runs(B, T, attention_mask, position_ids, cu_seq_lens_q)
    if not runs:
        return out
    dev = mixed.device
    bi = torch.cat([torch.full((t1 - t0,), b) for b, t0, t1 in runs]).to(dev)
    ti = torch.cat([torch.arange(t0, t1) for b, t0, t1 in runs]).to(dev)
    cu = torch.tensor([0] + [t1 - t0 for _, t0, t1 in runs], dtype=torch.int64).cumsum(0).to(dev)
    n = int(cu[-1])
    companion = spec is None or hal.spec.resolve("gated_delta_rule", spec).policy == hal.spec.STRICT
    y, _ = hal.gdn_causal_conv1d(mixed[bi, ti].unsqueeze(0), conv_weight, conv_bias, activation="silu", cu_seqlens=cu,
                                 spec=spec if companion else None, backend=backend if companion else None)
    q, k, v = torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
    o, _ = hal.chunk_gated_delta_rule(q.reshape(1, n, -1, head_k_dim), k.reshape(1, n, -1, head_k_dim),
                                      v.reshape(1, n, -1, head_v_dim), g[bi, ti].unsqueeze(0), beta[bi, ti].unsqueeze(0),
                                      cu_seqlens=cu, use_qk_l2norm_in_kernel=True, spec=spec, backend=backend)
    return out.index_put((bi, ti), o[0])


def _engine_gated_delta_net(mod, hidden_states, states, cu_seq_lens_q, rule_choice=(None, None)):
    """One engine step of a GatedDeltaNet layer: ``hidden_states [1, tokens, H]``, requests packed as
    ``cu_seq_lens_q`` says (rows past its end: the engine's padding, zeros out).

    The projections, gates and norm run over the whole step (lockstep's ops give each token the bits it has
    alone); the conv and the gated delta rule run per request from its own state in ``states``
    (hal.serving.gdn_step, shared with the vLLM shim).
    """
    cu = [int(x) for x in cu_seq_lens_q.tolist()]
    n = cu[-1]
    pos = mod.__dict__.get("_lockstep_position_ids")
    if pos is None or len(states.step_requests) < len(cu) - 1:
        raise UnsupportedError("GatedDeltaNet in the engine: the step's positions / request ids are missing "
                               "(the engine must be set up by lockstep on a lockstep-patched model)")
    starts = pos.reshape(-1, pos.shape[-1])[0].tolist()  # [B=1, T] (or mRoPE rows: text positions alike)
    h = hidden_states[:, :n]
    mixed, z, b, a = gdn_projections(mod, h)
    g, beta = hal.gdn_gating(mod.A_log, a, mod.dt_bias, b)
    chunks = [(cu[row], cu[row + 1], int(starts[cu[row]]) if cu[row + 1] > cu[row] else 0)
              for row in range(len(cu) - 1)]
    o = gdn_step(mixed, g, beta, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, chunks,
                 lambda row, start: states.lookup(row, mod.layer_idx, start),
                 lambda row, start, end, conv, st: states.store(row, mod.layer_idx, start, end, conv, st),
                 mod.key_dim, mod.head_k_dim, mod.head_v_dim, spec=rule_choice[0], backend=rule_choice[1])
    out = hidden_states.new_zeros((1, hidden_states.shape[1], mod.out_proj.weight.shape[0]))
    if n == 0:
        return out
    dv = mod.head_v_dim
    o = mod.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, n, -1)
    out[:, :n] = mod.out_proj(o)
    return out


def _hf_bookkeeping(mod, cache, mixed, bi, ti, B, T, state):
    """Keep HF's linear-attention cache layer in step (has_previous_state, shapes); never read back."""
    with torch.no_grad():
        padded = mixed.new_zeros((B, T, mixed.shape[-1])).index_put((bi, ti), mixed[0].detach())
        cache.update_conv_state(padded.transpose(1, 2), mod.layer_idx, conv_kernel_size=mod.conv_kernel_size)
        if state is not None:
            cache.update_recurrent_state(state.final_state.detach(), mod.layer_idx)


def decoder_position_hook(layer, args, kwargs):
    """Forward pre-hook on a Qwen3-Next / Qwen3.5 decoder layer: hand position_ids to its GatedDeltaNet.

    HF's decoder layer does not pass position_ids to the linear-attention block, so packed
    sequences would be invisible to it.
    """
    la = getattr(layer, "linear_attn", None)
    if la is not None:
        la.__dict__["_lockstep_position_ids"] = kwargs.get("position_ids")
    return None


# ---------------------------------------------------------------- Qwen3-Next / Qwen3.5-MoE MoE

# Routers that always renormalise their top-k weights (no norm_topk_prob attribute).
ALWAYS_NORMALISED_ROUTER = {"Qwen3_5MoeTopKRouter"}


def router(mod, hidden_states, *, mm=DEFAULT):
    """Top-k router: softmax (hal), top-k with ties broken by lower expert index, normalised in k order."""
    h = hidden_states.reshape(-1, mod.hidden_dim)
    if mod.weight.dtype == h.dtype:
        logits = mm.linear(h, mod.weight, key=(id(mod), "weight"))
    else:  # a converted copy: a temporary, not cached
        logits = mm.linear(h, mod.weight.to(h.dtype))
    vals, idx = top_k_route(logits, mod.top_k, type(mod).__name__ in ALWAYS_NORMALISED_ROUTER or mod.norm_topk_prob)
    return logits, vals, idx


def top_k_route(logits, top_k: int, normalise: bool):
    """``(weights [tokens, k] in logits' dtype, expert ids [tokens, k])`` from router logits: ``hal.softmax`` in
    float32, the k largest with ties broken by the lower expert index, optionally divided by their sum taken
    left to right. Engine-neutral (the vLLM shim routes with it too)."""
    probs = hal.softmax(logits.float(), -1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: equal probs keep index order
    vals, idx = vals[:, :top_k], idx[:, :top_k]
    if normalise:
        total = vals[:, 0]
        for j in range(1, top_k):  # a fixed left-to-right sum, not a vectorised reduction
            total = total + vals[:, j]
        vals = vals / total.unsqueeze(-1)
    return vals.to(logits.dtype), idx


def experts(mod, hidden_states, top_k_index, top_k_weights, *, mm=DEFAULT):
    """Each token's expert outputs, weighted and summed in rank order (rank 0 first)."""
    if getattr(mod, "has_bias", False):
        raise UnsupportedError(f"{type(mod).__name__} with expert biases is not supported")
    if tracing():
        return _dense_experts(mod, hidden_states, top_k_index, top_k_weights, mm)

    def expert(e, x):
        gate, up = mm.linear(x, mod.gate_up_proj[e], key=(id(mod), "gate_up_proj", e)).chunk(2, dim=-1)
        return mm.linear(hal.silu_mul(gate, up), mod.down_proj[e], key=(id(mod), "down_proj", e))

    return routed_experts(hidden_states, top_k_index, top_k_weights, mod.num_experts, expert)


def routed_experts(hidden_states, top_k_index, top_k_weights, num_experts: int, expert):
    """lockstep's defined MoE order, engine-neutral: for each rank ``j`` (rank 0 first), every token's chosen
    expert ``expert(e, rows) -> [rows, H]`` on its rows, times the token's weight (rounded once), the ranks
    summed left to right. Ids outside ``[0, num_experts)`` contribute nothing."""
    out = torch.zeros_like(hidden_states)
    for j in range(top_k_index.shape[-1]):
        acc = torch.zeros_like(hidden_states)
        col = top_k_index[:, j]
        for e in torch.unique(col).tolist():
            if e < 0 or e >= num_experts:
                continue
            rows = (col == e).nonzero()[:, 0]
            y = expert(e, hidden_states[rows])
            acc = acc.index_put((rows,), y * top_k_weights[rows, j, None].to(y.dtype))
        out = out + acc
    return out


def _dense_experts(mod, hidden_states, top_k_index, top_k_weights, mm):
    """:func:`experts` as torch.compile / torch.export trace it: which experts a token chose is a value, so every
    expert runs over every token and each token keeps the outputs of the ones it chose (num_experts times the
    expert work: the price of a graph without host reads). Each row's bits are the sparse form's (lockstep's
    linears give a row the bits it has alone), summed in the same rank order."""
    out = torch.zeros_like(hidden_states)
    ys = []
    for e in range(mod.num_experts):
        gate, up = mm.linear(hidden_states, mod.gate_up_proj[e], key=(id(mod), "gate_up_proj", e)).chunk(2, dim=-1)
        ys.append(mm.linear(hal.silu_mul(gate, up), mod.down_proj[e], key=(id(mod), "down_proj", e)))
    for j in range(top_k_index.shape[-1]):
        acc = torch.zeros_like(hidden_states)
        col = top_k_index[:, j, None]
        for e, y in enumerate(ys):
            acc = torch.where(col == e, y * top_k_weights[:, j, None].to(y.dtype), acc)
        out = out + acc
    return out


def sparse_moe_block(mod, hidden_states):
    """Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock: routed experts + sigmoid-gated shared expert."""
    B, T, H = hidden_states.shape
    h = hidden_states.reshape(-1, H)
    shared = mod.shared_expert(h)
    _, weights, index = mod.gate(h)
    routed = mod.experts(h, index, weights)
    shared = hal.sigmoid(mod.shared_expert_gate(h)) * shared
    return (routed + shared).reshape(B, T, H)


# ---------------------------------------------------------------- the integration's own torch op
# The patched GatedDeltaNet's mask / positions -> packed sequences (a plan that reads values), conv and chunk rule
# in one kernel (packed_conv_and_rule): o [B, T, HV, dv] with zeros at padding.
register(TorchOp(
    "hf_gated_delta_net", "chunk_gated_delta_rule", packed_conv_and_rule,
    "Tensor mixed, Tensor g, Tensor beta, Tensor conv_weight, Tensor? conv_bias, Tensor? attention_mask, "
    "Tensor? position_ids, Tensor? cu_seq_lens_q, int key_dim, int head_k_dim, int head_v_dim", "Tensor",
    fake=lambda mixed, g, beta, conv_weight, conv_bias, attention_mask, position_ids, cu_seq_lens_q, key_dim,
    head_k_dim, head_v_dim, spec, backend: mixed.new_empty((*mixed.shape[:2], g.shape[-1], head_v_dim)),
    backward=Refused("the patched HF GatedDeltaNet under torch.compile / torch.export has no backward pass yet; "
                     "compile the patched model for inference (torch.no_grad()) or train it eagerly")))
