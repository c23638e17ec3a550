"""vLLM's layers on lockstep's ops, mirroring what ``lt.patch`` (transformers/modules.py) computes on the HF model.

Each class replaces vLLM's class of the same name through ``CustomOp.register_oot`` / ``PluggableLayer.register_oot``
(vLLM builds the registered class wherever a model asks for the stock one); the linear methods are replaced on
vLLM's unquantized method classes (on CPU they have no registry). What stays torch is exact: the embedding
gather, reshapes, slices, and the residual add (one IEEE rounding, the add HF's decoder layer does).

Bit-for-bit with the patched HF model, op by op (transformers/modules.py):

* RMSNorm: ``hal.rms_norm(x, w, eps)``; with vLLM's fused residual, HF's order: ``h = x + residual`` rounded
  to the model dtype, then the norm of ``h`` (vLLM's native fused op normalises the float32 sum instead).
* linears: ``hal.linear`` under the default spec. Each output element's bits depend only on its own row of
  the weight, so vLLM's merged QKV / gate-up weights give the bits of HF's separate q/k/v, gate/up linears.
* rotary: HF's default ``inv_freq`` (the same float32 expression), ``hal.rotary_cos_sin`` from the integer
  positions, ``hal.apply_rotary`` on the half-split (NeoX / ``rotate_half``) pairs.
* SiLU-mul: ``hal.silu_mul(gate, up)`` on the two halves of the merged gate-up output.
* the LM head: ``hal.linear`` over the real vocabulary rows (vLLM pads the head); the hidden rows are kept
  for the sampler, which records ``hal.token_logprobs`` of them (sampler.py) -- from the head's own float32
  logits, the ones that op reduces (``hal.sampling.head_logits_are_the_logprobs_dot``): one pass,
  ``hal.ops.linear_with_float32``, gives vLLM ``hal.linear``'s logits (bf16 / fp16: the one rounding) and keeps
  the float32 result unrounded, so the head runs once per token whatever its dtype.
"""
from __future__ import annotations

import weakref

import torch

import hal
from ...errors import UnsupportedError
from ...ops import linear_with_float32
from ...sampling import head_logits_are_the_logprobs_dot

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod


class LockstepRMSNorm(RMSNorm):
    """vLLM's RMSNorm (decoder norms, the final norm, Qwen3's per-head q/k norms) on ``hal.rms_norm``."""

    def forward(self, x, residual=None):
        if self.variance_size_override is not None or not self.has_weight:
            raise UnsupportedError("RMSNorm with variance_size_override or without a weight is not supported by "
                                   "lockstep's vLLM plugin")
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if residual is None:
            return hal.rms_norm(x, w, self.variance_epsilon)
        h = x + residual  # HF's decoder: residual + hidden, rounded to the model dtype, then the norm
        return hal.rms_norm(h, w, self.variance_epsilon), h

    forward_native = forward_cpu = forward_cuda = forward


class LockstepSiluAndMul(SiluAndMul):
    """``silu(x[..., :d]) * x[..., d:]`` as ``hal.silu_mul`` (the product rounded once)."""

    def forward(self, x):
        d = x.shape[-1] // 2
        return hal.silu_mul(x[..., :d], x[..., d:])

    forward_native = forward_cpu = forward_cuda = forward


def hf_default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """float32 inverse frequencies as transformers' default RoPE computes them (``_compute_default_rope_parameters``
    of 5.19 and 5.24): the same expression, so the same bits as the trainer's ``inv_freq`` buffer."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


class LockstepRotaryEmbedding(RotaryEmbedding):
    """Plain (default) RoPE from integer positions: ``hal.rotary_cos_sin`` + ``hal.apply_rotary``.

    vLLM's scaled variants (Llama-3, YaRN, dynamic, mRoPE) are other classes and are refused by the engine
    checks (plugin.py); this class is built only for ``rope_type="default"``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lockstep_inv_freq = hf_default_inv_freq(self.base, self.rotary_dim)
        self._lockstep_last = None  # (positions, cos, sin) of the last eager call

    def tables(self, positions):
        """float32 (cos, sin) for ``positions``. vLLM builds one rotary module for every layer of a model
        (``get_rope`` keeps them by configuration) and each layer of a forward passes the same positions, so the
        last tables are reused when the positions equal the last ones -- compared value by value (a copy is kept:
        the engine rewrites its positions buffer in place between steps, and inference tensors have no version
        counter). Traced (torch.compile) calls build their tables in the graph."""
        if torch.compiler.is_compiling():
            return hal.rotary_cos_sin(positions, self.rotary_dim, inv_freq=self._lockstep_inv_freq)
        last = self._lockstep_last
        if (last is not None and last[0].shape == positions.shape and last[0].dtype == positions.dtype
                and torch.equal(last[0], positions)):
            return last[1], last[2]
        cos, sin = hal.rotary_cos_sin(positions, self.rotary_dim, inv_freq=self._lockstep_inv_freq)
        self._lockstep_last = (positions.clone(), cos, sin)
        return cos, sin

    def forward(self, positions, query, key=None):
        if not self.is_neox_style:
            raise UnsupportedError("interleaved (GPT-J style) rotary embeddings are not supported by lockstep's vLLM "
                                   "plugin (the tested models use the half-split NeoX layout)")
        cos, sin = self.tables(positions)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [tokens, 1, rotary_dim / 2]: every head alike

        def rotate(x):
            shape = x.shape
            return hal.apply_rotary(x.reshape(*positions.shape, -1, self.head_size), c, s).reshape(shape)

        return rotate(query), None if key is None else rotate(key)

    forward_native = forward_cpu = forward_cuda = forward


