"""Strict float32 arithmetic that every backend can reproduce bit for bit.

Only IEEE-754 operations that are correctly rounded everywhere are used: fma, +, -, *, /, sqrt,
floor, comparisons and exact bit manipulation. Every product that feeds a sum is a fused
multiply-add: compilers are allowed to contract ``a*b + c`` into an fma (XLA's CPU backend does
under ``jax.jit``), but never to split an explicit fma, so writing the fma in the spec removes the
ambiguity. Triton has ``tl.fma``, CUDA ``fmaf``, JAX ``lax`` on most targets; torch has no fma
on CPU, so :func:`fma` emulates it exactly in float64 (below: a fast path, and the general
round-to-odd method for the rare operands the fast path cannot decide).

``exp`` and ``log`` are lockstep's own (version ``lsm1``): Cody-Waite range reduction and a
polynomial evaluated by Horner's rule with fma. They are not correctly rounded, but the same on
every backend; their error against the correctly rounded result is measured by
``python -m benchmarks.ulp`` (at most 1 ulp, ~99.5% correctly rounded) and stated in the README.
"""
from __future__ import annotations

import torch

F32 = torch.float32
F64 = torch.float64

#: The one NaN of each dtype that a strict op returns (a positive quiet NaN, no payload). Hardware and
#: libraries disagree on NaN bits (x86 propagates payloads, GPUs return 0x7FFFFFFF, torch's vector
#: and scalar paths differ), so the strict policy names one pattern and every output is mapped to it.
CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00,
                      torch.float64: 0x7FF8000000000000}
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
               torch.float64: torch.int64}


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN replaced by the canonical NaN of its dtype (bit-exact; other values untouched)."""
    if t.dtype not in CANONICAL_NAN_BITS:
        return t
    nan = torch.tensor(CANONICAL_NAN_BITS[t.dtype], dtype=_BITS_DTYPE[t.dtype]).view(t.dtype)
    return torch.where(torch.isnan(t), nan.to(t.device), t)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root.

    torch's vectorised float32 ``sqrt`` on AVX-512 CPUs is not correctly rounded (about 0.6% of
    random inputs differ by 1 ulp from its own scalar path). The float64 square root of a float32
    rounded to float32 is correct (53 >= 2 * 24 + 2 bits, so the double rounding is innocuous).
    """
    assert x.dtype == F32
    return torch.sqrt(x.to(F64)).to(F32)


def fma_exact(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a*b + c`` with a single rounding (IEEE fusedMultiplyAdd), for any operands.

    The float64 product of two float32 values is exact (24 + 24 < 53 bits). The float64 sum is
    rounded once; rounding that again to float32 could round twice wrongly, so the sum is first
    made *round-to-odd* (exact error by TwoSum; an inexact result with an even last bit moves one
    float64 ulp towards the exact value). Rounding a round-to-odd value with at least two extra bits
    to nearest-even gives the correctly rounded result (Boldo & Melquiond).
    """
    p = a.to(F64) * b.to(F64)  # exact
    c64 = c.to(F64)
    s = p + c64
    # TwoSum: err = (p + c) - s exactly.
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    bits = s.view(torch.int64)
    inexact = (err != 0) & torch.isfinite(s)
    to_odd = inexact & ((bits & 1) == 0)
    # +1 on the bit pattern grows the magnitude, -1 shrinks it (for either sign).
    step = torch.where((err > 0) == (s > 0), 1, -1)
    bits = torch.where(to_odd, bits + step, bits)
    return bits.view(F64).to(F32)


_MID_MASK = 0x1FFFFFFF  # the 29 float64 mantissa bits that a float32 drops ...
_MID = 0x10000000       # ... holding exactly half a float32 ulp: a float32 rounding midpoint
_ABS = 0x7FFFFFFFFFFFFFFF
_TINY32 = int(torch.tensor(2.0 ** -126, dtype=F64).view(torch.int64))  # smallest normal float32


def fma_wide(a64: torch.Tensor, b64: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """:func:`fma` for a, b already widened to float64 (saves the conversions inside loops).

    s = a*b + c rounded once to float64 (the product is exact). Rounding s to float32 is then
    correct unless s sits exactly on a float32 midpoint (the first rounding may have decided the
    tie) or in float32's subnormal range; only those rare elements take :func:`fma_exact`.
    """
    c64 = c.to(F64)
    s = a64 * b64 + c64
    r = s.to(F32)
    bits = s.view(torch.int64)
    mag = bits & _ABS
    suspect = ((bits & _MID_MASK) == _MID) | ((mag < _TINY32) & (mag != 0))
    if bool(suspect.any()):
        idx = suspect.nonzero(as_tuple=True)
        shape = s.shape
        r = r.clone()
        r[idx] = fma_exact(a64.expand(shape)[idx].to(F32), b64.expand(shape)[idx].to(F32),
                           c64.expand(shape)[idx].to(F32))
    return r


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a*b + c`` with a single rounding (IEEE fusedMultiplyAdd), for float32 tensors."""
    return fma_wide(a.to(F64), b.to(F64), c)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 for integer-valued float32 k in [-126, 127], built from its bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(F32)


# exp: x = k*ln2 + r, |r| <= ln2/2. LN2_HI has 16 trailing zero bits so k*LN2_HI is exact for
# |k| < 2**8; with fma that does not even matter, but it keeps the reduction accurate.
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.4286067653e-06
# Taylor coefficients 1/n!, n = 7..2, as float32 (rounded from the exact rationals).
_EXP_POLY = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5]


