"""The triton backend: the strict specs as Triton kernels (kernels/triton), same bits as the reference.

Serves CUDA tensors. Under ``TRITON_INTERPRET=1`` (Triton >= 3.9, whose interpreter has a
single-rounding ``tl.fma``) it also serves CPU tensors, so the conformance suite can run the real
kernels on a machine without a GPU; it is never chosen automatically for CPU tensors (its
``device_types`` stay ``("cuda",)``; only an explicit ``backend="triton"`` reaches CPU).

Importing this module does not import triton: the kernels are imported on first use.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from hal import fp_env
from hal.backend import LEVELS, Backend
from hal.backend import tokens_per_row
from hal.kernels.exact.prepared import ExactWeight
from hal.spec import EXACT, FAST, STRICT

from hal.kernels.triton.versions import (MIN_TRITON, installed_triton, interpreter_too_old, interpreting,  # noqa: F401
                                         version_text)

from .triton_seq import SequenceOps, TrainingOps

FAST_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernel(module: str):
    """The kernels/triton module of that name, imported on first use (importing this backend imports no triton)."""
    return importlib.import_module(f"hal.kernels.triton.{module}")


def _exact():
    """kernels/exact/triton_matmul.py: the exact policy's slicing, int8 products and finish kernels."""
    return importlib.import_module("hal.kernels.exact.triton_matmul")


def _matmul_kernels(spec):
    """kernels/triton/matmul.py (strict), fast_matmul.py (tensor cores, FastMatmulSpec) or the exact policy's
    kernels (kernels/exact/triton_matmul.py: int8 tl.dot, ExactMatmulSpec)."""
    if spec.policy == EXACT:
        return _exact()
    return _kernel("fast_matmul" if spec.policy == FAST else "matmul")


@contextlib.contextmanager
def _on(t: torch.Tensor):
    """Launch on the tensor's GPU (Triton launches on the current device)."""
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield


#: spec fields that size a kernel's lanes (tl.arange needs a power of two); the other tiles run any length
_POW2_TILES = {"AttentionSpec": ("kv_block",), "GatedDeltaRuleSpec": ("chunk",)}


class FoundationOps:
    """The foundation ops (matmul/linear, rms_norm, softmax family, token_logprobs) as the strict Triton
    kernels, shared by the triton and ascend backends: each says where kernels launch (``launch_on``); the
    conformance suites it claims under the strict policy follow from the ops it implements (``suites``)."""

    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        if device.type == "cpu" and interpreting():  # explicit use only: auto never offers CPU to us
            reasons = [r for r in reasons if "serves devices" not in r]
        for field in _POW2_TILES.get(type(spec).__name__, ()):
            n = getattr(spec, field)
            if n & (n - 1):
                reasons.append(f"{self.name}: {type(spec).__name__}.{field} must be a power of two on this backend "
                               f"(a kernel tile's lanes are one tl.arange), got {n}")
        return reasons

    def claimed_levels(self, suite, spec):
        if suite in self.suites and spec.policy == STRICT:
            return frozenset(LEVELS)
        return frozenset()

    def matmul(self, a, b, spec):
        with self.launch_on(a):
            return _matmul_kernels(spec).matmul(a, b, spec)

    def linear(self, x, weight, bias, spec):
        with self.launch_on(x):
            return _matmul_kernels(spec).linear(x, weight, bias.contiguous() if bias is not None else None, spec)

    def rms_norm(self, x, weight, eps, residual, spec):
        with self.launch_on(x):
            return _kernel("rms_norm").rms_norm(x, weight, eps, residual, spec)

    def softmax(self, x, spec):
        with self.launch_on(x):
            return _kernel("softmax").softmax(x, spec)

    def log_softmax(self, x, spec):
        with self.launch_on(x):
            return _kernel("softmax").log_softmax(x, spec)

    def logsumexp(self, x, spec):
        with self.launch_on(x):
            return _kernel("softmax").logsumexp(x, spec)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        # the kernel takes one token per row; K tokens per row: one launch per column (same bits, K LM-head rows)
        with self.launch_on(hidden):
            return tokens_per_row(_kernel("token_logprobs").token_logprobs, hidden, weight, tokens, temperature, spec)


