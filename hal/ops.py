"""Public ops on torch tensors: validate, pick a spec and a backend, run, add autograd.

Forward bits come from the backend (the spec's canonical computation). Backward passes are
ordinary torch float32/float64 math: correct and deterministic, but not part of any spec
(docs/design.md, principle 6: the bits that decide on-policy-ness are the forward log-probs).
"""
from __future__ import annotations

import torch

from . import dispatch, spec as specs, tensor_parallel as _tp, validate as v
from .errors import SpecError, UnsupportedError
from .kernels.exact import core as _exact_core
from .kernels.exact.prepared import ExactWeight, prepare as _prepare_exact
from .op_call import backward_dtype, needs_grad, resolve
from .ops_registry import DIRECT, DTENSOR, TORCH_OP, route, routing
from .torch_ops import FunctionBackward, OpRecord, TorchOp, register, saves

__all__ = ["exact_weight", "ExactWeight", "matmul", "linear", "linear_with_float32", "rms_norm", "softmax", "log_softmax",
           "logsumexp", "token_logprobs"]


# ---------------------------------------------------------------- prepared exact weights


def exact_weight(weight: torch.Tensor, *, spec, layout: str = "linear", backend=None) -> ExactWeight:
    """Slice a constant weight once for the exact matmul policy; pass the result where the weight goes.

    ``weight``: [N, K] for ``hal.linear`` and token_logprobs' LM head (``layout="linear"``), or b
    [K, N] for ``hal.matmul`` (``layout="matmul"``). ``spec``: the exact spec of the calls (an
    ExactMatmulSpec, or an exact token_logprobs spec, or either's id). ``backend``: whose slicer
    runs (default: the one ``hal.linear`` would pick for this device; the slices are the same bits
    from every backend). A call with the result gives the bits of the same call with ``weight``;
    using it after ``weight``'s bits changed, in any way, raises InputError (docs/exact_matmul.md).
    """
    v.tensor("weight", weight, ndim=2)
    v.floating("weight", weight)
    if weight.dtype not in _exact_core.DTYPES:
        raise v.InputError(f"weight: the exact policy takes float32, bfloat16 or float16, got {weight.dtype}")
    s = specs.get(spec) if isinstance(spec, str) else spec
    s = getattr(s, "matmul", s)  # an exact token_logprobs spec: its logits' matmul spec
    if getattr(s, "policy", None) != specs.EXACT:
        raise SpecError(f"spec: exact_weight needs an exact matmul spec (ExactMatmulSpec, e.g. "
                        f"matmul.exact.s4.v2, or an exact token_logprobs spec), got {getattr(spec, 'id', spec)!r}")
    try:
        impl = dispatch.select("linear", s, weight.dtype, weight.device, backend)
    except UnsupportedError:
        if backend is not None:
            raise
        impl = None  # no backend serves exact linear here (CUDA: the Triton kernel is called directly)
    return _prepare_exact(weight, s, layout, getattr(impl, "exact_slice", None))


def _unprepared(name: str, w, layout: str):
    """(the ExactWeight or None, the tensor to validate): a prepared weight is checked before anything runs."""
    if not isinstance(w, ExactWeight):
        return None, w
    w.check_fresh(name)
    w.check_layout(name, layout)
    return w.checked(), w.source  # checked here: the kernel's own check (prepared.unpack) is not repeated


def _weight_arg(impl, prepared: ExactWeight | None, weight: torch.Tensor):
    """What the backend gets: the prepared weight if it reads slices, else the source (same bits)."""
    return prepared if prepared is not None and impl.reads_exact_weight else weight


# ---------------------------------------------------------------- matmul / linear


def _run_matmul(a, b, s, impl, prepared):
    if prepared is not None and impl.reads_exact_weight:
        return impl.linear(a, prepared, None, s)  # the exact matmul is linear(a, b^T): the slices' orientation
    return impl.matmul(a, b, s)