def exp(x: torch.Tensor) -> torch.Tensor:
    """lockstep's float32 exp (lsm1). exp(NaN) = NaN, exp(-inf) = 0, exp(+inf) = inf."""
    assert x.dtype == F32
    xc = x.clamp(-110.0, 100.0)  # beyond these exp is 0 / inf in float32; keeps k small
    k = torch.floor(fma(xc, _f32(_LOG2E).expand_as(xc), _f32(0.5).expand_as(xc)))
    r = fma(-k, _f32(_LN2_HI).expand_as(k), xc)
    r = fma(-k, _f32(_LN2_LO).expand_as(k), r)
    p = _f32(_EXP_POLY[0]).expand_as(r)
    for c in _EXP_POLY[1:]:
        p = fma(p, r, _f32(c).expand_as(r))
    one = _f32(1.0).expand_as(r)
    p = fma(p, r, one)  # 1 + r + r^2/2 + ...
    p = fma(p, r, one)
    # Scale by 2**k in two exact steps so that only the last product can round (subnormal results).
    k1 = torch.floor(k * 0.5)
    y = (p * _pow2(k1)) * _pow2(k - k1)
    return torch.where(torch.isnan(x), x, y)


# log: x = m * 2**e with m in [sqrt(1/2), sqrt(2)); f = m - 1 (exact); s = f / (2 + f);
# log(1+f) = 2 atanh(s) = f - s*(f - R(s^2)),  R(z) = z*(2/3 + z*(2/5 + z*(2/7 + z*2/9))).
_LOG_POLY = [2.0 / 9.0, 2.0 / 7.0, 2.0 / 5.0, 2.0 / 3.0]
_SQRT2_BITS = 0x3FB504F3  # float32 sqrt(2) rounded down


def log(x: torch.Tensor) -> torch.Tensor:
    """lockstep's float32 natural log (lsm1). log(0) = -inf, log(x<0) = NaN, log(inf) = inf."""
    assert x.dtype == F32
    tiny = x < 1.1754943508222875e-38  # subnormal (or zero/negative): scale up exactly first
    xs = torch.where(tiny, x * 8388608.0, x)  # 2**23
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 23, 0).to(torch.int32)
    mbits = (bits & 0x7FFFFF) | 0x3F800000
    big = mbits > _SQRT2_BITS
    mbits = torch.where(big, mbits - 0x00800000, mbits)  # m/2, exact
    e = e + big.to(torch.int32)
    m = mbits.view(F32)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    r = _f32(_LOG_POLY[0]).expand_as(z)
    for c in _LOG_POLY[1:]:
        r = fma(r, z, _f32(c).expand_as(z))
    r = r * z
    lp = fma(-s, f - r, f)
    ef = e.to(F32)
    y = fma(ef, _f32(_LN2_HI).expand_as(ef), fma(ef, _f32(_LN2_LO).expand_as(ef), lp))
    y = torch.where(x == 0, float("-inf"), y)
    y = torch.where(x < 0, float("nan"), y)
    y = torch.where(torch.isinf(x) & (x > 0), float("inf"), y)
    return torch.where(torch.isnan(x), x, y)


# ---------------------------------------------------------------- sin / cos (lsm1)

