"""Tiny randomly initialised HF causal LMs (nothing downloaded) for tests, examples and verify demos."""
from __future__ import annotations

import torch

KINDS = ("llama", "qwen3", "qwen3_next", "qwen3_5")
# same adapters (Qwen2: q/k/v biases; Qwen3.5-MoE: Qwen3.5 layers with Qwen3-Next-style MoE); checked by tests
EXTRA_KINDS = ("qwen2", "mistral", "qwen3_5_moe")

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
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        # head_dim 32 with Qwen3.5's partial rotary factor 0.25: 8 rotary dims, 4 frequencies, so the
        # interleaved t/h/w pick of its multimodal RoPE touches all three rows. 2 key / 4 value GDN heads.
        gdn = dict(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        if kind == "qwen3_5":
            cfg = tf.Qwen3_5TextConfig(**_COMMON, **gdn)
        else:
            common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}  # every layer is MoE
            cfg = tf.Qwen3_5MoeTextConfig(**common, **gdn, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        raise ValueError(f"kind must be one of {KINDS + EXTRA_KINDS}, got {kind!r}")
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(kind: str, seed: int = 0, dtype=torch.float32, attn_implementation: str = "lockstep"):
    """A tiny ``*ForCausalLM`` in eval mode, built under a fixed seed without touching the caller's RNG."""
    import transformers as tf
    cfg = tiny_config(kind, attn_implementation)
    cls = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "mistral": tf.MistralForCausalLM, "qwen3_5": tf.Qwen3_5ForCausalLM,
           "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}[kind]
    return _build(cls, cfg, seed, dtype)


_ONE_PLUS_NORMS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def _build(cls, cfg, seed, dtype):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        if cfg.model_type in _ONE_PLUS_NORMS:  # HF inits its (1 + w) norms to w = 0: make them non-trivial
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                        p.normal_(0.0, 0.1)
    return model.to(dtype).eval()


# Qwen3.5's real layer shapes (item 5 of issue 25): hidden 2048, attention head dim 256 (8 query / 2 KV heads,
# rotary over 64 dims), GDN key / value head dim 128 (16 key, 32 value heads), MLP 6144, and the real
# 248,320-token vocabulary; two layers (one Gated DeltaNet, one full attention). The input embedding is tied
# to the LM head (the head alone is 508M parameters: 2 GB in float32), random weights, nothing downloaded.
REAL_SHAPED_QWEN3_5 = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                           linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                           linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                           max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=True)


def real_shaped_qwen3_5(seed: int = 0, dtype=torch.float32, attn_implementation: str = "lockstep"):
    """A two-layer ``Qwen3_5ForCausalLM`` with Qwen3.5's real layer shapes (``REAL_SHAPED_QWEN3_5``), eval mode.

    Built in ``dtype`` directly with HF's initialisation skipped, then filled here with uniform draws (HF's
    normal draws over 600M parameters take a minute on a loaded 2-core machine): matrices U(-a, a) with
    a = sqrt(3) * initializer_range (HF's std), (1 + w) norm weights w ~ U(-0.1, 0.1), the GDN's A_log =
    log U(0.01, 16) and dt_bias = 1 as HF's, the conv U(-0.5, 0.5) (1 / sqrt(kernel))."""
    import transformers as tf
    from transformers.initialization import no_init_weights
    cfg = tf.Qwen3_5TextConfig(**REAL_SHAPED_QWEN3_5)
    cfg._attn_implementation = attn_implementation
    old = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), no_init_weights():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            model = tf.Qwen3_5ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        model.lm_head.weight = model.model.embed_tokens.weight  # tied (HF leaves them apart under no_init_weights)
        a = 3 ** 0.5 * cfg.initializer_range
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(0.01, 16).log_())
                elif name.endswith("dt_bias"):
                    p.fill_(1.0)
                elif name.endswith("conv1d.weight"):
                    p.uniform_(-0.5, 0.5)
                elif p.dim() == 1:
                    p.uniform_(-0.1, 0.1)
                else:
                    p.uniform_(-a, a)
    for buf_name, buf in model.named_buffers():  # rotary tables are float32 in HF whatever the default dtype
        if buf.dtype != torch.float32 and buf_name.endswith("inv_freq"):
            raise AssertionError(f"{buf_name} built as {buf.dtype}")
    return model.eval()


def continuous_batching_config(**kwargs):
    """``transformers.ContinuousBatchingConfig(**kwargs)`` on every supported release: 5.17 names the engine's page
    size ``block_size``, later releases ``page_size`` (the argument written here)."""
    import dataclasses

    from transformers import ContinuousBatchingConfig
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "page_size" in kwargs and "page_size" not in fields:
        kwargs["block_size"] = kwargs.pop("page_size")
    return ContinuousBatchingConfig(**kwargs)
