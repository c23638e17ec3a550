"""TorchTitan's Qwen3.5 (Gated DeltaNet hybrid) leaves computing with lockstep's ops (imported only by
hal.integrations.torchtitan, and only for Qwen3.5 configs: TorchTitan's qwen3_5 module imports ``fla``).

As in modules.py each class subclasses the TorchTitan module it replaces, keeps its parameters and
state-dict keys, and computes the math lockstep's transformers patch computes for the matching HF module
(the same helpers of transformers/modules.py where one exists). Two classes override a forward that is not a leaf,
because TorchTitan writes a rounding op inline there:

* ``GatedDeltaNet.forward`` computes the gates (``-exp(A_log) * softplus(a + dt_bias)``, ``sigmoid(b)``) and
  calls FLA's Triton conv (or ``F.conv1d``) itself: the lockstep forward is TorchTitan's line by line with
  ``hal.gdn_gating`` and ``hal.gdn_causal_conv1d`` (one conv per q / k / v channel group, reset per document:
  a depthwise conv's channels are independent, so HF's one conv over the joined channels gives the same bits);
  its kernel and gated norm stay modules (``LockstepGatedDeltaKernel``, ``LockstepRMSNormGated``).
* ``Qwen35Attention.forward`` gates the attention output with ``torch.sigmoid``: here ``hal.sigmoid``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.qwen3_5.model import (GatedDeltaKernel, GatedDeltaNet, OffsetRMSNorm, Qwen35Attention,
                                             RMSNormGated)
from torchtitan.models.qwen3_5.rope import MRoPE
from torchtitan.models.qwen3_5.vision_encoder import Qwen35VisionEncoder

import hal
from ...errors import UnsupportedError
from ..transformers import modules as hf_modules
from ...spec import STRICT
from .modules import switched, torch_inv_freq


class LockstepOffsetRMSNorm(OffsetRMSNorm):
    """``(1 + w) * norm(x)`` in float32, rounded once to x's dtype (hf_modules.rms_norm_one_plus, as HF's side)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OffsetRMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hf_modules.rms_norm_one_plus(self, x)


class LockstepRMSNormGated(RMSNormGated):
    """``w * norm(x) * silu(gate)`` in float32, rounded once (TorchTitan's stock rounds after the weight too)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNormGated.Config):
        pass

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return hf_modules.rms_norm_gated(self, x, gate)


class LockstepMRoPE(MRoPE):
    """Qwen3.5's (partial, interleaved multimodal) RoPE with ``hal.rotary_cos_sin`` / ``hal.apply_rotary``.

    Text positions ``[B, L]`` use one row for temporal, height and width; ``[B, L, 3]`` positions pick each
    frequency's row as HF's ``Qwen3_5TextRotaryEmbedding`` does (hf_modules.rotary_mrope, the one home)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MRoPE.Config):
        pass

    def __init__(self, config: Config):
        if config.scaling != "none":
            raise UnsupportedError(f"RoPE scaling {config.scaling!r} is not supported by lockstep's TorchTitan "
                                   "integration (Qwen3.5's RoPE is unscaled)")
        super().__init__(config)

    def forward(self, query, key, positions=None):
        B, L = query.shape[:2]
        if positions is None:
            positions = torch.arange(L, device=query.device).expand(B, L)
        if positions.dim() == 3:  # TorchTitan's [B, L, 3] -> HF's [3, B, L]
            rows = positions.permute(2, 0, 1)
        else:
            rows = positions.expand(B, L)[None].expand(3, B, L)
        cfg = self.config
        table = _MRopeTable(torch_inv_freq(cfg.dim, cfg.theta).to(query.device), list(cfg.mrope_section))
        cos, sin = hf_modules.rotary_mrope(table, query, rows)
        half = cfg.dim // 2
        cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)  # one table for every head
        return hal.apply_rotary(query, cos, sin), hal.apply_rotary(key, cos, sin)


class _MRopeTable:
    """What ``transformers.modules.rotary_mrope`` reads from HF's rotary module (a plain class: Dynamo traces its
    construction, which it does not for ``types.SimpleNamespace``)."""

    def __init__(self, inv_freq, mrope_section):
        self.inv_freq, self.mrope_section, self.attention_scaling = inv_freq, mrope_section, 1.0


