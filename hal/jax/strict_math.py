"""Strict float32 arithmetic in JAX: the one FMA helper and everything built on it.

XLA gives no way to ask for the strict policy's float32 arithmetic directly:

* there is no fma primitive, and XLA:CPU contracts ``a*b + c`` under jit only sometimes;
* XLA:CPU runs with flush-to-zero / denormals-are-zero: float32 subnormal inputs read as 0 and
  subnormal results become 0 (``--xla_cpu_ftz=false`` changes nothing);
* under jit ``x + 0.0`` is rewritten to ``x`` (wrong for x = -0.0).

So every strict float32 value is carried in a float64 array ("F": a float64 whose value is a
float32 value, subnormals included) and every operation is done in float64 and rounded to the
float32 grid by :func:`round_to_grid` (an exact float64 trick, no float32 instruction involved):

* products of two float32 values are exact in float64, so contraction of float64 ``a*b + c``
  into an fma can never change a result;
* ``+ - * / sqrt`` of float32 values computed in float64 and rounded once more to float32 are
  correctly rounded (53 >= 2*24 + 2; double rounding is innocuous for these operations);
* :func:`fma` makes the float64 sum round-to-odd (TwoSum) before rounding to float32, which
  rounds the exact ``a*b + c`` once (Boldo & Melquiond), as ``kernels/reference/strict_math.fma_exact``;
* float32 values never become float64 subnormals (the smallest float32 is 2**-149, and a product of
  two is >= 2**-298), so XLA's flushing never touches them; the float32 <-> float64 boundary is
  crossed through integer bit operations (:func:`widen`, :func:`narrow`), never by XLA's converts.

Everything here needs 64-bit types: callers trace inside :func:`x64` (a scoped ``jax.enable_x64``).
``--xla_cpu_enable_fast_math=true`` lets XLA reassociate and breaks the emulation:
:func:`fast_math_flag` detects it and :func:`check_environment` refuses.
"""
from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F64 = jnp.float64
I64 = jnp.int64
_SIGN = np.int64(-0x8000000000000000)
_ABS = np.int64(0x7FFFFFFFFFFFFFFF)

# (mantissa bits p incl. the hidden bit, emin, emax, exponent bits) of the strict output formats.
FORMATS = {
    "float32": (24, -126, 127, 8),
    "bfloat16": (8, -126, 127, 8),
    "float16": (11, -14, 15, 5),
}
#: The strict policy's one NaN per dtype (hal.kernels.reference.strict_math.canonical_nan).
CANONICAL_NAN = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}
_UINT = {"float32": jnp.uint32, "bfloat16": jnp.uint16, "float16": jnp.uint16}
_JDTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------------ environment


def fast_math_flag() -> str | None:
    """The XLA flag that breaks the emulation, if XLA_FLAGS sets it."""
    for tok in os.environ.get("XLA_FLAGS", "").split():
        name, _, val = tok.lstrip("-").partition("=")
        if name == "xla_cpu_enable_fast_math" and val.lower() in ("true", "1", ""):
            return tok
    return None


def check_environment() -> str | None:
    """None when strict arithmetic can run here, else why not."""
    if jax.default_backend() == "tpu":
        return ("the default jax backend is TPU: no IEEE float64 and float32 subnormals flushed, so the "
                "strict bits cannot be emulated there; run hal.jax in a CPU process (JAX_PLATFORMS=cpu)")
    flag = fast_math_flag()
    if flag:
        return (f"XLA_FLAGS contains {flag}: XLA may then reassociate float arithmetic, which breaks "
                "the exact float64 emulation of fma; unset it")
    return None


@contextlib.contextmanager
def x64():
    """64-bit types for the enclosed tracing only (the caller's global jax_enable_x64 is untouched)."""
    with jax.enable_x64(True):
        yield


# ------------------------------------------------------------------ bits <-> F


def _bits(x):
    return lax.bitcast_convert_type(x, I64)


def _f64(bits):
    return lax.bitcast_convert_type(bits, F64)


def _pow2(k):
    """2.0**k as float64 for integer k in float64's normal range (built from the bits: exact)."""
    return _f64((jnp.asarray(k, I64) + 1023) << 52)


