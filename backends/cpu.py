"""The `cpu` backend: the strict specs compiled with numba, bit for bit the reference's output.

Chosen automatically for CPU tensors (priority above `reference`); `reference` stays selectable by
name and remains the source of the golden bits. Ops it does not implement (see ``ops()``) fall
back to the reference through dispatch. Without numba it is unavailable and auto-selection falls
back to the reference. float64 inputs run the float64 oracle, as on the reference.

Threads: each call runs the numba kernels on ``torch.get_num_threads()`` threads (capped by numba's
pool), so ``torch.set_num_threads`` governs both. Work is split over independent outputs only,
so the thread count never changes a bit. Unless ``NUMBA_THREADING_LAYER`` says otherwise, numba's
``workqueue`` layer is used: the OpenMP layer shares libgomp with torch and measured ~30 ms per
call here (spinning workers of the two pools); workqueue is not safe for concurrent launches, so
calls are serialised by a lock.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading

import torch

from hal.backend import FLOAT_DTYPES, LEVELS, Backend
from hal.kernels import oracle
from hal.spec import EXACT, STRICT

F64 = torch.float64

#: conformance families whose every op this backend implements (so it claims every level there)
_FAMILIES = ("matmul", "rms_norm", "softmax", "token_logprobs", "attention", "gated_delta_rule", "gdn_layer",
             "elementwise", "rotary", "matmul_exact", "token_logprobs_exact")


@functools.cache
def _kernel(module: str):
    return importlib.import_module(f"hal.kernels.cpu.{module}")


def _exact():
    return _kernel("exact_slice")  # compiled slicing, torch._int_mm slice products


_lock = threading.Lock()
_numba = None  # (numba, host.check_fp_environment) once numba's threading layer is chosen (the first call)
_kernels = None  # hal.kernels.cpu (the cache stamp and the compile notice), once numba is started
_threads = threading.local()  # numba's thread count is per calling thread: what this backend last set there


def _start_numba():
    global _numba, _kernels
    import numba

    import hal.kernels.cpu as _kernels
    from hal.kernels.cpu.host import check_fp_environment
    if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "workqueue"  # takes effect if numba's pool is not started yet
    _numba = numba, check_fp_environment
    return _numba


def _strict(fn):
    """Check the FP environment and set numba's thread count before a compiled call.

    Per-call work is kept to a few attribute reads (a small kernel takes microseconds): numba's
    thread count is set only when torch's differs from what this thread last set."""
    op = fn.__name__

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        numba, check_fp_environment = _numba or _start_numba()
        with _lock:
            _kernels.current_op = op  # named by the one-line notice if this call compiles
            n = torch.get_num_threads()
            if getattr(_threads, "n", None) != n:
                numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
                _threads.n = n
            check_fp_environment()
            return fn(self, *args, **kwargs)
    return wrapper


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    priority = 10
    dtypes = FLOAT_DTYPES + (F64,)
    policies = (STRICT, EXACT)  # exact: matmul / linear and token_logprobs' logits by torch._int_mm
    reads_exact_weight = True
    description = "the strict specs compiled with numba: the reference bits, compiled"

    def unavailable_reason(self):
        if importlib.util.find_spec("numba") is None:
            return "numba is not installed (pip install numba); the reference backend serves CPU tensors"
        return None

    def claimed_levels(self, family, spec):
        return frozenset(LEVELS) if family in _FAMILIES else frozenset()

    @_strict
    def matmul(self, a, b, spec):
        if a.dtype == F64:
            return oracle.matmul(a, b)
        return (_exact() if spec.policy == EXACT else _kernel("matmul")).matmul(a, b, spec)

    @_strict
    def linear(self, x, weight, bias, spec):
        if x.dtype == F64:
            return oracle.linear(x, weight, bias)
        return (_exact() if spec.policy == EXACT else _kernel("matmul")).linear(x, weight, bias, spec)

    @_strict
    def exact_slice(self, weight, slices):
        """The compiled ``core.slice_rows`` (hal.exact_weight prepares CPU weights with it)."""
        return _exact().slice_rows(weight, slices)

    @_strict
    def rms_norm(self, x, weight, eps, residual, spec):
        if x.dtype == F64:
            return oracle.rms_norm(x, weight, eps, residual)
        return _kernel("rms_norm").rms_norm(x, weight, eps, residual, spec)

    @_strict
    def softmax(self, x, spec):
        return oracle.softmax(x) if x.dtype == F64 else _kernel("softmax").softmax(x, spec)

    @_strict
    def log_softmax(self, x, spec):
        return oracle.log_softmax(x) if x.dtype == F64 else _kernel("softmax").log_softmax(x, spec)

    @_strict
    def logsumexp(self, x, spec):
        return oracle.logsumexp(x) if x.dtype == F64 else _kernel("softmax").logsumexp(x, spec)

    @_strict
    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        if F64 in (hidden.dtype, weight.dtype):
            return oracle.token_logprobs(hidden, weight, tokens, temperature)
        return _kernel("exact_logprobs" if spec.matmul else "softmax").token_logprobs(hidden, weight, tokens,
                                                                                     temperature, spec)

    @_strict
    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        if q.dtype == F64:
            from hal.kernels.oracle import attention as _oa
            return _oa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window)
        return _kernel("attention").flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal,
                                                           window, spec)

    @_strict
    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        if q.dtype == F64:
            from hal.kernels.oracle import attention as _oa
            return _oa.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window)
        return _kernel("attention").flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale,
                                                            causal, window, num_splits, spec)

    # gated delta rule: both op names compute the one spec's bits; float64 runs the oracle (gradcheck)
    @_strict
    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        if v.dtype == F64:
            from hal.kernels.oracle import gated_delta_rule as ora
            return ora.run_float64(q, k, v, g, beta, scale, state, cu_seqlens, l2)
        return _kernel("gated_delta_rule").gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                                                            want_final)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule

    @_strict
    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        if a.dtype == F64:
            from hal.kernels.oracle import gated_delta_rule as ora
            return ora.gdn_gating(A_log, a, dt_bias, b)
        return _kernel("qwen3_next").gdn_gating(A_log, a, dt_bias, b)

    @_strict
    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        if x.dtype == F64:
            from hal.kernels.oracle import gated_delta_rule as ora
            return ora.causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)
        return _kernel("qwen3_next").causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)

    # elementwise and rotary: float64 runs the oracle (gradcheck)
    @_strict
    def sigmoid(self, x, spec):
        return _elementwise_oracle().sigmoid(x) if x.dtype == F64 else _kernel("elementwise").unary("sigmoid", x)

    @_strict
    def silu(self, x, spec):
        return _elementwise_oracle().silu(x) if x.dtype == F64 else _kernel("elementwise").unary("silu", x)

    @_strict
    def softplus(self, x, spec):
        return _elementwise_oracle().softplus(x) if x.dtype == F64 else _kernel("elementwise").unary("softplus", x)

    @_strict
    def silu_mul(self, a, b, spec):
        return _elementwise_oracle().silu_mul(a, b) if a.dtype == F64 else _kernel("elementwise").silu_mul(a, b)

    @_strict
    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        return _kernel("elementwise").rotary_cos_sin(positions, rotary_dim, base, inv_freq)

    @_strict
    def apply_rotary(self, x, cos, sin, interleaved, spec):
        if x.dtype == F64:
            return _elementwise_oracle().apply_rotary(x, cos, sin, interleaved)
        return _kernel("elementwise").apply_rotary(x, cos, sin, interleaved)


def _elementwise_oracle():
    from hal.kernels.oracle import elementwise
    return elementwise