class _MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, s, impl, prepared):
        ctx.save_for_backward(a, b)
        return _run_matmul(a, b, s, impl, prepared)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        acc = backward_dtype(a)
        g32, a32, b32 = g.to(acc), a.to(acc), b.to(acc)
        ga = (g32 @ b32.transpose(0, 1)).to(a.dtype) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            gb = (a32.reshape(-1, a.shape[-1]).transpose(0, 1) @ g32.reshape(-1, g.shape[-1])).to(b.dtype)
        return ga, gb, None, None, None


def matmul(a: torch.Tensor, b, *, spec=None, backend=None) -> torch.Tensor:
    """``a [..., M, K] @ b [K, N]`` -> ``[..., M, N]`` in the inputs' dtype (float32 accumulation).

    ``b`` may be ``hal.exact_weight(b, spec=..., layout="matmul")`` under that exact spec."""
    if routing("matmul", a, b) is TORCH_OP:
        return route("matmul", a, b, spec=spec, backend=backend)
    prepared, b = _unprepared("b", b, "matmul")
    v.tensor("a", a, ndim_min=2), v.tensor("b", b, ndim=2)
    dtype = v.same_dtype(a=v.floating("a", a), b=v.floating("b", b))
    v.dim_eq("matmul: a.shape[-1] (K) vs b.shape[0]", a.shape[-1], b.shape[0], "b must be [K, N]")
    s, impl = resolve("matmul", spec, backend, dtype, a=a, b=b)
    if prepared is not None:
        prepared.check_spec("b", s if s.policy == specs.EXACT else None, s.id)
    if needs_grad(a, b):
        return _MatmulFn.apply(a, b, s, impl, prepared)
    return _run_matmul(a, b, s, impl, prepared)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, s, impl, w_arg):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return impl.linear(x, w_arg, bias, s)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        acc = backward_dtype(x)
        g2 = g.reshape(-1, g.shape[-1]).to(acc)
        gx = (g.to(acc) @ w.to(acc)).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g2.transpose(0, 1) @ x.reshape(-1, x.shape[-1]).to(acc)).to(w.dtype) if ctx.needs_input_grad[1] else None
        gbias = g2.sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gbias, None, None, None


def _checked_linear(x, weight, bias, spec, backend):
    """(spec, backend, dtype) of a linear call on plain tensors, its arguments validated."""
    v.tensor("x", x, ndim_min=1), v.tensor("weight", weight, ndim=2)
    if bias is not None:
        v.tensor("bias", bias, ndim=1)
        v.floating("bias", bias)
        v.dim_eq("linear: bias.shape[0] vs weight.shape[0] (N)", bias.shape[0], weight.shape[0])
    dtype = v.same_dtype(x=v.floating("x", x), weight=v.floating("weight", weight))
    v.dim_eq("linear: x.shape[-1] (K) vs weight.shape[1]", x.shape[-1], weight.shape[1], "weight must be [N, K]")
    s, impl = resolve("linear", spec, backend, dtype, x=x, weight=weight,
                      **({"bias": bias} if bias is not None else {}))
    return s, impl, dtype


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *, spec=None, backend=None):
    """``x [..., K] @ weight[N, K]^T + bias[N]`` -> ``[..., N]`` (drop-in for ``F.linear``).

    ``weight`` may be ``hal.exact_weight(weight, spec=...)`` under that exact spec (sliced once)."""
    how = routing("linear", x, weight, bias)
    if how is TORCH_OP:
        return route("linear", x, weight, bias, spec=spec, backend=backend)
    if how is DTENSOR:
        return _tp.linear(lambda x, w, b: linear(x, w, b, spec=spec, backend=backend), x, weight, bias, spec)
    prepared, weight = _unprepared("weight", weight, "linear")
    s, impl, _ = _checked_linear(x, weight, bias, spec, backend)
    if prepared is not None:
        prepared.check_spec("weight", s if s.policy == specs.EXACT else None, s.id)
    w_arg = _weight_arg(impl, prepared, weight)
    if needs_grad(x, weight, bias):
        return _LinearFn.apply(x, weight, bias, s, impl, w_arg)
    return impl.linear(x, w_arg, bias, s)


