"""Installing lockstep into vLLM (the plugin switched on), and what it refuses.

:func:`install` runs once per process (front end, engine core, each worker, an in-process engine's process):

* the layers (layers.py) through vLLM's out-of-tree registries; the unquantized linear methods' ``apply`` and
  ``process_weights_after_loading`` (vLLM-CPU has no linear registry); ``CPU_ATTN`` -> attention.py's backend;
  ``Sampler.forward`` -> sampler.py, and the seeded rows' generators around the model runner's
  ``sample_tokens`` (a discarded prefill-chunk draw is never rewound with CUDA's ``set_offset``); the prompt
  positions' log-probs (``prompt_logprobs``) through sampler.py's ``PromptScorer`` around the runner's
  ``_get_prompt_logprobs_dict``; the worker's model calls with torch on one thread and lockstep's kernels on
  the cores (threads.py);
* the refusals, each naming the feature, before anything computes: the engine's configuration when it is
  built (:func:`check_config`, in the front end's ``EngineArgs.create_engine_config`` and again in the worker
  before the model loads), every module of the loaded model (:func:`audit_model`: a module lockstep does not
  cover stops the engine), and every request at admission (:func:`check_request`).

vLLM-CPU forces async scheduling off (``platforms/cpu.py``); lockstep relies on nothing async.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...errors import UnsupportedError

SUPPORTED = ((0, 32), (0, 33))  # [low, high): the vLLM releases whose layers and hooks this plugin mirrors
ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")  # tests/vllm_engine
GDN_ARCHITECTURES = ARCHITECTURES[2:]  # the Gated DeltaNet hybrids: gdn.py
DTYPES = (torch.float32, torch.bfloat16)

_installed = False


@dataclass(frozen=True)
class Step:
    """One schedule of the engine, for tests and diagnostics: ``rows`` = (request id, tokens computed before
    this step, tokens scheduled now, prompt length) per scheduled request. A row is a prefill chunk while its
    computed tokens are fewer than its prompt, else a decode row."""
    rows: tuple

    @property
    def prefill(self) -> list:
        return [r for r in self.rows if r[1] < r[3]]

    @property
    def decode(self) -> list:
        return [r for r in self.rows if r[1] >= r[3]]


STEP_HOOKS: list = []  # fn(Step) called after each schedule in the engine-core process (in-process engines: here)


def _step_of(scheduler, out) -> Step:
    rows = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    rows += list(zip(cached.req_ids, cached.num_computed_tokens))
    return Step(tuple((rid, done, out.num_scheduled_tokens[rid], scheduler.requests[rid].num_prompt_tokens)
                      for rid, done in rows))


def check_version() -> str:
    import vllm

    from .._versions import check_supported
    return check_supported("vLLM", vllm.__version__, SUPPORTED, "lockstep's vLLM plugin",
                           ": the plugin replaces that release's layers, sampler and attention backend.")


def check_platform() -> None:
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        raise UnsupportedError(
            f"lockstep's vLLM plugin runs on vLLM's CPU platform only (this is {type(current_platform).__name__}): "
            "the GPU route (vLLM's CUSTOM attention backend, its linear method, CUDA graphs) cannot be tested in "
            "lockstep's environments yet, so it is refused rather than run unverified. Unset LOCKSTEP_VLLM.")


def check_config(cfg) -> None:
    """Refuse, naming each, the engine features lockstep cannot make exact (UnsupportedError, every reason)."""
    mc, problems = cfg.model_config, []
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    if not archs or any(a not in ARCHITECTURES for a in archs):
        problems.append(f"architecture {archs} (tested: {', '.join(ARCHITECTURES)})")
    if str(getattr(mc, "model_impl", "auto")) not in ("auto", "vllm", "ModelImpl.AUTO", "ModelImpl.VLLM"):
        problems.append(f"model_impl={mc.model_impl!r} (vLLM's own model code only; not the transformers backend)")
    if mc.dtype not in DTYPES:
        problems.append(f"dtype {mc.dtype} (float32 or bfloat16)")
    if mc.head_dtype != mc.dtype:
        problems.append(f"head_dtype {mc.head_dtype} != dtype {mc.dtype} (lockstep's LM head accumulates in float32 "
                        "itself; leave head_dtype at the model dtype)")
    if mc.quantization is not None or cfg.quant_config is not None:
        problems.append(f"quantization={mc.quantization!r}")
    try:
        from .weights import trainer_convention
        trainer_convention()
    except UnsupportedError as e:
        problems.append(str(e))
    if mc.logits_processors:
        problems.append(f"logits_processors={mc.logits_processors!r} (custom logits processors: lockstep's sampler "
                        "draws from and records its own logits, so a processor would never run)")
    if mc.enable_prompt_embeds:
        problems.append("enable_prompt_embeds (the trainer scores token ids, not embeddings)")
    if cfg.use_v2_model_runner:
        problems.append("vLLM's second-generation model runner (VLLM_USE_V2_MODEL_RUNNER; none of lockstep's runner "
                        "hooks run there)")
    if mc.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        problems.append(f"logprobs_mode={mc.logprobs_mode!r} (raw_logprobs or processed_logprobs)")
    if cfg.cache_config.cache_dtype != "auto":
        problems.append(f"kv_cache_dtype={cfg.cache_config.cache_dtype!r} (fp8 KV cache)")
    if cfg.speculative_config is not None:
        problems.append("speculative decoding")
    if cfg.lora_config is not None:
        problems.append("LoRA (enable_lora)")
    pc = cfg.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
        problems.append(f"tensor/pipeline/data parallel sizes {pc.tensor_parallel_size}/{pc.pipeline_parallel_size}/"
                        f"{pc.data_parallel_size} (1 each)")
    hf = mc.hf_text_config
    if any(a in GDN_ARCHITECTURES for a in archs):  # the hybrids' own checks (gdn.py)
        from .gdn import check_config as gdn_checks
        problems += gdn_checks(cfg, hf)
    else:
        if getattr(hf, "sliding_window", None) is not None or getattr(hf, "use_sliding_window", False) or \
                any(t != "full_attention" for t in (getattr(hf, "layer_types", None) or [])):
            problems.append("sliding-window attention")
        if getattr(hf, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf.hidden_act!r} (silu MLPs only)")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append(f"rope_parameters {rope} (plain full-width RoPE only)")
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
            problems.append("attention / MLP biases")
    if problems:
        raise UnsupportedError("lockstep's vLLM plugin (LOCKSTEP_VLLM=1) cannot make this engine's bits exact:",
                               problems)


# Module classes of the tested models; each is lockstep's (layers.py), exact as it stands, or a container.
_COVERED = {
    "LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
    "Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer", "Qwen3Attention", "Qwen2MLP",  # Qwen3 reuses Qwen2MLP
    "VocabParallelEmbedding", "ParallelLMHead",  # a gather; the head's logits: LockstepLogitsProcessor
    "QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear",  # checked: UnquantizedLinearMethod
    "LockstepRMSNorm", "LockstepSiluAndMul", "LockstepRotaryEmbedding", "LockstepLogitsProcessor",
    "Attention",  # checked: lockstep's attention impl
    "ModuleList", "PPMissingLayer", "ApplyRotaryEmb",  # containers; ApplyRotaryEmb: never called by ours
}


def audit_model(model) -> None:
    """Every module of the loaded model is covered (or the engine stops, naming the first few that are not)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from .attention import LockstepCPUAttentionImpl
    from .gdn import COVERED as GDN_COVERED, audit as gdn_audit
    bad = gdn_audit(model)
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls not in _COVERED and cls not in GDN_COVERED:
            bad.append(f"{name or '(root)'} ({cls})")
        elif isinstance(mod, LinearBase) and type(mod.quant_method) is not UnquantizedLinearMethod:
            bad.append(f"{name} ({cls} with {type(mod.quant_method).__name__})")
        elif cls == "Attention" and not isinstance(getattr(mod, "impl", None), LockstepCPUAttentionImpl):
            bad.append(f"{name} (attention impl {type(getattr(mod, 'impl', None)).__name__})")
    if bad:
        raise UnsupportedError("lockstep's vLLM plugin does not cover these modules of the model (they would compute "
                               "stock bits): " + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""), bad)


