"""Every vLLM engine argument (``EngineArgs`` field), declared: what lockstep's plugin does with it.

tests/vllm_engine walks vLLM's ``EngineArgs`` against this table, so a field a new vLLM adds cannot pass unnamed.

* ``CHECKED``: the resolved configuration it decides is inspected at engine start (plugin.py ``check_config``, gdn.py,
  the module audit) or its requests at admission (``check_request``), and refused by name where lockstep cannot
  make the bits exact.
* ``SCHEDULING``: how requests are batched, chunked, cached and sized in memory; lockstep's bits do not depend on it
  (tests/vllm_engine: chunked prefill, batch sizes, prefix hits, preemption, KV memory).
* ``NO_BITS``: plumbing the computed bits never see (paths, ports, logging, metrics, tokenizer, process layout),
  or options of a feature refused elsewhere (LoRA with ``enable_lora``, data parallelism with its size, multimodal
  inputs on the text-only architectures, pooling at admission).
* ``REFUSED_UNLESS_DEFAULT``: anything but vLLM's default is refused by name at engine start (:func:`check`): their
  effect on the bits is not covered.
"""
from __future__ import annotations

import dataclasses

from ...errors import UnsupportedError

CHECKED = frozenset("""
model model_weights hf_config_path config_format revision code_revision hf_overrides model_class_overrides
trust_remote_code runner convert dtype kv_cache_dtype quantization quantization_config allow_deprecated_quantization
tensor_parallel_size pipeline_parallel_size data_parallel_size enable_lora speculative_config spec_method spec_model
spec_tokens logprobs_mode logits_processors enable_prompt_embeds model_impl enable_prefix_caching enforce_eager
compilation_config generation_config override_generation_config structured_outputs_config reasoning_config
pooler_config
""".split())

SCHEDULING = frozenset("""
seed max_model_len block_size prefix_caching_hash_algo prefix_cache_retention_interval gpu_memory_utilization
kv_cache_memory_bytes max_num_batched_tokens max_num_scheduled_tokens long_prefill_token_threshold
long_prefill_token_threshold_adaptive max_num_seqs max_num_active_seqs max_num_queued_reqs max_num_queued_tokens
max_logprobs num_gpu_blocks_override enable_chunked_prefill scheduler_reserve_full_isl prefill_schedule_interval
scheduling_policy async_scheduling stream_interval attention_backend disable_cascade_attn
""".split())

NO_BITS = frozenset("""
served_model_name tokenizer skip_tokenizer_init tokenizer_mode tokenizer_revision allowed_local_media_path
allowed_media_domains download_dir safetensors_load_strategy safetensors_prefetch_num_threads
safetensors_prefetch_block_size hf_token distributed_executor_backend master_addr master_port nnodes node_rank
distributed_timeout_seconds cpu_distributed_timeout_seconds numa_bind numa_bind_nodes numa_bind_cpus device_ids
_api_process_count _api_process_rank max_parallel_loading_workers disable_log_stats enable_log_requests
aggregate_engine_logging
show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces per_request_spec_decode_metrics
kv_cache_metrics kv_cache_metrics_sample custom_histogram_buckets cudagraph_metrics enable_layerwise_nvtx_tracing
enable_mfu_metrics enable_logging_iteration_details jit_monitor_mode jit_monitor_verbose enable_mm_processor_stats
profiler_config logging_config log_level log_config_file worker_extension_cls use_tqdm_on_load pt_load_map_location
ray_workers_use_nsight shutdown_timeout fail_on_environ_validation reasoning_parser reasoning_parser_plugin
tokens_only enable_fault_tolerance fault_tolerance_config cudagraph_capture_sizes max_cudagraph_capture_size
disable_custom_all_reduce kv_events_config enable_shm_tensor_arena
data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port
data_parallel_hybrid_lb data_parallel_external_lb data_parallel_multi_port_external_lb data_parallel_backend
dp_sync_interval disable_nccl_for_dp_synchronization
max_loras max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_target_modules
enable_tower_connector_lora specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras
max_lora_cls_labels
language_model_only limit_mm_per_prompt enable_mm_embeds interleave_mm_strings media_io_kwargs mm_processor_kwargs
mm_processor_cache_gb mm_processor_cache_type mm_hasher_algorithm mm_shm_cache_max_object_size_mb mm_encoder_only
mm_encoder_tp_mode mm_encoder_attn_backend mm_encoder_attn_dtype mm_encoder_fp8_scale_path
mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin renderer_num_workers skip_mm_profiling
video_pruning_rate video_pruning_method mm_tensor_ipc mm_processor_device mm_ipc_gpu_memory_gb
mm_device_do_normalize disable_chunked_mm_input io_processor_plugin
""".split())

REFUSED_UNLESS_DEFAULT = frozenset("""
enable_return_routed_experts return_sampling_mask load_format prefill_context_parallel_size
decode_context_parallel_size dcp_comm_backend dcp_q_replicate dcp_kv_cache_interleave_size cp_kv_cache_interleave_size
enable_hc_sp enable_expert_parallel enable_batch_sharded_sampling enable_ep_weight_filter moe_backend linear_backend
sparse_indexer_topk_backend all2all_backend enable_elastic_ep elastic_ep_max_dp_size enable_dbo ubatch_size
dbo_decode_token_threshold dbo_prefill_token_threshold eplb_config enable_eplb expert_placement_strategy
offload_backend cpu_offload_gb cpu_offload_params offload_group_size offload_num_in_group offload_prefetch_step
offload_params use_fp64_gumbel enable_trace_replay watermark watermark_config diffusion_config aux_output_config
scheduler_cls engram_config mamba_config kernel_config enable_flashinfer_autotune worker_cls kv_transfer_config
ec_transfer_config ec_manager_config enable_sleep_mode sleep_mode_offload_cudagraph sleep_preserve_parameter_names
enable_cumem_allocator enable_nccl_comm_suspend kv_cache_dtype_skip_layers mamba_cache_dtype mamba_ssm_cache_dtype
mamba_block_size prefix_match_unit mamba_cache_mode enable_mamba_shared_prefix_checkpoint replayssm_buffer_len
use_replayssm mamba_backend mamba_ssu_algorithm enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds
additional_config kv_sharing_fast_prefill swa_bounded_replay performance_mode kv_offloading_size
kv_offloading_backend weight_transfer_config gdn_prefill_backend kda_prefill_backend kda_decode_backend
optimization_level disable_sliding_window ir_op_priority attention_config disable_hybrid_kv_cache_manager
ignore_patterns model_loader_extra_config
""".split())

DECLARED = CHECKED | SCHEDULING | NO_BITS | REFUSED_UNLESS_DEFAULT


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def check(args) -> None:
    """In the front end, before vLLM builds anything: every field of ``args`` (vLLM's ``EngineArgs``) is declared
    here, and the ones whose effect is not covered hold vLLM's default (UnsupportedError naming each otherwise)."""
    problems = []
    for field in dataclasses.fields(args):
        if field.name not in DECLARED:
            problems.append(f"{field.name} (an engine argument this plugin does not know: a vLLM it was not written "
                            "for)")
        elif field.name in REFUSED_UNLESS_DEFAULT:
            value, default = getattr(args, field.name), _default(field)
            try:
                same = value == default
            except Exception:  # noqa: BLE001 -- a value that cannot be compared is not vLLM's default
                same = False
            if not same:
                problems.append(f"{field.name}={value!r} (vLLM's default {default!r}: other values are not covered)")
    if problems:
        raise UnsupportedError("lockstep's vLLM plugin (LOCKSTEP_VLLM=1) cannot make this engine's bits exact:",
                               problems)
