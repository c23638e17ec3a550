"""Benchmark rows for the gated delta rule on CPU: lockstep's reference backend (serial and chunked
specs) vs transformers' Qwen3-Next reference functions (torch_chunk_gated_delta_rule for prefill,
torch_recurrent_gated_delta_rule for decode), on the same tensors.

Prefill: one call over a fresh sequence batch. Decode: one token per sequence continuing from a
state at a position that is not a multiple of 64 (so the chunked spec recomputes its open chunk).
"""
from __future__ import annotations

import torch

import hal
from hal.spec import GatedDeltaRuleSpec

CHUNKED = GatedDeltaRuleSpec(variant="chunked")
SERIAL = GatedDeltaRuleSpec(variant="serial")


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def rows(quick: bool):
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                   torch_recurrent_gated_delta_rule)
    B, T, H, HV, d = (1, 128, 1, 2, 64) if quick else (2, 256, 2, 4, 128)
    pos = 100 if quick else 200  # decode position: inside a chunk
    q, k, v = _r(B, T, H, d), _r(B, T, H, d, seed=1), _r(B, T, HV, d, seed=2)
    g = -torch.rand(B, T, HV, generator=torch.Generator().manual_seed(3))
    beta = torch.rand(B, T, HV, generator=torch.Generator().manual_seed(4))
    shape = f"B{B} T{T} H{H}/{HV} D{d} fp32"

    def prefill(spec):
        return lambda: hal.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, spec=spec)

    def hf_prefill():
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)

    x1 = [t[:, pos:pos + 1] for t in (q, k, v, g, beta)]
    states = {}
    for spec in (CHUNKED, SERIAL):
        prefix = [t[:, :pos] for t in (q, k, v, g, beta)]
        _, states[spec] = hal.chunk_gated_delta_rule(*prefix, output_final_state="state", use_qk_l2norm_in_kernel=True,
                                                     spec=spec)
    s_bare = states[SERIAL].final_state

    def decode(spec):
        return lambda: hal.fused_recurrent_gated_delta_rule(*x1, initial_state=states[spec], output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True, spec=spec)

    def hf_decode():
        return torch_recurrent_gated_delta_rule(x1[0], x1[1], x1[2], g=x1[3], beta=x1[4], initial_state=s_bare,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)

    return [
        ("gdn prefill chunked", shape, prefill(CHUNKED), hf_prefill),
        ("gdn prefill serial", shape, prefill(SERIAL), hf_prefill),
        ("gdn decode chunked", f"B{B} pos{pos} H{H}/{HV} D{d} fp32", decode(CHUNKED), hf_decode),
        ("gdn decode serial", f"B{B} pos{pos} H{H}/{HV} D{d} fp32", decode(SERIAL), hf_decode),
    ]
