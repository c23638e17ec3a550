"""The op record and the tables derived from it: every public op's spec family, the torch ops
(``torch.ops.lockstep.*``) it becomes, and how each call is routed.

Each public op declares one :class:`OpRecord` beside its public function (hal/ops.py, hal/attention.py, ...)
and hands it to ``hal.torch_ops.register``, which fills ``OPS`` (public op name -> spec family: what dispatch
and the conformance suite read), ``TORCH_OPS`` (torch op name -> :class:`TorchOp`: its schema -- tensors, ints,
floats, bools, then ``spec`` and ``backend`` as ``str?`` id / name --, the arguments it writes, ``Tensor(a!)``,
the python function its real kernel calls, its fake and its backward), ``DTENSOR_RULES``, the backend contract
(hal/backend_contract.py) and the conformance suites a backend may claim (hal/backend.py). An integration
registers its own torch ops the same way (a lone :class:`TorchOp` over a public op's family): the core names
none. docs/architecture.md, "A new op, step by step".

Routing, one call at every public op's head: ``how = routing("linear", x, weight, bias)`` says how this
call runs, one of

* ``DIRECT``: the op's own eager path (validate, dispatch, kernel; the common case, ~0.5 us to decide);
* ``TORCH_OP``: Dynamo or torch.export is tracing the caller (or :func:`hal.torch_ops.routed` is on):
  the op calls :func:`route`, i.e. ``torch.ops.lockstep.<op>`` with the spec as its id and the backend
  as its name, and the op's kernel resolves the rest (``hal.use``, ``LOCKSTEP_BACKEND``, the default spec)
  when it runs, so a compiled graph never bakes a choice made at trace time;
* ``DTENSOR``: a tensor argument is a DTensor: the op applies its sharding rule (hal/tensor_parallel.py).
  Only the ops in ``DTENSOR_RULES`` have one; for any other op :func:`routing` raises UnsupportedError
  naming the op, never a DTensor run through plain-tensor code. This holds while tracing too: the rule is
  python that Dynamo traces (placements are trace-time constants it guards on; ``to_local`` /
  ``DTensor.from_local`` are graph ops), and its local calls, on plain tensors, then take ``TORCH_OP``. A
  DTensor handed to ``torch.ops.lockstep.*`` itself would meet DTensor's own dispatch, which knows no
  lockstep rule: compiled and eager calls take the same rule, its refusals and its bits.

A new public op starts with the same head::

    how = routing("my_op", x, w)          # every tensor argument, None allowed
    if how is TORCH_OP:
        return route("my_op", x, w, spec=spec, backend=backend)
    if how is DTENSOR:                    # only if its record has a ``sharding`` rule
        return tensor_parallel.rowwise(...)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from . import spec as specs
from .errors import SpecError, UnsupportedError

#: op name -> spec family (derived: filled by each op's record, hal.torch_ops.register)
OPS: dict[str, str] = {}


def register_op(op: str, family: str) -> None:
    OPS[op] = family


NAMESPACE = "lockstep"
_CHOICE = "str? spec, str? backend"  # every torch op ends with these two


@dataclass(frozen=True)
class TorchOp:
    """One ``torch.ops.lockstep.<name>`` serving public op ``public`` (a key of OPS; None inside an
    :class:`OpRecord`: the record's op). Its real kernel calls ``function`` with the schema's arguments by
    name, plus ``fixed``; ``fake`` gives its outputs' shapes (same arguments, no data); ``backward`` is how
    autograd reaches it (:class:`FunctionBackward`, :class:`OpBackward`, :class:`Refused`; None: the op
    takes no gradient, its public function refuses inputs that require one)."""
    name: str
    public: str | None
    function: Callable
    args: str  # the schema's arguments before ``spec, backend``
    returns: str
    fixed: tuple[tuple[str, object], ...] = ()  # keyword arguments the kernel adds (e.g. return_lse=True)
    fake: Callable | None = None
    backward: object = None

    @property
    def family(self) -> str:
        return OPS[self.public]

    @property
    def schema(self) -> str:
        return f"({self.args}, {_CHOICE}) -> {self.returns}"

    @property
    def mutates(self) -> tuple[str, ...]:
        """The arguments the op writes, read from the schema's ``(a!)`` annotations."""
        return tuple(a.split()[-1] for a in self.args.split(",") if "!)" in a)


@dataclass(frozen=True)
class HelperOp:
    """A torch op that is no public op's own: a backward op, or a step of a sharding rule a graph cannot
    trace. ``schema`` is the whole ``name(args) -> returns``; ``kernel`` gets the arguments positionally
    (inside the public ops' direct path when ``direct``), ``fake`` the same."""
    schema: str
    kernel: Callable
    fake: Callable
    direct: bool = False

    @property
    def name(self) -> str:
        return self.schema.partition("(")[0]


@dataclass(frozen=True)
class FunctionBackward:
    """The op's gradient is an ``autograd.Function``'s backward, run as the op ``<name>_backward``: ``setup``
    (ctx, inputs, output) stores on ctx what the Function's forward stores; ``grads``: how many leading op
    arguments (the differentiable tensors, in the Function's order) it returns grads for; ``reads_output``:
    setup reads the op's outputs. ``formula`` (ctx, *grads) replaces ``function.backward`` when the op's
    argument order differs from the Function's."""
    function: type
    setup: Callable
    grads: int
    reads_output: bool = False
    formula: Callable | None = None


@dataclass(frozen=True)
class OpBackward:
    """The op's gradient is a backward op of its own (``op``, e.g. one that reads host values), called by
    ``backward`` (ctx, *grads) from what ``setup_context`` (ctx, inputs, output) saved."""
    op: HelperOp
    setup_context: Callable
    backward: Callable


@dataclass(frozen=True)
class Refused:
    """The op has no backward yet: an input that requires grad is refused with ``message``."""
    message: str


@dataclass(frozen=True)
class OpRecord:
    """One public op, declared beside its public function; ``hal.torch_ops.register(record)`` derives every
    op-indexed table from it: ``OPS`` (name -> spec ``family``), ``TORCH_OPS`` and the torch ops themselves
    (``torch_ops``: schema, kernel, fake, backward), ``DTENSOR_RULES`` (``sharding``: what its DTensor rule
    takes, None when it has none), the backend contract (``contract``: the backend method's signature and
    what it returns) and ``hal.backend.CONFORMANCE_SUITES`` (``suites``: conformance suite -> the policies
    its specs use). An op that lives outside lockstep also brings its ``kernels`` (backend name -> the method
    that backend runs for it, added to the backend's class) and its ``conformance`` suites (``Suite`` objects,
    found by ``hal.conformance.suites.get`` like lockstep's own)."""
    name: str
    family: str
    torch_ops: tuple[TorchOp, ...]
    contract: Callable
    sharding: str | None = None
    suites: tuple[tuple[str, tuple[str, ...]], ...] = ()
    kernels: tuple[tuple[str, Callable], ...] = ()
    conformance: tuple[object, ...] = ()


#: torch op name -> its TorchOp (derived: filled by the records and the integrations' torch ops)
TORCH_OPS: dict[str, TorchOp] = {}

# ---------------------------------------------------------------- routing

DIRECT, TORCH_OP, DTENSOR = "direct", "torch_op", "dtensor"  # what routing() answers

#: public ops with a DTensor rule in hal/tensor_parallel.py (derived: the records with a ``sharding``)
DTENSOR_RULES: set[str] = set()

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo knows the function, not the name


def tracing() -> bool:
    """True while Dynamo (torch.compile) or torch.export traces the caller (or under ``routed()``): then
    a public op becomes its torch op. One flag read (~0.25 us)."""
    return _is_compiling() or _route_all


_route_all = False  # set by hal.torch_ops.routed(): eager calls through the torch ops (tests, counting)


def routing(op: str, *tensors) -> str:
    """How public op ``op`` runs this call, given its tensor arguments: DIRECT, TORCH_OP or DTENSOR (the
    module docstring). Plain tensors and None cost one type check each (other values are allowed and
    never a DTensor); a DTensor wins over tracing (its sharding rule runs, traced, and calls the torch op
    on the local tensors)."""
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and _is_dtensor(t):
            if op not in DTENSOR_RULES:
                raise UnsupportedError(
                    f"{op}: DTensor arguments are not supported (lockstep's sharding rules cover "
                    f"{', '.join(sorted(DTENSOR_RULES))}); pass local tensors (DTensor.to_local()) or "
                    "redistribute to a plain tensor first")
            return DTENSOR
    if _is_compiling() or _route_all:
        return TORCH_OP
    return DIRECT


def dtensor_class():
    """The DTensor class, or None while torch.distributed.tensor was never imported (then no DTensor exists,
    and checking a tensor subclass such as a FakeTensor costs no import)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _is_dtensor(t) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def has_dtensor(*tensors) -> bool:
    """True if any argument is a DTensor (plain tensors and None cost one type check)."""
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and _is_dtensor(t):
            return True
    return False


def _crossing(op: TorchOp, spec):
    """A spec object crosses the torch op as its id, and the kernel rebuilds it from that id (spec.from_id):
    refused now, with eager's refusal, when it is not a spec of this op's family or its id names no spec.
    (An id string crosses as it is: the kernel resolves it when it runs, and refuses it as eagerly.)"""
    spec = specs.resolve(op.family, spec)
    if specs.from_id(spec.id) != spec:
        raise SpecError(f"{op.public} under torch.compile / torch.export: spec {type(spec).__name__} crosses the torch op "
                        f"as its id {spec.id!r}, which names no spec of hal.spec's classes at their current version; "
                        "pass one of those (hal.spec.CLASSES) or call eagerly")
    return spec


def route(name: str, *args, spec=None, backend=None):
    """Call ``torch.ops.lockstep.<name>`` with the spec as its id and the backend as its name."""
    op = TORCH_OPS[name]
    for a in args:
        if isinstance(a, (list, tuple)) and all(isinstance(x, (int, torch.SymInt)) for x in a):
            continue  # int[] arguments (window_size)
        if not (a is None or isinstance(a, (torch.Tensor, bool, int, float, str, torch.SymInt, torch.SymFloat))):
            raise UnsupportedError(
                f"{op.public} under torch.compile / torch.export: an argument of type {type(a).__name__} cannot "
                f"cross the torch op boundary", [f"{type(a).__name__} is not a tensor or a number (a prepared "
                "hal.exact_weight is refused under compile: pass the weight tensor itself, same bits)"])
    if spec is not None and not isinstance(spec, str):
        spec = _crossing(op, spec)
    spec_id = spec if spec is None or isinstance(spec, str) else spec.id
    backend_name = backend if backend is None or isinstance(backend, str) else backend.name
    return getattr(getattr(torch.ops, NAMESPACE), name)(*args, spec_id, backend_name)
