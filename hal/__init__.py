"""lockstep's hardware abstraction layer: canonical ops that compute the same bits everywhere.

    import hal
    y = hal.linear(x, w)                       # backend chosen by x's device
    with hal.use("reference"):                 # or name one explicitly
        lp = hal.token_logprobs(h, lm_head, tokens)
    with hal.use(policy="fast"):               # every family's fast spec where it has one (one GPU model's bits)
        y = hal.linear(x, w)

Importing ``hal`` imports no optional dependency (triton, jax, torch_npu).
"""
import os as _os

# Installed (wheel or editable), the repository's backends/, kernels/ and conformance/ folders are
# the subpackages hal.backends, hal.kernels and hal.conformance (pyproject's package-dir). Run from a
# source checkout without an install they sit beside this folder: let the subpackages be found there.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and \
        _os.path.isfile(_os.path.join(_here, _os.pardir, "kernels", "__init__.py")):
    __path__.append(_os.path.normpath(_os.path.join(_here, _os.pardir)))
from . import rl, spec
from .backend import LEVELS, Backend
from .dispatch import (backends, fast_fingerprint, get_backend, policy_in_force, register_backend, select,
                       unregister_backend, use)
from .errors import (BackendUnavailable, GoldenError, HalError, InputError, SpecError, UnsupportedError)
from .ops import ExactWeight, exact_weight, linear, log_softmax, logsumexp, matmul, rms_norm, softmax, token_logprobs
from .attention import flash_attn_varlen_func, flash_attn_with_kvcache
from .kv_cache import KVCache
from .gated_delta_rule import GatedDeltaRuleState, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .gdn_layer import gdn_causal_conv1d, gdn_gating
from .elementwise import apply_rotary, rotary_cos_sin, sigmoid, silu, silu_mul, softplus
from .aten_mode import aten_mode
from . import torch_ops as _torch_ops

_torch_ops.register_all()  # torch.ops.lockstep.*: each op module registered its records on import (hal/torch_ops.py)

__version__ = "0.2.0"

__all__ = [
    "rl", "spec", "LEVELS", "Backend", "backends", "get_backend", "register_backend", "unregister_backend", "select", "use",
    "policy_in_force", "fast_fingerprint",
    "HalError", "InputError", "SpecError", "BackendUnavailable", "UnsupportedError", "GoldenError",
    "matmul", "linear", "exact_weight", "ExactWeight", "rms_norm", "softmax", "log_softmax", "logsumexp", "token_logprobs",
    "flash_attn_varlen_func", "flash_attn_with_kvcache", "KVCache",
    "GatedDeltaRuleState", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gdn_causal_conv1d", "gdn_gating",
    "sigmoid", "silu", "softplus", "silu_mul", "rotary_cos_sin", "apply_rotary", "aten_mode",
]