def audit_logits_processors(runner) -> None:
    """The runner's logits processors are vLLM's built-in ones only (their parameters are refused at admission): a
    custom class, configured (``logits_processors=``, refused at engine start) or installed through vLLM's
    ``vllm.logits_processors`` entry points, would never run under lockstep's sampler."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS
    batch = getattr(runner, "input_batch", None)
    custom = [type(p).__name__ for p in (batch.logitsprocs.all if batch is not None else ())
              if type(p) not in BUILTIN_LOGITS_PROCESSORS]
    if custom:
        raise UnsupportedError("lockstep's vLLM plugin refuses custom logits processors (its sampler draws from and "
                               "records lockstep's own logits, so they would never run):", custom)


def check_switches() -> None:
    """vLLM switches that decide which code runs, refused before vLLM builds anything (its own refusal of them,
    where it has one, would not name lockstep)."""
    import vllm.envs as envs
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise UnsupportedError("lockstep's vLLM plugin (LOCKSTEP_VLLM=1) cannot make this engine's bits exact:",
                               ["VLLM_USE_V2_MODEL_RUNNER=1 (vLLM's second-generation model runner: none of lockstep's "
                                "runner hooks run there; unset it)"])


def check_prompt(prompt_ids, vocab_size: int) -> None:
    """A prompt's token ids are the model's vocabulary (at admission, before anything computes): vLLM pads its
    embedding table, so an id in the padded rows would be embedded and served (the trainer cannot score it; past the
    padding it fails inside the forward). prompt_logprobs score the prompt's own ids, so this covers their targets."""
    from ...errors import InputError
    bad = [(i, t) for i, t in enumerate(prompt_ids) if not 0 <= int(t) < vocab_size]
    if bad:
        raise InputError(f"prompt_token_ids: {len(bad)} id(s) outside the model's vocabulary [0, {vocab_size}) "
                         f"(position, id): {bad[:8]}; lockstep's vLLM plugin refuses them at admission")


