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
    # --- attention ops ---
    # --- gated delta rule ops ---
}


def register_op(op: str, family: str) -> None:
    OPS[op] = family
