"""The exact matmul policy on jax.Arrays: ``kernels/exact/core.py``'s steps, products by int8 dot_general.

The same arithmetic as the torch core (its docstring and ``ExactMatmulSpec.describe`` say it in
words), written for XLA; traced under :func:`strict_math.x64` (int64 and float64 needed):

* slicing reads each value through :func:`strict_math.widen` (exact, subnormals included: XLA's
  converts flush them), where every float32 value is a normal float64, so ``|T|`` is the 53-bit
  mantissa shifted right (``E >= e`` and ``7s - 1 <= 27 < 52``): truncation towards zero by a shift;
* the s x s slice products are one ``lax.dot_general(int8, int8, preferred_element_type=int32)``
  per K piece of at most 131,072 (no int32 overflow), the pieces added in int64: exact, so XLA
  may tile and order them as it likes;
* the wide combine and the round-to-odd float64 are the core's (TwoSum has no product for XLA to
  contract; float64 values here are never subnormal); the one rounding to the output dtype is
  :func:`strict_math.narrow` (integer ops; correct from a round-to-odd float64);
* NaN/inf flags are counts of 0/1 indicators by int8 dots (exact), computed only when an input
  is not finite (``lax.cond``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from hal.kernels.exact import core

from . import strict_math as sm

I64, I32, I8, F64 = jnp.int64, jnp.int32, jnp.int8, jnp.float64
_MANT = (1 << 52) - 1
_DOT = (((1,), (1,)), ((), ()))  # contract the last axis of both: [R, K] . [C, K] -> [R, C]


def _idot(a, b):
    """a [R, K] . b [C, K] over K, int8 operands, exact int32 result per piece, int64 sum of pieces."""
    k = a.shape[-1]
    out = jnp.zeros((a.shape[0], b.shape[0]), I64)
    for k0 in range(0, k, core.INT32_SAFE_K):
        part = lax.dot_general(a[:, k0:k0 + core.INT32_SAFE_K], b[:, k0:k0 + core.INT32_SAFE_K], _DOT,
                               preferred_element_type=I32)
        out = out + part.astype(I64)
    return out


def slice_rows(x, s: int):
    """x [R, K] (float32 / bfloat16 / float16) -> (digits int8 [s, R, K], E int64 [R]); non-finite -> 0."""
    f = sm.widen(x)
    mag = lax.bitcast_convert_type(f, I64) & np.int64(0x7FFFFFFFFFFFFFFF)
    nz = jnp.isfinite(f) & (f != 0)
    e = jnp.where(nz, (mag >> 52) - 1023, core._NO_EXP)
    big = jnp.max(e, axis=-1, initial=core._NO_EXP)
    ex = jnp.where(big == core._NO_EXP, 0, big)
    shift = jnp.clip(ex[:, None] - e + 53 - core.DIGIT * s, 0, 63)  # |T| = m53 * 2**(e - 52 + 7s - 1 - E)
    t = jnp.where(nz, ((mag & _MANT) | (1 << 52)) >> shift, 0)
    neg = f < 0
    digits = []
    for i in range(s):
        dg = (t >> (core.DIGIT * (s - 1 - i))) & 127
        digits.append(jnp.where(neg, -dg, dg).astype(I8))
    return jnp.stack(digits), ex


def _products(da, dw):
    """All s*s slice products in one dot: [s*M, K] . [s*N, K] -> int64 [s, s, M, N]."""
    s, m, k = da.shape
    n = dw.shape[1]
    p = _idot(da.reshape(s * m, k), dw.reshape(s * n, k))
    return p.reshape(s, m, s, n).transpose(0, 2, 1, 3)


def _combine(p, s: int):
    """S = hi * 2**28 + lo (core.combine)."""
    hi = jnp.zeros(p.shape[2:], I64)
    lo = jnp.zeros_like(hi)
    for t in range(s):
        for u in range(s):
            shift = core.DIGIT * (2 * s - 2 - t - u)
            if shift >= core.LIMB:
                hi = hi + (p[t, u] << (shift - core.LIMB))
            else:
                lo = lo + (p[t, u] << shift)
    return hi, lo


def _to_f64_odd(hi, lo, q):
    """(hi * 2**28 + lo) * 2**q rounded to odd in float64 (core.to_f64_odd / _round_odd_f64)."""
    carry = lo >> core.LIMB  # arithmetic shift: floor, so 0 <= r < 2**28
    r = lo - (carry << core.LIMB)
    a, b = (hi + carry).astype(F64) * float(1 << core.LIMB), r.astype(F64)
    total = a + b
    bv = total - a
    err = (a - (total - bv)) + (b - bv)
    bits = lax.bitcast_convert_type(total, I64)
    to_odd = (err != 0) & ((bits & 1) == 0)
    step = jnp.where((err > 0) == (total > 0), 1, -1)
    return lax.bitcast_convert_type(jnp.where(to_odd, bits + step, bits), F64) * sm._pow2(q)


def _flags(fa, fw):
    """(nan, pinf, ninf) bool [M, N] for F inputs fa [M, K], fw [N, K] (core.special_flags), each
    a count of indicator products: the classes are stacked along K so one dot sums every pair."""
    def cls(f):
        inf = jnp.isinf(f)
        return {"nan": jnp.isnan(f), "zero": f == 0, "inf": inf, "pinf": inf & (f > 0), "ninf": inf & (f < 0),
                "pos": f > 0, "neg": f < 0}
    ca, cw = cls(fa), cls(fw)

    def any_of(pairs):
        a = jnp.concatenate([ca[i] for i, _ in pairs], -1).astype(I8)
        w = jnp.concatenate([cw[j] for _, j in pairs], -1).astype(I8)
        return _idot(a, w) > 0

    nan = (ca["nan"].any(-1)[:, None] | cw["nan"].any(-1)[None, :]
           | any_of([("inf", "zero"), ("zero", "inf")]))
    pinf = any_of([("pinf", "pos"), ("ninf", "neg"), ("pos", "pinf"), ("neg", "ninf")])
    ninf = any_of([("pinf", "neg"), ("ninf", "pos"), ("pos", "ninf"), ("neg", "pinf")])
    return nan | (pinf & ninf), pinf, ninf


def _apply_specials(v, fa, fw):
    """v with the IEEE value of sum_k a*b where a row or column holds a NaN / inf."""
    finite = jnp.isfinite(fa).all() & jnp.isfinite(fw).all()
    shape = (fa.shape[0], fw.shape[0])
    no = jnp.zeros(shape, bool)
    nan, pinf, ninf = lax.cond(finite, lambda: (no, no, no), lambda: _flags(fa, fw))
    return jnp.where(nan, jnp.nan, jnp.where(pinf, jnp.inf, jnp.where(ninf, -jnp.inf, v)))


def _dot_odd(x, w, s: int):
    """The sliced dot x [M, K] . w [N, K] rounded to odd in float64, non-finite inputs applied."""
    da, ea = slice_rows(x, s)
    dw, ew = slice_rows(w, s)
    hi, lo = _combine(_products(da, dw), s)
    q = ea[:, None] + ew[None, :] - 2 * (core.DIGIT * s - 1)
    return _apply_specials(_to_f64_odd(hi, lo, q), sm.widen(x), sm.widen(w))


def logits(x, w, s: int):
    """x [M, K] . w [N, K] rounded once to float32, as F (token_logprobs' exact LM head)."""
    return sm.rnd(_dot_odd(x, w, s))


def linear(x, w, bias, s: int, fmt: str):
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in ``fmt`` (core.exact_linear)."""
    v = _dot_odd(x, w, s)
    if bias is not None:  # the dot rounded to float32, one float32 addition, one rounding to fmt
        v = sm.add(sm.rnd(v), sm.widen(bias))
    return sm.narrow(v, fmt)