class ElementwiseOps:
    """sigmoid / silu / softplus / silu_mul and rotary as the strict Triton kernels (kernels/triton/elementwise.py);
    a mixin like FoundationOps (the backend names ``launch_on``)."""

    def sigmoid(self, x, spec):
        with self.launch_on(x):
            return _kernel("elementwise").sigmoid(x, spec)

    def silu(self, x, spec):
        with self.launch_on(x):
            return _kernel("elementwise").silu(x, spec)

    def softplus(self, x, spec):
        with self.launch_on(x):
            return _kernel("elementwise").softplus(x, spec)

    def silu_mul(self, a, b, spec):
        with self.launch_on(a):
            return _kernel("elementwise").silu_mul(a, b, spec)

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        with self.launch_on(positions):
            return _kernel("elementwise").rotary_cos_sin(positions, rotary_dim, base, inv_freq, spec)

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        with self.launch_on(x):
            return _kernel("elementwise").apply_rotary(x, cos, sin, interleaved, spec)


class TritonBackend(TrainingOps, ElementwiseOps, SequenceOps, FoundationOps, Backend):
    name = "triton"
    device_types = ("cuda",)
    priority = 10
    description = ("strict specs as Triton kernels (explicit fma chains, lsm1 exp/log, fusion off); CUDA, or CPU "
                   "through TRITON_INTERPRET=1 for verification")
    launch_on = staticmethod(_on)
    # fast: matmul / linear, attention, gated delta rule and token_logprobs' logits on tensor cores
    # (docs/fast_policy.md); exact: matmul / linear
    # and token_logprobs' logits as int8 tl.dot kernels (kernels/exact/triton_matmul.py, docs/exact_matmul.md)
    policies = (STRICT, FAST, EXACT)
    reads_exact_weight = True  # the exact kernels read a prepared weight's int8 planes
    #: fast-policy conformance suites and the levels they hold on one GPU model; never L4 (no cross-vendor bits)
    fast_levels = {"matmul_fast": frozenset({"L0", "L1", "L3", "A"}),
                   "attention_fast": frozenset({"L0", "L1", "L2", "L3", "A"}),
                   "gated_delta_rule_fast": frozenset({"L0", "L1", "L2", "L3", "A"}),
                   "token_logprobs_fast": frozenset({"L0", "L1", "L3", "A"})}

    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        fast = FAST in spec.policies_used()  # a fast spec, or a token_logprobs spec whose logits' dot is one
        if fast and dtype not in FAST_DTYPES:
            reasons.append(f"{self.name}: fast policy runs bfloat16/float16 tensor cores only, not {dtype} (spec "
                           f"{spec.id}; float32 is refused rather than run as tf32: use the strict spec, or cast)")
        dot = getattr(spec, "matmul", None) or spec  # the spec whose tensor-core dot runs
        if fast and getattr(dot, "version", 2) == 3 and device.type == "cuda" and \
                torch.cuda.is_available() and torch.cuda.get_device_capability(device) != (9, 0):
            cap = "sm_%d%d" % torch.cuda.get_device_capability(device)
            reasons.append(f"{self.name}: {spec.id} names the wgmma instruction family of sm_90; this device is {cap} "
                           "(use the v2 fast spec)")
        return reasons

    def claimed_levels(self, suite, spec):
        if FAST in spec.policies_used():
            return self.fast_levels.get(suite, frozenset()) if suite in self.suites else frozenset()
        if spec.policy == EXACT:  # integer sums: the reference's bits, every level (L4's goldens included)
            return frozenset(LEVELS) if suite in self.suites else frozenset()
        return super().claimed_levels(suite, spec)

    def fast_fingerprint(self, device) -> dict:
        """What this backend's fast bits depend on besides the spec (hal.fast_fingerprint): the GPU model and
        compute capability, or the interpreter and the CPU it runs on; the Triton version."""
        from importlib import metadata
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = {"device": torch.cuda.get_device_name(device), "compute_capability": f"{major}.{minor}"}
        else:  # only reached under TRITON_INTERPRET=1 (supports refuses CPU otherwise)
            where = {"device": f"triton interpreter on {_cpu_name()}", "compute_capability": None}
        return {**where, "triton": metadata.version("triton")}

    def exact_slice(self, weight, slices):
        """The exact policy's slicing kernel (hal.exact_weight prepares CUDA weights with it): core.slice_rows's bits."""
        with self.launch_on(weight):
            return _exact().prepared_slices(weight, slices)

    def unavailable_reason(self) -> str | None:
        version = installed_triton()
        if version is None:
            return "triton is not installed (pip install 'lockstep[triton]')"
        if interpreting():
            from hal.kernels.triton.launch import interpreter_problem
            # the interpreter computes with numpy on the calling thread, under its FP control bits
            return interpreter_too_old(version) or interpreter_problem() or fp_env.flush_reason(self.name, ())
        if version < MIN_TRITON:
            return f"needs triton >= {version_text(MIN_TRITON)}; installed: {version_text(version)}"
        if not torch.cuda.is_available():
            return ("no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 to run the "
                    "kernels on CPU in the Triton interpreter (verification only, slow)")
        return None


