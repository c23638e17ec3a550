"""Strict float32 arithmetic as Triton device functions, bit for bit kernels/reference/strict_math.py.

Why each building block is what it is (measured facts: issue 8, docs/triton.md):

* ``tl.fma`` is a single-rounding fma on the GPU (``fma.rn.f32``) and, since Triton 3.9, in the
  interpreter too (older interpreters rounded twice; :func:`hal.kernels.triton.launch.check_interpreter`
  refuses those).
* ``a*b + c`` written as two operations must stay two roundings: every strict kernel is launched with
  fp fusion OFF (:mod:`hal.kernels.triton.launch`), otherwise Triton contracts it into an fma.
* ``/`` lowers to the approximate ``div.full.f32`` and ``tl.sqrt`` to ``sqrt.approx``: use
  ``tl.math.div_rn`` / ``tl.math.sqrt_rn`` (correctly rounded, IEEE).
* ``tl.exp`` / ``tl.log`` are not lockstep's lsm1: :func:`exp` and :func:`log` port lsm1 with the same
  float32 constants, the same operation order, ``tl.fma`` and integer bit operations.
* the interpreter's fp32 -> bf16 cast truncates, the GPU's rounds: outputs are rounded with integer
  round-to-nearest-even on the float32 bits (:func:`round_to_bf16`, :func:`round_to_fp16`), one path
  for both, and every NaN becomes the canonical pattern of its dtype.

The float constants below are written as the exact float32 values (decimal of the float32 the
reference rounds its float64 constant to), so the double -> float32 conversion of a literal is exact.
"""
from __future__ import annotations

import triton
import triton.language as tl

# exp: x = k*ln2 + r (reference: _LOG2E, _LN2_HI, _LN2_LO, _EXP_POLY as float32)
LOG2E = tl.constexpr(1.4426950216293335)        # 0x3FB8AA3B
LN2_HI = tl.constexpr(0.693145751953125)        # 0x3F317200
LN2_LO = tl.constexpr(1.428606765330187e-06)    # 0x35BFBE8E
EXP_C7 = tl.constexpr(0.00019841270113829523)   # 1/5040
EXP_C6 = tl.constexpr(0.0013888889225199819)    # 1/720
EXP_C5 = tl.constexpr(0.008333333767950535)     # 1/120
EXP_C4 = tl.constexpr(0.0416666679084301)       # 1/24
EXP_C3 = tl.constexpr(0.1666666716337204)       # 1/6
# log: R(z) = z*(2/3 + z*(2/5 + z*(2/7 + z*2/9)))
LOG_C9 = tl.constexpr(0.2222222238779068)       # 2/9
LOG_C7 = tl.constexpr(0.2857142984867096)       # 2/7
LOG_C5 = tl.constexpr(0.4000000059604645)       # 2/5
LOG_C3 = tl.constexpr(0.6666666865348816)       # 2/3
SQRT2_BITS = tl.constexpr(0x3FB504F3)           # float32 sqrt(2) rounded down
MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2**-126

# canonical NaN bit patterns (hal.kernels.reference.strict_math.canonical_nan)
NAN_F32_BITS = tl.constexpr(0x7FC00000)
NAN_BF16_BITS = tl.constexpr(0x7FC0)
NAN_FP16_BITS = tl.constexpr(0x7E00)


@triton.jit
def fma(a, b, c):
    """float32 a*b + c rounded once."""
    return tl.fma(a, b, c)


@triton.jit
def div(a, b, NPU: tl.constexpr = False):
    """float32 a / b, correctly rounded (never the approximate ``/``); NPU: the fma/integer substitute."""
    if NPU:
        return div_exact(a, b)
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def sqrt(x, NPU: tl.constexpr = False):
    """float32 sqrt, correctly rounded; NPU: the integer-checked substitute."""
    if NPU:
        return sqrt_exact(x)
    else:
        return tl.math.sqrt_rn(x)


