"""TorchTitan leaf modules that compute with lockstep's ops (imported only by hal.integrations.torchtitan).

Each class subclasses the TorchTitan module it replaces, with a ``Config`` subclass of that module's
config, so TorchTitan's own model code (decoder, blocks, GQA attention, fused QKV split, state-dict
hooks, parameter init) keeps running and only the leaf computation changes. Names, parameters and
state-dict keys stay TorchTitan's, so its HF state-dict adapter moves the weights unchanged.

The math each one computes is the math lockstep's transformers patch computes for the matching HF
module (transformers/modules.py), so a TorchTitan trainer and an HF sampler give the same bits; the differences
between the two codebases are listed in docs/integrations.md ("TorchTitan vs transformers").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.protocols.module import Module

import hal
from ... import dispatch
from ...errors import UnsupportedError
from ...ops_registry import tracing
from ...spec import STRICT


def switched(policy: str, op: str, x: torch.Tensor):
    """``(spec, backend name)`` of a leaf's op under the converter's ``policy`` (``LockstepConverter.Config(policy=)``):
    strict: (None, None), as without the switch; else the op's spec under the policy (hal.dispatch.switched_spec) on
    the backend that
    claims it for x's device and dtype (hal.dispatch.check_policy: refused by name otherwise, per call, memoized).
    While Dynamo traces: the spec alone (it crosses the torch op as its id; the backend is chosen when the
    graph runs, never stock unless requested)."""
    if policy == STRICT:
        return None, None
    if tracing():
        return dispatch.switched_spec(op, policy), None
    spec, backend = dispatch.check_policy(policy, x.device, x.dtype, (op,))[op]
    return spec, None if backend is None else backend.name


class LockstepLinear(Linear):
    """``nn.Linear`` as ``hal.linear`` (the matmul spec of the converter's policy, as lt.patch's linears).

    A fused projection (TorchTitan's ``wqkv``) gives each output column the bits of the separate
    projection HF runs: a strict dot product's bits do not depend on which other columns are computed."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        policy: str = STRICT  # the converter's (LockstepConverter.Config(policy=...)): hal.spec.POLICY_SPECS

    def __init__(self, config: Config):
        super().__init__(config)
        self.policy = config.policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec, backend = switched(self.policy, "linear", x)
        return hal.linear(x, self.weight, self.bias, spec=spec, backend=backend)


class LockstepRMSNorm(RMSNorm):
    """``nn.RMSNorm`` (``w * x / sqrt(mean(x^2) + eps)``) as ``hal.rms_norm``, the weight in x's dtype as HF's."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            raise UnsupportedError(f"{type(self).__name__} without an elementwise weight is not supported")
        if self.eps is None:  # nn.RMSNorm's default is the dtype's machine epsilon: HF models always name one
            raise UnsupportedError("RMSNorm with eps=None (torch's dtype-dependent default): set the model's eps")
        w = self.weight
        return hal.rms_norm(x, w if w.dtype == x.dtype else w.to(x.dtype), float(self.eps))


def torch_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """float32 ``1 / theta ** (2i / dim)`` computed with torch's pow, as both TorchTitan's cos/sin cache and
    HF's default RoPE init compute it (the table lockstep's transformers patch reads from HF's buffer)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class LockstepCosSinRoPE(CosSinRoPE):
    """Rotate-half RoPE with ``hal.rotary_cos_sin`` tables (float32) and ``hal.apply_rotary`` (one rounding).

    Stock TorchTitan takes cos/sin from its precomputed float32 cache (torch's cos/sin); HF computes
    them per call. Here both sides build the table from the same float32 ``inv_freq`` with lockstep's
    sin/cos, per token position, so a packed trainer and a decoding sampler agree."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def __init__(self, config: Config):
        if config.scaling != "none":
            raise UnsupportedError(f"RoPE scaling {config.scaling!r} is not supported by lockstep's TorchTitan "
                                   "integration (only unscaled rotate-half RoPE, as Qwen3's)")
        super().__init__(config)

    def forward(self, query, key, positions=None):
        B, L = query.shape[:2]
        if positions is None:
            positions = torch.arange(L, device=query.device).expand(B, L)
        positions = positions.expand(B, L)
        cfg = self.config
        inv_freq = torch_inv_freq(cfg.dim, cfg.theta).to(query.device)
        cos, sin = hal.rotary_cos_sin(positions, cfg.dim, inv_freq=inv_freq)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # one table for every head
        return hal.apply_rotary(query, cos, sin), hal.apply_rotary(key, cos, sin)


class LockstepVarlenAttention(VarlenAttention):
    """TorchTitan's varlen attention (documents packed into one stream, ``VarlenMetadata``) as
    ``hal.flash_attn_varlen_func``: causal, GQA, every dtype (no bf16 cast), forward and backward on any device."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        policy: str = STRICT  # the converter's (LockstepConverter.Config(policy=...)): hal.spec.POLICY_SPECS

    def __init__(self, config: Config) -> None:
        Module.__init__(self)  # VarlenAttention.__init__ only selects a CUDA flash-attention build
        if tuple(config.window_size) != (-1, 0):
            raise UnsupportedError(f"attention window_size={tuple(config.window_size)}: lockstep's TorchTitan "
                                   "integration supports causal attention without a window, (-1, 0), only")
        self.window_size = tuple(config.window_size)
        self.policy = config.policy

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, out_transform=None, **kwargs):
        B, L = q_BLNH.shape[:2]
        T = B * L
        if attention_masks is None:  # no packing: every row is one document
            cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=q_BLNH.device)
            cu_q, cu_k, max_q, max_k = cu, cu, L, L
        else:
            if not isinstance(attention_masks, VarlenMetadata):
                raise UnsupportedError(f"lockstep's varlen attention needs TorchTitan's VarlenMetadata (or None), got "
                                       f"{type(attention_masks).__name__}")
            cu_q, cu_k = attention_masks.cu_seq_q, attention_masks.cu_seq_k
            max_q, max_k = int(attention_masks.max_q), int(attention_masks.max_k)
        q = q_BLNH.reshape(T, -1, q_BLNH.shape[-1])
        k = k_BLNH.reshape(T, -1, k_BLNH.shape[-1])
        v = v_BLNH.reshape(T, -1, v_BLNH.shape[-1])
        spec, backend = switched(self.policy, "flash_attn_varlen_func", q)
        res = hal.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True,
                                         return_lse=out_transform is not None, spec=spec, backend=backend)
        if out_transform is None:
            return res.view(B, L, -1, v.shape[-1])
        out, lse = res
        return out_transform(out.view(B, L, -1, v.shape[-1]), lse.transpose(0, 1).reshape(B, L, -1))


class LockstepFeedForward(FeedForward):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` with ``hal.silu_mul`` (the product rounded once; stock rounds silu too)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(hal.silu_mul(self.w1(x), self.w3(x)))


# stock config class -> lockstep config class (exact types: a subclass of a stock module may compute otherwise)
REPLACEMENTS = {
    Linear.Config: LockstepLinear.Config,
    RMSNorm.Config: LockstepRMSNorm.Config,
    CosSinRoPE.Config: LockstepCosSinRoPE.Config,
    VarlenAttention.Config: LockstepVarlenAttention.Config,
    FeedForward.Config: LockstepFeedForward.Config,
}