def lockstep_linear_apply(self, layer, x, bias=None):
    """``UnquantizedLinearMethod.apply`` / ``UnquantizedEmbeddingMethod.apply``: ``hal.linear``."""
    return hal.linear(x, layer.weight, bias)


def keep_weights(self, layer) -> None:
    """``process_weights_after_loading`` without vLLM-CPU's oneDNN prepacking (which empties ``layer.weight``):
    lockstep's linear reads the weight itself."""
    return None


class HiddenRows:
    """The final-normed hidden rows each logits tensor was computed from, found again by the sampler.

    vLLM's runner calls ``compute_logits(hidden[logits_indices])`` and hands only the logits to the sampler;
    the recorded log-prob is ``hal.token_logprobs`` of the hidden rows (the LM head accumulated in float32),
    not a function of the rounded logits, so the logits processor files its inputs here under the logits
    tensor's identity (a weak reference: an entry dies with its logits). ``head_logits``: the float32 logits
    ``hal.token_logprobs`` reduces, where the head gave them (a copy: vLLM may mask the logits it samples
    from in place, a recorded value is the head's), else None."""

    def __init__(self):
        self._rows: dict[int, tuple] = {}

    def remember(self, logits, hidden, head_weight, head_logits=None) -> None:
        for key in [k for k, (ref, *_) in self._rows.items() if ref() is None]:
            del self._rows[key]
        self._rows[id(logits)] = (weakref.ref(logits), hidden, head_weight, head_logits)

    def find(self, logits):
        entry = self._rows.get(id(logits))
        if entry is None or entry[0]() is not logits:
            raise UnsupportedError("lockstep's vLLM sampler got logits that lockstep's logits processor did not "
                                   "compute (a vLLM path that bypasses model.compute_logits); refusing to record "
                                   "log-probs it cannot define from the hidden rows")
        return entry[1:]


HIDDEN = HiddenRows()


class LockstepLogitsProcessor(LogitsProcessor):
    """The LM head as ``hal.linear`` over the real vocabulary rows (the bits HF's patched head gives, for
    greedy argmax and sampling); remembers the hidden rows for the sampler (:data:`HIDDEN`)."""

    def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
        if self.logits_as_input or self.soft_cap is not None or self.scale != 1.0 or embedding_bias is not None:
            raise UnsupportedError("logits soft-capping, logit scaling, an LM-head bias or logits as input are not "
                                   "supported by lockstep's vLLM plugin")
        if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod) or lm_head.tp_size != 1:
            raise UnsupportedError(f"LM head with {type(lm_head.quant_method).__name__} (tp_size={lm_head.tp_size}) "
                                   "is not supported by lockstep's vLLM plugin")
        weight = lm_head.weight[: self.org_vocab_size]  # vLLM pads the head to a multiple of 64 rows
        if head_logits_are_the_logprobs_dot(weight.dtype):  # one pass: vLLM's logits and the recorded values' own
            logits, own = linear_with_float32(hidden_states, weight)
        else:
            logits, own = hal.linear(hidden_states, weight), None
        HIDDEN.remember(logits, hidden_states, weight, own)
        return logits


OOT_CUSTOM_OPS = {"RMSNorm": LockstepRMSNorm, "SiluAndMul": LockstepSiluAndMul, "RotaryEmbedding": LockstepRotaryEmbedding}
OOT_LAYERS = {"LogitsProcessor": LockstepLogitsProcessor}
