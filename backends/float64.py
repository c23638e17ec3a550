"""float64 calls run the float64 oracle: the one place a backend routes them there.

No spec promises float64 bits; float64 exists so ``torch.autograd.gradcheck`` can check the backward
passes against the mathematical value. A backend that serves float64 (reference, cpu) decorates its
class with :func:`float64_runs_oracle` instead of writing the branch into every op.

Which calls are float64: the op modules (hal/ops.py, hal/attention.py, ...) refuse mixed float64 /
other inputs, so the first floating tensor argument decides for the whole call.
"""
from __future__ import annotations

import functools

import torch

from hal.kernels import oracle
from hal.kernels.oracle import (attention as oracle_attention, elementwise as oracle_elementwise,
                                gated_delta_rule as oracle_gdn)
from hal.ops_registry import OPS

F64 = torch.float64


class Float64Oracle:
    """The float64 oracle of every op that has a float64 path, with the backends' op signatures
    (the spec argument is accepted and ignored: the oracle is the mathematical value)."""

    def matmul(self, a, b, spec):
        return oracle.matmul(a, b)

    def linear(self, x, weight, bias, spec):
        return oracle.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual, spec):
        return oracle.rms_norm(x, weight, eps, residual)

    def softmax(self, x, spec):
        return oracle.softmax(x)

    def log_softmax(self, x, spec):
        return oracle.log_softmax(x)

    def logsumexp(self, x, spec):
        return oracle.logsumexp(x)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        return oracle.token_logprobs(hidden, weight, tokens, temperature)

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        return oracle_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        return oracle_attention.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window)

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        return oracle_gdn.run_float64(q, k, v, g, beta, scale, state, cu_seqlens, l2)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        return oracle_gdn.gdn_gating(A_log, a, dt_bias, b)

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        return oracle_gdn.causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)

    def sigmoid(self, x, spec):
        return oracle_elementwise.sigmoid(x)

    def silu(self, x, spec):
        return oracle_elementwise.silu(x)

    def softplus(self, x, spec):
        return oracle_elementwise.softplus(x)

    def silu_mul(self, a, b, spec):
        return oracle_elementwise.silu_mul(a, b)

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        return oracle_elementwise.apply_rotary(x, cos, sin, interleaved)

    # rotary_cos_sin has no float64 path: its table is float32 whatever inv_freq's dtype (hal/elementwise.py).


ORACLE = Float64Oracle()


def is_float64_call(args, kwargs) -> bool:
    """Whether the call's first floating tensor argument (positional first, then keyword) is float64."""
    for group in (args, kwargs.values()):  # no tuple built per call: this runs on every op call
        for a in group:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return a.dtype == F64
    return False


def float64_runs_oracle(cls):
    """Class decorator: every op of ``cls`` that :class:`Float64Oracle` has runs the oracle on a float64 call."""
    for op in OPS:
        method, oracle = getattr(cls, op, None), getattr(ORACLE, op, None)
        if callable(method) and oracle is not None:
            setattr(cls, op, _routed(method, oracle))
    return cls


def _routed(method, oracle):
    @functools.wraps(method)
    def op(self, *args, **kwargs):
        if is_float64_call(args, kwargs):
            return oracle(*args, **kwargs)
        return method(self, *args, **kwargs)
    return op
