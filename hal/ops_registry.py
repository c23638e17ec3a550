"""Which public op belongs to which spec family, and which levels apply to it."""

#: op name -> spec family
OPS: dict[str, str] = {
    "matmul": "matmul",
    "linear": "matmul",
    "rms_norm": "rms_norm",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "logsumexp": "softmax",
    "token_logprobs": "token_logprobs",
    "flash_attn_varlen_func": "attention",
    "flash_attn_with_kvcache": "attention",
    "chunk_gated_delta_rule": "gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "gated_delta_rule",
    "gdn_gating": "gated_delta_rule",
    "gdn_causal_conv1d": "gated_delta_rule",
    "sigmoid": "elementwise",
    "silu": "elementwise",
    "softplus": "elementwise",
    "silu_mul": "elementwise",
    "rotary_cos_sin": "rotary",
    "apply_rotary": "rotary",
}


def register_op(op: str, family: str) -> None:
    OPS[op] = family
