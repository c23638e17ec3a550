"""The backend contract: every op a backend may implement, with the arguments hal passes, declared once.

A backend implements an op by defining a method of the same name with exactly the parameters of its contract
(names and order; each op's record declares it, hal.ops_registry.OpRecord, and it is collected on ``BackendOps``). hal calls it with validated tensors (one device, a dtype the backend lists, shapes checked) and the
resolved spec, and adds autograd itself: the method returns plain tensors. :func:`violations` checks a
backend against this page; tests/test_backend_contract.py runs it over every registered backend.

Kept beside, not inside, ``hal.backend``: a reader who implements a backend reads this file and
``help(BackendOps)``.
"""
from __future__ import annotations

import inspect

from .ops_registry import OPS


class BackendOps:
    """One method per op in ``hal.ops_registry.OPS``, its signature and what it returns: each op's record
    (``OpRecord.contract``, declared beside the op's public function) puts its method here when the op is
    registered. Read them with ``help(hal.backend_contract.BackendOps)`` (docs/architecture.md lists them)."""


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
