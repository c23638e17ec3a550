"""Registers ``torch.ops.lockstep.*`` from the op table (hal/ops_registry.py ``TORCH_OPS``).

Per op: the schema from the table (``torch.library.Library("lockstep", "DEF").define``), one real kernel
for every device (CompositeExplicitAutograd: it calls the public python function under ``no_grad``, so
the compiled path runs the very code the eager path runs, and reads ``hal.use`` / ``LOCKSTEP_BACKEND`` / the
default spec when it runs), a fake kernel (shapes, dtypes and strides; no data) and ``register_autograd``
calling the op's backward op, ``<name>_backward``, whose real kernel runs the backward of the op's
autograd.Function (flash_attn_with_kvcache, which mutates its caches, has none: its public function
refuses inputs that require grad). Every backward is an op (the attention ones, ``flash_attn_varlen_backward``
and ``hf_attention_backward``, also read host values): a compiled training step keeps them opaque, so
AOT autograd / Inductor never trace and refuse a backward's float math, and its grads are eager's bits.

APIs used (all in torch 2.11): torch.library.Library(ns, "DEF"), Library.define, Library.impl,
torch.library.register_fake(lib=), torch.library.register_autograd(setup_context=, lib=).
"""
from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

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


# ---------------------------------------------------------------- gated delta rule ops (fakes, backward ops)
# Their backwards are ops too: the rule's reads cu_seqlens on the host and, like the conv's and the gates',
# differentiates a recompute with torch.autograd.grad, which must stay out of AOT autograd's trace.


def _gdn_fake_rule(q, k, v, g, beta, scale, initial_state, state_spec, state_layout, state_position, state_S, open_k,
                   open_v, open_g, open_beta, state_final, output_final_state, open_rows, cu_seqlens, l2, spec, backend):
    from .gated_delta_rule import _rule_fake
    return _rule_fake(q, v, beta, initial_state, state_S, output_final_state, open_rows, cu_seqlens)


def _gdn_fake_gating(A_log, a, dt_bias, b, spec, backend):
    dtype = torch.float64 if torch.float64 in (A_log.dtype, a.dtype, dt_bias.dtype, b.dtype) else torch.float32
    return a.new_empty(a.shape, dtype=dtype), a.new_empty(a.shape, dtype=dtype)


def _gdn_fake_conv(x, weight, bias, conv_state, activation, cu_seqlens, spec, backend):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(x.shape), x.new_empty((n, weight.shape[1] - 1, x.shape[2]))


def _gdn_fake_hf(mixed, g, beta, conv_weight, conv_bias, attention_mask, position_ids, cu_seq_lens_q, key_dim,
                 head_k_dim, head_v_dim, spec, backend):
    return mixed.new_empty((*mixed.shape[:2], g.shape[-1], head_v_dim))


FAKES.update({"chunk_gated_delta_rule": _gdn_fake_rule, "fused_recurrent_gated_delta_rule": _gdn_fake_rule,
              "gdn_gating": _gdn_fake_gating, "gdn_causal_conv1d": _gdn_fake_conv, "hf_gated_delta_net": _gdn_fake_hf})

_HF_GDN_NO_BACKWARD = ("the patched HF GatedDeltaNet under torch.compile / torch.export has no backward pass yet; "
                       "compile the patched model for inference (torch.no_grad()) or train it eagerly")


def _no_backward(name):
    def backward(ctx, *grads):
        raise AssertionError(f"unreachable: {name}'s setup_context refuses inputs that require grad")
    return backward


def _hf_gdn_refuse(ctx, inputs, output):
    from .errors import UnsupportedError
    raise UnsupportedError(_HF_GDN_NO_BACKWARD)


def _like_or_empty(*inputs, fallback):
    """A fake gradient per input: its shape and dtype, or [0] for an input not given."""
    return tuple(fallback.new_empty((0,)) if x is None else x.new_empty(x.shape) for x in inputs)


# name -> (schema, the kernel in hal/gated_delta_rule.py, fake)
_GDN_BACKWARDS = {
    "gated_delta_rule_backward": (
        "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, Tensor? initial_state, str? state_spec, "
        "int[] state_layout, Tensor? state_position, Tensor? state_S, Tensor? open_k, Tensor? open_v, "
        "Tensor? open_g, Tensor? open_beta, Tensor? state_final, Tensor? cu_seqlens, bool use_qk_l2norm_in_kernel, "
        "Tensor do, Tensor dfinal, str op, str? spec, str? backend) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        "_rule_backward_kernel", lambda q, k, v, g, beta, scale, init, *rest: _like_or_empty(q, k, v, g, beta, init,
                                                                                           fallback=q)),
    "gdn_gating_backward": (
        "(Tensor A_log, Tensor a, Tensor dt_bias, Tensor b, Tensor grad_g, Tensor grad_beta) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        "_gating_backward_kernel", lambda A_log, a, dt_bias, b, gg, gb: _like_or_empty(A_log, a, dt_bias, b, fallback=a)),
    "gdn_causal_conv1d_backward": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, str? activation, Tensor? cu_seqlens, "
        "Tensor grad_y, Tensor grad_state) -> (Tensor, Tensor, Tensor, Tensor)",
        "_conv_backward_kernel", lambda x, weight, bias, state, *rest: _like_or_empty(x, weight, bias, state,
                                                                                     fallback=x)),
}


