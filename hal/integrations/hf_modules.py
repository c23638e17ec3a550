"""Per-instance forwards that route an HF model's computation through lockstep's ops.

Each function here is installed as ``module.__dict__["forward"]`` (see transformers.py) and mirrors the
HF class's forward line by line, with every op that rounds replaced by lockstep's: linears
(hal.linear under the patch's matmul spec, hf_matmul.py), norms (hal.rms_norm), activations
(hal.silu_mul, hal.sigmoid), rotary
(hal.rotary_cos_sin, hal.apply_rotary), attention (the "lockstep" attention function), and the
Qwen3-Next Gated DeltaNet layer (hal.gdn_causal_conv1d, hal.gdn_gating, hal.*_gated_delta_rule).
What stays torch is exact: reshapes, gathers, concatenation, residual adds and products of two
rounded numbers (one IEEE rounding each, the same wherever the element sits).
"""
from __future__ import annotations

import torch

import hal
from ..errors import UnsupportedError
from ..ops_registry import tracing
from .hf_attention import (attend, check_attention_args, masked_attention, segments_from_cu,
                           segments_from_positions, several_sequences_per_row, visibility)
from .hf_matmul import DEFAULT

# A patch's record on each module it owns; hf_verify reads it too, so it lives here, below both.
_OWNER = "_lockstep_patch"  # every module of a patched tree holds its Patch under this name in __dict__


def _owner(mod):
    """The active Patch that ``mod`` belongs to, or None."""
    p = mod.__dict__.get(_OWNER)
    return p if p is not None and p.active else None


def _refresh_stale(model) -> None:
    """Bring every patch over ``model``'s modules up to date (what the next forward would do)."""
    for p in {id(p): p for p in map(_owner, model.modules()) if p is not None and p.stale}.values():
        p.refresh()


# ---------------------------------------------------------------- linear, norms, MLP, rotary


def linear(mod, x, *, mm=DEFAULT):
    """``nn.Linear`` under the patch's matmul spec (``mm``: hf_matmul.PatchMatmul; weights prepared once if exact)."""
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


def rotary(mod, x, position_ids):
    """cos/sin for HF's attention, float32 ``[..., rotary_dim]`` (the two halves repeated, as HF's).

    Kept in float32: lockstep's attention forward hands the first half to hal.apply_rotary.
    """
    inv_freq = mod.inv_freq.float()
    cos, sin = hal.rotary_cos_sin(position_ids, 2 * inv_freq.shape[0], inv_freq=inv_freq)
    scale = float(getattr(mod, "attention_scaling", 1.0))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


# ---------------------------------------------------------------- attention module


def _check_cache_layer(cache, layer_idx):
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        name = type(layers[layer_idx]).__name__
        if "Sliding" in name or "Chunked" in name:
            raise UnsupportedError(f"cache layer {layer_idx} is a {name}: caches that evict keys are not supported "
                                   "by lockstep's transformers integration (use DynamicCache or StaticCache)")


