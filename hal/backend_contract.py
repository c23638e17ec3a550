"""The backend contract: every op a backend may implement, with the arguments hal passes, declared once.

A backend implements an op by defining a method of the same name with exactly these parameters (names and
order). hal calls it with validated tensors (one device, a dtype the backend lists, shapes checked) and the
resolved spec, and adds autograd itself: the method returns plain tensors. :func:`violations` checks a
backend against this page; tests/test_backend_contract.py runs it over every registered backend.

Kept beside, not inside, ``hal.backend``: a reader who implements a backend reads this file alone.
"""
from __future__ import annotations

import inspect

from .ops_registry import OPS


class BackendOps:
    """One method per op in ``hal.ops_registry.OPS``; the docstring says what it returns."""

    def matmul(self, a, b, spec):
        """``a [..., M, K] @ b [K, N]`` in a's dtype."""

    def linear(self, x, weight, bias, spec):
        """``x [..., K] @ weight[N, K]^T (+ bias[N])``; under the exact policy ``weight`` may be a prepared
        ``hal.ExactWeight`` when the backend sets ``reads_exact_weight``."""

    def rms_norm(self, x, weight, eps, residual, spec):
        """``y`` ([..., H], x's dtype), or ``(y, x + residual)`` when ``residual`` is given."""

    def softmax(self, x, spec):
        """Softmax over the last dim (hal moves the reduced dim last)."""

    def log_softmax(self, x, spec):
        """Log-softmax over the last dim."""

    def logsumexp(self, x, spec):
        """Logsumexp over the last dim, float32 (float64 for float64 input), the dim removed."""

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        """float32 ``log_softmax(hidden @ weight^T / temperature)[token]`` per row of hidden [T, H]."""

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        """``(out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] float32)`` over packed sequences (cu_* as lists)."""

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        """``(out, lse)`` of q [B, Sq, Hq, D] over the cached keys (already appended by hal)."""

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        """``(o, Parts)``: the chunked gated delta rule from ``state`` (kernels/layout.py ``Parts``)."""

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                                         want_final):
        """``(o, Parts)``: the same rule, one token at a time (same bits as the chunked form)."""

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        """``(g, beta)`` float32: ``-exp(A_log) * softplus(a + dt_bias)`` and ``sigmoid(b)``."""

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        """``(y, new_conv_state)``: the depthwise causal conv over the previous K-1 inputs, then the activation."""

    def sigmoid(self, x, spec):
        """Elementwise sigmoid in x's dtype."""

    def silu(self, x, spec):
        """Elementwise ``x * sigmoid(x)``."""

    def softplus(self, x, spec):
        """Elementwise ``log(1 + exp(x))``."""

    def silu_mul(self, a, b, spec):
        """``silu(a) * b``, rounded once."""

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        """``(cos, sin)`` float32 tables [..., rotary_dim / 2]."""

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        """x with its first 2 * cos.shape[-1] channels rotated (rotate-half or interleaved pairs)."""


def parameters(fn) -> list[str]:
    """The parameter names of a backend method, ``self`` dropped, through wrappers (``functools.wraps``)."""
    names = list(inspect.signature(inspect.unwrap(fn)).parameters)
    return names[1:] if names and names[0] == "self" else names


def violations(backend) -> list[str]:
    """Every way ``backend``'s op methods break the contract (empty: none). An op it does not define is not a
    violation (it simply does not serve that op); a method named after an op with other parameters is."""
    found = []
    for op in OPS:
        fn = getattr(type(backend), op, None)
        if fn is None or not callable(fn):
            continue
        want = getattr(BackendOps, op, None)
        if want is None:
            found.append(f"{backend.name}.{op}: op {op!r} has no contract in hal/backend_contract.py")
            continue
        got, expected = parameters(fn), parameters(want)
        if got != expected:
            found.append(f"{backend.name}.{op}({', '.join(got)}): the contract is {op}({', '.join(expected)})")
    return found