def _gdn_kernel(name):
    def kernel(*args):
        from . import gated_delta_rule
        return getattr(gated_delta_rule, name)(*args)
    kernel.__name__ = f"lockstep_{name}"
    return kernel


def _gdn_rule_setup(ctx, inputs, output):
    (q, k, v, g, beta, scale, init, state_spec, layout, *parts), rest = inputs[:16], inputs[16:]
    want, _, cu, l2, spec, backend = rest
    ctx.save_for_backward(q, k, v, g, beta, init, *parts, cu)
    ctx.rest = (scale, state_spec, list(layout), want, l2, spec, backend)


def _gdn_rule_backward(op):
    def backward(ctx, do, dfinal, *unused):
        q, k, v, g, beta, init, *parts, cu = ctx.saved_tensors
        scale, state_spec, layout, want, l2, spec, backend = ctx.rest
        n = q.shape[0] if cu is None else cu.shape[0] - 1
        if do is None:
            do = torch.zeros_like(v)
        if want == 0 or dfinal is None:  # no final state returned (an empty output): nothing flows from it
            dfinal = v.new_zeros((n, v.shape[2], q.shape[3], v.shape[3]),
                                 dtype=torch.float64 if v.dtype == torch.float64 else torch.float32)
        grads = getattr(torch.ops, NAMESPACE).gated_delta_rule_backward(
            q, k, v, g, beta, scale, init, state_spec, layout, *parts, cu, l2, do, dfinal, op, spec, backend)
        return (*grads[:5], None, grads[5] if init is not None else None, *[None] * 15)
    return backward


def _gdn_gating_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])


def _gdn_gating_backward(ctx, grad_g, grad_beta):
    A_log, a, dt_bias, b = ctx.saved_tensors
    dtype = torch.float64 if torch.float64 in (A_log.dtype, a.dtype, dt_bias.dtype, b.dtype) else torch.float32
    grad_g, grad_beta = (a.new_zeros(a.shape, dtype=dtype) if x is None else x for x in (grad_g, grad_beta))
    grads = getattr(torch.ops, NAMESPACE).gdn_gating_backward(A_log, a, dt_bias, b, grad_g, grad_beta)
    return (*grads, None, None)


def _gdn_conv_setup(ctx, inputs, output):
    x, weight, bias, conv_state, activation, cu = inputs[:6]
    ctx.save_for_backward(x, weight, bias, conv_state, cu)
    ctx.activation, ctx.state_shape = activation, output[1].shape


def _gdn_conv_backward(ctx, grad_y, grad_state):
    x, weight, bias, conv_state, cu = ctx.saved_tensors
    grad_y = torch.zeros_like(x) if grad_y is None else grad_y
    grad_state = x.new_zeros(ctx.state_shape) if grad_state is None else grad_state
    gx, gw, gb, gs = getattr(torch.ops, NAMESPACE).gdn_causal_conv1d_backward(
        x, weight, bias, conv_state, ctx.activation, cu, grad_y, grad_state)
    return gx, gw, gb if bias is not None else None, gs if conv_state is not None else None, None, None, None, None


