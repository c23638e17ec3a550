"""Backend registry and selection, and the policy switch.

Order of precedence for a call: ``backend=`` argument > innermost ``with hal.use(name)`` >
``LOCKSTEP_BACKEND`` environment variable (``HAL_BACKEND``, its older name, is still read when it is unset) >
automatic choice by the tensors' device.

The policy switch, ``with hal.use(policy="fast")`` (or "exact"): a call given no ``spec=`` runs its family's spec
under that policy (``hal.spec.POLICY_SPECS``, per op: :func:`switched_spec`; a family the policy has no spec for,
or an op of the family no suite checks under that spec, keeps its strict default; ``specs=`` replaces entries of that
table for the enclosed calls, e.g. ``hal.use(policy="fast", specs={"attention": FAST_ATTENTION_DECODE})``), and a
call whose spec is the policy's is served only by a backend that claims conformance levels for that op's suite
on that device (the requested one, else the first by priority that serves the call: the triton backend on CUDA,
or on CPU under ``TRITON_INTERPRET=1``), refused by name (UnsupportedError naming the policy and the device)
otherwise: never the stock control, never another policy's spec. ``policy="strict"`` (the default) changes
nothing. docs/fast_policy.md, "One switch for a whole model".

A named backend that cannot serve the call raises :class:`UnsupportedError` with every reason.
The automatic choice tries the backends serving the device in priority order and logs once when
it falls back past the first one.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import threading
from importlib import metadata

import torch

from .backend import Backend
from .errors import BackendUnavailable, InputError, UnsupportedError
from . import spec as specs
from .spec import POLICY_SPECS, STRICT, OpSpec, policy_specs

log = logging.getLogger("lockstep")

ENTRY_POINT_GROUP = "lockstep.backends"
#: The environment variables that name a backend, in the order they are read: lockstep's own prefix first, then
#: the older name (kept one release: read until hal.deprecation.REMOVED_IN; every other variable is LOCKSTEP_*).
BACKEND_ENV_VARS = ("LOCKSTEP_BACKEND", "HAL_BACKEND")
_BUILTIN = {
    "cpu": "hal.backends.cpu:CpuBackend",
    "reference": "hal.backends.reference:ReferenceBackend",
    "stock": "hal.backends.stock:StockBackend",
    "triton": "hal.backends.triton:TritonBackend",
    "ascend": "hal.backends.ascend:AscendBackend",
    "jax": "hal.backends.jax:JaxBackend",
}

_lock = threading.Lock()
_backends: dict[str, Backend] | None = None
_load_errors: dict[str, str] = {}
_fallback_logged: set[tuple] = set()
#: (op, id(spec), dtype, device, request) -> (spec, backend): repeated calls skip the search (see select)
_chosen: dict[tuple, tuple[OpSpec, Backend]] = {}
_chosen_for: dict | None = None  # the registry _chosen was filled from
_current: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("lockstep_backend", default=())
_policy: contextvars.ContextVar[str] = contextvars.ContextVar("lockstep_policy", default=STRICT)
#: the switch's table when ``hal.use(policy=..., specs=...)`` replaced entries (hal.spec.policy_specs); None: the
#: policy's own, hal.spec.POLICY_SPECS
_policy_table: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lockstep_policy_table", default=None)


def _load(target: str) -> Backend:
    module, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if isinstance(obj, type) else obj


def backends() -> dict[str, Backend]:
    """All registered backends by name (built-ins first, then entry points), loaded once."""
    global _backends
    with _lock:
        if _backends is None:
            found: dict[str, Backend] = {}
            for name, target in _BUILTIN.items():
                found[name] = _load(target)
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in found:
                    continue
                try:
                    b = ep.load()
                    found[ep.name] = b() if isinstance(b, type) else b
                except Exception as e:  # a broken plug-in must not break lockstep
                    _load_errors[ep.name] = f"entry point {ep.value!r} failed to load: {type(e).__name__}: {e}"
            _backends = found
        return _backends


def register_backend(backend: Backend) -> None:
    """Register a backend object at run time (tests, notebooks). Entry points are the durable way."""
    if not backend.name:
        raise ValueError("a backend needs a name")
    backends()[backend.name] = backend
    _chosen.clear()
    _claimed.clear()


def unregister_backend(name: str) -> None:
    backends().pop(name, None)
    _chosen.clear()
    _claimed.clear()


def load_errors() -> dict[str, str]:
    backends()
    return dict(_load_errors)


def get_backend(name: str) -> Backend:
    bs = backends()
    if name not in bs:
        extra = f" ({_load_errors[name]})" if name in _load_errors else ""
        raise BackendUnavailable(f"unknown backend {name!r}{extra}; registered: {', '.join(bs)} (`hal info` lists them)")
    return bs[name]


@contextlib.contextmanager
def use(name: str | None = None, *, policy: str | None = None, specs: dict | None = None):
    """Run the enclosed calls on backend ``name`` and / or under ``policy`` (the switch: module docstring), whose
    table ``specs`` (family -> spec or id) changes for them (hal.spec.policy_specs: SpecError naming a spec that is
    not the policy's, of another family, or for a family the policy has none of). An inner ``hal.use(policy=...)``
    brings its own table. Nests, restores on exceptions, per thread/task; yields the named backend (None when only a
    policy is given)."""
    if specs is not None and policy is None:
        raise InputError("hal.use: specs= changes a policy switch's table; pass the policy too, e.g. "
                         "hal.use(policy='fast', specs={'attention': ...})")
    if name is None and policy is None:
        raise InputError("hal.use needs a backend name, a policy= or both, e.g. hal.use('triton'), "
                         "hal.use(policy='fast')")
    if name is not None:
        get_backend(name)  # fail early on a typo
    if policy is not None and policy not in POLICY_SPECS:
        raise InputError(f"hal.use: policy must be one of {tuple(POLICY_SPECS)}, got {policy!r}")
    table = policy_specs(policy, specs) if specs is not None else None
    backend_token = _current.set(_current.get() + (name,)) if name is not None else None
    policy_token = (_policy.set(policy), _policy_table.set(table)) if policy is not None else None
    try:
        yield get_backend(name) if name is not None else None
    finally:
        if policy_token is not None:
            _policy_table.reset(policy_token[1])
            _policy.reset(policy_token[0])
        if backend_token is not None:
            _current.reset(backend_token)


def policy_in_force() -> str:
    """The policy of the innermost ``hal.use(policy=...)``; "strict" outside any."""
    return _policy.get()


def call_spec(op: str, spec: OpSpec | str | None) -> OpSpec:
    """The spec a call of public op ``op`` runs: the given one (object or id), else its spec under the policy in
    force (:func:`switched_spec`: its family's strict default outside a switch)."""
    from .ops_registry import OPS
    return specs.resolve(OPS[op], spec if spec is not None else switched_spec(op, _policy.get(), _policy_table.get()))


def switched_spec(op: str, policy: str, table: dict | None = None) -> OpSpec:
    """The spec public op ``op`` runs under ``policy``'s switch: its family's entry of ``hal.spec.POLICY_SPECS``
    (or of ``table``, a switch's own: hal.spec.policy_specs) where a conformance suite checks ``op`` under that spec (:func:`suite_of`: the op's record lists the suite),
    else the family's strict default. So one family entry reaches the ops its spec is made for: under fast the
    gated delta rule's two ops run the fast GDN spec, the GDN layer ops of the same family (gdn_gating,
    gdn_causal_conv1d, which refuse a fast spec) stay strict."""
    from .ops_registry import OPS
    family = OPS[op]
    s, default = specs.policy_spec(family, policy, table), specs.DEFAULTS[family]
    return s if s is default or suite_of(op, s) is not None else default


def requested_backend() -> tuple[str | None, str]:
    """The backend name asked for by context or environment, and where the request came from."""
    stack = _current.get()
    if stack:
        return stack[-1], "hal.use"
    for var in BACKEND_ENV_VARS:
        env = os.environ.get(var, "").strip()
        if env:
            return (None, "auto") if env == "auto" else (env, var)
    return None, "auto"


def common_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    device = None
    for t in tensors.values():
        if isinstance(t, torch.Tensor):
            d = t.device
            if device is None:
                device = d
            elif d != device:
                listing = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if isinstance(t, torch.Tensor))
                raise InputError(f"tensors are on different devices ({listing}); move them to one device")
    return device


def select(op: str, spec: OpSpec, dtype: torch.dtype, device: torch.device, backend: str | Backend | None = None) -> Backend:
    """The backend that serves this call (see module docstring).

    The answer is remembered per (op, spec, dtype, device, request): a per-call search costs more
    than a small kernel. What may change between calls is checked again on every hit: the
    request (``hal.use`` / ``LOCKSTEP_BACKEND``, read each call), the registry (register/unregister
    clear the memo; a replaced registry drops it) and the chosen backend's availability. Only a
    backend that needed no fallback is remembered, so the automatic choice stays the first
    capable backend by priority."""
    global _chosen_for
    policy = _policy.get()
    if policy != STRICT and policy in spec.policies_used():
        return claiming_backend(op, spec, dtype, device, backend, policy)
    request = backend if backend not in (None, "auto") else requested_backend()[0]
    # a device by its type and index: torch.device is hashable, stand-in devices (tests, wrappers) may not be
    key = (op, id(spec), dtype, getattr(device, "type", device), getattr(device, "index", None), request)
    hit = _chosen.get(key)
    if hit is not None and hit[0] is spec and _chosen_for is _backends and hit[1].unavailable_reason() is None:
        return hit[1]
    chosen, first_choice = _select(op, spec, dtype, device, backend)
    if _chosen_for is not _backends:
        _chosen.clear()
        _chosen_for = _backends
    if first_choice and len(_chosen) < 4096:  # bounded: a program uses a handful of (op, spec, dtype) combinations
        _chosen[key] = (spec, chosen)
    return chosen


def _select(op, spec, dtype, device, backend) -> tuple[Backend, bool]:
    """The search itself: (backend, whether it is the first choice, i.e. no fallback)."""
    if isinstance(backend, Backend):
        name, source = backend.name, "backend="
        chosen = backend
    else:
        name, source = (backend, "backend=") if backend not in (None, "auto") else requested_backend()
        chosen = get_backend(name) if name else None
    if chosen is not None:
        reasons = chosen.supports(op, spec, dtype, device)
        if reasons:
            raise UnsupportedError(f"backend {name!r} (requested by {source}) cannot run {op} with spec "
                                   f"{spec.id}, {dtype}, device {device}", reasons)
        return chosen, True
    candidates = sorted((b for b in backends().values() if b.auto and device.type in b.device_types),
                        key=lambda b: -b.priority)
    reasons: list[str] = []
    for i, b in enumerate(candidates):
        why = b.supports(op, spec, dtype, device)
        if not why:
            if i > 0:
                key = (op, spec.id, device.type, b.name)
                if key not in _fallback_logged:
                    _fallback_logged.add(key)
                    log.warning("lockstep: %s on %s falls back to backend %r: %s", op, device.type, b.name,
                                "; ".join(reasons))
            return b, i == 0
        reasons.extend(why)
    if not candidates:
        reasons.append(f"no registered backend serves device type {device.type!r}")
    raise UnsupportedError(f"no backend can run {op} with spec {spec.id}, {dtype}, device {device}", reasons)


# ---------------------------------------------------------------- the policy switch


def suite_of(op: str, spec: OpSpec) -> str | None:
    """The conformance suite that checks ``op`` under ``spec`` (the one whose policies are those the spec uses, e.g.
    linear + a fast matmul spec -> "matmul_fast"), None when none does."""
    from .backend import CONFORMANCE_SUITES
    used = spec.policies_used()
    return next((s for s, (ops, policies) in CONFORMANCE_SUITES.items() if op in ops and set(policies) == used), None)


#: (policy, op, id(spec), dtype, device type, index, request) -> (spec, backend): the switch's choices, remembered
_claimed: dict[tuple, tuple[OpSpec, Backend]] = {}


def claiming_backend(op: str, spec: OpSpec, dtype: torch.dtype, device: torch.device,
                     backend: str | Backend | None = None, policy: str | None = None) -> Backend:
    """The backend that runs ``op`` under ``spec`` for the policy switch ``policy`` (default: the one in force): the
    requested one (``backend=``, ``hal.use``, ``LOCKSTEP_BACKEND``), else the first by priority that serves the call
    (triton serves CPU under ``TRITON_INTERPRET=1``: its ``supports`` says so), and it must claim conformance levels
    of the op's suite (:func:`suite_of`) for ``spec``; UnsupportedError naming the policy and the device otherwise."""
    policy = policy or _policy.get()
    request = backend if backend not in (None, "auto") else requested_backend()[0]
    name = request.name if isinstance(request, Backend) else request
    key = (policy, op, id(spec), dtype, getattr(device, "type", device), getattr(device, "index", None), name)
    hit = _claimed.get(key)
    if hit is not None and hit[0] is spec and hit[1] is backends().get(hit[1].name) and hit[1].unavailable_reason() is None:
        return hit[1]
    where = f"policy {policy!r} on device {device}"
    suite = suite_of(op, spec)
    if suite is None:
        raise UnsupportedError(f"{where}: {op} under {spec.id} is checked by no conformance suite, so no backend "
                               "can claim it")
    claimants = sorted(n for n, b in backends().items() if b.claimed_levels(suite, spec))
    hint = (f"backends claiming {suite} under {spec.id}: {', '.join(claimants) or 'none'} (triton: on CUDA, or on "
            "CPU under TRITON_INTERPRET=1 for tests); use policy='strict' where none can run")
    if request is not None:
        chosen = request if isinstance(request, Backend) else get_backend(request)
        reasons = chosen.supports(op, spec, dtype, device)
        if reasons:
            raise UnsupportedError(f"{where}: the requested backend {chosen.name!r} cannot run {op} with {spec.id}, "
                                   f"{dtype}", reasons + [hint])
        if not chosen.claimed_levels(suite, spec):
            raise UnsupportedError(f"{where}: the requested backend {chosen.name!r} claims no level of conformance "
                                   f"suite {suite!r} for {spec.id}, so it cannot serve {op} under the switch", [hint])
    else:
        reasons: list[str] = []
        chosen = None
        for b in sorted((b for b in backends().values() if b.auto), key=lambda b: -b.priority):
            why = b.supports(op, spec, dtype, device)
            if not why and not b.claimed_levels(suite, spec):
                why = [f"{b.name}: claims no level of conformance suite {suite!r} for {spec.id}"]
            if not why:
                chosen = b
                break
            reasons.extend(why)
        if chosen is None:
            raise UnsupportedError(f"{where}: no backend that claims {suite!r} can run {op} with {spec.id}, {dtype}",
                                   reasons + [hint])
    if len(_claimed) < 4096:
        _claimed[key] = (spec, chosen)
    return chosen


def check_policy(policy: str, device: torch.device, dtype: torch.dtype, ops,
                 table: dict | None = None) -> dict[str, tuple[OpSpec, Backend]]:
    """Before a switch changes anything (lt.patch, TorchTitan's converter): for each of ``ops``, the spec it runs
    under ``policy`` (with ``table``, the switch's own: hal.spec.policy_specs) and, where that spec is the policy's own, the backend that claims it on ``device`` for
    ``dtype`` (:func:`claiming_backend`, refusing by name); strict ops are listed with backend None (dispatched
    per call as ever). ``{op: (spec, backend)}``."""
    if policy not in specs.POLICY_SPECS:
        raise InputError(f"policy must be one of {tuple(specs.POLICY_SPECS)}, got {policy!r}")
    out = {}
    for op in ops:
        s = switched_spec(op, policy, table)
        out[op] = (s, claiming_backend(op, s, dtype, device, policy=policy) if policy in s.policies_used() else None)
    return out


def fast_fingerprint(device: torch.device | str | None = None, spec_ids: dict[str, str] | None = None,
                     backend: str | None = None) -> dict:
    """What fast bits depend on, for a trainer and an engine to compare (equal dicts: the same fast bits may be
    expected; different: not promised): the GPU (name, compute capability) or, under ``TRITON_INTERPRET=1``,
    "triton interpreter" and the CPU; the Triton version; the backend; and the spec id of every family under
    the fast switch (``spec_ids``: those a patch records; default: the table of an enclosing ``hal.use(policy="fast",
    specs=...)``, else ``hal.spec.POLICY_SPECS["fast"]``).
    ``device``: default the current CUDA device, or the CPU under the interpreter. Refused (UnsupportedError
    naming the policy and the device) where no backend claims the fast specs there."""
    from .spec import FAST
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if spec_ids is None:
        table = _policy_table.get() if _policy.get() == FAST else None
        spec_ids = {family: s.id for family, s in (table or specs.POLICY_SPECS[FAST]).items()}
    from .ops_registry import OPS
    served = {}
    for family, spec_id in spec_ids.items():  # the backend that claims each fast spec in force (today: triton)
        s = specs.resolve(family, spec_id)
        op = next(op for op, f in OPS.items() if f == family and suite_of(op, s) is not None)  # an op it is for
        served[family] = claiming_backend(op, s, torch.bfloat16, device, backend, FAST)
    if not served:
        raise UnsupportedError(f"policy 'fast' on device {device}: no fast spec is in force, nothing to fingerprint")
    described = {}
    for b in sorted(set(served.values()), key=lambda b: b.name):
        describe = getattr(b, "fast_fingerprint", None)
        if describe is None:
            raise UnsupportedError(f"policy 'fast' on device {device}: backend {b.name!r} does not say what its fast "
                                   "bits depend on (no fast_fingerprint method)")
        described.update(describe(device))
    return {"policy": FAST, "backend": ",".join(sorted({b.name for b in served.values()})), **described,
            "specs": dict(sorted(spec_ids.items()))}
