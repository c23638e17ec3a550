"""The backend interface.

A backend implements ops as methods named after the op (``matmul``, ``rms_norm``, ...) that take
validated tensors (same device, supported dtype, checked shapes) and the resolved spec, and return
plain tensors without autograd. ``hal`` adds validation, dispatch and autograd around them.
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch

from .spec import EXACT, FAST, OpSpec, STRICT

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LEVELS = ("L0", "L1", "L2", "L3", "L4", "A")

#: The conformance suites (conformance/suites/*.py) a backend may claim: suite -> (the ops it checks,
#: the policies its specs use). Derived from the ops' records (``OpRecord.suites``, hal/torch_ops.py
#: ``register``); the backends derive their ``suites`` from it (by the ops they implement);
#: tests/test_layering.py checks it against hal.conformance.suites. A suite is not a spec family
#: (hal/spec.py): the matmul spec family has three suites, matmul, matmul_exact and matmul_fast.
CONFORMANCE_SUITES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
#: The suite objects of ops registered from outside lockstep (``OpRecord.conformance``): name -> Suite. Lockstep's
#: own live in conformance/suites/; ``hal.conformance.suites.get`` finds both.
OUTSIDE_SUITES: dict[str, object] = {}


def __getattr__(name):
    """The deprecated module names, kept one release (hal/deprecation.py): ``CONFORMANCE_FAMILIES`` is
    ``CONFORMANCE_SUITES``."""
    if name == "CONFORMANCE_FAMILIES":
        from .deprecation import warn_moved
        warn_moved("hal.backend.CONFORMANCE_FAMILIES", "hal.backend.CONFORMANCE_SUITES")
        return CONFORMANCE_SUITES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_running = threading.local()


def kernel_running() -> bool:
    """Whether a backend op is running on this thread: the torch calls it makes are lockstep's own
    internals (e.g. the exact policy's special-value ``@``), which ``hal.aten_mode()`` must leave to torch."""
    return getattr(_running, "depth", 0) > 0


def _marks_running(fn):
    @functools.wraps(fn)
    def op(*args, **kwargs):
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _running.depth -= 1
    op._marks_running = True
    return op


class Backend:
    #: Name used by ``backend=``, ``hal.use`` and ``LOCKSTEP_BACKEND``.
    name: str = ""
    #: Device types (``torch.device.type``) this backend serves.
    device_types: tuple[str, ...] = ()
    #: Higher is tried first when a backend is chosen automatically by device.
    priority: int = 0
    #: Whether automatic selection may pick it (the stock negative control never is).
    auto: bool = True
    #: Policies whose specs it implements.
    policies: tuple[str, ...] = (STRICT,)
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    description: str = ""
    #: Whether its exact-policy linear / token_logprobs read a prepared ``hal.ExactWeight`` (its slices);
    #: the others are given the prepared weight's source tensor (same bits, sliced per call).
    reads_exact_weight: bool = False

    def __init_subclass__(cls, **kwargs):
        """Every public method a subclass adds (its ops) marks the thread as inside lockstep while it runs."""
        super().__init_subclass__(**kwargs)
        for name, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and not name.startswith("_") and not hasattr(Backend, name) \
                    and not getattr(fn, "_marks_running", False):
                setattr(cls, name, _marks_running(fn))

    @classmethod
    def add_op(cls, name: str, fn) -> None:
        """Give this backend class the method ``name`` (an op registered from outside lockstep brings its kernels
        in its record: hal/torch_ops.py ``register``); it marks the thread as inside lockstep as the others do."""
        setattr(cls, name, fn if getattr(fn, "_marks_running", False) else _marks_running(fn))

    def unavailable_reason(self) -> str | None:
        """None when the backend can run on this machine, else why not (missing package, device)."""
        return None

    def ops(self) -> list[str]:
        from .ops_registry import OPS
        return [op for op in OPS if callable(getattr(self, op, None))]

    @property
    def suites(self) -> frozenset[str]:
        """The conformance suites this backend serves: it implements every op of the suite and every
        policy the suite's specs use (derived, never listed per backend)."""
        implemented = set(self.ops())
        return frozenset(s for s, (ops, policies) in CONFORMANCE_SUITES.items()
                         if set(policies) <= set(self.policies) and implemented.issuperset(ops))

    @property
    def families(self) -> frozenset[str]:
        """Deprecated (kept one release, hal/deprecation.py): :attr:`suites`."""
        from .deprecation import warn_moved
        warn_moved("Backend.families", "Backend.suites (the conformance suites it serves)")
        return self.suites

    def supports(self, op: str, spec: OpSpec, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Reasons this backend cannot serve the call; an empty list means it can."""
        reasons = []
        why = self.unavailable_reason()
        if why:
            reasons.append(f"{self.name}: not available here: {why}")
        if not callable(getattr(self, op, None)):
            reasons.append(f"{self.name}: does not implement {op}")
        if device.type not in self.device_types:
            reasons.append(f"{self.name}: serves devices {list(self.device_types)}, not {device.type!r}")
        if dtype not in self.dtypes:
            reasons.append(f"{self.name}: dtype {dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in self.dtypes)})")
        missing = sorted(spec.policies_used() - set(self.policies))
        if missing:  # e.g. a token_logprobs spec whose logits use the exact matmul
            reasons.append(f"{self.name}: implements policies {list(self.policies)}, not "
                           f"{', '.join(map(repr, missing))} (spec {spec.id})")
        return reasons

    def claimed_levels(self, suite: str, spec: OpSpec) -> frozenset[str]:
        """The levels this backend promises for a conformance suite (its name, e.g. "attention" or
        "matmul_exact"; never a spec family) under ``spec``, one of the specs the suite's cases use; a failure
        of a claimed level fails the conformance run. Backends whose bits are the golden ones claim every
        level of their :attr:`suites`; the default claims none (the stock control)."""
        return frozenset()

    def __repr__(self):
        return f"<backend {self.name}>"


def tokens_per_row(one_token, hidden, weight, tokens, temperature, spec):
    """A backend's token_logprobs for both forms of the contract, from a kernel that takes one token per row:
    tokens [N, K] (hidden [N, H]) runs it once per column -- the same bits as K single calls, each a full
    LM-head row (for backends whose kernel cannot read K tokens from one row)."""
    if tokens.ndim != hidden.ndim:
        return one_token(hidden, weight, tokens, temperature, spec)
    cols = [one_token(hidden, weight, tokens[:, j].contiguous(), temperature, spec) for j in range(tokens.shape[1])]
    return torch.stack(cols, 1) if cols else hidden.new_empty(tokens.shape, dtype=torch.float32)
