"""Arithmetic of the exact matmul policy, shared by every exact kernel (device-neutral torch ops).

The computation (``ExactMatmulSpec.describe`` says it in words):

1. slice: every row r of A and every output channel n of B (over K) gets the exponent
   E = max floor(log2|x|) over its finite non-zero values (0 for a row without any); each value is
   truncated towards zero to T = trunc(x * 2**(7s - 1 - E)), |T| < 2**(7s), and T is cut into s
   signed 7-bit digits with the sign of x: x' = T * 2**(E - 7s + 1) = sum_t X_t * 2**(E - 6 - 7t),
   X_t in [-127, 127]. Scaling by a power of two and truncating are exact in float64.
2. products: P_tu = A_t @ B_u^T, int8 x int8 summed exactly (int32 suffices for K <= 133,144;
   beyond that the products are summed in int64 pieces). Integer sums: any order, any split.
3. combine: S = sum_tu P_tu * 2**(7(2s - 2 - t - u)) is held exactly as H * 2**28 + R with
   0 <= R < 2**28 (two int64 limbs; s <= 4 and K <= 2**24 keep both in range).
4. round once: the value S * 2**(Ea + Eb - 2(7s - 1)) is rounded to nearest even in the output
   dtype (overflow to inf, subnormal results, no flush to zero), via round-to-odd in float64.
5. non-finite inputs: outputs whose row or column holds a NaN or Inf take the IEEE value of the
   sum of the products (NaN if any product is NaN -- NaN input, inf * 0 -- or +inf and -inf meet;
   else the infinity); the finite values of such a row still slice as above for the other outputs.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from hal.errors import InputError
from hal.kernels.reference.strict_math import canonical_nan

F32, F64, I64 = torch.float32, torch.float64, torch.int64
DIGIT = 7                      # bits per slice (int8 holds [-127, 127])
LIMB = 28                      # S = H * 2**LIMB + R
MAX_K = 2 ** 24                # H stays below 2**53 (exact in float64) and L below 2**63
INT32_SAFE_K = 131072          # K per int32 accumulation: 131072 * 127**2 < 2**31
_NO_EXP = -(2 ** 30)           # exponent of a zero (never the max of a row that has a non-zero)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float32's fields hold each exactly

Products = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pow2_f64(q: torch.Tensor) -> torch.Tensor:
    """2.0**q as float64, built from its bits (exact), for integer q in [-1022, 1023]."""
    return ((q.to(I64) + 1023) << 52).view(F64)


def check_k(name: str, k: int) -> None:
    if k > MAX_K:
        raise InputError(f"{name}: K = {k} exceeds the exact matmul limit 2**24 = {MAX_K} (the range of "
                         "its two-limb accumulator); use a strict matmul spec for longer reductions")


def _fields(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 view of x (exact for every input dtype): (finite mask, integer mantissa m, scale
    exponent q with |x| = m * 2**q, floor(log2|x|) or the sentinel for 0 and non-finite values)."""
    bits = x.to(F32).view(torch.int32)
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    finite = field != 0xFF
    normal = (field != 0) & finite
    m = torch.where(normal, frac | 0x800000, torch.where(finite, frac, 0))
    q = torch.where(normal, field, 1) - 150
    # a subnormal's leading bit: float64 of m is exact and normal, its exponent field says where
    lead = ((m.to(F64).view(I64) >> 52) & 0x7FF) - 1023
    e = torch.where(m != 0, q + lead.to(torch.int32), _NO_EXP)
    return finite, m, q, e


def row_exponents(x: torch.Tensor, keep_empty: bool = False) -> torch.Tensor:
    """E per row of x [R, K] (finite values only; 0 for a row without a finite non-zero): int64 [R].

    ``keep_empty`` leaves the sentinel -2**30 on rows without one (so a maximum over K shards
    ignores them; :func:`settle_exponents` then maps it to 0).
    """
    e = _fields(x)[3].to(I64)
    big = e.amax(-1) if x.shape[-1] else torch.full(x.shape[:-1], _NO_EXP, dtype=I64, device=x.device)
    return big if keep_empty else settle_exponents(big)


def settle_exponents(e: torch.Tensor) -> torch.Tensor:
    return torch.where(e == _NO_EXP, 0, e)


class Sliced(NamedTuple):
    """A matrix cut into slices: computed once per weight, reused by every call."""
    digits: torch.Tensor   # int8 [s, R, K]
    exp: torch.Tensor      # int64 [R], the row exponents E
    finite: bool           # no NaN / Inf among the values (the special-value pass can be skipped)

    def rows(self, r0: int, r1: int) -> "Sliced":
        """Rows r0:r1 (views; ``finite`` stays the whole matrix's, a safe answer: the special-value
        pass then checks the rows' values themselves)."""
        return Sliced(self.digits[:, r0:r1], self.exp[r0:r1], self.finite)


