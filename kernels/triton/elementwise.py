"""Strict elementwise ops (ElementwiseSpec) and rotary embedding (RotarySpec) in Triton.

Bit for bit kernels/reference/elementwise.py: each value is computed alone in float32 from its own
input (lsm1 exp / log / sin / cos from strict_math, correctly rounded division, fp fusion off), rounded
once to the output dtype by integer round-to-nearest-even, every NaN the canonical one. The float32
cores (:func:`sigmoid_f32`, :func:`silu_f32`, :func:`softplus_f32`) are also the gated-delta-rule
kernels' gates and activation (one definition, as in the reference).

Every kernel is persistent (``launch(..., persistent=True)``): one program per block on CUDA, at most
the core count for the Ascend variant, which also swaps in its exact division (``NPU``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import strict_math as sm
from .dtypes import tl_dtype
from .launch import cdiv, float32_value, launch, next_power_of_2

F32 = torch.float32
BLOCK = 1024          # elements per program of the unary / silu_mul kernels
SIGMOID, SILU, SOFTPLUS = 0, 1, 2
_UNARY = {"sigmoid": SIGMOID, "silu": SILU, "softplus": SOFTPLUS}
LEAD = 4              # leading dims of apply_rotary's table handled by strides (more are materialised)


# ---------------------------------------------------------------- float32 cores (reference *_f32)


@triton.jit
def sigmoid_f32(x, NPU: tl.constexpr = False):
    """1 / (1 + exp(-x)): sigmoid(-inf) = 0, sigmoid(+inf) = 1."""
    return sm.div(1.0, 1.0 + sm.exp(-x), NPU)


@triton.jit
def silu_f32(x, NPU: tl.constexpr = False):
    """x / (1 + exp(-x)) (one division); silu(-inf) = -0.0, the limit (the formula gives NaN there)."""
    y = sm.div(x, 1.0 + sm.exp(-x), NPU)
    return sm.neg_zero_where(x != float("-inf"), y)


@triton.jit
def softplus_f32(x, NPU: tl.constexpr = False):
    """m + log1p(e), e = exp(-|x|), m = x if x > 0 else +0.0: fma(log(w), e / (w - 1), m) with w = 1 + e
    (Goldberg's log1p), or m + e when w == 1."""
    m = tl.where(x > 0.0, x, 0.0)
    e = sm.exp(-sm.absf(x))
    w = 1.0 + e
    tiny = w == 1.0
    safe = tl.where(tiny, 1.0, w)
    return tl.where(tiny, m + e, tl.fma(sm.log(safe, NPU), sm.div(e, safe - 1.0, NPU), m))


# ---------------------------------------------------------------- sigmoid / silu / softplus / silu_mul


@triton.jit(do_not_specialize=["n", "n_work"])  # counts that change per call: no recompiles
def _unary_kernel(X, B, Y, n, n_work, OP: tl.constexpr, HAS_B: tl.constexpr, OUT: tl.constexpr,
                  BLOCK: tl.constexpr, NPU: tl.constexpr):
    """Y = OP(X) (times B for silu_mul: the float32 silu times b, one rounding) over n contiguous elements."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        i = (tl.zeros([BLOCK], tl.int64) + item) * BLOCK + tl.arange(0, BLOCK)  # int64: n may pass 2**31
        ok = i < n
        x = sm.widen(tl.load(X + i, mask=ok, other=0.0))
        if OP == 0:
            y = sigmoid_f32(x, NPU)
        elif OP == 1:
            y = silu_f32(x, NPU)
        else:
            y = softplus_f32(x, NPU)
        if HAS_B:
            y = y * sm.widen(tl.load(B + i, mask=ok, other=0.0))
        tl.store(Y + i, sm.round_out(y, OUT, NPU), mask=ok)


def _elementwise(op: int, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    xc = x.contiguous()  # a copy only for non-contiguous views: the bits do not depend on the layout
    bc = b.contiguous() if b is not None else xc
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = xc.numel()
    if n:
        launch(_unary_kernel, (cdiv(n, BLOCK),), xc, bc, y, n, OP=op, HAS_B=b is not None,
               OUT=tl_dtype(x.dtype), BLOCK=BLOCK, persistent=True)
    return y


def sigmoid(x, spec=None):
    return _elementwise(SIGMOID, x, None)


def silu(x, spec=None):
    return _elementwise(SILU, x, None)


def softplus(x, spec=None):
    return _elementwise(SOFTPLUS, x, None)


def silu_mul(a, b, spec=None):
    return _elementwise(SILU, a, b)


# ---------------------------------------------------------------- rotary tables


@triton.jit(do_not_specialize=["n", "n_work"])  # counts that change per call: no recompiles
def _cos_sin_kernel(P, F, COS, SIN, n, half, r_float, base32, n_work, HAS_F: tl.constexpr,
                    BP: tl.constexpr, BH: tl.constexpr, NPU: tl.constexpr):
    """cos/sin [n, half] float32 of angle = float32(pos) * inv_freq_i; inv_freq_i = exp(-((2i / R) * log(base)))
    (each operation rounded once, as the reference) unless F holds the caller's table."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        p = item * BP + tl.arange(0, BP)
        p_ok = p < n
        pos = sm.widen(tl.load(P + p, mask=p_ok, other=0))  # exact: |pos| < 2**24
        for h0 in range(0, half, BH):
            j = h0 + tl.arange(0, BH)
            j_ok = j < half
            if HAS_F:
                f = tl.load(F + j, mask=j_ok, other=0.0)
            else:
                lb = sm.log(base32 + tl.zeros([BH], tl.float32), NPU)
                e = sm.div((2 * j).to(tl.float32), r_float, NPU)
                f = sm.exp(-(e * lb))
            s, c = sm.sincos(pos[:, None] * f[None, :])
            offs = p.to(tl.int64)[:, None] * half + j[None, :]
            ok = p_ok[:, None] & j_ok[None, :]
            tl.store(COS + offs, sm.canonical_nan(c), mask=ok)
            tl.store(SIN + offs, sm.canonical_nan(s), mask=ok)


def rotary_cos_sin(positions, rotary_dim: int, base: float, inv_freq_, spec=None):
    """float32 (cos, sin) of shape positions.shape + (R/2,) (reference ``rotary_cos_sin``)."""
    half = rotary_dim // 2
    pos = positions.contiguous().reshape(-1)
    n = pos.numel()
    cos = torch.empty((n, half), dtype=F32, device=positions.device)
    sin = torch.empty((n, half), dtype=F32, device=positions.device)
    if n:
        f = inv_freq_.to(device=positions.device, dtype=F32).contiguous() if inv_freq_ is not None else cos
        bh = min(128, next_power_of_2(half))
        bp = max(1, min(64, 2048 // bh))
        # base and R as float32 arguments: the spec's float32(base), and an int equal to 1 would be a constexpr
        launch(_cos_sin_kernel, (cdiv(n, bp),), pos, f, cos, sin, n, half, float(rotary_dim),
               float32_value(base), HAS_F=inv_freq_ is not None, BP=bp, BH=bh, persistent=True)
    shape = (*positions.shape, half)
    return cos.reshape(shape), sin.reshape(shape)


# ---------------------------------------------------------------- apply_rotary


@triton.jit(do_not_specialize=["n_rows", "n_work"])  # counts that change per call: no recompiles
def _rotary_kernel(X, C, S, Y, n_rows, D, half, d1, d2, d3,
                   c0, c1, c2, c3, c4, s0, s1, s2, s3, s4, n_work,
                   INTERLEAVED: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                   NPU: tl.constexpr):
    """Rows of x [n_rows, D] (contiguous); the table row of x-row r = ((i0 d1 + i1) d2 + i2) d3 + i3 is at
    i0 c0 + i1 c1 + i2 c2 + i3 c3 (strides, 0 where broadcast), element j at j c4 (s*: sin).
    out1 = fma(x1, c, -(x2 s)), out2 = fma(x2, c, x1 s) rounded once; dims >= 2 half copied (canonical NaN)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (tl.zeros([BR], tl.int64) + item) * BR + tl.arange(0, BR)
        r_ok = rows < n_rows
        i3 = rows % d3
        t = rows // d3
        i2 = t % d2
        t = t // d2
        i1 = t % d1
        i0 = t // d1
        coff = i0 * c0 + i1 * c1 + i2 * c2 + i3 * c3
        soff = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
        xrow = rows * D
        for h0 in range(0, half, BH):
            j = h0 + tl.arange(0, BH)
            ok = r_ok[:, None] & (j < half)[None, :]
            c = sm.widen(tl.load(C + coff[:, None] + j[None, :] * c4, mask=ok, other=0.0))
            s = sm.widen(tl.load(S + soff[:, None] + j[None, :] * s4, mask=ok, other=0.0))
            if INTERLEAVED:
                k1 = 2 * j
                k2 = 2 * j + 1
            else:
                k1 = j
                k2 = j + half
            p1 = xrow[:, None] + k1[None, :]
            p2 = xrow[:, None] + k2[None, :]
            x1 = sm.widen(tl.load(X + p1, mask=ok, other=0.0))
            x2 = sm.widen(tl.load(X + p2, mask=ok, other=0.0))
            o1 = tl.fma(x1, c, -(x2 * s))
            o2 = tl.fma(x2, c, x1 * s)
            tl.store(Y + p1, sm.round_out(o1, OUT, NPU), mask=ok)
            tl.store(Y + p2, sm.round_out(o2, OUT, NPU), mask=ok)
        for d0 in range(2 * half, D, BH):  # partial rotary: the rest passes through (exact widening and back)
            d = d0 + tl.arange(0, BH)
            ok = r_ok[:, None] & (d < D)[None, :]
            p = xrow[:, None] + d[None, :]
            tl.store(Y + p, sm.round_out(sm.widen(tl.load(X + p, mask=ok, other=0.0)), OUT, NPU), mask=ok)


def _lead_strides(t: torch.Tensor, lead: tuple) -> list[int] | None:
    """Strides of t broadcast to lead + (half,), as LEAD leading dims (size-1 dims in front) + the last dim;
    None when there are more than LEAD leading dims (then the caller materialises the table)."""
    if len(lead) > LEAD:
        return None
    e = t.expand(*lead, t.shape[-1])
    st = list(e.stride())
    return [0] * (LEAD - len(lead)) + st[:-1] + [st[-1]]


def apply_rotary(x, cos, sin, interleaved: bool, spec=None):
    """Reference ``apply_rotary``: x [..., D], cos/sin broadcastable to x.shape[:-1] + (R/2,)."""
    half, d = cos.shape[-1], x.shape[-1]
    lead = tuple(x.shape[:-1])
    rows = x.numel() // d if d else 0
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return y
    cs, ss = _lead_strides(cos, lead), _lead_strides(sin, lead)
    sizes = [1] * (LEAD - len(lead)) + list(lead)
    if cs is None:  # more than LEAD leading dims: one [rows, half] table (a copy)
        cos = cos.expand(*lead, half).reshape(rows, half).contiguous()
        sin = sin.expand(*lead, half).reshape(rows, half).contiguous()
        cs, ss = [0, 0, 0, half, 1], [0, 0, 0, half, 1]
        sizes = [1, 1, 1, rows]
    br = 16
    bh = min(64, next_power_of_2(half))
    launch(_rotary_kernel, (cdiv(rows, br),), xc, cos, sin, y, rows, d, half, *sizes[1:], *cs, *ss,
           INTERLEAVED=bool(interleaved), OUT=tl_dtype(x.dtype), BR=br, BH=bh, persistent=True)
    return y