def round_to_grid(x, fmt: str = "float32"):
    """float64 x rounded to nearest-even onto ``fmt``'s grid (subnormals and overflow included),
    returned as float64. Sign, zeros, inf and NaN pass through.

    With e the exponent of |x| (at least fmt's emin) the grid step is 2**k, k = e - (p - 1).
    Adding C = 1.5 * 2**(k + 52) puts |x| + C in a binade whose float64 ulp is exactly 2**k, so
    the float64 addition rounds |x| to the grid (nearest-even) and subtracting C is exact.
    """
    p, emin, emax, _ = FORMATS[fmt]
    bits = _bits(x)
    sign = bits & _SIGN
    a = _f64(bits & _ABS)
    e = jnp.clip(((bits & _ABS) >> 52) - 1023, emin, emax + 1)
    c = _f64(((e - (p - 1) + 52 + 1023) << 52) | (1 << 51))
    y = (a + c) - c
    y = jnp.where(y >= 2.0 ** (emax + 1), jnp.inf, y)
    return _f64(_bits(y) | sign)


def rnd(x):
    """float64 -> nearest float32 value (as float64)."""
    return round_to_grid(x, "float32")


def widen(x):
    """A float32 / bfloat16 / float16 jax array -> F, exactly, through its bits (XLA's convert would
    read subnormals as zero)."""
    name = jnp.dtype(x.dtype).name
    if name == "float64":
        return x
    p, emin, _, ebits = FORMATS[name]
    m = p - 1
    b = lax.bitcast_convert_type(x, _UINT[name]).astype(I64)
    sign = (b >> (m + ebits)) << 63
    ef = (b >> m) & ((1 << ebits) - 1)
    mant = b & ((1 << m) - 1)
    bias = (1 << (ebits - 1)) - 1
    normal = _f64(((ef - bias + 1023) << 52) | (mant << (52 - m)))
    sub = mant.astype(F64) * _pow2(emin - m)  # exact: a small integer times a power of two
    special = jnp.where(mant == 0, jnp.inf, jnp.nan)
    mag = jnp.where(ef == 0, sub, jnp.where(ef == (1 << ebits) - 1, special, normal))
    return _f64(_bits(mag) | sign)


def narrow(x, fmt: str = "float32"):
    """F (any float64) -> a jax array of ``fmt``: rounded nearest-even through integer ops, NaN made
    the canonical NaN."""
    p, emin, emax, ebits = FORMATS[fmt]
    m = p - 1
    y = round_to_grid(x, fmt)
    bits = _bits(y)
    sign = (bits >> 63) & 1
    mag = bits & _ABS
    e = (mag >> 52) - 1023
    bias = (1 << (ebits - 1)) - 1
    normal = ((e + bias) << m) | ((mag & ((1 << 52) - 1)) >> (52 - m))
    a = _f64(mag)
    sub = (a * _pow2(m - emin)).astype(I64)  # exact integer: y is on the subnormal grid
    inf = jnp.asarray(((1 << ebits) - 1) << m, I64)
    out = jnp.where(e < emin, sub, jnp.where(e > emax, inf, normal))
    out = out | (sign << (m + ebits))
    out = jnp.where(jnp.isnan(x), CANONICAL_NAN[fmt], out)
    return lax.bitcast_convert_type(out.astype(_UINT[fmt]), _JDTYPE[fmt])


def to_format(x, fmt: str):
    """Round F to ``fmt``'s grid and keep it as F (the value a round trip through fmt gives)."""
    return x if fmt == "float32" else round_to_grid(x, fmt)


# ------------------------------------------------------------------ arithmetic on F


def const(v, like=None):
    """A float32 constant as F (rounded to float32 first, as ``torch.tensor(v, dtype=float32)``)."""
    c = jnp.asarray(float(np.float32(v)), F64)
    return c if like is None else jnp.broadcast_to(c, jnp.shape(like))


def zeros(shape):
    """+0.0 that XLA cannot see through: ``acc + 0.0`` must round -0.0 to +0.0, not fold to acc."""
    return lax.optimization_barrier(jnp.zeros(shape, F64))


def add(a, b):
    return rnd(a + b)


def sub(a, b):
    return rnd(a - b)


def mul(a, b):
    return rnd(a * b)


def div(a, b):
    return rnd(a / b)


def sqrt(a):
    return rnd(jnp.sqrt(a))


def fma(a, b, c):
    """float32 ``a*b + c`` rounded once, on F operands (the one FMA helper).

    p = a*b is exact; s = p + c rounded to float64 with its exact error from TwoSum; an inexact s
    with an even last bit moves one float64 ulp towards the exact value (round-to-odd); rounding
    that to float32 rounds the exact sum once.
    """
    p = a * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    bits = _bits(s)
    to_odd = (err != 0) & jnp.isfinite(s) & ((bits & 1) == 0)
    step = jnp.where((err > 0) == (s > 0), 1, -1)
    return rnd(_f64(jnp.where(to_odd, bits + step, bits)))


