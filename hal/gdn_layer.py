"""The Gated DeltaNet layer's own ops around the gated delta rule (Qwen3-Next, Qwen3.5): the gates and the causal conv.

    g, beta = hal.gdn_gating(A_log, a, dt_bias, b)                # float32 gates
    y, conv_state = hal.gdn_causal_conv1d(x, weight, bias, conv_state)  # depthwise conv + SiLU, decode state

Both compute the bits of the gated delta rule's spec family (``GatedDeltaRuleSpec``; its companion ops): the gates
per element, the conv over its K taps in one fixed order, so decode from the returned state reproduces prefill.
Their backwards are autograd through the float64/float32 oracle formulas (hal/kernels/oracle/gated_delta_rule.py):
correct and deterministic, not part of any spec. The rule itself is hal/gated_delta_rule.py.
"""
from __future__ import annotations

import torch

from . import spec as specs, validate as val
from .errors import InputError, UnsupportedError
from .op_call import needs_grad, resolve
from .ops_registry import TORCH_OP, route, routing
from .torch_ops import HelperOp, OpBackward, OpRecord, TorchOp, fake_grads, register

__all__ = ["gdn_gating", "gdn_causal_conv1d"]

F32, F64 = torch.float32, torch.float64


class _RecomputeFn(torch.autograd.Function):
    """Forward: the backend's bits; backward: autograd through the float64/float32 oracle formula."""

    @staticmethod
    def forward(ctx, fwd, oracle_fn, n_in, *args):
        ctx.oracle_fn, ctx.n_in = oracle_fn, n_in
        ctx.save_for_backward(*[a if isinstance(a, torch.Tensor) else None for a in args[:n_in]])
        ctx.rest = args[n_in:]
        return fwd()

    @staticmethod
    def backward(ctx, *grads):
        ins = ctx.saved_tensors
        acc = F64 if any(t is not None and t.dtype == F64 for t in ins) else F32
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().to(acc).requires_grad_(t.dtype.is_floating_point)
                      for t in ins]
            outs = ctx.oracle_fn(*leaves, *ctx.rest, dtype=acc)
            pairs = [(o, gr) for o, gr in zip(outs, grads) if o is not None and o.requires_grad and gr is not None]
            wrt = [x for x in leaves if x is not None and x.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [gr.to(o.dtype) for o, gr in pairs],
                                      allow_unused=True)
        it = iter(got)
        res = []
        for t, x in zip(ins, leaves):
            if x is not None and x.requires_grad:
                gr = next(it)
                res.append(None if gr is None else gr.to(t.dtype))
            else:
                res.append(None)
        return (None, None, None, *res, *[None] * len(ctx.rest))


def _strict_companion(op, s):
    """The layer ops are the strict spec's companions: a fast gated delta rule spec has none (refused by name, never
    run as the strict bits under a fast id)."""
    if s.policy != specs.STRICT:
        raise UnsupportedError(f"{op}: spec {s.id} is {s.policy}; the layer ops have strict bits only (pass the "
                               f"strict spec, e.g. {specs.DEFAULTS['gated_delta_rule'].id}, or none)")


