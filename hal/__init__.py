"""lockstep's hardware abstraction layer: canonical ops that compute the same bits everywhere.

    import hal
    y = hal.linear(x, w)                       # backend chosen by x's device
    with hal.use("reference"):                 # or name one explicitly
        lp = hal.token_logprobs(h, lm_head, tokens)

Importing ``hal`` imports no optional dependency (triton, jax, torch_npu).
"""
from . import spec
from .backend import LEVELS, Backend
from .dispatch import backends, get_backend, register_backend, select, unregister_backend, use
from .errors import (BackendUnavailable, GoldenError, HalError, InputError, SpecError, UnsupportedError)
from .ops import linear, log_softmax, logsumexp, matmul, rms_norm, softmax, token_logprobs
# --- attention exports ---
# --- gated delta rule exports ---

__version__ = "0.1.0"

__all__ = [
    "spec", "LEVELS", "Backend", "backends", "get_backend", "register_backend", "unregister_backend", "select", "use",
    "HalError", "InputError", "SpecError", "BackendUnavailable", "UnsupportedError", "GoldenError",
    "matmul", "linear", "rms_norm", "softmax", "log_softmax", "logsumexp", "token_logprobs",
]