# ------------------------------------------------------------------ lsm1 exp / log (ported exactly)

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.4286067653e-06
_EXP_POLY = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5]
_LOG_POLY = [2.0 / 9.0, 2.0 / 7.0, 2.0 / 5.0, 2.0 / 3.0]
_SQRT2_MANT = 0x3504F3  # mantissa field of float32 sqrt(2) rounded down


def exp(x):
    """lockstep's float32 exp (lsm1) on F. exp(NaN) = NaN, exp(-inf) = 0, exp(+inf) = inf."""
    xc = jnp.clip(x, -110.0, 100.0)
    k = jnp.floor(fma(xc, const(_LOG2E, xc), const(0.5, xc)))
    r = fma(-k, const(_LN2_HI, k), xc)
    r = fma(-k, const(_LN2_LO, k), r)
    p = const(_EXP_POLY[0], r)
    for c in _EXP_POLY[1:]:
        p = fma(p, r, const(c, r))
    one = const(1.0, r)
    p = fma(p, r, one)
    p = fma(p, r, one)
    k1 = jnp.floor(k * 0.5)  # exact (k is a small integer)
    y = mul(mul(p, _pow2(k1.astype(I64))), _pow2((k - k1).astype(I64)))
    return jnp.where(jnp.isnan(x), x, y)


def log(x):
    """lockstep's float32 natural log (lsm1) on F. log(0) = -inf, log(x<0) = NaN, log(inf) = inf.

    The reference scales float32 subnormals by 2**23 to read exponent and mantissa; in float64
    they are normal numbers already, so the fields are read directly (the same e and m).
    """
    bits = _bits(x) & _ABS
    e = (bits >> 52) - 1023
    mant = bits & ((1 << 52) - 1)
    big = (mant >> 29) > _SQRT2_MANT
    e = e + big.astype(I64)
    m = _f64(mant | ((1023 - big.astype(I64)) << 52))
    f = sub(m, const(1.0, m))
    s = div(f, add(f, const(2.0, f)))
    z = mul(s, s)
    r = const(_LOG_POLY[0], z)
    for c in _LOG_POLY[1:]:
        r = fma(r, z, const(c, z))
    r = mul(r, z)
    lp = fma(-s, sub(f, r), f)
    ef = e.astype(F64)
    y = fma(ef, const(_LN2_HI, ef), fma(ef, const(_LN2_LO, ef), lp))
    y = jnp.where(x == 0, -jnp.inf, y)
    y = jnp.where(x < 0, jnp.nan, y)
    y = jnp.where(jnp.isinf(x) & (x > 0), jnp.inf, y)
    return jnp.where(jnp.isnan(x), x, y)


_SINCOS_LIMIT = 16777216.0
_TWO_OVER_PI = 0.6366197466850281
_PIO2 = (1.5707963705062866, -4.371138828673793e-08, -1.7151245100058819e-15)
_SIN_POLY = [-1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0]
_COS_POLY = [1.0 / 479001600.0, -1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5]


def _horner(z, coeffs):
    p = const(coeffs[0], z)
    for c in coeffs[1:]:
        p = fma(p, z, const(c, z))
    return p


def _quarter_turns(x):
    return jnp.floor(fma(x, const(_TWO_OVER_PI, x), const(0.5, x)))


def _reduce(x, k):
    r = x
    for c in _PIO2:
        r = fma(-k, const(c, k), r)
    return r


def sincos(x):
    """lockstep's float32 (sin x, cos x) (lsm1) on F, ported from the reference; |x| >= 2**24, inf, NaN -> NaN."""
    finite = jnp.abs(x) < _SINCOS_LIMIT
    xf = jnp.where(finite, x, 0.0)
    k = _quarter_turns(xf)
    k = add(k, _quarter_turns(_reduce(xf, k)))  # integer-valued, exact
    r = _reduce(xf, k)
    z = mul(r, r)
    s = fma(mul(r, z), _horner(z, _SIN_POLY), r)
    c = fma(z, _horner(z, _COS_POLY), const(1.0, z))
    q = k - 4.0 * jnp.floor(k * 0.25)  # exact
    swap = (q == 1.0) | (q == 3.0)
    sin, cos = jnp.where(swap, c, s), jnp.where(swap, s, c)
    sin = jnp.where((q == 2.0) | (q == 3.0), -sin, sin)
    cos = jnp.where((q == 1.0) | (q == 2.0), -cos, cos)
    sin = jnp.where(x == 0, x, sin)
    return jnp.where(finite, sin, jnp.nan), jnp.where(finite, cos, jnp.nan)


# ------------------------------------------------------------------ the canonical tiled reduction


