"""Strict float32 arithmetic for numba kernels: the same bits as kernels/reference/strict_math.py.

* :func:`fma` is LLVM's ``llvm.fma.f32``: one rounding, on every target (a ``vfmadd`` instruction
  with hardware FMA, else libm's exact ``fmaf``). Plain ``a*b + c`` is never contracted by numba
  without fastmath, and fastmath is never used here (it would reassociate the spec's chains).
* :func:`exp` / :func:`log` port lsm1 exactly: the same float32 constants, the same operation
  order, 2**k built from integer bits, the same exponent/mantissa split and subnormal scaling.
* Every float32 literal is a module-level ``np.float32``: a bare Python float would promote the
  arithmetic to float64 and change the bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

F32 = np.float32


@intrinsic
def fma(typingctx, a, b, c):
    """float32 a*b + c rounded once (IEEE fusedMultiplyAdd)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The int32 bit pattern of a float32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, i):
    """The float32 whose bit pattern is the int32 ``i``."""
    if i != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


ZERO = F32(0.0)
ONE = F32(1.0)
HALF = F32(0.5)
TWO = F32(2.0)
NEG_INF = F32(-np.inf)
POS_INF = F32(np.inf)
#: float32 canonical NaN (0x7FC00000); bf16 0x7FC0 and fp16 0x7E00 are its RNE conversions.
NAN = np.frombuffer(np.uint32(0x7FC00000).tobytes(), dtype=np.float32)[0]

_LOG2E = F32(1.4426950408889634)
_LN2_HI = F32(0.693145751953125)
_LN2_LO = F32(1.4286067653e-06)
_E0, _E1, _E2, _E3, _E4, _E5 = (F32(c) for c in (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5))
_EXP_LO = F32(-110.0)
_EXP_HI = F32(100.0)
_L0, _L1, _L2, _L3 = (F32(c) for c in (2.0 / 9.0, 2.0 / 7.0, 2.0 / 5.0, 2.0 / 3.0))
_TINY = F32(1.1754943508222875e-38)  # 2**-126, smallest normal float32
_TWO23 = F32(8388608.0)
_SQRT2_BITS = 0x3FB504F3


@njit(inline="always", cache=True)
def pow2(k):
    """2**k for an integer-valued float32 k in [-126, 127], from its bits (exact)."""
    return bits_f32(np.int32((np.int32(k) + np.int32(127)) << np.int32(23)))


@njit(inline="always", cache=True)
def exp(x):
    """lsm1 exp of a float32 (reference: strict_math.exp). Branch-free (selects only), so loops
    over it vectorise; NaN never enters the arithmetic (the clamp maps it to the low end) and is
    returned as it came."""
    xc = x if x >= _EXP_LO else _EXP_LO  # NaN -> _EXP_LO (replaced by x at the end)
    xc = xc if xc <= _EXP_HI else _EXP_HI
    k = np.floor(fma(xc, _LOG2E, HALF))
    r = fma(-k, _LN2_HI, xc)
    r = fma(-k, _LN2_LO, r)
    p = _E0
    p = fma(p, r, _E1)
    p = fma(p, r, _E2)
    p = fma(p, r, _E3)
    p = fma(p, r, _E4)
    p = fma(p, r, _E5)
    p = fma(p, r, ONE)
    p = fma(p, r, ONE)
    k1 = np.floor(k * HALF)
    y = (p * pow2(k1)) * pow2(k - k1)
    return x if x != x else y


@njit(inline="always", cache=True)
def log(x):
    """lsm1 natural log of a float32 (reference: strict_math.log)."""
    if x != x:
        return x
    if x == ZERO:
        return NEG_INF
    if x < ZERO:
        return NAN
    if x == POS_INF:
        return POS_INF
    tiny = x < _TINY
    xs = x * _TWO23 if tiny else x
    bits = f32_bits(xs)
    e = ((bits >> np.int32(23)) & np.int32(0xFF)) - np.int32(127)
    if tiny:
        e = e - np.int32(23)
    mbits = (bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000)
    if mbits > np.int32(_SQRT2_BITS):
        mbits = mbits - np.int32(0x00800000)
        e = e + np.int32(1)
    m = bits_f32(np.int32(mbits))
    f = m - ONE
    s = f / (f + TWO)
    z = s * s
    r = _L0
    r = fma(r, z, _L1)
    r = fma(r, z, _L2)
    r = fma(r, z, _L3)
    r = r * z
    lp = fma(-s, f - r, f)
    ef = F32(e)
    return fma(ef, _LN2_HI, fma(ef, _LN2_LO, lp))


@njit(inline="always", cache=True)
def canon(x):
    """x, with any NaN replaced by the canonical NaN."""
    return NAN if x != x else x


