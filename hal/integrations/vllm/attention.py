"""vLLM's CPU attention backend as a thin shim over the serving core (hal/serving.py).

vLLM's CPU platform resolves every attention request to ``CPU_ATTN``; the plugin points that name at
:class:`LockstepCPUAttentionBackend` (``register_backend``). vLLM's own metadata builder still runs (its
``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping`` are what the core takes); the impl writes
the step's keys into vLLM's own paged cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` (in place, through
views: ``PagedKV.from_vllm_cpu``) and attends with ``hal.serving.paged_attention``: each request's queries on its
own keys, bottom-right aligned, so neighbours, prefill chunking, paging and prefix hits change no bit. One
``ServingBatch`` serves every layer of a step (:func:`step_batch`).
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ...serving import PagedKV, ServingBatch, paged_attention, write_kv

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


_STEP: list = [None, None]  # (vLLM's metadata object, its ServingBatch): the step the layers are in


def step_batch(attn_metadata) -> ServingBatch:
    """The step's :class:`ServingBatch`, one per metadata object: vLLM's builder makes a new metadata object each
    step and hands the same one to every layer of the group, so the batch's derived indices (the paged
    coordinates of every request's keys, the checks) are computed once per step, not once per layer. The
    object is held (not its id), so a later step's metadata is never mistaken for it."""
    if _STEP[0] is not attn_metadata:
        _STEP[:] = attn_metadata, ServingBatch(attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                               attn_metadata.block_table, attn_metadata.slot_mapping)
    return _STEP[1]


class LockstepCPUAttentionImpl(CPUAttentionBackendImpl):
    """Decoder self-attention over vLLM's paged KV cache on lockstep's bits; anything else is refused."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        problems = []
        if attn_type != AttentionType.DECODER:
            problems.append(f"attention type {attn_type}")
        if alibi_slopes is not None:
            problems.append("ALiBi slopes")
        if sliding_window is not None:
            problems.append(f"a sliding window ({sliding_window})")
        if kv_cache_dtype != "auto":
            problems.append(f"kv_cache_dtype={kv_cache_dtype!r} (a quantized KV cache)")
        if logits_soft_cap:
            problems.append("attention logits soft-capping")
        if sinks is not None:
            problems.append("attention sinks")
        if kv_sharing_target_layer_name is not None:
            problems.append("KV sharing across layers")
        if problems:
            raise UnsupportedError("lockstep's vLLM attention does not support " + ", ".join(problems))
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        write_kv(PagedKV.from_vllm_cpu(kv_cache, self.head_size), key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("fused output quantization is not supported by lockstep's vLLM attention")
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise UnsupportedError("non-causal attention is not supported by lockstep's vLLM attention")
        n = attn_metadata.num_actual_tokens
        out = paged_attention(query[:n], PagedKV.from_vllm_cpu(kv_cache, self.head_size), step_batch(attn_metadata),
                              self.scale)
        output[:n] = out.reshape(output[:n].shape)
        return output


class LockstepCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with lockstep's impl (vLLM's metadata builder and cache layout unchanged)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: lockstep's attention has no head-size table

    @staticmethod
    def get_impl_cls():
        return LockstepCPUAttentionImpl
