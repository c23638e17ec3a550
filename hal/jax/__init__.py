"""hal.jax: the strict specs as JAX functions on jax.Arrays (jit-able, same names as the torch ops).

Importing ``hal`` never imports this package (it imports jax). See docs/jax.md.
"""
from .ops import linear, log_softmax, logsumexp, matmul, rms_norm, softmax, token_logprobs
from .strict_math import check_environment

__all__ = ["matmul", "linear", "rms_norm", "softmax", "log_softmax", "logsumexp", "token_logprobs",
           "check_environment"]
from .attention import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402

__all__ += ["flash_attn_varlen_func", "flash_attn_with_kvcache"]
from .elementwise import apply_rotary, rotary_cos_sin, sigmoid, silu, silu_mul, softplus  # noqa: E402

__all__ += ["sigmoid", "silu", "softplus", "silu_mul", "rotary_cos_sin", "apply_rotary"]
from .gdn_layer import gdn_causal_conv1d, gdn_gating  # noqa: E402

__all__ += ["gdn_gating", "gdn_causal_conv1d"]
from .gated_delta_rule import GatedDeltaRuleState, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402

__all__ += ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "GatedDeltaRuleState"]


def __getattr__(name):
    """``GDNState``: the old name of :class:`GatedDeltaRuleState` (one name everywhere public, as in
    ``hal.GatedDeltaRuleState``), kept for one release with a DeprecationWarning (hal/deprecation.py)."""
    if name == "GDNState":
        from hal.deprecation import warn_moved
        warn_moved("hal.jax.GDNState", "hal.jax.GatedDeltaRuleState (the same class)")
        return GatedDeltaRuleState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
