"""Tiny randomly initialised HF causal LMs (nothing downloaded) for tests, examples and verify demos."""
from __future__ import annotations

import torch

KINDS = ("llama", "qwen3", "qwen3_next")
EXTRA_KINDS = ("qwen2", "mistral")  # same adapters (Qwen2: q/k/v biases); checked by tests, not in the example

VOCAB = 128  # token ids of the tiny models

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)


def tiny_config(kind: str, attn_implementation: str = "lockstep"):
    import transformers as tf
    if kind == "llama":
        cfg = tf.LlamaConfig(**_COMMON)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**_COMMON)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**_COMMON, sliding_window=None)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**_COMMON, head_dim=16)
    elif kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**_COMMON, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                 linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])
    else:
        raise ValueError(f"kind must be one of {KINDS + EXTRA_KINDS}, got {kind!r}")
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(kind: str, seed: int = 0, dtype=torch.float32, attn_implementation: str = "lockstep"):
    """A tiny ``*ForCausalLM`` in eval mode, built under a fixed seed without touching the caller's RNG."""
    import transformers as tf
    cfg = tiny_config(kind, attn_implementation)
    cls = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "mistral": tf.MistralForCausalLM}[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        if kind == "qwen3_next":  # HF inits its (1 + w) norms to w = 0: make them non-trivial
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                        p.normal_(0.0, 0.1)
    return model.to(dtype).eval()