class LockstepGatedDeltaKernel(GatedDeltaKernel):
    """FLA's chunked / fused-recurrent gated delta rule as ``hal.chunk_gated_delta_rule`` /
    ``hal.fused_recurrent_gated_delta_rule`` (the same bits under one spec), q/k L2-normed in the kernel.

    q/k keep their key heads: lockstep's rule reads q/k head ``j // (HV / H)`` for value head j, which is what
    TorchTitan's ``repeat_interleave`` expansion builds, so the bits are those of the expanded call."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaKernel.Config):
        policy: str = STRICT  # the converter's (LockstepConverter.Config(policy=...)): hal.spec.POLICY_SPECS

    def __init__(self, config: Config):
        super().__init__(config)
        self.policy = config.policy

    def forward(self, xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, *, cu_seqlens=None, cu_seqlens_cpu=None):
        op = {"fla_chunked": "chunk_gated_delta_rule",
              "fla_fused_recurrent": "fused_recurrent_gated_delta_rule"}.get(self.backend)
        if op is None:
            raise UnsupportedError(f"GatedDeltaKernel backend {self.backend!r}: lockstep maps 'fla_chunked' and "
                                   "'fla_fused_recurrent' only")
        spec, backend = switched(self.policy, op, xv_BLNV)  # the conv and gates (LockstepGatedDeltaNet) stay strict
        o, _ = getattr(hal, op)(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=True, spec=spec, backend=backend)
        return o


class LockstepGatedDeltaNet(GatedDeltaNet):
    """TorchTitan's GatedDeltaNet forward with lockstep's conv (``hal.gdn_causal_conv1d``, per document) and gates
    (``hal.gdn_gating``); its projections, kernel and norm are the (lockstep) child modules."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaNet.Config):
        pass

    def _lockstep_conv(self, x_1TD, conv, cu):
        if conv.bias is not None or tuple(conv.stride) != (1,) or tuple(conv.dilation) != (1,):
            raise UnsupportedError("GatedDeltaNet conv: lockstep supports the bias-free, stride-1 depthwise conv only")
        y, _ = hal.gdn_causal_conv1d(x_1TD, conv.weight.squeeze(1), None, activation="silu", cu_seqlens=cu)
        return y

    def forward(self, x_BLD, attention_masks=None):
        B, L, _ = x_BLD.shape
        if attention_masks is not None:
            cu = attention_masks.cu_seq_q
        else:  # no document offsets: each row is one stream (as TorchTitan's unpacked path)
            cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=x_BLD.device)

        def fold(t):  # [B, L, ...] -> [1, B * L, ...], TorchTitan's folded recurrence layout
            return t.reshape(1, B * L, *t.shape[2:])

        q = self._lockstep_conv(fold(self.in_proj_q(x_BLD)), self.conv_q, cu)
        k = self._lockstep_conv(fold(self.in_proj_k(x_BLD)), self.conv_k, cu)
        v = self._lockstep_conv(fold(self.in_proj_v(x_BLD)), self.conv_v, cu)
        q = q.view(1, B * L, -1, self.key_head_dim)
        k = k.view(1, B * L, -1, self.key_head_dim)
        v = v.view(1, B * L, -1, self.value_head_dim)
        z = fold(self.in_proj_z(x_BLD)).view(1, B * L, -1, self.value_head_dim)
        g, beta = hal.gdn_gating(self.A_log, fold(self.in_proj_a(x_BLD)), self.dt_bias, fold(self.in_proj_b(x_BLD)))
        o = self.kernel(q, k, v, g, beta, cu_seqlens=cu)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, L, -1))


class LockstepQwen35Attention(Qwen35Attention):
    """Qwen3.5's gated full attention: TorchTitan's forward with the output gate as ``hal.sigmoid``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen35Attention.Config):
        pass

    def forward(self, x_BLD, attention_masks, positions=None):
        B, L, _ = x_BLD.shape
        q, gate = self.wq(x_BLD).view(B, L, -1, self.head_dim * 2).chunk(2, dim=-1)
        k = self.wk(x_BLD).view(B, L, -1, self.head_dim)
        v = self.wv(x_BLD).view(B, L, -1, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        r = self.rotary_dim
        qr, kr = self.rope(q[..., :r], k[..., :r], positions)
        q, k = torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)
        out = self.inner_attention(q, k, v, attention_masks=attention_masks, scale=self.scaling,
                                   enable_gqa=self.enable_gqa).contiguous()
        out = out * hal.sigmoid(gate)
        return self.wo(out.view(B, L, -1))


class TextOnlyVisionEncoder(Qwen35VisionEncoder):
    """TorchTitan always builds Qwen3.5's vision encoder; lockstep computes text only. The weights stay (so
    TorchTitan's adapter and initialisation run unchanged) but running it refuses: no image is ever encoded
    with stock bits behind a lockstep-converted model."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen35VisionEncoder.Config):
        pass

    def forward(self, *args, **kwargs):
        raise UnsupportedError("lockstep's TorchTitan integration computes Qwen3.5's text model only: image / video "
                               "inputs (the vision encoder) are not supported")


# stock config class -> lockstep config class (exact types, as modules.REPLACEMENTS)
REPLACEMENTS = {
    OffsetRMSNorm.Config: LockstepOffsetRMSNorm.Config,
    RMSNormGated.Config: LockstepRMSNormGated.Config,
    MRoPE.Config: LockstepMRoPE.Config,
    GatedDeltaKernel.Config: LockstepGatedDeltaKernel.Config,
    GatedDeltaNet.Config: LockstepGatedDeltaNet.Config,
    Qwen35Attention.Config: LockstepQwen35Attention.Config,
}

# configs whose modules a lockstep forward above only reads weights from (never calls): the GDN's Conv1d
WEIGHT_HOLDERS = ("conv_q", "conv_k", "conv_v")

VISION = {Qwen35VisionEncoder.Config: TextOnlyVisionEncoder.Config}