def _tiles(x, t: int):
    """[..., n] -> [t, ..., n_tiles] (element j of every tile on the leading axis), zero-padded."""
    n = x.shape[-1]
    nt = max(1, -(-n // t))
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nt * t - n)])
    x = x.reshape(*x.shape[:-1], nt, t)
    return jnp.moveaxis(x, -1, 0), nt


def _valid(n: int, t: int, nt: int):
    """[t, n_tiles] bool: element j of tile i exists (past the end the accumulator is kept)."""
    return (np.arange(nt)[None, :] * t + np.arange(t)[:, None]) < n


def _combine_tiles(partials):
    """Tile partials added in increasing tile order from +0.0 (a scan: one compiled step)."""
    total, _ = lax.scan(lambda acc, p: (add(acc, p), None), zeros(partials.shape[:-1]),
                        jnp.moveaxis(partials, -1, 0))
    return total


def _chain(step, xs, valid, shape):
    """acc = step(acc, x_j) for j = 0..t-1 over all tiles at once, from +0.0, skipping absent elements."""
    def body(acc, inp):
        xj, vj = inp
        return jnp.where(vj, step(acc, xj), acc), None
    acc, _ = lax.scan(body, zeros(shape), (xs, jnp.asarray(valid)))
    return acc


def tiled_dot(a, b, t: int):
    """sum_k a[..., k] * b[..., k] (F, broadcastable) in the canonical order (fma chains in tiles)."""
    n = a.shape[-1]
    shape = jnp.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    at, nt = _tiles(a, t)  # broadcast inside the chain, never materialised
    bt, _ = _tiles(b, t)
    acc = _chain(lambda acc, ab: fma(ab[0], ab[1], acc), (at, bt), _valid(n, t, nt), (*shape, nt))
    return _combine_tiles(acc)


def tiled_sum(x, t: int):
    """sum_k x[..., k] (F) in the canonical order."""
    n = x.shape[-1]
    xt, nt = _tiles(x, t)
    acc = _chain(add, xt, _valid(n, t, nt), (*x.shape[:-1], nt))
    return _combine_tiles(acc)


# ------------------------------------------------------------------ start-up probe


def _numpy_fma(a, b, c):
    """The same round-to-odd fma in numpy (IEEE float64, no flush-to-zero): an independent check."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    bits = s.view(np.int64)
    to_odd = (err != 0) & np.isfinite(s) & ((bits & 1) == 0)
    step = np.where((err > 0) == (s > 0), 1, -1)
    return np.where(to_odd, bits + step, bits).view(np.float64).astype(np.float32)


def self_test() -> str | None:
    """Run a few decisive fma cases (double rounding, subnormal result and inputs, -0.0 + +0.0) jitted
    and compare with :func:`_numpy_fma`; None when they agree, else what went wrong."""
    t = 2.0 ** -24
    cases = np.array([
        [1 + t * 2, 1 - t, -1.0],             # exact result needs the round-to-odd step
        [1 + 2 * t, 1 + 2 * t, 2.0 ** -60],   # near a float32 midpoint
        [2.0 ** -70, 2.0 ** -70, 2.0 ** -149],  # subnormal result
        [3 * 2.0 ** -149, 0.5, 0.0],           # subnormal input, midpoint in the subnormal range
        [-0.0, 1.0, 0.0],                      # -0 + +0 = +0 (XLA folds x + 0.0)
        [-1.0, 0.0, -0.0],                     # -0 + -0 = -0
    ], np.float64).astype(np.float32)
    want = _numpy_fma(cases[:, 0], cases[:, 1], cases[:, 2]).view(np.uint32)

    def f(a, b, c):
        # the constant-zero chain start, as every tiled reduction has it: must give +0.0 for -0.0 * 1
        return narrow(fma(widen(a), widen(b), widen(c))), narrow(fma(widen(a), widen(b), zeros(a.shape)))
    try:
        with x64():
            got, got0 = jax.jit(f)(*(jnp.asarray(cases[:, i]) for i in range(3)))
        got, got0 = np.asarray(got).view(np.uint32), np.asarray(got0).view(np.uint32)
    except Exception as e:
        return f"self-test failed to run: {type(e).__name__}: {e}"
    if got0[4] != 0:
        return f"self-test: -0.0 * 1 + (+0.0) gave bits {got0[4]:#010x}, expected +0.0 (XLA folded x + 0.0)"
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = int(bad[0])
        return (f"self-test: fma{tuple(float(v) for v in cases[i])} gave bits {got[i]:#010x}, expected "
                f"{want[i]:#010x} (XLA flags or the CPU change float64 arithmetic here)")
    return None