# x = k*(pi/2) + r: k0 = floor(fma(x, 2/pi, 0.5)) is the nearest integer only up to the product's rounding
# (off by one for large x), so r0 = x - k0*pi/2 is computed and k = k0 + floor(fma(r0, 2/pi, 0.5)), then
# r = x - k*pi/2 again: |r| <= pi/4 (+ a few ulp). x - k*pi/2 is three fma with pi/2 = C1 + C2 + C3 (float32
# each; together pi/2 to ~2**-76); the first is exact (x - k*C1 is a multiple of 2**-23 below 1 in magnitude).
SINCOS_LIMIT = 16777216.0              # 2**24: the domain of sin/cos is |x| < 2**24
_TWO_OVER_PI = 0.6366197466850281      # float32 0x3F22F983
_PIO2_1 = 1.5707963705062866          # float32 0x3FC90FDB
_PIO2_2 = -4.371138828673793e-08      # float32 0xB33BBD2E
_PIO2_3 = -1.7151245100058819e-15     # float32 0xA6F72CED
# Taylor coefficients in z = r*r, float32 (rounded from the exact rationals), highest power first:
# sin r = r + r*z*(-1/3! + z/5! - z^2/7! + z^3/9! - z^4/11!), cos r = 1 + z*(-1/2! + z/4! - ... + z^5/12!).
# Truncation at |r| <= pi/4 is below 2**-35 relative: the float32 roundings decide the error.
_SIN_POLY = [-1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0]
_COS_POLY = [1.0 / 479001600.0, -1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5]


def _horner(z: torch.Tensor, coeffs) -> torch.Tensor:
    p = _f32(coeffs[0]).expand_as(z)
    for c in coeffs[1:]:
        p = fma(p, z, _f32(c).expand_as(z))
    return p


def _nearest_quarter_turns(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(fma(x, _f32(_TWO_OVER_PI).expand_as(x), _f32(0.5).expand_as(x)))


def _reduce(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    nk = -k
    r = fma(nk, _f32(_PIO2_1).expand_as(k), x)
    r = fma(nk, _f32(_PIO2_2).expand_as(k), r)
    return fma(nk, _f32(_PIO2_3).expand_as(k), r)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lockstep's float32 (sin x, cos x) (lsm1) for |x| < 2**24; NaN, ±inf and |x| >= 2**24 give NaN
    (beyond 2**24 a float32 angle has no fraction bits and pi/2 reduction by three constants is meaningless);
    sin(±0) = ±0.

    Range reduction by pi/2 (Cody-Waite, three constants, fma; k corrected once), the quadrant q = k mod 4 taken by exact
    float32 operations on the integer-valued k (k - 4*floor(k/4): no integer overflow for any x),
    Taylor polynomials in r*r by Horner with fma: sin r = fma(r*z, P(z), r), cos r = fma(z, Q(z), 1).
    q = 0: (s, c); 1: (c, -s); 2: (-s, -c); 3: (-c, s). Not correctly rounded; error measured by
    ``python -m benchmarks.ulp --fn sin`` / ``--fn cos``.
    """
    assert x.dtype == F32
    finite = x.abs() < SINCOS_LIMIT  # False for NaN and ±inf too
    xf = torch.where(finite, x, torch.zeros_like(x))
    k = _nearest_quarter_turns(xf)
    r = _reduce(xf, k)
    k = k + _nearest_quarter_turns(r)  # the product x * 2/pi may be off by > 1/2 for large x: one correction
    r = _reduce(xf, k)
    z = r * r
    s = fma(r * z, _horner(z, _SIN_POLY), r)
    c = fma(z, _horner(z, _COS_POLY), _f32(1.0).expand_as(z))
    q = k - 4.0 * torch.floor(k * 0.25)  # exact: k mod 4 in {0, 1, 2, 3}
    swap = (q == 1.0) | (q == 3.0)
    sin = torch.where(swap, c, s)
    cos = torch.where(swap, s, c)
    sin = torch.where((q == 2.0) | (q == 3.0), -sin, sin)
    cos = torch.where((q == 1.0) | (q == 2.0), -cos, cos)
    sin = torch.where(x == 0, x, sin)  # keeps the sign of zero
    nan = torch.full_like(x, float("nan"))
    return torch.where(finite, sin, nan), torch.where(finite, cos, nan)


def sin(x: torch.Tensor) -> torch.Tensor:
    return sincos(x)[0]


def cos(x: torch.Tensor) -> torch.Tensor:
    return sincos(x)[1]