def _cpu_name() -> str:
    """The CPU model (/proc/cpuinfo's "model name" on Linux), else what platform knows."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _op_methods() -> tuple[str, ...]:
    """The op methods of the triton backend (its op mixins)."""
    mixins = (FoundationOps, ElementwiseOps, SequenceOps, TrainingOps)
    return tuple(sorted({n for cls in mixins for n, f in vars(cls).items()
                         if callable(f) and not n.startswith("_")} - {"supports", "claimed_levels"}))


def launch_path(call):
    """Run ``call`` (a thunk of public hal ops on the triton backend) once, then return a thunk that repeats only
    the backend calls it made, with the same arguments: the capture-safe path for ``torch.cuda.graph``.

    The eager call is the validation step: hal checks every argument there, values included (cu_seqlens,
    cache_seqlens, block tables, token ids read on the host). The returned thunk skips those checks, which is
    what the caller asks for by using it: a replay trusts whatever values the same input tensors hold then
    (a CUDA graph's static inputs; a prepared ``hal.ExactWeight`` is not checked for staleness again), and runs only
    the backend's kernels and host arithmetic on shapes (none of
    hal's own torch ops around them, e.g. the KV-cache append of ``flash_attn_with_kvcache``). Returns
    ``(replay, result)``: ``replay()`` gives the last backend call's result, ``result`` is the eager call's;
    ``replay.ops`` names the backend ops it repeats.
    Setup-time only: it swaps the backend's methods for the eager call (not thread-safe).
    """
    recorded, ops, real = [], [], {name: getattr(TritonBackend, name) for name in _op_methods()}
    own = {name for name in real if name in vars(TritonBackend)}  # the others live on the mixins

    def recorder(name):
        def method(self, *args, **kwargs):
            # a prepared exact weight is replayed as the eager call checked it (its staleness check hashes on the host)
            replay_args = tuple(a.trusted() if isinstance(a, ExactWeight) else a for a in args)
            recorded.append((self, real[name], replay_args, kwargs))
            ops.append(name)
            return real[name](self, *args, **kwargs)
        return method
    for name in real:
        setattr(TritonBackend, name, recorder(name))
    try:
        result = call()
    finally:
        for name, method in real.items():
            if name in own:
                setattr(TritonBackend, name, method)
            else:
                delattr(TritonBackend, name)
    if not recorded:
        raise ValueError("launch_path: the call made no triton backend call (pass backend='triton', or "
                         "hal.use('triton'), to the ops inside it)")

    def replay():
        out = None
        for backend, method, args, kwargs in recorded:
            out = method(backend, *args, **kwargs)
        return out
    replay.ops = tuple(ops)  # the backend ops it repeats, in order
    replay.calls = tuple(recorded)  # (backend, method, args, kwargs) of each
    return replay, result

