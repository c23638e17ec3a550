"""Registers ``torch.ops.lockstep.*`` from the op table (hal/ops_registry.py ``TORCH_OPS``).

Per op: the schema from the table (``torch.library.Library("lockstep", "DEF").define``), one real kernel
for every device (CompositeExplicitAutograd: it calls the public python function under ``no_grad``, so
the compiled path runs the very code the eager path runs, and reads ``hal.use`` / ``HAL_BACKEND`` / the
default spec when it runs), a fake kernel (shapes, dtypes and strides; no data) and ``register_autograd``
reusing the backward of the op's autograd.Function (flash_attn_with_kvcache, which mutates its caches,
has none: its public function refuses inputs that require grad). The attention backwards read host values
(cu_seqlens, the HF mask plan), so they are ops too (``flash_attn_varlen_backward``,
``hf_attention_backward``): a compiled training step keeps them opaque.

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
    names, fixed = _names(op), dict(op.fixed)

    def kernel(*args):
        fn = _function(op)  # resolved at the call: the hf_attention op's module sits above hal's core
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


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_size, spec, backend):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _fake_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size,
                  num_splits, spec, backend):
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v_cache.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32))


def _fake_hf_attention(query, key, value, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, causal,
                       scaling, spec, backend):
    b, hq, tq, _ = query.shape
    return query.new_empty((b, tq, hq, value.shape[-1])), query.new_empty((b, tq, hq), dtype=torch.float32)


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
    "flash_attn_varlen": _fake_varlen,
    "flash_attn_with_kvcache": _fake_kvcache,
    "hf_attention": _fake_hf_attention,
}


# ---------------------------------------------------------------- attention backwards, themselves ops
# Their math reads cu_seqlens / the mask plan on the host (sequence by sequence), so under AOT autograd they
# must be opaque too. Each: schema, real kernel, fake kernel; the forward op's autograd calls it.

_VARLEN_BACKWARD = ("flash_attn_varlen_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, "
                    "bool causal, SymInt[] window_size, Tensor gout, Tensor? glse, str? spec, str? backend) "
                    "-> (Tensor, Tensor, Tensor)")


def _varlen_backward_kernel(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, gout, glse, spec,
                            backend):
    """_VarlenFn.backward with the backend chosen now (as the forward kernel chose its own)."""
    from types import SimpleNamespace

    from .attention import _VarlenFn
    from .ops import _prepare
    _, impl = _prepare("flash_attn_varlen_func", spec, backend, q.dtype, q=q, k=k, v=v, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k)
    ctx = SimpleNamespace(saved_tensors=(q, k, v, cu_q, cu_k, out, lse), args=(scale, causal, tuple(window)),
                          maxes=(max_q, max_k), impl=impl)
    with torch.no_grad():
        gq, gk, gv = _VarlenFn.backward(ctx, gout, glse)[:3]
    return gq.contiguous(), gk.contiguous(), gv.contiguous()


def _varlen_setup(ctx, inputs, output):
    from .attention import _scale, _window
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window, spec, backend = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.rest = (max_q, max_k, _scale(softmax_scale, q.shape[2]), bool(causal), list(_window(window)), spec, backend)


def _varlen_backward(ctx, gout, glse):
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    max_q, max_k, scale, causal, window, spec, backend = ctx.rest
    if gout is None:
        gout = torch.zeros_like(out)
    gq, gk, gv = getattr(torch.ops, NAMESPACE).flash_attn_varlen_backward(
        q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, gout, glse, spec, backend)
    return gq, gk, gv, *[None] * 9


_HF_ATTENTION_BACKWARD = ("hf_attention_backward(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, "
                          "Tensor? position_ids, Tensor? cu_seq_lens_q, Tensor? cu_seq_lens_k, bool causal, "
                          "float? scaling, Tensor out, Tensor lse, Tensor gout, Tensor? glse, str? spec, "
                          "str? backend) -> (Tensor, Tensor, Tensor)")


def _hf_attention_backward_kernel(query, key, value, attention_mask, position_ids, cu_q, cu_k, causal, scaling, out,
                                  lse, gout, glse, spec, backend):
    """The mask plan again (host values), then the eager patched attention's gradients (attend_backward)."""
    from .integrations.hf_attention import attend_backward, visibility
    vis = visibility(query.shape[0], query.shape[2], key.shape[2], attention_mask, position_ids, cu_q, cu_k, causal)
    with torch.no_grad():
        return attend_backward(query, key, value, vis, scaling, out, lse, gout, glse, spec=spec, backend=backend)


def _fake_hf_attention_backward(query, key, value, *rest):
    """The real kernel's layout: [B, H, T, D] views of [B, T, H, D] buffers (as eager's gradients)."""
    return tuple(t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2)
                 for t in (query, key, value))


def _hf_attention_setup(ctx, inputs, output):
    query, key, value, *masks, causal, scaling, spec, backend = inputs
    ctx.save_for_backward(query, key, value, *masks, *output)
    ctx.rest = (bool(causal), scaling, spec, backend)


def _hf_attention_backward(ctx, gout, glse):
    query, key, value, mask, positions, cu_q, cu_k, out, lse = ctx.saved_tensors
    causal, scaling, spec, backend = ctx.rest
    if gout is None:
        gout = torch.zeros_like(out)
    grads = getattr(torch.ops, NAMESPACE).hf_attention_backward(
        query, key, value, mask, positions, cu_q, cu_k, causal, scaling, out, lse, gout, glse, spec, backend)
    return *grads, *[None] * 8


#: name -> (schema, real kernel, fake kernel)
_BACKWARD_OPS = {
    "flash_attn_varlen_backward": (_VARLEN_BACKWARD, _varlen_backward_kernel,
                                   lambda q, k, v, *rest: (q.new_empty(q.shape), k.new_empty(k.shape),
                                                           v.new_empty(v.shape))),
    "hf_attention_backward": (_HF_ATTENTION_BACKWARD, _hf_attention_backward_kernel, _fake_hf_attention_backward),
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
    for name, (schema, kernel, fake) in _BACKWARD_OPS.items():
        lib.define(schema)
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    for op in TORCH_OPS.values():
        lib.define(op.name + op.schema)
        lib.impl(op.name, _kernel(op), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{op.name}", FAKES[op.name], lib=lib)
        if op.name in autograd:
            fn_class, setup, n_grads = autograd[op.name]
            torch.library.register_autograd(f"{NAMESPACE}::{op.name}", _backward(op, fn_class, n_grads),
                                            setup_context=setup, lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::flash_attn_varlen", _varlen_backward,
                                    setup_context=_varlen_setup, lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::hf_attention", _hf_attention_backward,
                                    setup_context=_hf_attention_setup, lib=lib)
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
