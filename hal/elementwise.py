"""Public strict elementwise ops (sigmoid, silu, softplus, silu_mul) and rotary embedding.

Forward bits come from the backend under an ElementwiseSpec / RotarySpec (``hal spec show
elementwise.strict.lsm1.v2``); backward passes are ordinary torch float32 (float64 for float64
inputs) math: correct and deterministic, not part of any spec.
"""
from __future__ import annotations

import math

import torch

from . import tensor_parallel as _tp, validate as v
from .errors import InputError
from .op_call import backward_dtype, needs_grad, resolve
from .ops_registry import DTENSOR, TORCH_OP, route, routing
from .spec import STRICT
from .torch_ops import FunctionBackward, OpRecord, TorchOp, register, saves

__all__ = ["sigmoid", "silu", "softplus", "silu_mul", "rotary_cos_sin", "apply_rotary"]

F32, F64 = torch.float32, torch.float64
#: |position| bound: float32(pos) is exact below 2**24, and the strict sin/cos domain is |angle| < 2**24.
POSITION_LIMIT = 2 ** 24


# ---------------------------------------------------------------- backward math (float32 / float64)


def _silu_grad(x):
    s = torch.sigmoid(x)
    d = s * (1.0 + x * (1.0 - s))
    return torch.where(x == float("-inf"), 0.0, d)  # the limit; the formula gives 0 * -inf


_UNARY_GRAD = {
    "sigmoid": lambda x: torch.sigmoid(x) * (1.0 - torch.sigmoid(x)),
    "silu": _silu_grad,
    "softplus": torch.sigmoid,
}


class _UnaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, s, impl):
        ctx.kind = kind
        ctx.save_for_backward(x)
        return getattr(impl, kind)(x, s)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        acc = backward_dtype(x)
        return (g.to(acc) * _UNARY_GRAD[ctx.kind](x.to(acc))).to(x.dtype), None, None, None


def _unary(kind: str, x, spec, backend):
    if routing(kind, x) is TORCH_OP:
        return route(kind, x, spec=spec, backend=backend)
    v.tensor("x", x)
    v.floating("x", x)
    s, impl = resolve(kind, spec, backend, x.dtype, x=x)
    if needs_grad(x):
        return _UnaryFn.apply(x, kind, s, impl)
    return getattr(impl, kind)(x, s)


