"""Registers ``torch.ops.lockstep.*`` from the op table (hal/ops_registry.py ``TORCH_OPS``).

Per op: the schema from the table (``torch.library.Library("lockstep", "DEF").define``), one real kernel
for every device (CompositeExplicitAutograd: it calls the public python function under ``no_grad``, so
the compiled path runs the very code the eager path runs, and reads ``hal.use`` / ``HAL_BACKEND`` / the
default spec when it runs), a fake kernel (shapes, dtypes and strides; no data) and, for the ops that
have a backward, ``register_autograd`` reusing the backward of the op's autograd.Function.

APIs used (all in torch 2.11): torch.library.Library(ns, "DEF"), Library.define, Library.impl,
torch.library.register_fake(lib=), torch.library.register_autograd(setup_context=, lib=).
"""
from __future__ import annotations

import contextlib
import importlib

import torch

from . import ops_registry
from .ops_registry import NAMESPACE, TORCH_OPS, TorchOp

__all__ = ["register_all", "registered", "routed", "op_calls"]

_lib: torch.library.Library | None = None


def _function(op: TorchOp):
    module, _, attr = op.function.partition(":")
    return getattr(importlib.import_module(module), attr)


def _names(op: TorchOp) -> list[str]:
    return [a.split()[-1] for a in op.args.split(",")] + ["spec", "backend"]


def _kernel(op: TorchOp):
    fn, names, fixed = _function(op), _names(op), dict(op.fixed)

    def kernel(*args):
        routing, ops_registry._route_all = ops_registry._route_all, False  # the direct path from here on
        try:
            with torch.no_grad():  # autograd is the registered formula's, above this kernel
                out = fn(**dict(zip(names, args)), **fixed)
        finally:
            ops_registry._route_all = routing
        if isinstance(out, tuple):
            return tuple(_unaliased(o, args) for o in out)
        return _unaliased(out, args)
    kernel.__name__ = f"lockstep_{op.name}"
    return kernel


def _unaliased(out, args):
    """The op's outputs are fresh and contiguous (what the fake kernels promise, whatever the input
    strides): an output that aliases an input (a pass-through, e.g. an empty case) is copied."""
    for a in args:
        if isinstance(a, torch.Tensor) and (out is a or (out._is_view() and out._base is a)):
            return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


# ---------------------------------------------------------------- fake kernels (no data access)


def _fake_logsumexp(x, dim, spec, backend):
    d = dim % x.dim()
    return x.new_empty(x.shape[:d] + x.shape[d + 1:])


def _fake_rotary_cos_sin(positions, rotary_dim, base, inv_freq, spec, backend):
    shape = (*positions.shape, rotary_dim // 2)
    return (positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32))


FAKES = {
    "matmul": lambda a, b, spec, backend: a.new_empty((*a.shape[:-1], b.shape[1])),
    "linear": lambda x, weight, bias, spec, backend: x.new_empty((*x.shape[:-1], weight.shape[0])),
    "rms_norm": lambda x, weight, eps, spec, backend: x.new_empty(x.shape),
    "rms_norm_residual": lambda x, weight, residual, eps, spec, backend: (x.new_empty(x.shape), x.new_empty(x.shape)),
    "softmax": lambda x, dim, spec, backend: x.new_empty(x.shape),
    "log_softmax": lambda x, dim, spec, backend: x.new_empty(x.shape),
    "logsumexp": _fake_logsumexp,
    "token_logprobs": lambda hidden, w, tokens, temperature, spec, backend: hidden.new_empty(tokens.shape,
                                                                                           dtype=torch.float32),
    "sigmoid": lambda x, spec, backend: x.new_empty(x.shape),
    "silu": lambda x, spec, backend: x.new_empty(x.shape),
    "softplus": lambda x, spec, backend: x.new_empty(x.shape),
    "silu_mul": lambda a, b, spec, backend: a.new_empty(a.shape),
    "rotary_cos_sin": _fake_rotary_cos_sin,
    "apply_rotary": lambda x, cos, sin, interleaved, spec, backend: x.new_empty(x.shape),
}


# ---------------------------------------------------------------- autograd: today's backward formulas


def _autograd_table():
    """op -> (the autograd.Function whose backward is the op's, setup_context, grads it returns).

    ``setup`` stores on ctx what that Function's forward stores; ``grads``: how many leading op
    arguments (the differentiable tensors, in the Function's order) its backward returns grads for."""
    from . import elementwise as ew, ops

    def save(*idx, **attrs):
        def setup(ctx, inputs, output):
            ctx.save_for_backward(*(inputs[i] for i in idx))
            for k, get in attrs.items():
                setattr(ctx, k, get(inputs, output))
        return setup

    def softmax_setup(kind):
        def setup(ctx, inputs, output):
            x, dim = inputs[0], inputs[1] % inputs[0].dim()
            out = output if kind == "logsumexp" else output.movedim(dim, -1)
            ctx.save_for_backward(x.movedim(dim, -1), out)
            ctx.kind, ctx.dim = kind, dim
        return setup

    def rms_residual(ctx, inputs, output):
        ctx.save_for_backward(output[1], inputs[1])  # the backward reads h = x + residual
        ctx.eps, ctx.has_residual = inputs[3], True

    unary = {k: (ew._UnaryFn, save(0, kind=lambda i, o, k=k: k), 1) for k in ("sigmoid", "silu", "softplus")}
    return {
        "matmul": (ops._MatmulFn, save(0, 1), 2),
        "linear": (ops._LinearFn, save(0, 1, has_bias=lambda i, o: i[2] is not None), 3),
        "rms_norm": (ops._RMSNormFn, save(0, 1, eps=lambda i, o: i[2], has_residual=lambda i, o: False), 2),
        "rms_norm_residual": (ops._RMSNormFn, rms_residual, 3),
        **{k: (ops._SoftmaxFamilyFn, softmax_setup(k), 1) for k in ("softmax", "log_softmax", "logsumexp")},
        "token_logprobs": (ops._TokenLogprobsFn, save(0, 1, 2, temperature=lambda i, o: i[3]), 2),
        **unary,
        "silu_mul": (ew._SiluMulFn, save(0, 1), 2),
        "apply_rotary": (ew._RotaryFn, save(0, 1, 2, interleaved=lambda i, o: i[3]), 3),
    }


def _backward(op: TorchOp, fn_class, n_grads: int):
    n_args = len(_names(op))

    def backward(ctx, *grads):
        dim = getattr(ctx, "dim", None)
        if dim is not None and op.name != "logsumexp":  # softmax family: the Function's rows are the last axis
            grads = tuple(g.movedim(dim, -1) for g in grads)
        out = fn_class.backward(ctx, *grads)[:n_grads]
        if dim is not None:
            out = tuple(g.movedim(-1, dim) for g in out)
        return (*out, *[None] * (n_args - n_grads))
    return backward


# ---------------------------------------------------------------- registration


def register_all() -> None:
    """Define every op of the table once (idempotent: importing hal calls it)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    autograd = _autograd_table()
    for op in TORCH_OPS.values():
        lib.define(op.name + op.schema)
        lib.impl(op.name, _kernel(op), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{op.name}", FAKES[op.name], lib=lib)
        if op.name in autograd:
            fn_class, setup, n_grads = autograd[op.name]
            torch.library.register_autograd(f"{NAMESPACE}::{op.name}", _backward(op, fn_class, n_grads),
                                            setup_context=setup, lib=lib)
    _lib = lib


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
