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
import importlib.util
import os
from importlib import metadata

import torch

from hal import fp_env
from hal.backend import LEVELS, Backend
from hal.spec import FAST, STRICT

from .triton_seq import FAMILIES as _SEQ_FAMILIES, SequenceOps, TrainingOps

FAST_DTYPES = (torch.bfloat16, torch.float16)
MIN_TRITON = (3, 6)        # GPU: enable_fp_fusion launch option, tl.fma, div_rn, sqrt_rn
MIN_INTERPRETER = (3, 9)   # CPU interpreter: tl.fma rounds once only since 3.9


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    digits = lambda s: int("".join(ch for ch in s if ch.isdigit()) or 0)  # noqa: E731
    return digits(parts[0]), digits(parts[1]) if len(parts) > 1 else 0


@functools.lru_cache(maxsize=None)
def installed_triton() -> tuple[int, int] | None:
    """The installed triton's (major, minor), None when absent; (0, 0) without metadata. Asked once per process:
    dispatch asks ``unavailable_reason`` on every call, and the package lookup plus metadata read cost
    milliseconds (2.5 ms per call measured on a busy CPU, the bulk of the per-call host time)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return _version(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        return (0, 0)


def _kernels():
    from hal.kernels.triton import matmul, rms_norm, softmax, token_logprobs
    return matmul, rms_norm, softmax, token_logprobs


def _matmul_kernels(spec):
    """kernels/triton/matmul.py (strict) or fast_matmul.py (tensor cores, FastMatmulSpec)."""
    if spec.policy == FAST:
        from hal.kernels.triton import fast_matmul
        return fast_matmul
    return _kernels()[0]


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
    kernels, shared by the triton and ascend backends: each says where kernels launch (``launch_on``)
    and which conformance ``families`` it claims."""

    families: set = {"matmul", "rms_norm", "softmax", "token_logprobs"}

    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        if device.type == "cpu" and _interpreting():  # explicit use only: auto never offers CPU to us
            reasons = [r for r in reasons if "serves devices" not in r]
        for field in _POW2_TILES.get(type(spec).__name__, ()):
            n = getattr(spec, field)
            if n & (n - 1):
                reasons.append(f"{self.name}: {type(spec).__name__}.{field} must be a power of two on this backend "
                               f"(a kernel tile's lanes are one tl.arange), got {n}")
        return reasons

    def claimed_levels(self, family, spec):
        if family in self.families and spec.policy == STRICT:
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
            return _kernels()[1].rms_norm(x, weight, eps, residual, spec)

    def softmax(self, x, spec):
        with self.launch_on(x):
            return _kernels()[2].softmax(x, spec)

    def log_softmax(self, x, spec):
        with self.launch_on(x):
            return _kernels()[2].log_softmax(x, spec)

    def logsumexp(self, x, spec):
        with self.launch_on(x):
            return _kernels()[2].logsumexp(x, spec)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        with self.launch_on(hidden):
            return _kernels()[3].token_logprobs(hidden, weight, tokens, temperature, spec)


def _elementwise():
    from hal.kernels.triton import elementwise
    return elementwise


class ElementwiseOps:
    """sigmoid / silu / softplus / silu_mul and rotary as the strict Triton kernels (kernels/triton/elementwise.py);
    a mixin like FoundationOps (the backend names ``launch_on``)."""

    families: set = {"elementwise", "rotary"}

    def sigmoid(self, x, spec):
        with self.launch_on(x):
            return _elementwise().sigmoid(x, spec)

    def silu(self, x, spec):
        with self.launch_on(x):
            return _elementwise().silu(x, spec)

    def softplus(self, x, spec):
        with self.launch_on(x):
            return _elementwise().softplus(x, spec)

    def silu_mul(self, a, b, spec):
        with self.launch_on(a):
            return _elementwise().silu_mul(a, b, spec)

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        with self.launch_on(positions):
            return _elementwise().rotary_cos_sin(positions, rotary_dim, base, inv_freq, spec)

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        with self.launch_on(x):
            return _elementwise().apply_rotary(x, cos, sin, interleaved, spec)


class TritonBackend(TrainingOps, ElementwiseOps, SequenceOps, FoundationOps, Backend):
    name = "triton"
    device_types = ("cuda",)
    priority = 10
    description = ("strict specs as Triton kernels (explicit fma chains, lsm1 exp/log, fusion off); CUDA, or CPU "
                   "through TRITON_INTERPRET=1 for verification")
    #: conformance families whose ops this backend implements under the strict policy (the attention /
    #: GDN kernels add theirs here).
    families = FoundationOps.families | _SEQ_FAMILIES | ElementwiseOps.families
    launch_on = staticmethod(_on)
    policies = (STRICT, FAST)  # fast: matmul / linear on tensor cores (FastMatmulSpec, docs/fast_policy.md)
    #: fast-policy families and the levels they hold on one GPU model; never L4 (no cross-vendor bits)
    fast_levels = {"matmul_fast": frozenset({"L0", "L1", "L3", "A"}), "attention_fast": frozenset({"L0", "L1", "L2", "L3", "A"})}

    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        if spec.policy == FAST and dtype not in FAST_DTYPES:
            reasons.append(f"{self.name}: fast policy runs bfloat16/float16 tensor cores only, not {dtype} "
                           "(float32 is refused rather than run as tf32: use the strict spec, or cast)")
        return reasons

    def claimed_levels(self, family, spec):
        if spec.policy == FAST:
            return self.fast_levels.get(family, frozenset())
        return super().claimed_levels(family, spec)

    def unavailable_reason(self) -> str | None:
        version = installed_triton()
        if version is None:
            return "triton is not installed (pip install 'lockstep[triton]')"
        if _interpreting():
            if version < MIN_INTERPRETER:
                return (f"TRITON_INTERPRET=1 needs triton >= {'.'.join(map(str, MIN_INTERPRETER))} (older "
                        f"interpreters round tl.fma twice); installed: {'.'.join(map(str, version))}")
            from hal.kernels.triton.launch import interpreter_problem
            # the interpreter computes with numpy on the calling thread, under its FP control bits
            return interpreter_problem() or fp_env.flush_reason(self.name, ())
        if version < MIN_TRITON:
            return f"needs triton >= {'.'.join(map(str, MIN_TRITON))}; installed: {'.'.join(map(str, version))}"
        if not torch.cuda.is_available():
            return ("no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 to run the "
                    "kernels on CPU in the Triton interpreter (verification only, slow)")
        return None