def _register_gdn(lib) -> None:
    """The gated delta rule ops' backward ops and autograd (their forward rows are in the table)."""
    for name, (schema, kernel, fake) in _GDN_BACKWARDS.items():
        lib.define(name + schema)
        lib.impl(name, _gdn_kernel(kernel), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        torch.library.register_autograd(f"{NAMESPACE}::{op}", _gdn_rule_backward(op), setup_context=_gdn_rule_setup,
                                        lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::gdn_gating", _gdn_gating_backward, setup_context=_gdn_gating_setup,
                                    lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::gdn_causal_conv1d", _gdn_conv_backward,
                                    setup_context=_gdn_conv_setup, lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::hf_gated_delta_net", _no_backward("hf_gated_delta_net"),
                                    setup_context=_hf_gdn_refuse, lib=lib)


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
    from .attention_checks import _scale, _window
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


# ---------------------------------------------------------------- tensor parallelism: two steps of a DTensor rule
# A compiled DTensor call runs its sharding rule at trace time (hal/tensor_parallel.py); these are the rule's two
# steps a graph cannot trace: the exact row-parallel linear (collectives, host decisions on the reduced exponents)
# and the float partial sums' opt-in, read when the graph runs. Their gradients: the rule's autograd.Functions.

#: name -> (schema, kernel in hal/tensor_parallel.py, fake kernel)
_TP_OPS = {
    "row_parallel_linear": ("row_parallel_linear(Tensor x, Tensor weight, Tensor? bias, str group_name, str spec) "
                            "-> Tensor", "row_parallel_linear_kernel",
                            lambda x, weight, bias, group_name, spec: x.new_empty((*x.shape[:-1], weight.shape[0]))),
    "float_partials_gate": ("float_partials_gate(Tensor partials, str spec) -> Tensor", "float_partials_gate_kernel",
                            lambda partials, spec: partials.new_empty(partials.shape)),
}


def _tp_kernel(name):
    def kernel(*args):
        from . import tensor_parallel
        with _direct():
            return getattr(tensor_parallel, name)(*args)
    kernel.__name__ = f"lockstep_{name}"
    return kernel


# ---------------------------------------------------------------- autograd: the eager backwards, as ops
# Under AOT autograd a backward written in torch code is traced and Inductor fuses / reorders its float math,
# so a compiled step's gradients would not be eager's bits. Each table row's backward is therefore an op too,
# ``<name>_backward``: its real kernel rebuilds the ctx the Function's forward would have filled (the row's
# ``setup``) and runs that Function's backward, the very code eager autograd runs; no recompute of the forward.


def _autograd_table():
    """op -> (the autograd.Function whose backward is the op's, setup_context, grads it returns, reads_output).

    ``setup`` stores on ctx what that Function's forward stores; ``grads``: how many leading op
    arguments (the differentiable tensors, in the Function's order) its backward returns grads for;
    ``reads_output``: setup saves the op's outputs (so the backward op takes them)."""
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

    unary = {k: (ew._UnaryFn, save(0, kind=lambda i, o, k=k: k), 1, False) for k in ("sigmoid", "silu", "softplus")}
    return {
        "matmul": (ops._MatmulFn, save(0, 1), 2, False),
        "linear": (ops._LinearFn, save(0, 1, has_bias=lambda i, o: i[2] is not None), 3, False),
        "rms_norm": (ops._RMSNormFn, save(0, 1, eps=lambda i, o: i[2], has_residual=lambda i, o: False), 2, False),
        "rms_norm_residual": (ops._RMSNormFn, rms_residual, 3, True),
        **{k: (ops._SoftmaxFamilyFn, softmax_setup(k), 1, True) for k in ("softmax", "log_softmax", "logsumexp")},
        "token_logprobs": (ops._TokenLogprobsFn, save(0, 1, 2, temperature=lambda i, o: i[3]), 2, False),
        **unary,
        "silu_mul": (ew._SiluMulFn, save(0, 1), 2, False),
        "apply_rotary": (ew._RotaryFn, save(0, 1, 2, interleaved=lambda i, o: i[3]), 3, False),
    }


def _eager_backward(op: TorchOp, fn_class, n_grads: int):
    """fn_class.backward with the op's argument order (the softmax family's Function works on the last axis)."""
    def backward(ctx, *grads):
        dim = getattr(ctx, "dim", None)
        if dim is not None and op.name != "logsumexp":
            grads = tuple(g.movedim(dim, -1) for g in grads)
        out = fn_class.backward(ctx, *grads)[:n_grads]
        if dim is not None:
            out = tuple(None if g is None else g.movedim(-1, dim) for g in out)
        return out
    return backward


class _EagerCtx(SimpleNamespace):
    """The ctx an autograd.Function's forward fills, outside autograd: what its backward reads."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _OpaqueBackward:
    """One table row's ``<name>_backward`` op: schema, real kernel, fake, and the forward's autograd calling it.

    The op takes the forward's arguments (without spec and backend: a backward formula is not a spec),
    its outputs when the row reads them, one grad per output and ``needs`` (which grads are wanted); it
    returns ``n_grads`` tensors, an empty one where a grad is not wanted or its input is None."""

    def __init__(self, op: TorchOp, fn_class, setup, n_grads: int, reads_output: bool):
        self.op, self.setup, self.n_grads, self.reads_output = op, setup, n_grads, reads_output
        self.formula = _eager_backward(op, fn_class, n_grads)
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
            _OpaqueBackward(op, *autograd[op.name]).register(lib)
    torch.library.register_autograd(f"{NAMESPACE}::flash_attn_varlen", _varlen_backward,
                                    setup_context=_varlen_setup, lib=lib)
    torch.library.register_autograd(f"{NAMESPACE}::hf_attention", _hf_attention_backward,
                                    setup_context=_hf_attention_setup, lib=lib)
    _register_gdn(lib)
    for name, (schema, kernel, fake) in _TP_OPS.items():
        lib.define(schema)
        lib.impl(name, _tp_kernel(kernel), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
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