#: vLLM's ``SamplingParams.__post_init__`` raises a temperature in (0, this) to this (its ``_MAX_TEMP``), with a log
#: line only. A request that reaches admission at this value may have asked any smaller one, so (0, this] is refused.
RAISED_TEMPERATURE = 0.01


def check_request(params) -> None:
    """Refuse (at admission, naming each) the sampling parameters lockstep cannot record exactly."""
    from vllm.sampling_params import SamplingParams
    if not isinstance(params, SamplingParams):
        raise UnsupportedError(f"{type(params).__name__} requests (pooling) are not supported by lockstep's plugin")
    p, problems = params, []
    if p.min_p:
        problems.append(f"min_p={p.min_p}")
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        problems.append("presence / frequency / repetition penalties")
    if p.logit_bias:
        problems.append("logit_bias")
    if p.bad_words:
        problems.append("bad_words")
    if p.allowed_token_ids:
        problems.append("allowed_token_ids")
    if p.min_tokens:
        problems.append(f"min_tokens={p.min_tokens}")
    if p.structured_outputs is not None:
        problems.append("structured outputs")
    if p.logprobs is not None and p.logprobs < 0:
        problems.append(f"logprobs={p.logprobs} (the full vocabulary; logprobs=N >= 0 is served)")
    if p.prompt_logprobs is not None and p.prompt_logprobs < 0:
        problems.append(f"prompt_logprobs={p.prompt_logprobs} (the full vocabulary; prompt_logprobs=N >= 0 is served)")
    if p.prompt_logprobs is not None and p.skip_reading_prefix_cache is False:
        problems.append("prompt_logprobs with skip_reading_prefix_cache=False (prompt positions read from the prefix "
                        "cache are never computed, so vLLM would return undefined values for them)")
    if p.prompt_logprob_token_ids is not None:
        problems.append("prompt_logprob_token_ids")
    if p.logprob_token_ids:
        problems.append("logprob_token_ids")
    if 0 < p.temperature <= RAISED_TEMPERATURE:
        problems.append(f"temperature={p.temperature} (vLLM raises any temperature below {RAISED_TEMPERATURE} to "
                        f"{RAISED_TEMPERATURE} when a SamplingParams is built, so the temperature asked is not known "
                        f"and the recorded log-prob would be at another one: ask 0 (greedy) or above "
                        f"{RAISED_TEMPERATURE})")
    if p.thinking_token_budget is not None:
        problems.append("thinking_token_budget")
    if getattr(p, "repetition_detection", None) is not None:
        problems.append("repetition_detection")
    if problems:
        raise UnsupportedError("lockstep's vLLM plugin (LOCKSTEP_VLLM=1) refuses this request's sampling parameters:",
                               problems)


