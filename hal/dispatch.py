"""Backend registry and selection.

Order of precedence for a call: ``backend=`` argument > innermost ``with hal.use(name)`` >
``LOCKSTEP_BACKEND`` environment variable (``HAL_BACKEND``, its older name, is still read when it is unset) >
automatic choice by the tensors' device.

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
from .spec import OpSpec

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


def unregister_backend(name: str) -> None:
    backends().pop(name, None)
    _chosen.clear()


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
def use(name: str):
    """Run the enclosed calls on backend ``name``. Nests, restores on exceptions, per thread/task."""
    get_backend(name)  # fail early on a typo
    token = _current.set(_current.get() + (name,))
    try:
        yield get_backend(name)
    finally:
        _current.reset(token)


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