def slice_rows(x: torch.Tensor, s: int, e: torch.Tensor | None = None) -> Sliced:
    """x [R, K] float -> its slices; non-finite values slice as 0.

    ``e`` overrides the row exponents (tensor parallelism: the maximum over every rank's shard).
    |T| = trunc(|x| * 2**(7s - 1 - E)) = m * 2**(q + 7s - 1 - E): a shift of the integer mantissa
    (left by at most 7s - 24, or right, truncating), all in integers.
    """
    if x.dtype not in DTYPES:
        raise InputError(f"the exact policy takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    finite, m, q, ex = _fields(x)
    if e is None:
        big = ex.to(I64).amax(-1) if x.shape[-1] else torch.full(x.shape[:-1], _NO_EXP, dtype=I64, device=x.device)
        e = settle_exponents(big)
    d = (q.to(I64) + (DIGIT * s - 1) - e.unsqueeze(-1)).clamp(-40, DIGIT * s)
    m64 = m.to(I64)
    mag = torch.where(d >= 0, m64 << d.clamp_min(0), m64 >> (-d).clamp_min(0))
    neg = (x.to(F32).view(torch.int32) < 0) & (mag != 0)
    digits = []
    for i in range(s):
        dg = (mag >> (DIGIT * (s - 1 - i))) & 127
        digits.append(torch.where(neg, -dg, dg).to(torch.int8))
    return Sliced(torch.stack(digits), e, bool(finite.all()))


def diagonal_sums(p: torch.Tensor) -> torch.Tensor:
    """Slice products p [s, s, M, N] -> their diagonal sums q [2s - 1, M, N], q_d = sum over t + u = d of P_tu
    (exact: int64, |q_d| < s * 127**2 * 2**24)."""
    s = p.shape[0]
    return torch.stack([sum(p[t, d - t] for t in range(max(0, d - s + 1), min(d, s - 1) + 1))
                        for d in range(2 * s - 1)])


def combine(p: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice products p [s, s, M, N] (int64), or their diagonal sums [2s - 1, M, N] (:func:`diagonal_sums`: a
    product's weight depends on t + u only) -> limbs (hi, lo), S = hi * 2**28 + lo, not normalised.

    Limbs of partial sums (K shards) add exactly: sum the limbs, then :func:`to_f64_odd`.
    """
    if p.dim() == 3:
        terms = [(d, p[d]) for d in range(2 * s - 1)]
    else:  # the pairs one by one (summing them into diagonals first would cost a pass more)
        terms = [(t + u, p[t, u]) for t in range(s) for u in range(s)]
    hi = torch.zeros(p.shape[-2:], dtype=I64, device=p.device)
    lo = torch.zeros_like(hi)
    for d, term in terms:
        shift = DIGIT * (2 * s - 2 - d)
        if shift >= LIMB:
            hi = hi + term * (1 << (shift - LIMB))
        else:
            lo = lo + term * (1 << shift)
    return hi, lo


def to_f64_odd(hi: torch.Tensor, lo: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(hi * 2**28 + lo) * 2**q rounded to odd in float64 (exact scaling: no float64 over/underflow)."""
    carry = torch.div(lo, 1 << LIMB, rounding_mode="floor")  # lo = carry * 2**28 + r, 0 <= r < 2**28
    return _round_odd_f64(hi + carry, lo - carry * (1 << LIMB)) * pow2_f64(q)


def scale_exponent(ea: torch.Tensor, ew: torch.Tensor, s: int) -> torch.Tensor:
    """q [M, N]: the value of S's unit, 2**(Ea + Eb - 2(7s - 1))."""
    return ea.unsqueeze(-1) + ew.unsqueeze(0) - 2 * (DIGIT * s - 1)


def _round_odd_f64(hi: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """hi * 2**28 + r (|hi| < 2**53, 0 <= r < 2**28) rounded to odd in float64.

    The float64 sum rounds once; TwoSum gives its exact error; an inexact result with an even last
    bit moves one ulp towards the exact value. Rounding a round-to-odd value with >= 2 extra bits to
    nearest even is the correct rounding of the exact value (Boldo & Melquiond), for any target
    precision, subnormal targets included.
    """
    a, b = hi.to(F64) * float(1 << LIMB), r.to(F64)
    s = a + b
    bv = s - a
    err = (a - (s - bv)) + (b - bv)
    bits = s.view(I64)
    to_odd = (err != 0) & ((bits & 1) == 0)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    return torch.where(to_odd, bits + step, bits).view(F64)


def _round_odd_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded to odd (truncate towards zero; an inexact result gets its last bit set)."""
    t = x.to(F32)
    back = t.to(F64)
    bits = t.view(torch.int32) - (back.abs() > x.abs()).to(torch.int32)  # one step towards zero
    return torch.where(back == x, bits, bits | 1).view(F32)


def round_from_f64_odd(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A round-to-odd float64 value -> dtype, round to nearest even, one rounding of the exact value."""
    if dtype == F32:
        return v.to(F32)
    return _round_odd_f32(v).to(dtype)  # float32 keeps >= 2 extra bits over bf16 / fp16


def special_flags(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Where sum_k a[m,k] * w[n,k] meets a NaN product, a +inf product, a -inf product: bool [M, N] x 3.

    None when every input is finite. Counts of 0/1 indicators are exact float32 sums (K <= 2**24)
    in any order, so a BLAS matmul of indicators is order-free here. Flags of K shards combine by OR.
    """
    if bool(torch.isfinite(a).all()) and bool(torch.isfinite(w).all()):
        return None

    def cls(x):
        inf = torch.isinf(x)
        return {"nan": torch.isnan(x), "zero": x == 0, "pinf": inf & (x > 0), "ninf": inf & (x < 0),
                "pos": x > 0, "neg": x < 0}   # pos/neg include the infinities, exclude NaN

    ca, cw = cls(a), cls(w)

    def any_of(pairs):
        tot = 0
        for ka, kw in pairs:
            tot = tot + ca[ka].to(F32) @ cw[kw].to(F32).T
        return tot > 0

    nan = (ca["nan"].any(-1, keepdim=True) | cw["nan"].any(-1).unsqueeze(0)
           | any_of([("pinf", "zero"), ("ninf", "zero"), ("zero", "pinf"), ("zero", "ninf")]))
    pinf = any_of([("pinf", "pos"), ("ninf", "neg"), ("pos", "pinf"), ("neg", "ninf")])
    ninf = any_of([("pinf", "neg"), ("ninf", "pos"), ("pos", "ninf"), ("neg", "pinf")])
    return nan, pinf, ninf


def apply_specials(out: torch.Tensor, flags) -> torch.Tensor:
    """IEEE sum of the products: NaN if a product is NaN or +inf meets -inf, else the infinity."""
    if flags is None:
        return out
    nan, pinf, ninf = flags
    nan = nan | (pinf & ninf)
    return torch.where(nan, float("nan"), torch.where(pinf, float("inf"), torch.where(ninf, float("-inf"), out)))


def dot_f64_odd(x: torch.Tensor, w: torch.Tensor, s: int, products: Products,
                w_sliced: Sliced | None = None, slicer=None) -> tuple[torch.Tensor, bool]:
    """The sliced dot x [M, K] . w [N, K] over K rounded to odd in float64 (finite part only), and
    whether every input was finite. ``w_sliced``: ``slice_rows(w, s)`` computed once per weight;
    ``slicer``: a compiled :func:`slice_rows` with the same bits (default: this one)."""
    check_k("x / a", x.shape[-1])
    slicer = slicer or slice_rows
    sa = slicer(x, s)
    sw = w_sliced if w_sliced is not None else slicer(w, s)
    hi, lo = combine(products(sa.digits, sw.digits), s)
    return to_f64_odd(hi, lo, scale_exponent(sa.exp, sw.exp, s)), sa.finite and sw.finite


def finish(v: torch.Tensor, flags, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Round the round-to-odd float64 dot once, apply NaN/Inf inputs (``special_flags``), the bias,
    canonical NaN."""
    out = apply_specials(round_from_f64_odd(v, out_dtype if bias is None else F32), flags)
    if bias is not None:  # one float32 addition after the rounded dot, then one rounding to the output dtype
        out = (out + bias.to(F32)).to(out_dtype)
    return canonical_nan(out)


def exact_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, s: int,
                 products: Products, w_sliced: Sliced | None = None,
                 out_dtype: torch.dtype | None = None, slicer=None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) under the exact policy with s slices -> [M, N] in x.dtype
    (``out_dtype``: another output dtype, e.g. float32 logits of bf16 inputs in token_logprobs).

    ``products(a_digits [s, M, K], w_digits [s, N, K])`` returns the exact int64 slice products
    [s, s, M, N] or their diagonal sums [2s - 1, M, N] (:func:`combine` takes either); it is the only part a
    backend replaces.
    """
    v, finite = dot_f64_odd(x, w, s, products, w_sliced, slicer)
    return finish(v, None if finite else special_flags(x, w), bias, out_dtype or x.dtype)