def attention(mod, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """Llama / Qwen2 / Qwen3 / Mistral / Qwen3-Next (gated) self-attention."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    else:
        kwargs.pop("past_key_values", None)
    if getattr(mod, "sliding_window", None) is not None:
        raise UnsupportedError(f"{type(mod).__name__} layer {mod.layer_idx} uses sliding-window attention, which "
                               "lockstep's transformers integration does not support")
    shape = hidden_states.shape[:-1]
    hd = mod.head_dim
    gated = type(mod).__name__ == "Qwen3NextAttention"
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
        out = masked_attention(q, k, v, *masks, causal, mod.scaling)
    else:  # eager only (refused above under tracing): the cache is marked from the visibility
        vis = visibility(q.shape[0], q.shape[2], k.shape[2], *masks, causal)
        if several_sequences_per_row(vis):
            cache._lockstep_packed = True
        out = attend(q, k, v, vis, mod.scaling)
    out = out.reshape(*shape, -1)
    if gated:
        out = out * hal.sigmoid(gate)
    return mod.o_proj(out), None


# ---------------------------------------------------------------- Qwen3-Next Gated DeltaNet


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


def gated_delta_net(mod, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Qwen3NextGatedDeltaNet: every sequence (padded row or packed run) computed as if alone.

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
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(h), mod.in_proj_ba(h))
    mixed = torch.cat([x.reshape(1, n, -1) for x in (q, k, v)], dim=-1)
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
                    use_qk_l2norm_in_kernel=True)
    if cache is not None:
        store[mod.layer_idx] = dict(conv=conv1, state=state, packed=not one_per_row)
        _hf_bookkeeping(mod, cache, mixed, bi, ti, B, T, state if one_per_row else None)
    dv = mod.head_v_dim
    o = mod.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, n, -1)
    return out.index_put((bi, ti), mod.out_proj(o)[0])


def _hf_bookkeeping(mod, cache, mixed, bi, ti, B, T, state):
    """Keep HF's linear-attention cache layer in step (has_previous_state, shapes); never read back."""
    with torch.no_grad():
        padded = mixed.new_zeros((B, T, mixed.shape[-1])).index_put((bi, ti), mixed[0].detach())
        cache.update_conv_state(padded.transpose(1, 2), mod.layer_idx, conv_kernel_size=mod.conv_kernel_size)
        if state is not None:
            cache.update_recurrent_state(state.final_state.detach(), mod.layer_idx)


def decoder_position_hook(layer, args, kwargs):
    """Forward pre-hook on a Qwen3-Next decoder layer: hand position_ids to its GatedDeltaNet.

    HF's decoder layer does not pass position_ids to the linear-attention block, so packed
    sequences would be invisible to it.
    """
    la = getattr(layer, "linear_attn", None)
    if la is not None:
        la.__dict__["_lockstep_position_ids"] = kwargs.get("position_ids")
    return None


# ---------------------------------------------------------------- Qwen3-Next MoE


def router(mod, hidden_states, *, mm=DEFAULT):
    """Top-k router: softmax (hal), top-k with ties broken by lower expert index, normalised in k order."""
    h = hidden_states.reshape(-1, mod.hidden_dim)
    if mod.weight.dtype == h.dtype:
        logits = mm.linear(h, mod.weight, key=(id(mod), "weight"))
    else:  # a converted copy: a temporary, not cached
        logits = mm.linear(h, mod.weight.to(h.dtype))
    probs = hal.softmax(logits.float(), -1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: equal probs keep index order
    vals, idx = vals[:, :mod.top_k], idx[:, :mod.top_k]
    if mod.norm_topk_prob:
        total = vals[:, 0]
        for j in range(1, mod.top_k):  # a fixed left-to-right sum, not a vectorised reduction
            total = total + vals[:, j]
        vals = vals / total.unsqueeze(-1)
    return logits, vals.to(logits.dtype), idx


def experts(mod, hidden_states, top_k_index, top_k_weights, *, mm=DEFAULT):
    """Each token's expert outputs, weighted and summed in rank order (rank 0 first)."""
    if getattr(mod, "has_bias", False):
        raise UnsupportedError(f"{type(mod).__name__} with expert biases is not supported")
    out = torch.zeros_like(hidden_states)
    for j in range(top_k_index.shape[-1]):
        acc = torch.zeros_like(hidden_states)
        col = top_k_index[:, j]
        for e in torch.unique(col).tolist():
            if e < 0 or e >= mod.num_experts:
                continue
            rows = (col == e).nonzero()[:, 0]
            gate_up = mm.linear(hidden_states[rows], mod.gate_up_proj[e], key=(id(mod), "gate_up_proj", e))
            gate, up = gate_up.chunk(2, dim=-1)
            y = mm.linear(hal.silu_mul(gate, up), mod.down_proj[e], key=(id(mod), "down_proj", e))
            acc = acc.index_put((rows,), y * top_k_weights[rows, j, None].to(y.dtype))
        out = out + acc
    return out


def sparse_moe_block(mod, hidden_states):
    """Qwen3NextSparseMoeBlock: routed experts + sigmoid-gated shared expert."""
    B, T, H = hidden_states.shape
    h = hidden_states.reshape(-1, H)
    shared = mod.shared_expert(h)
    _, weights, index = mod.gate(h)
    routed = mod.experts(h, index, weights)
    shared = hal.sigmoid(mod.shared_expert_gate(h)) * shared
    return (routed + shared).reshape(B, T, H)