def _run_inside(cls, name: str, context) -> None:
    """cls.name replaced by the same method run inside ``context(self)``: vLLM's code unchanged, lockstep's state
    (which rows' generators to spare, which scorer serves prompt log-probs) set around the call."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def run_inside(self, *args, **kwargs):
        with context(self):
            return method(self, *args, **kwargs)

    setattr(cls, name, run_inside)


def install() -> None:
    """Swap vLLM's components for lockstep's (idempotent; refuses non-CPU platforms and other vLLM releases)."""
    global _installed
    if _installed:
        return
    check_version()
    check_platform()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.offline import OfflineInferenceMixin
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from . import engine_args, gdn, layers, sampler, threads, weights

    for name, cls in layers.OOT_CUSTOM_OPS.items():
        CustomOp.register_oot(cls, name=name)
    for name, cls in layers.OOT_LAYERS.items():
        PluggableLayer.register_oot(cls, name=name)
    gdn.install(CustomOp, PluggableLayer)
    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        method.apply = layers.lockstep_linear_apply
        method.process_weights_after_loading = layers.keep_weights
    register_backend(AttentionBackendEnum.CPU_ATTN, "hal.integrations.vllm.attention.LockstepCPUAttentionBackend")
    Sampler.forward = sampler.lockstep_sample

    create = EngineArgs.create_engine_config

    @functools.wraps(create)
    def create_engine_config(self, *args_, **kwargs):
        check_switches()
        engine_args.check(self)
        asked = self.enable_prefix_caching  # None: left at vLLM's default (create() fills it in)
        cfg = create(self, *args_, **kwargs)
        cfg = gdn.prefix_caching_policy(self, asked, cfg, lambda args: create(args, *args_, **kwargs))
        check_config(cfg)
        return cfg

    EngineArgs.create_engine_config = create_engine_config

    validate = InputProcessor._validate_params

    @functools.wraps(validate)
    def _validate_params(self, params, *args, **kwargs):
        check_request(params)
        return validate(self, params, *args, **kwargs)

    InputProcessor._validate_params = _validate_params

    validate_input = InputProcessor._validate_model_input

    @functools.wraps(validate_input)
    def _validate_model_input(self, prompt_input, *args, **kwargs):
        if prompt_input["type"] == "embeds":
            raise UnsupportedError("prompt_embeds requests are not supported by lockstep's vLLM plugin (the trainer "
                                   "scores token ids)")
        check_prompt(prompt_input["prompt_token_ids"], self.model_config.get_vocab_size())
        return validate_input(self, prompt_input, *args, **kwargs)

    InputProcessor._validate_model_input = _validate_model_input

    load = CPUModelRunner.load_model

    @functools.wraps(load)
    def load_model(self, *args, **kwargs):
        check_config(self.vllm_config)
        load(self, *args, **kwargs)
        audit_model(self.model)
        audit_logits_processors(self)
        weights.watch_weights(self.model, self.vllm_config.model_config.dtype)

    CPUModelRunner.load_model = load_model

    _run_inside(CPUModelRunner, "sample_tokens", sampler.discarded_rows_spare_their_generators)
    _run_inside(CPUModelRunner, "_get_prompt_logprobs_dict", sampler.scoring_prompts)
    threads.install(CPUWorker)
    CPUWorker.lockstep_weights_changed = weights.worker_weights_changed
    CPUWorker.lockstep_weights_handled = weights.worker_weights_handled

    def checking_weights(fn, when):
        """EngineCore's method ``fn`` with weights.check_weights at its boundary ``when`` (weights.py)."""
        @functools.wraps(fn)
        def checked(self, *args, **kwargs):
            if when == "admission":  # a full check once per admission burst (the first request after a step)
                if not self.__dict__.get("_lockstep_admission_checked"):
                    weights.check_weights(self, full=True, when=when)
                    self.__dict__["_lockstep_admission_checked"] = True
                return fn(self, *args, **kwargs)
            if when == "rpc":
                out = fn(self, *args, **kwargs)
                weights.check_weights(self, full=True, when=when)
                return out
            weights.check_weights(self, full=False, when=when)
            self.__dict__["_lockstep_admission_checked"] = False
            outputs, executed = fn(self, *args, **kwargs)
            # before a finishing request's last output leaves the core: a full check (a raw write is seen here)
            finishing = any(o.finish_reason is not None for eco in (outputs or {}).values() for o in eco.outputs)
            weights.check_weights(self, full=finishing, when=when, outputs=outputs)
            return weights.take_error_outputs(self, outputs), executed
        return checked

    for name, when in (("step", "step"), ("step_with_batch_queue", "step"), ("add_request", "admission"),
                       ("collective_rpc", "rpc")):
        setattr(EngineCore, name, checking_weights(getattr(EngineCore, name), when))

    run_engine = OfflineInferenceMixin._run_engine

    @functools.wraps(run_engine)
    def _run_engine(self, *args_, **kwargs):
        outputs = run_engine(self, *args_, **kwargs)
        refused = [o.request_id for o in outputs
                   if any(c.stop_reason == weights.WEIGHTS_CHANGED for c in getattr(o, "outputs", None) or ())]
        if refused:
            raise UnsupportedError(f"lockstep's vLLM plugin refused {len(refused)} request(s) of this call: the "
                                   "model's weights changed while they ran (their KV and tokens would mix two "
                                   "weights); they are finished, the prefix cache is evicted, and the next call runs "
                                   "on the new weights. Update weights between generate calls.", refused)
        return outputs

    OfflineInferenceMixin._run_engine = _run_engine

    schedule = Scheduler.schedule

    @functools.wraps(schedule)
    def scheduled(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if STEP_HOOKS:
            step = _step_of(self, out)
            for fn in STEP_HOOKS:
                fn(step)
        return out

    Scheduler.schedule = scheduled
    _installed = True