def linear_with_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, spec=None,
                        backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hal.linear(x, weight, bias, spec=spec), its float32 result before the one rounding)`` from one pass.

    The strict linear accumulates in float32 and rounds once to the inputs' dtype (MatmulSpec's words): the
    second tensor is that float32 result, unrounded (its own memory, float32 inputs included), so an LM head gives
    the logits it samples from and the float32 logits a recorded log-prob reduces (hal.sampling.logits_logprobs)
    without a second pass. Strict specs only; forward only, eagerly (not a torch op: refused while tracing); a
    backend without the float32 result for bf16 / fp16 inputs (only reference and cpu give it) is refused by
    name, never run twice or elsewhere."""
    if routing("linear", x, weight, bias) is not DIRECT:
        raise UnsupportedError("linear_with_float32 runs eagerly on plain tensors (not a torch op: not under "
                               "torch.compile / export, not on DTensors); call hal.linear there")
    if isinstance(weight, ExactWeight):
        raise UnsupportedError("linear_with_float32: an exact_weight is the exact policy's; the float32 result "
                               "is the strict linear's (pass the weight tensor)")
    if needs_grad(x, weight, bias):
        raise UnsupportedError("linear_with_float32 has no backward (an LM head's sampling pass): call it under "
                               "torch.no_grad() / inference_mode, or hal.linear for a gradient")
    s, impl, dtype = _checked_linear(x, weight, bias, spec, backend)
    if not isinstance(s, specs.MatmulSpec) or s.policy != specs.STRICT:
        raise UnsupportedError(f"linear_with_float32: spec {s.id} is not a strict MatmulSpec; only the strict "
                               "linear's float32 result is defined here")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UnsupportedError(f"linear_with_float32 takes float32, bfloat16 or float16 inputs, got {dtype} "
                               "(float64 runs the oracle, not a strict spec)")
    if dtype == torch.float32:  # the linear's output is its float32 result
        y = impl.linear(x, weight, bias, s)
        return y, y.clone()
    both = getattr(impl, "linear_with_float32", None)
    if both is None:
        raise UnsupportedError(f"backend {impl.name!r} does not give the strict linear's float32 result for "
                               f"{dtype} inputs (linear_with_float32: reference and cpu do); call hal.linear")
    return both(x, weight, bias, s)


# ---------------------------------------------------------------- rms_norm


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, s, impl):
        out = impl.rms_norm(x, weight, eps, residual, s)
        h = out[1] if residual is not None else x
        ctx.save_for_backward(h, weight)
        ctx.eps, ctx.has_residual = eps, residual is not None
        return out

    @staticmethod
    def backward(ctx, gy, gh=None):
        h, w = ctx.saved_tensors
        acc = backward_dtype(h)
        h32, w32, gy32 = h.to(acc), w.to(acc), gy.to(acc)
        n = h.shape[-1]
        inv = torch.rsqrt((h32 * h32).mean(-1, keepdim=True) + ctx.eps)
        xhat = h32 * inv
        gxhat = gy32 * w32
        gx = inv * (gxhat - xhat * (gxhat * xhat).sum(-1, keepdim=True) / n)
        if gh is not None:
            gx = gx + gh.to(acc)
        gw = (gy32 * xhat).reshape(-1, n).sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        gx = gx.to(h.dtype)
        if ctx.has_residual:
            return gx, gw, gx, None, None, None
        return gx, gw, None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *,
             spec=None, backend=None):
    """RMSNorm over the last dim. With ``residual``: ``h = x + residual`` (fused), returns ``(y, h)``."""
    how = routing("rms_norm", x, weight, residual)
    if how is TORCH_OP:
        return (route("rms_norm", x, weight, eps, spec=spec, backend=backend) if residual is None else
                route("rms_norm_residual", x, weight, residual, eps, spec=spec, backend=backend))
    if how is DTENSOR:
        return _tp.rowwise("rms_norm", lambda x, residual, weight: rms_norm(x, weight, eps, residual, spec=spec,
                           backend=backend), {"x": x, "residual": residual}, {"weight": weight},
                           {"x": {x.ndim - 1}, "residual": {x.ndim - 1}}, x.ndim - 1)
    v.tensor("x", x, ndim_min=1), v.tensor("weight", weight, ndim=1)
    v.floating("x", x), v.floating("weight", weight)
    v.dim_eq("rms_norm: weight.shape[0] vs x.shape[-1] (hidden size)", weight.shape[0], x.shape[-1])
    eps = v.scalar("eps", eps)
    if residual is not None:
        v.tensor("residual", residual)
        v.same_dtype(x=x, residual=v.floating("residual", residual))
        if residual.shape != x.shape:
            raise v.InputError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    tensors = dict(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    s, impl = resolve("rms_norm", spec, backend, x.dtype, **tensors)
    if needs_grad(x, weight, residual):
        return _RMSNormFn.apply(x, weight, residual, eps, s, impl)
    return impl.rms_norm(x, weight, eps, residual, s)


# ---------------------------------------------------------------- softmax family


class _SoftmaxFamilyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, s, impl):
        out = getattr(impl, kind)(x, s)
        ctx.kind = kind
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        acc = backward_dtype(x)
        g32, x32 = g.to(acc), x.to(acc)
        p = torch.softmax(x32, -1)
        if ctx.kind == "softmax":
            gx = p * (g32 - (g32 * p).sum(-1, keepdim=True))
        elif ctx.kind == "log_softmax":
            gx = g32 - p * g32.sum(-1, keepdim=True)
        else:  # logsumexp
            gx = g32.unsqueeze(-1) * p
        return gx.to(x.dtype), None, None, None


def _softmax_family(kind: str, x: torch.Tensor, dim: int, spec, backend):
    how = routing(kind, x)
    if how is TORCH_OP:
        return route(kind, x, dim, spec=spec, backend=backend)
    if how is DTENSOR:
        d = v.normalize_dim(dim, x.ndim)
        return _tp.rowwise(kind, lambda x: _softmax_family(kind, x, dim, spec, backend), {"x": x}, {}, {"x": {d}},
                           x.ndim)
    v.tensor("x", x, ndim_min=1)
    v.floating("x", x)
    d = v.normalize_dim(dim, x.dim())
    v.nonempty_axis("x", x, d, kind)
    s, impl = resolve(kind, spec, backend, x.dtype, x=x)
    last = d == x.dim() - 1
    xt = x if last else x.movedim(d, -1)  # rows are independent, so moving the axis changes no bits
    if needs_grad(x):
        out = _SoftmaxFamilyFn.apply(xt, kind, s, impl)
    else:
        out = getattr(impl, kind)(xt, s)
    if kind == "logsumexp" or last:
        return out
    return out.movedim(-1, d)


def softmax(x, dim: int = -1, *, spec=None, backend=None):
    """Softmax along ``dim`` (tiled along that axis by the spec)."""
    return _softmax_family("softmax", x, dim, spec, backend)


def log_softmax(x, dim: int = -1, *, spec=None, backend=None):
    """log-softmax along ``dim``."""
    return _softmax_family("log_softmax", x, dim, spec, backend)


def logsumexp(x, dim: int = -1, *, spec=None, backend=None):
    """log-sum-exp along ``dim`` (that dim is removed)."""
    return _softmax_family("logsumexp", x, dim, spec, backend)


# ---------------------------------------------------------------- token log-probs


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, s, impl, w_arg):
        ctx.save_for_backward(hidden, weight, tokens)
        ctx.temperature = temperature
        return _run_token_logprobs(impl, hidden, w_arg, tokens, temperature, s)

    @staticmethod
    def backward(ctx, g):
        h, w, tok = ctx.saved_tensors
        acc = backward_dtype(h)
        h32, w32 = h.to(acc).reshape(-1, h.shape[-1]), w.to(acc)
        t = ctx.temperature
        p = torch.softmax(h32 @ w32.transpose(0, 1) / t, -1)
        if tok.ndim == h.ndim:  # K tokens per row: d/dlogits of sum_k g_k log p_k = sum_k g_k onehot_k - (sum_k g_k) p
            gk = g.reshape(p.shape[0], -1).to(acc)
            picked = torch.zeros_like(p).scatter_add_(-1, tok.reshape(p.shape[0], -1).long(), gk)
            glogits = (picked - gk.sum(-1, keepdim=True) * p) / t
        else:
            onehot = torch.zeros_like(p).scatter_(-1, tok.reshape(-1, 1).long(), 1.0)
            glogits = g.reshape(-1, 1).to(acc) * (onehot - p) / t
        gh = (glogits @ w32).reshape(h.shape).to(h.dtype) if ctx.needs_input_grad[0] else None
        gw = (glogits.transpose(0, 1) @ h32).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None


def token_logprobs(hidden: torch.Tensor, lm_head_weight, tokens: torch.Tensor,
                   temperature: float = 1.0, *, spec=None, backend=None) -> torch.Tensor:
    """float32 ``log p(tokens | hidden)`` for hidden ``[..., H]``, LM head ``[V, H]``, tokens ``[...]``.

    ``tokens [..., K]`` (one dim more than ``hidden``'s lead shape): K tokens of each row, out ``[..., K]``,
    each value the bits of the same token asked alone -- one LM-head row and one log-softmax per hidden row,
    whatever K (how ``hal.sampling`` reads a row's whole top-p / top-k kept set).

    The LM head is accumulated in float32 and the log-softmax is vocab-tiled; the result is never
    rounded below float32. This is the number a sampler records and a trainer recomputes. Under an
    exact spec the LM head may be ``hal.exact_weight(lm_head_weight, spec=...)`` (sliced once).
    """
    how = routing("token_logprobs", hidden, lm_head_weight, tokens)
    if how is TORCH_OP:
        return route("token_logprobs", hidden, lm_head_weight, tokens, temperature, spec=spec, backend=backend)
    if how is DTENSOR:
        return _tp.rowwise("token_logprobs", lambda hidden, tokens, lm_head_weight: token_logprobs(
            hidden, lm_head_weight, tokens, temperature, spec=spec, backend=backend), {"hidden": hidden, "tokens": tokens},
            {"lm_head_weight": lm_head_weight}, {"hidden": {hidden.ndim - 1}, "tokens": {hidden.ndim - 1} if tokens.ndim == hidden.ndim else set()},
            hidden.ndim - 1)
    prepared, lm_head_weight = _unprepared("lm_head_weight", lm_head_weight, "linear")
    v.tensor("hidden", hidden, ndim_min=1), v.tensor("lm_head_weight", lm_head_weight, ndim=2)
    dtype = v.same_dtype(hidden=v.floating("hidden", hidden), lm_head_weight=v.floating("lm_head_weight", lm_head_weight))
    v.tensor("tokens", tokens)
    v.integer("tokens", tokens)
    v.dim_eq("token_logprobs: lm_head_weight.shape[1] vs hidden.shape[-1] (hidden size)",
             lm_head_weight.shape[1], hidden.shape[-1], "lm_head_weight must be [vocab, hidden]")
    lead = tuple(tokens.shape[:-1]) if tokens.ndim == hidden.ndim else tuple(tokens.shape)
    if lead != tuple(hidden.shape[:-1]):
        raise v.InputError(f"tokens shape {tuple(tokens.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
                           " (one token per row), or that plus a trailing K (K tokens per row)")
    vocab = lm_head_weight.shape[0]
    v.nonempty_axis("lm_head_weight", lm_head_weight, 0, "a log-softmax over the vocabulary")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise v.InputError(f"tokens must be in [0, {vocab}) (the LM head's vocab size); got values in "
                           f"[{int(tokens.min())}, {int(tokens.max())}]")
    temperature = v.scalar("temperature", temperature, positive=True, reciprocal=True)
    s, impl = resolve("token_logprobs", spec, backend, dtype, hidden=hidden, lm_head_weight=lm_head_weight,
                       tokens=tokens)
    if prepared is not None:
        prepared.check_spec("lm_head_weight", s.matmul, s.id)
    w_arg = _weight_arg(impl, prepared, lm_head_weight)
    if needs_grad(hidden, lm_head_weight):
        return _TokenLogprobsFn.apply(hidden, lm_head_weight, tokens, temperature, s, impl, w_arg)
    return _run_token_logprobs(impl, hidden, w_arg, tokens, temperature, s)


def _run_token_logprobs(impl, hidden, w_arg, tokens, temperature, s):
    """The backend's token_logprobs; K tokens per row (tokens [..., K]) reach it flattened to hidden [N, H],
    tokens [N, K] (the contract's second form), out reshaped to tokens' shape."""
    if tokens.ndim != hidden.ndim:
        return impl.token_logprobs(hidden, w_arg, tokens, temperature, s)
    k = tokens.shape[-1]
    out = impl.token_logprobs(hidden.reshape(-1, hidden.shape[-1]), w_arg, tokens.reshape(-1, k), temperature, s)
    return out.reshape(tokens.shape)


# ---------------------------------------------------------------- the records (hal/torch_ops.py derives every table)


def _softmax_setup(kind):
    def setup(ctx, inputs, output):
        x, dim = inputs[0], inputs[1] % inputs[0].dim()
        out = output if kind == "logsumexp" else output.movedim(dim, -1)
        ctx.save_for_backward(x.movedim(dim, -1), out)
        ctx.kind, ctx.dim = kind, dim
    return setup


def _softmax_formula(kind):
    """_SoftmaxFamilyFn.backward on the op's ``dim`` (the Function works on the last axis)."""
    def formula(ctx, g):
        if kind != "logsumexp":
            g = g.movedim(ctx.dim, -1)
        return (_SoftmaxFamilyFn.backward(ctx, g)[0].movedim(-1, ctx.dim),)
    return formula


def _rms_residual_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[1])  # the backward reads h = x + residual
    ctx.eps, ctx.has_residual = inputs[3], True


class _Contract:
    """The backend methods (hal/backend_contract.py): hal calls them with validated tensors and the resolved spec."""

    def matmul(self, a, b, spec):
        """``a [..., M, K] @ b [K, N]`` in a's dtype."""

    def linear(self, x, weight, bias, spec):
        """``x [..., K] @ weight[N, K]^T (+ bias[N])``; under the exact policy ``weight`` may be a prepared
        ``hal.ExactWeight`` when the backend sets ``reads_exact_weight``."""

    def rms_norm(self, x, weight, eps, residual, spec):
        """``y`` ([..., H], x's dtype), or ``(y, x + residual)`` when ``residual`` is given."""

    def softmax(self, x, spec):
        """Softmax over the last dim (hal moves the reduced dim last)."""

    def log_softmax(self, x, spec):
        """Log-softmax over the last dim."""

    def logsumexp(self, x, spec):
        """Logsumexp over the last dim, float32 (float64 for float64 input), the dim removed."""

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        """float32 ``log_softmax(hidden @ weight^T / temperature)[token]`` per row of hidden [..., H], tokens
        [...]; or, tokens [N, K] with hidden [N, H] (``tokens.ndim == hidden.ndim``), K tokens of each row,
        out [N, K], each the bits of that token alone (``hal.backend.tokens_per_row`` runs a one-token kernel so)."""


_MATMUL_SUITES = (("matmul", (specs.STRICT,)), ("matmul_exact", (specs.EXACT,)), ("matmul_fast", (specs.FAST,)))

for _record in (
    OpRecord("matmul", "matmul", contract=_Contract.matmul, suites=_MATMUL_SUITES, torch_ops=(
        TorchOp("matmul", None, matmul, "Tensor a, Tensor b", "Tensor",
                fake=lambda a, b, spec, backend: a.new_empty((*a.shape[:-1], b.shape[1])),
                backward=FunctionBackward(_MatmulFn, saves(0, 1), 2)),)),
    OpRecord("linear", "matmul", contract=_Contract.linear, suites=_MATMUL_SUITES,
             sharding=_tp.TP_LINEAR,
             torch_ops=(TorchOp("linear", None, linear, "Tensor x, Tensor weight, Tensor? bias", "Tensor",
                                fake=lambda x, weight, bias, spec, backend: x.new_empty((*x.shape[:-1], weight.shape[0])),
                                backward=FunctionBackward(_LinearFn, saves(0, 1, has_bias=lambda i, o: i[2] is not None),
                                                          3)),)),
    OpRecord("rms_norm", "rms_norm", contract=_Contract.rms_norm, suites=(("rms_norm", (specs.STRICT,)),),
             sharding=_tp.ROWWISE, torch_ops=(
        TorchOp("rms_norm", None, rms_norm, "Tensor x, Tensor weight, float eps", "Tensor",
                fake=lambda x, weight, eps, spec, backend: x.new_empty(x.shape),
                backward=FunctionBackward(_RMSNormFn, saves(0, 1, eps=lambda i, o: i[2], has_residual=lambda i, o: False),
                                          2)),
        TorchOp("rms_norm_residual", None, rms_norm, "Tensor x, Tensor weight, Tensor residual, float eps",
                "(Tensor, Tensor)",
                fake=lambda x, weight, residual, eps, spec, backend: (x.new_empty(x.shape), x.new_empty(x.shape)),
                backward=FunctionBackward(_RMSNormFn, _rms_residual_setup, 3, reads_output=True)))),
    *(OpRecord(kind, "softmax", contract=getattr(_Contract, kind), suites=(("softmax", (specs.STRICT,)),),
               sharding=None if kind == "logsumexp" else _tp.ROWWISE, torch_ops=(
        TorchOp(kind, None, fn, "Tensor x, int dim", "Tensor",
                fake=(lambda x, dim, spec, backend: x.new_empty(x.shape[:dim % x.dim()] + x.shape[dim % x.dim() + 1:]))
                if kind == "logsumexp" else (lambda x, dim, spec, backend: x.new_empty(x.shape)),
                backward=FunctionBackward(_SoftmaxFamilyFn, _softmax_setup(kind), 1, reads_output=True,
                                          formula=_softmax_formula(kind))),))
      for kind, fn in (("softmax", softmax), ("log_softmax", log_softmax), ("logsumexp", logsumexp))),
    OpRecord("token_logprobs", "token_logprobs", contract=_Contract.token_logprobs, sharding=_tp.ROWWISE,
             suites=(("token_logprobs", (specs.STRICT,)), ("token_logprobs_exact", (specs.STRICT, specs.EXACT)),
                     ("token_logprobs_fast", (specs.STRICT, specs.FAST))),
             torch_ops=(TorchOp("token_logprobs", None, token_logprobs,
                                "Tensor hidden, Tensor lm_head_weight, Tensor tokens, float temperature", "Tensor",
                                fake=lambda hidden, w, tokens, temperature, spec, backend: hidden.new_empty(
                                    tokens.shape, dtype=torch.float32),
                                backward=FunctionBackward(_TokenLogprobsFn,
                                                          saves(0, 1, 2, temperature=lambda i, o: i[3]), 2)),)),
):
    register(_record)
