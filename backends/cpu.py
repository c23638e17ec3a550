"""The `cpu` backend: the strict specs compiled with numba, bit for bit the reference's output.

Chosen automatically for CPU tensors (priority above `reference`); `reference` stays selectable by
name and remains the source of the golden bits. Ops it does not implement (see ``ops()``) fall
back to the reference through dispatch. Without numba it is unavailable and auto-selection falls
back to the reference. float64 inputs run the float64 oracle, as on the reference.

Threads: a large call splits its kernel's tasks over ``torch.get_num_threads()`` threads of lockstep's
own pool (kernels/cpu/pool.py: one compiled serial kernel per op, no numba ``parallel=True`` driver), so
``torch.set_num_threads`` governs both unless hal.kernel_threads gave the kernels a count of their own. Work is split over independent outputs only, so the thread
count never changes a bit. numba's thread pool and threading layer are never used: the process's
numba settings stay the user's own. Calls are serialised by a lock.

Unavailable (auto-selection falls back, with the reason logged; a named request fails with it):
without numba, with numba's JIT switched off (``NUMBA_DISABLE_JIT=1``: the kernels would run as
Python and their numba-only helpers raise), and while the floating-point environment flushes
subnormals (:mod:`hal.fp_env`, checked before every call, so a refused call has touched nothing).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading

from hal import fp_env
from hal.backend import FLOAT_DTYPES, LEVELS, Backend
from hal.backends.float64 import F64, float64_runs_oracle
from hal.errors import UnsupportedError
from hal.spec import EXACT, STRICT


@functools.cache
def _kernel(module: str):
    return importlib.import_module(f"hal.kernels.cpu.{module}")


def _exact():
    return _kernel("exact_slice")  # compiled slicing, torch._int_mm slice products


_lock = threading.RLock()  # one call at a time (its kernels may use every pool thread); re-entrant: a call's FP check probes the pool


def _pool():
    from hal.kernels.cpu import pool
    return pool


def _pool_keeps_subnormals() -> bool:
    with _lock:  # one launch at a time, on every thread of the pool
        return _pool().keep_subnormals()


#: the cpu kernels' worker threads (started on demand, never replaced: its size names the set)
POOL_THREADS = fp_env.WorkerThreads(
    "the cpu backend's worker threads", _pool_keeps_subnormals,
    "call torch.set_flush_denormal(False) before the process's first cpu-backend call",
    lambda: (_pool().size(), _pool().threads()))


def _fp_reason() -> str | None:
    return fp_env.flush_reason("cpu", (fp_env.TORCH_THREADS, POOL_THREADS))


def _jit_disabled() -> bool:
    """numba's NUMBA_DISABLE_JIT switch (read from numba's config once numba is loaded)."""
    numba = sys.modules.get("numba")
    if numba is not None:
        return bool(numba.config.DISABLE_JIT)
    return os.environ.get("NUMBA_DISABLE_JIT", "0").strip() not in ("", "0")


#: hal.kernels.cpu (its cache stamp and one-line compile notice), imported at the first compiled call
_cpu_kernels = functools.cache(lambda: importlib.import_module("hal.kernels.cpu"))


def _strict(fn):
    """Check the FP environment before a compiled call (a few attribute reads when nothing changed: a
    small kernel takes microseconds)."""
    op = fn.__name__

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with _lock:
            _cpu_kernels().current_op = op  # named by the one-line notice if this call compiles
            why = _fp_reason()  # also checked at selection; here for callers of the backend's methods
            if why is not None:
                raise UnsupportedError(why)
            return fn(self, *args, **kwargs)
    return wrapper


@float64_runs_oracle  # float64 calls: the oracle, without numba (backends/float64.py)
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
        if _jit_disabled():
            return ("numba's JIT is switched off (NUMBA_DISABLE_JIT is set); the kernels only run compiled. "
                    "Unset NUMBA_DISABLE_JIT to use this backend")
        return _fp_reason()

    def claimed_levels(self, suite, spec):
        return frozenset(LEVELS) if suite in self.suites else frozenset()

    @_strict
    def matmul(self, a, b, spec):
        return (_exact() if spec.policy == EXACT else _kernel("matmul")).matmul(a, b, spec)

    @_strict
    def linear(self, x, weight, bias, spec):
        return (_exact() if spec.policy == EXACT else _kernel("matmul")).linear(x, weight, bias, spec)

    @_strict
    def linear_with_float32(self, x, weight, bias, spec):
        """strict linear: (its output, the float32 result it rounded) -- hal.ops.linear_with_float32."""
        return _kernel("matmul").linear_with_float32(x, weight, bias, spec)

    @_strict
    def exact_slice(self, weight, slices):
        """The compiled ``core.slice_rows`` (hal.exact_weight prepares CPU weights with it)."""
        return _exact().slice_rows(weight, slices)

    @_strict
    def rms_norm(self, x, weight, eps, residual, spec):
        return _kernel("rms_norm").rms_norm(x, weight, eps, residual, spec)

    @_strict
    def softmax(self, x, spec):
        return _kernel("softmax").softmax(x, spec)

    @_strict
    def log_softmax(self, x, spec):
        return _kernel("softmax").log_softmax(x, spec)

    @_strict
    def logsumexp(self, x, spec):
        return _kernel("softmax").logsumexp(x, spec)

    @_strict
    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        return _kernel("exact_logprobs" if spec.matmul else "softmax").token_logprobs(hidden, weight, tokens,
                                                                                     temperature, spec)

    @_strict
    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        return _kernel("attention").flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal,
                                                           window, spec)

    @_strict
    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        return _kernel("attention").flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale,
                                                            causal, window, num_splits, spec)

    # gated delta rule: both op names compute the one spec's bits
    @_strict
    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        return _kernel("gated_delta_rule").gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                                                            want_final)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule

    @_strict
    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        return _kernel("gdn_layer").gdn_gating(A_log, a, dt_bias, b)

    @_strict
    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        return _kernel("gdn_layer").causal_conv1d(x, weight, bias, conv_state, activation, cu_seqlens)

    @_strict
    def sigmoid(self, x, spec):
        return _kernel("elementwise").unary("sigmoid", x)

    @_strict
    def silu(self, x, spec):
        return _kernel("elementwise").unary("silu", x)

    @_strict
    def softplus(self, x, spec):
        return _kernel("elementwise").unary("softplus", x)

    @_strict
    def silu_mul(self, a, b, spec):
        return _kernel("elementwise").silu_mul(a, b)

    @_strict
    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        return _kernel("elementwise").rotary_cos_sin(positions, rotary_dim, base, inv_freq)

    @_strict
    def apply_rotary(self, x, cos, sin, interleaved, spec):
        return _kernel("elementwise").apply_rotary(x, cos, sin, interleaved)