# ---- substitutes that need no correctly rounded hardware division / square root -------------------
# Ascend's documentation lists div_rn / sqrt_rn, but nothing states how its vector unit rounds them;
# these give the IEEE result from any seed within a few ulp, deciding the last bit with exact int64
# arithmetic on the 24-bit significands (so they are bit-exact wherever int64 multiply is exact).


@triton.jit
def _split(x):
    """|x| = m * 2**e for finite non-zero float32 x: m in [1, 2) as float32, e as int32 (subnormals too)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tiny = bits < 0x00800000
    a = bits.to(tl.float32, bitcast=True)
    bits = tl.where(tiny, a * 8388608.0, a).to(tl.int32, bitcast=True)  # 2**23: subnormals scaled up exactly
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 23, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return m, e


@triton.jit
def _scale(k, t):
    """k * 2**t for a float32 k that is an integer below 2**25 and int32 t in [-178, 246] (two exact steps,
    so only a result outside float32's range rounds: to 0 never happens by construction, to inf does)."""
    t1 = t >> 1
    return (k * _pow2(t1)) * _pow2(t - t1)


@triton.jit
def _specials(x_bits_sign, r, zero, inf, nan):
    r = tl.where(zero, 0.0, r)
    r = tl.where(inf, float("inf"), r)
    r = (r.to(tl.int32, bitcast=True) | x_bits_sign).to(tl.float32, bitcast=True)
    return tl.where(nan, float("nan"), r)


@triton.jit
def div_exact(a, b):
    """float32 a / b correctly rounded (ties to even, subnormal results, overflow, specials) from a seed
    ``/`` plus exact int64 midpoint tests: Q = ma/mb in [1, 2) is rounded to K units of g = 2**(s-23)
    (s > 0 only for subnormal results) by comparing 2*A*2**23 with (2K +- 1) * B * 2**s."""
    a = tl.where(b == b, a, a)  # a literal or scalar operand becomes a float32 tensor of the common shape
    b = tl.where(a == a, b, b)
    ma, ea = _split(a)
    mb, eb = _split(b)
    swap = ma < mb
    ma = tl.where(swap, ma * 2.0, ma)
    e = ea - eb - swap.to(tl.int32)
    e = tl.minimum(tl.maximum(e, -180), 260)           # beyond: 0 or inf whatever the significands
    s = tl.minimum(tl.maximum(-126 - e, 0), 25)
    big_a = (ma * 8388608.0).to(tl.int64)               # exact integers: ma in [1, 4), mb in [1, 2)
    big_b = (mb * 8388608.0).to(tl.int64)
    g = _pow2(s).to(tl.int64)
    n2 = big_a * 16777216
    k = (tl.fma(ma, 1.0 / mb, 0.0) * _pow2(23 - s)).to(tl.int64)  # seed: a few ulp are enough
    for _ in tl.static_range(3):
        hi = (2 * k + 1) * big_b * g
        lo = (2 * k - 1) * big_b * g
        odd = (k & 1) == 1
        up = (n2 > hi) | ((n2 == hi) & odd)
        down = (n2 < lo) | ((n2 == lo) & odd)
        k = k + up.to(tl.int64) - down.to(tl.int64)
    r = _scale(k.to(tl.float32), e + s - 23)
    abits = a.to(tl.int32, bitcast=True)
    bbits = b.to(tl.int32, bitcast=True)
    a_inf = (abits & 0x7FFFFFFF) == 0x7F800000
    b_inf = (bbits & 0x7FFFFFFF) == 0x7F800000
    nan = (a != a) | (b != b) | ((a == 0.0) & (b == 0.0)) | (a_inf & b_inf)
    return _specials((abits ^ bbits) & -2147483648, r, (a == 0.0) | b_inf, a_inf | (b == 0.0), nan)


@triton.jit
def sqrt_exact(x):
    """float32 sqrt correctly rounded from a seed ``tl.sqrt`` plus exact int64 tests: sqrt(m), m in
    [1, 4), is K units of 2**-23 with (2K - 1)**2 <= 4 * m * 2**46 < (2K + 1)**2 (no ties exist)."""
    m, e = _split(x)
    odd = (e & 1) == 1
    m = tl.where(odd, m * 2.0, m)
    e = e - odd.to(tl.int32)
    n = (m * 8388608.0).to(tl.int64) * 33554432        # 4 * m * 2**46, below 2**50
    k = (tl.sqrt(m) * 8388608.0).to(tl.int64)
    for _ in tl.static_range(3):
        up = n > (2 * k + 1) * (2 * k + 1)
        down = n < (2 * k - 1) * (2 * k - 1)
        k = k + up.to(tl.int64) - down.to(tl.int64)
    r = _scale(k.to(tl.float32), (e >> 1) - 23)
    r = tl.where(x == float("inf"), x, r)
    r = tl.where(x == 0.0, x, r)                       # keeps -0.0
    return tl.where((x != x) | (x < 0.0), float("nan"), r)


@triton.jit
def floor_small(x):
    """floor(x) for float32 |x| < 2**31 (NaN: unspecified). tl.floor lowers to cvt.rmi.ftz.f32 (flush to
    zero) on NVIDIA GPUs; truncation to an integer and a correction step are exact and never flush.
    Like torch.floor for the operands lsm1 has (never -0.0: fma(x, log2e, 0.5) cannot round to -0.0)."""
    t = x.to(tl.int32).to(tl.float32)  # toward zero, exact for |x| < 2**31
    return tl.where(t > x, t - 1.0, t)


@triton.jit
def _pow2(k):
    """2**k as float32 for integer-valued float32 k in [-126, 127], from its bits (exact)."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """lsm1 exp (reference ``exp``): exp(NaN) = NaN, exp(-inf) = 0, exp(+inf) = inf."""
    xc = tl.minimum(tl.maximum(x, -110.0), 100.0)
    k = floor_small(tl.fma(xc, LOG2E, 0.5))
    r = tl.fma(-k, LN2_HI, xc)
    r = tl.fma(-k, LN2_LO, r)
    p = tl.fma(EXP_C7 + tl.zeros_like(r), r, EXP_C6)
    p = tl.fma(p, r, EXP_C5)
    p = tl.fma(p, r, EXP_C4)
    p = tl.fma(p, r, EXP_C3)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    # 2**k in two exact steps so that only the last product can round (subnormal results)
    k1 = floor_small(k * 0.5)
    y = (p * _pow2(k1)) * _pow2(k - k1)
    return tl.where(x != x, x, y)


@triton.jit
def log(x, NPU: tl.constexpr = False):
    """lsm1 log (reference ``log``): log(0) = -inf, log(x<0) = NaN, log(inf) = inf, log(NaN) = NaN."""
    tiny = x < MIN_NORMAL
    xs = tl.where(tiny, x * 8388608.0, x)  # 2**23: subnormals scaled up exactly
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 23, 0)
    mbits = (bits & 0x7FFFFF) | 0x3F800000
    big = mbits > SQRT2_BITS
    mbits = tl.where(big, mbits - 0x00800000, mbits)  # m/2, exact
    e = e + big.to(tl.int32)
    m = mbits.to(tl.float32, bitcast=True)
    f = m - 1.0
    s = div(f, f + 2.0, NPU)
    z = s * s
    r = tl.fma(LOG_C9 + tl.zeros_like(z), z, LOG_C7)
    r = tl.fma(r, z, LOG_C5)
    r = tl.fma(r, z, LOG_C3)
    r = r * z
    lp = tl.fma(-s, f - r, f)
    ef = e.to(tl.float32)
    y = tl.fma(ef, LN2_HI, tl.fma(ef, LN2_LO, lp))
    inf = float("inf")
    y = tl.where(x == 0.0, -inf, y)
    y = tl.where(x < 0.0, float("nan"), y)
    y = tl.where(x == inf, inf, y)
    return tl.where(x != x, x, y)


# ---- lsm1 sin / cos (reference ``sincos``: same constants, same steps, floor_small for floor) ------------

SINCOS_LIMIT = tl.constexpr(16777216.0)          # 2**24: the domain is |x| < 2**24
TWO_OVER_PI = tl.constexpr(0.6366197466850281)   # 0x3F22F983
PIO2_1 = tl.constexpr(1.5707963705062866)        # 0x3FC90FDB  pi/2 = PIO2_1 + PIO2_2 + PIO2_3
PIO2_2 = tl.constexpr(-4.371138828673793e-08)    # 0xB33BBD2E
PIO2_3 = tl.constexpr(-1.7151245100058819e-15)   # 0xA6F72CED
SIN_C11 = tl.constexpr(-2.5052107943679403e-08)  # 0xB2D7322B  -1/11!
SIN_C9 = tl.constexpr(2.7557318844628753e-06)    # 0x3638EF1D   1/9!
SIN_C7 = tl.constexpr(-0.00019841270113829523)   # 0xB9500D01  -1/7!
SIN_C5 = tl.constexpr(0.008333333767950535)      # 0x3C088889   1/5!
SIN_C3 = tl.constexpr(-0.1666666716337204)       # 0xBE2AAAAB  -1/3!
COS_C12 = tl.constexpr(2.0876755879584152e-09)   # 0x310F76C7   1/12!
COS_C10 = tl.constexpr(-2.755731998149713e-07)   # 0xB493F27E  -1/10!
COS_C8 = tl.constexpr(2.4801587642286904e-05)    # 0x37D00D01   1/8!
COS_C6 = tl.constexpr(-0.0013888889225199819)    # 0xBAB60B61  -1/6!
COS_C4 = tl.constexpr(0.0416666679084301)        # 0x3D2AAAAB   1/4!


@triton.jit
def _quarter_turns(x):
    """floor(fma(x, 2/pi, 0.5)): the nearest multiple of pi/2, up to the product's rounding."""
    return floor_small(tl.fma(x, TWO_OVER_PI, 0.5))


@triton.jit
def _reduce_pio2(x, k):
    """x - k*pi/2 as three fma with pi/2 = PIO2_1 + PIO2_2 + PIO2_3."""
    nk = -k
    r = tl.fma(nk, PIO2_1, x)
    r = tl.fma(nk, PIO2_2, r)
    return tl.fma(nk, PIO2_3, r)


@triton.jit
def sincos(x):
    """lsm1 (sin x, cos x) for float32 |x| < 2**24 (reference ``sincos``); NaN, +-inf and |x| >= 2**24 give
    NaN; sin(+-0) = +-0. k is corrected once (x * 2/pi can be off by more than 1/2 for large x); the
    quadrant q = k - 4*floor(k/4) is exact float32 arithmetic on the integer-valued k."""
    finite = (x < SINCOS_LIMIT) & (x > -SINCOS_LIMIT)  # |x| < 2**24; False for NaN and +-inf too
    xf = tl.where(finite, x, 0.0)
    k = _quarter_turns(xf)
    r = _reduce_pio2(xf, k)
    k = k + _quarter_turns(r)
    r = _reduce_pio2(xf, k)
    z = r * r
    p = tl.fma(SIN_C11 + tl.zeros_like(z), z, SIN_C9)
    p = tl.fma(p, z, SIN_C7)
    p = tl.fma(p, z, SIN_C5)
    p = tl.fma(p, z, SIN_C3)
    s = tl.fma(r * z, p, r)
    q = tl.fma(COS_C12 + tl.zeros_like(z), z, COS_C10)
    q = tl.fma(q, z, COS_C8)
    q = tl.fma(q, z, COS_C6)
    q = tl.fma(q, z, COS_C4)
    q = tl.fma(q, z, -0.5)
    c = tl.fma(z, q, 1.0)
    quad = k - 4.0 * floor_small(k * 0.25)  # k mod 4 in {0, 1, 2, 3}
    swap = (quad == 1.0) | (quad == 3.0)
    sin = tl.where(swap, c, s)
    cos = tl.where(swap, s, c)
    sin = tl.where((quad == 2.0) | (quad == 3.0), -sin, sin)
    cos = tl.where((quad == 1.0) | (quad == 2.0), -cos, cos)
    sin = tl.where(x == 0.0, x, sin)  # keeps the sign of zero
    nan = float("nan")
    return tl.where(finite, sin, nan), tl.where(finite, cos, nan)


@triton.jit
def absf(x):
    """float32 |x| by clearing the sign bit (exact; tl.abs is outside triton-ascend's documented subset)."""
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def neg_zero_where(keep, x):
    """float32 x where keep, else -0.0 (a strict FMA dot's padded step needs a product equal to -0.0). The -0.0 is
    made from its bits: Triton 3.6 compiles a float -0.0 constant as +0.0 (``tl.where(m, x, -0.0)`` and a masked
    load's ``other=-0.0`` alike: its TTIR holds one +0.0 constant and its PTX selects 0; 3.9 keeps -0.0), while an
    int32 0x80000000 bitcast survives both. The lint rejects a float -0.0 constant in a strict kernel."""
    bits = tl.zeros_like(x).to(tl.int32, bitcast=True) | -2147483648
    return tl.where(keep, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def widen(x):
    """float32, bfloat16 or float16 x as float32, exactly. bfloat16 by its bits: the interpreter's
    bfloat16 -> float32 cast mangles subnormals (0x0016 became 0x00300000 in Triton 3.9); the shift is
    exact everywhere."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def canonical_nan(x):
    """float32 x with every NaN replaced by 0x7FC00000 (kept as float32)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, NAN_F32_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even on the bits; NaN -> 0x7FC0; overflow -> inf.

    bfloat16 has float32's exponent range, so rounding the low 16 bits away is the whole job, for
    subnormals too; a carry out of the mantissa correctly bumps the exponent (up to inf).
    """
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    r = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
    r = tl.where(x != x, NAN_BF16_BITS, r)
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to_fp16(x):
    """float32 -> float16, round to nearest even on the bits; NaN -> 0x7E00; subnormals; overflow -> inf."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    # normal float16 (|x| >= 2**-14): rebias the exponent (127 -> 15), round 13 bits away
    h = a - 0x38000000
    normal = (h + 0xFFF + ((h >> 13) & 1)) >> 13
    # subnormal float16: the value in units of 2**-24 is mant * 2**(E - 126), E = float32 exponent
    ex = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(126 - ex, 31)
    shift = tl.maximum(shift, 1)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    r = tl.where(a >= 0x38800000, normal, sub)
    r = tl.where(a < 0x33000001, 0, r)          # <= 2**-25 (and float32 subnormals): rounds to 0
    r = tl.where(a >= 0x477FF000, 0x7C00, r)    # >= 65520: rounds to inf (65504 is odd)
    r = sign | r
    r = tl.where(a > 0x7F800000, NAN_FP16_BITS, r)
    return r.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def round_to_fp16_npu(x):
    """round_to_fp16 without shifts by a tensor amount (triton-ascend supports shifts by scalars only):
    a float16 subnormal is |x| * 2**24 rounded to an integer, done as exact float scaling, truncation
    and a ties-to-even test on the exact remainder."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    h = a - 0x38000000
    normal = (h + 0xFFF + ((h >> 13) & 1)) >> 13
    y = a.to(tl.float32, bitcast=True) * 16777216.0       # 2**24, exact; below 2**10 where used
    t = y.to(tl.int32)
    rem = y - t.to(tl.float32)
    sub = t + ((rem > 0.5) | ((rem == 0.5) & ((t & 1) == 1))).to(tl.int32)
    r = tl.where(a >= 0x38800000, normal, sub)
    r = tl.where(a < 0x33000001, 0, r)
    r = tl.where(a >= 0x477FF000, 0x7C00, r)
    r = sign | r
    r = tl.where(a > 0x7F800000, NAN_FP16_BITS, r)
    return r.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def round_out(x, OUT_DTYPE: tl.constexpr, NPU: tl.constexpr = False):
    """float32 result -> the output dtype (float32, bfloat16 or float16), canonical NaN."""
    if OUT_DTYPE == tl.bfloat16:
        return round_to_bf16(x)
    elif OUT_DTYPE == tl.float16:
        if NPU:
            return round_to_fp16_npu(x)
        else:
            return round_to_fp16(x)
    else:
        return canonical_nan(x)