def sigmoid(x: torch.Tensor, *, spec=None, backend=None) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` per element, in float32, rounded once to x's dtype (strict: the same bits
    at every position of every tensor; ``torch.sigmoid`` is not, on AVX-512 CPUs)."""
    return _unary("sigmoid", x, spec, backend)


def silu(x: torch.Tensor, *, spec=None, backend=None) -> torch.Tensor:
    """SiLU / swish ``x / (1 + exp(-x))`` per element (drop-in for ``F.silu``)."""
    return _unary("silu", x, spec, backend)


def softplus(x: torch.Tensor, *, spec=None, backend=None) -> torch.Tensor:
    """``log(1 + exp(x))`` per element, without ``F.softplus``'s threshold (the exact formula everywhere)."""
    return _unary("softplus", x, spec, backend)


class _SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, s, impl):
        ctx.save_for_backward(a, b)
        return impl.silu_mul(a, b, s)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        acc = backward_dtype(a)
        g, a32, b32 = g.to(acc), a.to(acc), b.to(acc)
        ga = (g * b32 * _silu_grad(a32)).to(a.dtype) if ctx.needs_input_grad[0] else None
        gb = (g * torch.nn.functional.silu(a32)).to(b.dtype) if ctx.needs_input_grad[1] else None
        return ga, gb, None, None


def silu_mul(a: torch.Tensor, b: torch.Tensor, *, spec=None, backend=None) -> torch.Tensor:
    """SwiGLU's ``silu(a) * b``: the float32 silu(a) times b, rounded once to the inputs' dtype.

    ``a`` (gate) and ``b`` (up projection) must have the same shape and dtype.
    """
    how = routing("silu_mul", a, b)
    if how is TORCH_OP:
        return route("silu_mul", a, b, spec=spec, backend=backend)
    if how is DTENSOR:
        return _tp.rowwise("silu_mul", lambda a, b: silu_mul(a, b, spec=spec, backend=backend), {"a": a, "b": b}, {},
                           {"a": {a.ndim - 1}, "b": {b.ndim - 1}}, a.ndim - 1)
    v.tensor("a", a), v.tensor("b", b)
    dtype = v.same_dtype(a=v.floating("a", a), b=v.floating("b", b))
    if tuple(a.shape) != tuple(b.shape):
        raise InputError(f"silu_mul: a shape {tuple(a.shape)} != b shape {tuple(b.shape)}; pass the gate and up "
                         "projections with equal shapes (e.g. a, b = x.chunk(2, -1))")
    s, impl = resolve("silu_mul", spec, backend, dtype, a=a, b=b)
    if needs_grad(a, b):
        return _SiluMulFn.apply(a, b, s, impl)
    return impl.silu_mul(a, b, s)


# ---------------------------------------------------------------- rotary


def _rotary_dim(rotary_dim) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise InputError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if rotary_dim >= POSITION_LIMIT:
        raise InputError(f"rotary_dim must be < 2**24 (float32(2i) / float32(R) exact operands), got {rotary_dim}")
    return rotary_dim


def _base(base) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise InputError(f"base must be a number, got {base!r}")
    b32 = float(torch.tensor(float(base), dtype=F32))  # the value the spec uses
    if not (math.isfinite(b32) and b32 > 0):
        raise InputError(f"base must be a finite number > 0 as float32, got {base!r} (float32: {b32!r})")
    return float(base)


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None,
                   *, spec=None, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` of shape ``positions.shape + (rotary_dim // 2,)`` for integer positions.

    ``angle = float32(pos) * inv_freq_i`` with ``inv_freq_i = base ** (-2i / rotary_dim)`` computed
    strictly (or the float32 ``inv_freq`` [rotary_dim // 2] you pass, e.g. a scaled one; then ``base`` is
    not used), and lockstep's own sin/cos. A trainer that builds its table for a whole packed batch and
    a sampler that builds it per token, with int32 or int64 positions, get the same bits.
    """
    if routing("rotary_cos_sin", positions, inv_freq) is TORCH_OP:
        return route("rotary_cos_sin", positions, rotary_dim, base, inv_freq, spec=spec, backend=backend)
    v.tensor("positions", positions)
    v.integer("positions", positions)
    r = _rotary_dim(rotary_dim)
    base = _base(base)
    tensors = {"positions": positions}
    if inv_freq is not None:
        v.tensor("inv_freq", inv_freq, ndim=1)
        if inv_freq.dtype != F32:
            raise InputError(f"inv_freq must be float32 (the spec's table), got {inv_freq.dtype}; "
                             "pass inv_freq.float() if its float32 rounding is what you mean")
        v.dim_eq("rotary_cos_sin: inv_freq.shape[0] vs rotary_dim // 2", inv_freq.shape[0], r // 2)
        if not bool(torch.isfinite(inv_freq).all()):
            raise InputError("inv_freq must be finite")
        tensors["inv_freq"] = inv_freq
    pmax = int(positions.abs().max()) if positions.numel() else 0
    if pmax >= POSITION_LIMIT or (positions.numel() and int(positions.min()) <= -POSITION_LIMIT):
        raise InputError(f"positions must satisfy |pos| < 2**24 (exact in float32), got max |pos| = {pmax}")
    if inv_freq is None and float(torch.tensor(base, dtype=F32)) >= 1.0:
        fmax = torch.tensor(1.0, dtype=F32)  # inv_freq_0 = exp(-0) = 1 is the largest
    else:  # the spec's own table (a few exp/log on R/2 values), or the caller's
        from hal.kernels.reference.elementwise import inv_freq as strict_inv_freq
        f = strict_inv_freq(r, base) if inv_freq is None else inv_freq.detach().cpu()
        fmax = f.abs().max()
    amax = float(torch.tensor(float(pmax), dtype=F32) * fmax)  # the largest angle, rounded as the spec rounds it
    if not amax < POSITION_LIMIT:
        raise InputError(f"rotary angles must stay below 2**24 in magnitude (the strict sin/cos domain): max |pos| "
                         f"{pmax} x max inv_freq {float(fmax):.6g} = {amax:.6g}; check base / inv_freq")
    s, impl = resolve("rotary_cos_sin", spec, backend, F32, **tensors)
    # no gradient flows into a table: integer positions, and a given inv_freq is a constant here
    return impl.rotary_cos_sin(positions, r, base, None if inv_freq is None else inv_freq.detach(), s)


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, s, impl):
        ctx.save_for_backward(x, cos, sin)
        ctx.interleaved = interleaved
        return impl.apply_rotary(x, cos, sin, interleaved, s)

    @staticmethod
    def backward(ctx, g):
        from hal.kernels.reference.elementwise import rotary_pairs
        x, cos, sin = ctx.saved_tensors
        acc = backward_dtype(x)
        half = cos.shape[-1]
        g, xa, c, s = g.to(acc), x.to(acc), cos.to(acc), sin.to(acc)
        g1, g2 = rotary_pairs(g, half, ctx.interleaved)
        x1, x2 = rotary_pairs(xa, half, ctx.interleaved)
        gx = None
        if ctx.needs_input_grad[0]:  # the transpose of a rotation: rotate back by -angle
            gx = g.clone()
            r1, r2 = g1 * c + g2 * s, g2 * c - g1 * s
            if ctx.interleaved:
                gx[..., 0:2 * half:2], gx[..., 1:2 * half:2] = r1, r2
            else:
                gx[..., :half], gx[..., half:2 * half] = r1, r2
            gx = gx.to(x.dtype)
        gc = (g1 * x1 + g2 * x2).sum_to_size(cos.shape).to(cos.dtype) if ctx.needs_input_grad[1] else None
        gs = (g2 * x1 - g1 * x2).sum_to_size(sin.shape).to(sin.dtype) if ctx.needs_input_grad[2] else None
        return gx, gc, gs, None, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, *,
                 spec=None, backend=None) -> torch.Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of x's last axis; dims ``>= R`` pass through.

    ``x [..., D]``; ``cos``, ``sin`` (same shape and dtype, e.g. from :func:`rotary_cos_sin`) broadcastable to
    ``x.shape[:-1] + (R/2,)``. Half-split pairs ``(i, i + R/2)`` (GPT-NeoX / HF Llama ``rotate_half``; HF's
    full-width tables are ``cat(cos_half, cos_half)``: pass ``cos[..., :R/2]``) or interleaved pairs
    ``(2i, 2i+1)`` (GPT-J). ``out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin`` in float32, rounded once.
    """
    how = routing("apply_rotary", x, cos, sin)
    if how is TORCH_OP:
        return route("apply_rotary", x, cos, sin, interleaved, spec=spec, backend=backend)
    if how is DTENSOR:
        return _tp.rowwise("apply_rotary", lambda x, cos, sin: apply_rotary(x, cos, sin, interleaved, spec=spec,
                           backend=backend), {"x": x, "cos": cos, "sin": sin}, {},
                           {"x": {x.ndim - 1}, "cos": {cos.ndim - 1}, "sin": {sin.ndim - 1}}, x.ndim - 1)
    v.tensor("x", x, ndim_min=1), v.tensor("cos", cos, ndim_min=1), v.tensor("sin", sin, ndim_min=1)
    v.floating("x", x), v.floating("cos", cos), v.floating("sin", sin)
    if not isinstance(interleaved, bool):
        raise InputError(f"interleaved must be a bool, got {interleaved!r}")
    if cos.dtype != sin.dtype or tuple(cos.shape) != tuple(sin.shape):
        raise InputError(f"cos and sin must have the same shape and dtype; got {cos.dtype}{list(cos.shape)} and "
                         f"{sin.dtype}{list(sin.shape)}")
    if (x.dtype == F64) != (cos.dtype == F64):
        raise InputError(f"apply_rotary: float64 (the oracle, for gradient checks) needs float64 x, cos and sin; "
                         f"got x {x.dtype}, cos/sin {cos.dtype}")
    half = cos.shape[-1]
    if half == 0 or 2 * half > x.shape[-1]:
        raise InputError(f"cos.shape[-1] (R/2) must be in [1, D/2] with D = x.shape[-1] = {x.shape[-1]}; got {half}")
    want = (*x.shape[:-1], half)
    if not v.broadcasts_to(cos.shape, want):
        raise InputError(f"cos/sin shape {tuple(cos.shape)} must broadcast to x.shape[:-1] + (R/2,) = {want} "
                         "(e.g. cos[:, :, None, :] for x [B, T, H, D] and cos [B, T, R/2])")
    s, impl = resolve("apply_rotary", spec, backend, x.dtype, x=x, cos=cos, sin=sin)
    if needs_grad(x, cos, sin):
        return _RotaryFn.apply(x, cos, sin, interleaved, s, impl)
    return impl.apply_rotary(x, cos, sin, interleaved, s)


# ---------------------------------------------------------------- the records (hal/torch_ops.py derives every table)


class _Contract:
    """The backend methods (hal/backend_contract.py): hal calls them with validated tensors and the resolved spec."""

    def sigmoid(self, x, spec):
        """Elementwise sigmoid in x's dtype."""

    def silu(self, x, spec):
        """Elementwise ``x * sigmoid(x)``."""

    def softplus(self, x, spec):
        """Elementwise ``log(1 + exp(x))``."""

    def silu_mul(self, a, b, spec):
        """``silu(a) * b``, rounded once."""

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        """``(cos, sin)`` float32 tables [..., rotary_dim / 2]."""

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        """x with its first 2 * cos.shape[-1] channels rotated (rotate-half or interleaved pairs)."""


_ELEMENTWISE = (("elementwise", (STRICT,)),)
_ROTARY = (("rotary", (STRICT,)),)

for _kind, _fn in (("sigmoid", sigmoid), ("silu", silu), ("softplus", softplus)):
    register(OpRecord(_kind, "elementwise", contract=getattr(_Contract, _kind), suites=_ELEMENTWISE, torch_ops=(
        TorchOp(_kind, None, _fn, "Tensor x", "Tensor", fake=lambda x, spec, backend: x.new_empty(x.shape),
                backward=FunctionBackward(_UnaryFn, saves(0, kind=lambda i, o, k=_kind: k), 1)),)))
register(OpRecord("silu_mul", "elementwise", contract=_Contract.silu_mul, suites=_ELEMENTWISE, sharding=_tp.ROWWISE,
                  torch_ops=(TorchOp("silu_mul", None, silu_mul, "Tensor a, Tensor b", "Tensor",
                                     fake=lambda a, b, spec, backend: a.new_empty(a.shape),
                                     backward=FunctionBackward(_SiluMulFn, saves(0, 1), 2)),)))
register(OpRecord("rotary_cos_sin", "rotary", contract=_Contract.rotary_cos_sin, suites=_ROTARY, torch_ops=(
    TorchOp("rotary_cos_sin", None, rotary_cos_sin, "Tensor positions, int rotary_dim, float base, Tensor? inv_freq",
            "(Tensor, Tensor)",
            fake=lambda positions, rotary_dim, base, inv_freq, spec, backend: tuple(
                positions.new_empty((*positions.shape, rotary_dim // 2), dtype=F32) for _ in range(2))),)))
register(OpRecord("apply_rotary", "rotary", contract=_Contract.apply_rotary, suites=_ROTARY, sharding=_tp.ROWWISE,
                  torch_ops=(TorchOp("apply_rotary", None, apply_rotary, "Tensor x, Tensor cos, Tensor sin, bool interleaved",
                                     "Tensor", fake=lambda x, cos, sin, interleaved, spec, backend: x.new_empty(x.shape),
                                     backward=FunctionBackward(_RotaryFn,
                                                               saves(0, 1, 2, interleaved=lambda i, o: i[3]), 3)),)))