# -------------------------------------------------------------- flush-to-zero detection

@njit(cache=True)
def _probe_one(tiny):
    # tiny = 2**-126 arrives at run time, so nothing is constant-folded: under FTZ the product
    # (a subnormal) becomes 0; under DAZ the subnormal operand reads as 0.
    sub = tiny * HALF
    return sub != ZERO and (sub * ONE) != ZERO


# -------------------------------------------------------------- exact widening of stored values
# Kernels read bf16 / fp16 tensors as raw 16-bit integers (host.raw): int16 holds bf16 bits, uint16
# holds fp16 bits, and `widen` turns either (or a float32) into the exact float32 value, so no
# widened copy of a large operand (an LM head, a weight) is ever made.

@intrinsic
def _bf16_bits_to_f32(typingctx, i):
    if i != types.int16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, i):
    if i != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        # IEEE half -> float is exact (fpext; vcvtph2ps with F16C, else compiler-rt's conversion)
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def widen(v):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(widen, inline="always")
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.int16:
        return lambda v: _bf16_bits_to_f32(v)
    if v == types.uint16:
        return lambda v: _f16_bits_to_f32(v)
    return None


@intrinsic
def _round_f16(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        # float -> half -> float: IEEE round-to-nearest-even, with subnormals (exact way back)
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@njit(inline="always", cache=True)
def round_bf16(x):
    """x rounded to bfloat16 (nearest even) and widened back; NaN stays NaN."""
    if x != x:
        return x
    b = np.int64(f32_bits(x)) & np.int64(0xFFFFFFFF)  # the pattern as an unsigned value
    b = (b + np.int64(0x7FFF) + ((b >> np.int64(16)) & np.int64(1))) & np.int64(0xFFFF0000)
    return bits_f32(np.int32(b))  # truncation back to 32 bits restores the sign bit


@njit(inline="always", cache=True)
def round_f16(x):
    """x rounded to float16 (nearest even) and widened back."""
    return _round_f16(x)


@njit(inline="always", cache=True)
def nanmax(a, b):
    """max that propagates NaN (as torch.amax / cummax / maximum)."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a >= b else b


# -------------------------------------------------------------- sin / cos (lsm1)
# The port of strict_math.sincos: the same constants, reduction steps and quadrant selection.

SINCOS_LIMIT = F32(16777216.0)  # 2**24
_QUARTER = F32(0.25)
_THREE = F32(3.0)
_FOUR = F32(4.0)
_TWO_OVER_PI = F32(0.6366197466850281)
_PIO2_1 = F32(1.5707963705062866)
_PIO2_2 = F32(-4.371138828673793e-08)
_PIO2_3 = F32(-1.7151245100058819e-15)
_S0, _S1, _S2, _S3, _S4 = (F32(c) for c in (-1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0,
                                            -1.0 / 6.0))
_C0, _C1, _C2, _C3, _C4, _C5 = (F32(c) for c in (1.0 / 479001600.0, -1.0 / 3628800.0, 1.0 / 40320.0,
                                                 -1.0 / 720.0, 1.0 / 24.0, -0.5))


@njit(inline="always", cache=True)
def _reduce_quarter(x, k):
    nk = -k
    r = fma(nk, _PIO2_1, x)
    r = fma(nk, _PIO2_2, r)
    return fma(nk, _PIO2_3, r)


@njit(inline="always", cache=True)
def sincos(x):
    """lsm1 (sin x, cos x) of a float32 (reference: strict_math.sincos); NaN for NaN, ±inf and
    |x| >= 2**24; sin(±0) = ±0."""
    finite = abs(x) < SINCOS_LIMIT  # False for NaN and ±inf
    xf = x if finite else ZERO
    k = np.floor(fma(xf, _TWO_OVER_PI, HALF))
    r = _reduce_quarter(xf, k)
    k = k + np.floor(fma(r, _TWO_OVER_PI, HALF))  # one correction of the quadrant
    r = _reduce_quarter(xf, k)
    z = r * r
    ps = fma(fma(fma(fma(_S0, z, _S1), z, _S2), z, _S3), z, _S4)
    pc = fma(fma(fma(fma(fma(_C0, z, _C1), z, _C2), z, _C3), z, _C4), z, _C5)
    s = fma(r * z, ps, r)
    c = fma(z, pc, ONE)
    q = k - _FOUR * np.floor(k * _QUARTER)
    if q == ONE or q == _THREE:
        s, c = c, s
    if q == TWO or q == _THREE:
        s = -s
    if q == ONE or q == TWO:
        c = -c
    if x == ZERO:
        s = x
    if not finite:
        return NAN, NAN
    return s, c
