"""The reference backend: the strict specs, written out in ``kernels/reference``, on CPU.

Its bits are the golden bits. float64 inputs run the float64 oracle instead (no spec bits are
promised for float64; it exists so ``torch.autograd.gradcheck`` can check the backward passes).
Under flush-to-zero / denormals-are-zero it refuses (:mod:`hal.fp_env`): at selection, so a refused
call has touched nothing, and in every op, so no golden file is ever written from flushed bits.
"""
from __future__ import annotations

import torch

from hal import fp_env
from hal.backend import FLOAT_DTYPES, LEVELS, Backend
from hal.ops_registry import OPS
from hal.kernels.reference import exact_matmul as _xm, matmul as _mm, rms_norm as _rn, softmax as _sm
from hal.spec import EXACT, STRICT

from hal.backends.float64 import F64, float64_runs_oracle


@float64_runs_oracle  # float64 calls: the oracle (backends/float64.py)
class ReferenceBackend(Backend):
    name = "reference"
    device_types = ("cpu",)
    priority = 0
    dtypes = FLOAT_DTYPES + (F64,)
    policies = (STRICT, EXACT)
    reads_exact_weight = True
    description = ("readable definition of every strict spec (torch elementwise ops, no BLAS) and of the "
                   "exact matmul policy (int64 matmuls); golden bits")

    def unavailable_reason(self):
        return fp_env.flush_reason(self.name)

    def claimed_levels(self, suite, spec):
        return frozenset(LEVELS) if suite in self.suites else frozenset()

    def matmul(self, a, b, spec):
        return (_xm if spec.policy == EXACT else _mm).matmul(a, b, spec)

    def linear(self, x, weight, bias, spec):
        return (_xm if spec.policy == EXACT else _mm).linear(x, weight, bias, spec)

    def linear_with_float32(self, x, weight, bias, spec):
        """strict linear: (its output, the float32 result it rounded) -- hal.ops.linear_with_float32."""
        return _mm.linear_with_float32(x, weight, bias, spec)

    def rms_norm(self, x, weight, eps, residual, spec):
        return _rn.rms_norm(x, weight, eps, residual, spec)

    def softmax(self, x, spec):
        return _sm.softmax(x, spec)

    def log_softmax(self, x, spec):
        return _sm.log_softmax(x, spec)

    def logsumexp(self, x, spec):
        return _sm.logsumexp(x, spec)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        return _sm.token_logprobs(hidden, weight, tokens, temperature, spec)

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        from hal.kernels.reference import attention as _at
        return _at.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        from hal.kernels.reference import attention as _at
        return _at.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                           num_splits, spec)

    # both op names compute the one spec's bits
    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        from hal.kernels.reference import gated_delta_rule as gdn
        return gdn.gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        from hal.kernels.reference import gdn_layer
        return gdn_layer.gdn_gating(A_log, a, dt_bias, b)

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        from hal.kernels.reference import gdn_layer
        return gdn_layer.causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)

    def sigmoid(self, x, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.sigmoid(x, spec)

    def silu(self, x, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.silu(x, spec)

    def softplus(self, x, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.softplus(x, spec)

    def silu_mul(self, a, b, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.silu_mul(a, b, spec)

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.rotary_cos_sin(positions, rotary_dim, base, inv_freq, spec)

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        from hal.kernels.reference import elementwise as ew
        return ew.apply_rotary(x, cos, sin, interleaved, spec)


def _strict_op(method):
    """Wrap an op: it refuses under flush-to-zero before computing, and every float output (tensors,
    tuples, state parts) leaves with the canonical NaN."""
    import functools

    from hal.kernels.reference.strict_math import canonical_nan

    def canon(x):
        if isinstance(x, torch.Tensor):
            return canonical_nan(x)
        if isinstance(x, tuple):
            items = [canon(i) for i in x]
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
        return x

    @functools.wraps(method)
    def op(self, *args, **kwargs):
        fp_env.check(self.name)
        return canon(method(self, *args, **kwargs))
    return op


# The strict policy's first and last steps, in one place: no op computes with subnormals flushed,
# and whatever an op returns (the float64 oracle's too) carries one NaN pattern per dtype.
for _op in (*OPS, "linear_with_float32"):
    if callable(getattr(ReferenceBackend, _op, None)):
        setattr(ReferenceBackend, _op, _strict_op(getattr(ReferenceBackend, _op)))
