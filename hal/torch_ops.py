"""The registrar: ``register(record)`` turns an op's record (hal/ops_registry.py ``OpRecord``, declared beside
the op's public function) into ``torch.ops.lockstep.*`` and fills the op-indexed tables derived from it.

It knows no op's internals. Per torch op: the schema (``torch.library.Library("lockstep", "DEF").define``),
one real kernel for every device (CompositeExplicitAutograd: it calls the op's python function under
``no_grad``, so the compiled path runs the very code the eager path runs, and reads ``hal.use`` /
``LOCKSTEP_BACKEND`` / the default spec when it runs), the record's fake kernel (shapes, dtypes and strides;
no data) and its backward: every backward is an op too (``<name>_backward`` for a ``FunctionBackward``, the
record's own for an ``OpBackward``), so a compiled training step keeps it opaque: AOT autograd / Inductor
never trace and refuse a backward's float math, and its grads are eager's bits.

The same call takes a lone ``TorchOp`` (an integration's torch op over a public op's spec family: the
integration registers its own, the core names none) and a ``HelperOp`` (a torch op that is no public op's,
e.g. a step of a sharding rule).

APIs used (all in torch 2.11): torch.library.Library(ns, "DEF"), Library.define, Library.impl,
torch.library.register_fake(lib=), torch.library.register_autograd(setup_context=, lib=).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from types import SimpleNamespace

import torch

from . import backend as _backend, backend_contract, dispatch, ops_registry
from .errors import UnsupportedError
from .ops_registry import (DTENSOR_RULES, NAMESPACE, OPS, TORCH_OPS, FunctionBackward, HelperOp, OpBackward, OpRecord,
                           Refused, TorchOp)

__all__ = ["register", "register_all", "registered", "routed", "op_calls", "saves", "fake_grads", "OpRecord", "TorchOp",
           "HelperOp", "FunctionBackward", "OpBackward", "Refused"]

_lib: torch.library.Library | None = None


def _library() -> torch.library.Library:
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "DEF")
    return _lib


def _names(op: TorchOp) -> list[str]:
    return [a.split()[-1] for a in op.args.split(",")] + ["spec", "backend"]


def _kernel(op: TorchOp):
    names, fixed, fn = _names(op), dict(op.fixed), op.function

    def kernel(*args):
        with _direct():
            out = fn(**dict(zip(names, args)), **fixed)
        if isinstance(out, tuple):
            return tuple(_unaliased(o, args) for o in out)
        return _unaliased(out, args)
    kernel.__name__ = f"lockstep_{op.name}"
    return kernel


@contextlib.contextmanager
def _direct():
    """Inside a real kernel: the public ops' direct path (not the torch ops again), no autograd (the
    registered formula's is above the kernel)."""
    routing, ops_registry._route_all = ops_registry._route_all, False
    try:
        with torch.no_grad():
            yield
    finally:
        ops_registry._route_all = routing


