"""Tiny Qwen3.5 (text) and Qwen3-Next checkpoints built locally (nothing downloaded) for the GDN tests.

Shapes vLLM-CPU accepts: full-attention head_dim 32 (its attention kernel sizes), 2 key / 4 value GDN heads of
64 (the sizes stock's C++ GDN kernels accept: 32 is refused, and the negative control runs them), conv kernel 4;
one GDN layer then one full-attention layer, twice. Qwen3.5's partial rotary factor 0.25 gives 8 rotary dims
(4 frequencies: the interleaved mRoPE pick touches all three rows); Qwen3-Next's dense MLP in layer 0, MoE
(4 experts, top 2, a shared expert) in the others."""
from __future__ import annotations

import torch

from tiny import DTYPES, VOCAB

KINDS = ("qwen3_5", "qwen3_next")

_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"] * 2,
               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
               linear_conv_kernel_dim=4)


# One GDN head of 32 (lockstep's ops only: stock's kernels refuse it): vLLM sizes a hybrid's attention blocks to
# hold a GDN layer's state, 288 tokens at the shapes above (no request outgrows one), 32 here, so a few blocks
# make vLLM preempt.
SMALL_STATE = dict(linear_num_value_heads=1, linear_num_key_heads=1, linear_key_head_dim=32, linear_value_head_dim=32)


def save_tiny_gdn(kind: str, dtype: str, path, seed: int = 0, small_state: bool = False) -> str:
    import transformers as tf
    common = {**_COMMON, **(SMALL_STATE if small_state else {})}
    if kind == "qwen3_5":
        cfg, cls = tf.Qwen3_5TextConfig(**common), tf.Qwen3_5ForCausalLM
    elif kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])
        cls = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():  # HF initialises the (1 + w) norms' w at 0 and the gated norm at 1: move them
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
    model.to(DTYPES[dtype]).save_pretrained(str(path))
    return str(path)