def gdn_gating(A_log, a, dt_bias, b, *, spec=None, backend=None):
    """Qwen3-Next gates: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, float32.

    ``A_log, dt_bias [HV]``; ``a, b [..., HV]``. Per element, so decode-exact by construction.
    """
    if routing("gdn_gating", A_log, a, dt_bias, b) is TORCH_OP:
        return route("gdn_gating", A_log, a, dt_bias, b, spec=spec, backend=backend)
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        val.tensor(name, t)
        val.floating(name, t)
    if A_log.dim() != 1 or tuple(dt_bias.shape) != tuple(A_log.shape):
        raise InputError(f"A_log and dt_bias must both be [HV]; got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}")
    if a.dim() < 1 or a.shape[-1] != A_log.shape[0] or tuple(b.shape) != tuple(a.shape):
        raise InputError(f"a and b must be [..., HV] with HV = {A_log.shape[0]} and equal shapes; got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    f64 = {t.dtype == F64 for t in (A_log, a, dt_bias, b)}
    if len(f64) > 1:
        raise InputError("gdn_gating: float64 (oracle) needs float64 for every input")
    dtype = F64 if True in f64 else a.dtype
    s, impl = resolve("gdn_gating", spec, backend, dtype, A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    _strict_companion("gdn_gating", s)

    def fwd():
        return impl.gdn_gating(A_log, a, dt_bias, b, s)
    if needs_grad(A_log, a, dt_bias, b):
        from hal.kernels.oracle.gated_delta_rule import gdn_gating as ora
        return _RecomputeFn.apply(fwd, ora, 4, A_log, a, dt_bias, b)
    return fwd()


def gdn_causal_conv1d(x, weight, bias=None, conv_state=None, activation="silu", cu_seqlens=None, *, spec=None,
                      backend=None):
    """Causal depthwise conv1d (+ SiLU) over time with its decode state, as in Qwen3-Next's GDN layer.

    ``x [B, T, D]`` (or packed ``[1, total, D]`` with ``cu_seqlens``), ``weight [D, K]``, ``bias [D]``,
    ``conv_state [N, K-1, D]`` (the previous K-1 inputs, x's dtype; None = zeros). Returns
    ``(y like x, new conv_state)``; continuing with the returned state is exact at any split.
    """
    if routing("gdn_causal_conv1d", x, weight, bias, conv_state, cu_seqlens) is TORCH_OP:
        if activation not in ("silu", None):
            raise InputError(f"activation must be 'silu' or None, got {activation!r}")
        return route("gdn_causal_conv1d", x, weight, bias, conv_state, activation, cu_seqlens, spec=spec,
                     backend=backend)
    val.tensor("x", x, ndim=3), val.tensor("weight", weight, ndim=2)
    val.floating("x", x), val.floating("weight", weight)
    D, K = weight.shape
    val.dim_eq("gdn_causal_conv1d: weight.shape[0] vs x.shape[-1] (channels)", D, x.shape[-1], "weight must be [D, K]")
    if K < 1:
        raise InputError("weight must have at least one tap (K >= 1)")
    if bias is not None:
        val.tensor("bias", bias, ndim=1), val.floating("bias", bias)
        val.dim_eq("gdn_causal_conv1d: bias.shape[0] vs channels", bias.shape[0], D)
    if activation not in ("silu", None):
        raise InputError(f"activation must be 'silu' or None, got {activation!r}")
    cu = val.packed_offsets(cu_seqlens, x.unsqueeze(-1))
    n = x.shape[0] if cu is None else len(cu) - 1
    if conv_state is not None:
        val.tensor("conv_state", conv_state, ndim=3)
        if tuple(conv_state.shape) != (n, K - 1, D):
            raise InputError(f"conv_state shape {tuple(conv_state.shape)} must be [N, K-1, D] = {(n, K - 1, D)}")
        if conv_state.dtype != x.dtype:
            raise InputError(f"conv_state holds previous inputs and must have x's dtype {x.dtype}, "
                             f"got {conv_state.dtype}")
    if (x.dtype == F64) != (weight.dtype == F64) or (bias is not None and (bias.dtype == F64) != (x.dtype == F64)):
        raise InputError("gdn_causal_conv1d: float64 (oracle) needs float64 x, weight and bias")
    tensors = dict(x=x, weight=weight, **({"bias": bias} if bias is not None else {}))
    s, impl = resolve("gdn_causal_conv1d", spec, backend, x.dtype, **tensors)
    _strict_companion("gdn_causal_conv1d", s)
    if x.shape[1] == 0:
        st = conv_state.clone() if conv_state is not None else x.new_zeros((n, K - 1, D))
        return x.new_zeros(x.shape), st

    def fwd():
        return impl.gdn_causal_conv1d(x, weight, bias, conv_state, activation, cu, s)
    if needs_grad(x, weight, bias, conv_state):
        from hal.kernels.oracle.gated_delta_rule import causal_conv1d as ora
        return _RecomputeFn.apply(fwd, ora, 4, x, weight, bias, conv_state, activation, cu)
    return fwd()


# ---------------------------------------------------------------- the records (hal/torch_ops.py derives every table)
# Their backwards are ops too: each differentiates a recompute with torch.autograd.grad, which must stay out of
# AOT autograd's trace.


def _recompute_backward(oracle, inputs, rest, grads_out):
    """_RecomputeFn.backward for the op kernels: grads of ``inputs`` ([0] for an input not given)."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(saved_tensors=tuple(inputs), oracle_fn=oracle, rest=tuple(rest))
    got = _RecomputeFn.backward(ctx, *grads_out)[3:3 + len(inputs)]
    return tuple((x.new_zeros(x.shape) if x is not None else grads_out[0].new_empty((0,))) if gr is None
                 else gr.contiguous() for gr, x in zip(got, inputs))


def _gating_backward_kernel(A_log, a, dt_bias, b, grad_g, grad_beta):
    from hal.kernels.oracle.gated_delta_rule import gdn_gating as oracle
    return _recompute_backward(oracle, (A_log, a, dt_bias, b), (), (grad_g, grad_beta))


def _conv_backward_kernel(x, weight, bias, conv_state, activation, cu_seqlens, grad_y, grad_state):
    from hal.kernels.oracle.gated_delta_rule import causal_conv1d as oracle
    cu = val.packed_offsets(cu_seqlens, x.unsqueeze(-1))
    return _recompute_backward(oracle, (x, weight, bias, conv_state), (activation, cu), (grad_y, grad_state))


def _gating_dtype(*ts):
    return F64 if F64 in (t.dtype for t in ts) else F32


def _gating_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])


def _gating_backward(ctx, grad_g, grad_beta):
    A_log, a, dt_bias, b = ctx.saved_tensors
    dtype = _gating_dtype(A_log, a, dt_bias, b)
    grad_g, grad_beta = (a.new_zeros(a.shape, dtype=dtype) if x is None else x for x in (grad_g, grad_beta))
    grads = torch.ops.lockstep.gdn_gating_backward(A_log, a, dt_bias, b, grad_g, grad_beta)
    return (*grads, None, None)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, conv_state, activation, cu = inputs[:6]
    ctx.save_for_backward(x, weight, bias, conv_state, cu)
    ctx.activation, ctx.state_shape = activation, output[1].shape


def _conv_backward(ctx, grad_y, grad_state):
    x, weight, bias, conv_state, cu = ctx.saved_tensors
    grad_y = torch.zeros_like(x) if grad_y is None else grad_y
    grad_state = x.new_zeros(ctx.state_shape) if grad_state is None else grad_state
    gx, gw, gb, gs = torch.ops.lockstep.gdn_causal_conv1d_backward(
        x, weight, bias, conv_state, ctx.activation, cu, grad_y, grad_state)
    return gx, gw, gb if bias is not None else None, gs if conv_state is not None else None, None, None, None, None


def _conv_fake(x, weight, bias, conv_state, activation, cu_seqlens, spec, backend):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(x.shape), x.new_empty((n, weight.shape[1] - 1, x.shape[2]))


class _Contract:
    """The backend methods (hal/backend_contract.py): hal calls them with validated tensors and the resolved spec."""

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        """``(g, beta)`` float32: ``-exp(A_log) * softplus(a + dt_bias)`` and ``sigmoid(b)``."""

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        """``(y, new_conv_state)``: the depthwise causal conv over the previous K-1 inputs, then the activation."""


register(OpRecord("gdn_gating", "gated_delta_rule", contract=_Contract.gdn_gating,
                  suites=(("gdn_layer", (specs.STRICT,)),), torch_ops=(TorchOp(
    "gdn_gating", None, gdn_gating, "Tensor A_log, Tensor a, Tensor dt_bias, Tensor b", "(Tensor, Tensor)",
    fake=lambda A_log, a, dt_bias, b, spec, backend: (a.new_empty(a.shape, dtype=_gating_dtype(A_log, a, dt_bias, b)),
                                                      a.new_empty(a.shape, dtype=_gating_dtype(A_log, a, dt_bias, b))),
    backward=OpBackward(HelperOp(
        "gdn_gating_backward(Tensor A_log, Tensor a, Tensor dt_bias, Tensor b, Tensor grad_g, Tensor grad_beta) "
        "-> (Tensor, Tensor, Tensor, Tensor)", _gating_backward_kernel,
        lambda A_log, a, dt_bias, b, gg, gb: fake_grads(A_log, a, dt_bias, b, fallback=a)),
        _gating_setup, _gating_backward)),)))

register(OpRecord("gdn_causal_conv1d", "gated_delta_rule", contract=_Contract.gdn_causal_conv1d,
                  suites=(("gdn_layer", (specs.STRICT,)),), torch_ops=(TorchOp(
    "gdn_causal_conv1d", None, gdn_causal_conv1d,
    "Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, str? activation, Tensor? cu_seqlens",
    "(Tensor, Tensor)", fake=_conv_fake,
    backward=OpBackward(HelperOp(
        "gdn_causal_conv1d_backward(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, str? activation, "
        "Tensor? cu_seqlens, Tensor grad_y, Tensor grad_state) -> (Tensor, Tensor, Tensor, Tensor)",
        _conv_backward_kernel, lambda x, weight, bias, state, *rest: fake_grads(x, weight, bias, state, fallback=x)),
        _conv_setup, _conv_backward)),)))