def _unaliased(out, args):
    """The op's outputs are fresh and contiguous (what the fake kernels promise, whatever the input
    strides): an output that aliases an input (a pass-through, e.g. an empty case) is copied."""
    for a in args:
        if isinstance(a, torch.Tensor) and (out is a or (out._is_view() and out._base is a)):
            return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def saves(*idx, **attrs):
    """A ``FunctionBackward.setup`` that saves the op's arguments at ``idx`` and sets each ``attrs`` key on
    ctx to ``get(inputs, output)``: what most autograd.Functions' forwards store."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in idx))
        for k, get in attrs.items():
            setattr(ctx, k, get(inputs, output))
    return setup


def fake_grads(*inputs, fallback):
    """A backward op's fake result: one gradient per input with its shape and dtype, or ``[0]`` (like
    ``fallback``) for an input not given (a schema's ``Tensor`` output cannot be None)."""
    return tuple(fallback.new_empty((0,)) if x is None else x.new_empty(x.shape) for x in inputs)


# ---------------------------------------------------------------- autograd: the eager backwards, as ops
# Under AOT autograd a backward written in torch code is traced and Inductor fuses / reorders its float math,
# so a compiled step's gradients would not be eager's bits. A FunctionBackward is therefore an op too,
# ``<name>_backward``: its real kernel rebuilds the ctx the Function's forward would have filled (the record's
# ``setup``) and runs that Function's backward, the very code eager autograd runs; no recompute of the forward.


class _EagerCtx(SimpleNamespace):
    """The ctx an autograd.Function's forward fills, outside autograd: what its backward reads."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _OpaqueBackward:
    """One FunctionBackward's ``<name>_backward`` op: schema, real kernel, fake, and the forward's autograd calling it.

    The op takes the forward's arguments (without spec and backend: a backward formula is not a spec),
    its outputs when the row reads them, one grad per output and ``needs`` (which grads are wanted); it
    returns ``n_grads`` tensors, an empty one where a grad is not wanted or its input is None."""

    def __init__(self, op: TorchOp, b: FunctionBackward):
        self.op, self.setup, self.n_grads, self.reads_output = op, b.setup, b.grads, b.reads_output
        self.formula = b.formula or (lambda ctx, *grads: b.function.backward(ctx, *grads)[:b.grads])
        args = op.args.split(",")
        self.n_args, self.n_out = len(args), op.returns.count("Tensor")
        self.tensor_at = tuple(i for i, a in enumerate(args) if a.split()[0].startswith("Tensor"))
        self.name = f"{op.name}_backward"

    @property
    def schema(self) -> str:
        outs = [f"Tensor out{i}" for i in range(self.n_out)] if self.reads_output else []
        grads = [f"Tensor grad{i}" for i in range(self.n_out)]
        returns = "Tensor" if self.n_grads == 1 else "(" + ", ".join(["Tensor"] * self.n_grads) + ")"
        return f"{self.name}({self.op.args}, {', '.join(outs + grads)}, bool[] needs) -> {returns}"

    def _split(self, args):
        inputs, rest = args[:self.n_args], args[self.n_args:-1]
        outs = rest[:self.n_out] if self.reads_output else None
        return inputs, outs, rest[-self.n_out:], args[-1]

    def _result(self, grads):
        return grads[0] if self.n_grads == 1 else tuple(grads)

    def kernel(self, *args):
        inputs, outs, grads, needs = self._split(args)
        ctx = _EagerCtx(needs_input_grad=tuple(needs))
        self.setup(ctx, inputs, outs if outs is None or self.n_out > 1 else outs[0])
        with _direct():
            got = self.formula(ctx, *grads)
        result = []
        for g, need in zip(got, needs):
            if not need or g is None:
                g = inputs[0].new_empty((0,))
            elif any(g is r for r in result):  # rms_norm_residual's x and residual share one grad tensor
                g = g.clone()
            result.append(_unaliased(g, args))
        return self._result(result)

    def fake(self, *args):
        inputs, _, _, needs = self._split(args)
        return self._result([x.new_empty(x.shape) if need and x is not None else inputs[0].new_empty((0,))
                             for x, need in zip(inputs, needs)])

    def setup_context(self, ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*(inputs[i] for i in self.tensor_at), *(outs if self.reads_output else ()))
        ctx.scalars = {i: inputs[i] for i in range(self.n_args) if i not in self.tensor_at}
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]

    def backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        tensors = iter(saved[:len(self.tensor_at)])
        inputs = [next(tensors) if i in self.tensor_at else ctx.scalars[i] for i in range(self.n_args)]
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.out_meta)]
        needs = [bool(n) for n in ctx.needs_input_grad[:self.n_grads]]
        got = getattr(getattr(torch.ops, NAMESPACE), self.name)(*inputs, *saved[len(self.tensor_at):], *grads, needs)
        got = (got,) if self.n_grads == 1 else got
        wanted = [g if need and x is not None else None for g, need, x in zip(got, needs, inputs)]
        return (*wanted, *[None] * (len(_names(self.op)) - self.n_grads))

    def register(self, lib) -> None:
        lib.define(self.schema)
        lib.impl(self.name, self.kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{self.name}", self.fake, lib=lib)
        torch.library.register_autograd(f"{NAMESPACE}::{self.op.name}", self.backward,
                                        setup_context=self.setup_context, lib=lib)


# ---------------------------------------------------------------- registration


def _refuse(message: str):
    def setup_context(ctx, inputs, output):
        raise UnsupportedError(message)

    def backward(ctx, *grads):
        raise AssertionError(f"unreachable: the setup_context refuses inputs that require grad ({message})")
    return setup_context, backward


_helpers: dict[str, HelperOp] = {}


def _define(helper: HelperOp) -> None:
    lib = _library()
    known = _helpers.get(helper.name)
    if known == helper:
        return  # one backward op may serve several ops (the gated delta rule's two forms)
    if known is not None or helper.name in TORCH_OPS:
        raise ValueError(f"torch op {helper.name!r} is already registered (another definition)")
    kernel = helper.kernel
    if helper.direct:
        def kernel(*args, _fn=helper.kernel):
            with _direct():
                return _fn(*args)
    kernel.__name__ = f"lockstep_{helper.name}"
    lib.define(helper.schema)
    lib.impl(helper.name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{helper.name}", helper.fake, lib=lib)
    _helpers[helper.name] = helper


def _register_torch_op(op: TorchOp) -> None:
    if op.public not in OPS:
        raise ValueError(f"torch op {op.name!r}: public op {op.public!r} is not registered (register its record first)")
    if op.fake is None:
        raise ValueError(f"torch op {op.name!r} (of {op.public}): no fake kernel; torch.compile and torch.export "
                         "need one (TorchOp(fake=...): the outputs' shapes and dtypes from the arguments alone)")
    if op.name in TORCH_OPS:
        raise ValueError(f"torch op {op.name!r} is already registered")
    lib = _library()
    lib.define(op.name + op.schema)
    lib.impl(op.name, _kernel(op), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=lib)
    b, qualified = op.backward, f"{NAMESPACE}::{op.name}"
    if isinstance(b, FunctionBackward):
        _OpaqueBackward(op, b).register(lib)
    elif isinstance(b, OpBackward):
        _define(b.op)
        torch.library.register_autograd(qualified, b.backward, setup_context=b.setup_context, lib=lib)
    elif isinstance(b, Refused):
        setup_context, backward = _refuse(b.message)
        torch.library.register_autograd(qualified, backward, setup_context=setup_context, lib=lib)
    elif b is not None:
        raise TypeError(f"torch op {op.name!r}: backward must be a FunctionBackward, OpBackward, Refused or None, "
                        f"not {type(b).__name__}")
    TORCH_OPS[op.name] = op


def _check(record: OpRecord) -> None:
    """A record is refused whole, by name, before any table changes."""
    if record.name in OPS:
        raise ValueError(f"op {record.name!r} is already registered")
    if not record.torch_ops:
        raise ValueError(f"op {record.name!r}: a record needs at least one torch op (torch.compile's path)")
    for op in record.torch_ops:
        if op.fake is None:
            raise ValueError(f"op {record.name!r}: torch op {op.name!r} has no fake kernel; torch.compile and "
                             "torch.export need one (TorchOp(fake=...): the outputs' shapes and dtypes from the "
                             "arguments alone)")
        if op.public not in (None, record.name):
            raise ValueError(f"op {record.name!r}: torch op {op.name!r} names another public op ({op.public!r})")
        if op.name in TORCH_OPS:
            raise ValueError(f"op {record.name!r}: torch op {op.name!r} is already registered")
    if not callable(record.contract) or record.contract.__name__ != record.name:
        raise ValueError(f"op {record.name!r}: its contract must be the backend method {record.name}(self, ..., spec)")
    for suite, policies in record.suites:
        known = _backend.CONFORMANCE_SUITES.get(suite)
        if known is not None and tuple(known[1]) != tuple(policies):
            raise ValueError(f"op {record.name!r}: suite {suite!r} uses policies {known[1]}, not {policies}")
    listed = {suite for suite, _ in record.suites}
    for suite in record.conformance:
        if getattr(suite, "name", None) not in listed or record.name not in getattr(suite, "ops", ()):
            raise ValueError(f"op {record.name!r}: conformance suite {getattr(suite, 'name', suite)!r} must be one of "
                             f"its suites ({', '.join(sorted(listed)) or 'none listed'}) and check the op")
    for backend_name, kernel in record.kernels:
        dispatch.get_backend(backend_name)  # an unknown backend is refused here, by name
        got, want = backend_contract.parameters(kernel), backend_contract.parameters(record.contract)
        if got != want:
            raise ValueError(f"op {record.name!r}: its {backend_name} kernel takes ({', '.join(got)}), the contract "
                             f"is ({', '.join(want)})")


def register(item) -> None:
    """The one call that makes an op: an :class:`OpRecord` (a public op and its torch ops; every op-indexed
    table follows from it), a lone :class:`TorchOp` over a registered public op (an integration's own torch op),
    or a :class:`HelperOp`. A record that cannot be registered is refused whole, naming the op."""
    if isinstance(item, HelperOp):
        _define(item)
        return
    if isinstance(item, TorchOp):
        _register_torch_op(item)
        return
    if not isinstance(item, OpRecord):
        raise TypeError(f"register() takes an OpRecord, a TorchOp or a HelperOp, not {type(item).__name__}")
    _check(item)
    OPS[item.name] = item.family
    if item.sharding is not None:
        DTENSOR_RULES.add(item.name)
    setattr(backend_contract.BackendOps, item.name, item.contract)
    for suite, policies in item.suites:
        ops, _ = _backend.CONFORMANCE_SUITES.get(suite, ((), ()))
        _backend.CONFORMANCE_SUITES[suite] = ((*ops, item.name), tuple(policies))
    for suite in item.conformance:
        _backend.OUTSIDE_SUITES[suite.name] = suite
    for backend_name, kernel in item.kernels:
        type(dispatch.get_backend(backend_name)).add_op(item.name, kernel)
    for op in item.torch_ops:
        _register_torch_op(op if op.public is not None else replace(op, public=item.name))


def register_all() -> None:
    """Kept for callers of the old API: the ops register themselves when their modules are imported
    (``import hal``); this only makes sure the library exists."""
    _library()


def registered() -> list[str]:
    """The torch ops defined in the lockstep namespace."""
    return [name for name in TORCH_OPS if hasattr(getattr(torch.ops, NAMESPACE), name)]


@contextlib.contextmanager
def routed():
    """Eager calls go through ``torch.ops.lockstep.*`` too (as under compile): for tests and for counting
    the torch op calls a forward makes (:func:`op_calls`). Not thread-safe; not for production."""
    before = ops_registry._route_all
    ops_registry._route_all = True
    try:
        yield
    finally:
        ops_registry._route_all = before


class _Counter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == NAMESPACE:
            name = func._opname
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def op_calls():
    """Count the ``torch.ops.lockstep.*`` calls made inside (use with :func:`routed` for eager code)."""
    mode = _Counter()
    with mode:
        yield mode.calls
