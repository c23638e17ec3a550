"""The sequence ops of the ``triton`` backend: attention and the gated delta rule family.

:class:`SequenceOps` is a mixin of backend methods with the signatures of the backend contract
(hal/backend_contract.py); ``backends/triton.py``'s ``TritonBackend`` and ``backends/ascend.py``'s ``AscendBackend`` inherit it
(the conformance suites they claim follow from the ops, ``Backend.suites``); the backend's
``launch_on(tensor)`` context says where kernels launch. The kernels are imported on first use, so importing this module imports no
triton. float64 inputs are not served (the reference runs the float64 oracle for gradcheck).
"""
from __future__ import annotations

def _attn():
    from hal.kernels.triton import attention
    return attention


def _attn_backward():
    from hal.kernels.triton import attention_backward
    return attention_backward


def _gdn_backward():
    from hal.kernels.triton import gdn_backward
    return gdn_backward


def _gdn(spec):
    """The strict chunked / serial kernels, or the tensor-core ones for a FastGatedDeltaRuleSpec."""
    if spec.policy == "fast":
        from hal.kernels.triton import fast_gated_delta_rule
        return fast_gated_delta_rule
    from hal.kernels.triton import gated_delta_rule
    return gated_delta_rule


def _gdn_layer():
    from hal.kernels.triton import gdn_layer
    return gdn_layer


class SequenceOps:
    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        with self.launch_on(q):
            return _attn().flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        with self.launch_on(q):
            return _attn().flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal,
                                                   window, num_splits, spec)

    # both op names compute the one spec's bits (the spec, not the op, picks serial or chunked)
    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        with self.launch_on(v):
            return _gdn(spec).gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final)

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        return self.chunk_gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final)

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        with self.launch_on(a):
            return _gdn_layer().gdn_gating(A_log, a, dt_bias, b)

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        with self.launch_on(x):
            return _gdn_layer().causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)


class TrainingOps:
    """Backward kernels (deterministic, not strict), found by ``hal.attention._VarlenFn.backward`` and
    ``hal.gdn_backward.grads``; the triton backend only (the Ascend variant keeps hal's torch backward)."""

    def flash_attn_varlen_backward(self, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window,
                                   gout, glse):
        """(dq, dk, dv), or None for head dims the kernels do not serve (hal's torch backward then)."""
        bwd = _attn_backward()
        if q.shape[-1] > bwd.MAX_HEAD_DIM:
            return None
        with self.launch_on(q):
            return bwd.flash_attn_varlen_backward(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal,
                                                  window, gout, glse)

    def gdn_state_scan(self, U, W, kt, end, S0):
        """``hal.gdn_backward.state_scan`` (the GDN backward's chunk-state recurrence) as Triton kernels:
        (u, S_starts, S_end), differentiable; None for what they do not serve (float64, d_k or d_v > 256,
        CPU tensors outside the interpreter): hal's torch scan then."""
        scan = _gdn_backward()
        if not scan.serves(U, W, S0):
            return None
        with self.launch_on(U):
            return scan.state_scan(U, W, kt, end, S0)
