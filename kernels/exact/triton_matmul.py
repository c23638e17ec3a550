"""The exact matmul policy as Triton kernels: slicing, int8 ``tl.dot`` -> int32 products, an integer epilogue.

Self-contained (imports triton; never imported by ``import hal``); the triton backend serves the exact
specs through :func:`linear` / :func:`matmul` (backends/triton.py), the benchmark calls
:func:`exact_linear_triton` directly. The bits are ``hal.kernels.exact.core``'s (the same integer recipe,
step by step). The fast path is two launches, neither of which reads a value on the host, so a call can be
replayed in a CUDA graph:

* ``_slice_kernel``: a block of rows per program: the row exponent E (a maximum), the s int8 digit planes and
  the row's non-finite flag, written on the device (core.slice_rows turns it into a Python bool, a host sync).
  A row that fits one block (K <= 8192 on a GPU) is read once; a longer one twice (E first, then the digits);
* ``_fused_linear_kernel`` (default, ``FUSED``): per output tile one K loop; each step loads the s digit tiles of A
  and of W once and adds the s**2 int8 x int8 ``tl.dot`` products into one int32 accumulator per diagonal t + u
  (2s - 1, ``_piece_limbs``; exact: a piece of K is at most 131,072 // s long, so a diagonal never sums more than
  131,072 products of |.| <= 127**2); longer K runs piece after piece, each piece's diagonals shifted into two int64
  limbs (``core.combine``'s layout, grouped) in registers (never refused). Then the epilogue in the same program
  (``_finish_tile``): the one rounding of S * 2**(Ea + Eb - 2(7s-1)) to the output dtype on the integers
  (``_round_limbs``: the leading bit, the kept bits, guard and sticky; overflow, subnormals), the special values
  of non-finite inputs, the bias, the temperature (token_logprobs' logits) and the canonical NaN. The special
  values are a branch inside the tile: a tile whose rows and columns all hold finite values (per-row /
  per-column flags from the slicer) skips them; any other tile classifies the products of its rows and columns
  over K (NaN, +inf, -inf: core.special_flags' rules) and selects the IEEE value where one applies.

The two-kernel path (``split_k`` > 1, or ``FUSED = False``): ``_diagonal_limbs_kernel`` (``PRODUCTS``; the same
``_piece_limbs``) or ``_limbs_kernel`` (``PRODUCTS = "pairs"``, the first kernel: a K loop per slice pair) writes the
int64 limbs, K pieces and split-K as programs along the grid's third axis adding them with integer
``atomic_add`` (one piece: a plain store) -- exact and associative, so the block sizes, the split count and the
order the atomics land in cannot change a bit; then ``_finish_kernel`` runs ``_finish_tile`` over them. Under
``TRITON_INTERPRET=1`` ``tl.dot`` is a numpy integer matmul, exact as well (and it does not wrap at 2**31: an
int32 overflow shows only on a device, which is why kernels/exact/probe.py runs there).

``WEIGHT_SOURCE`` (opt-in, for decode, where the weight's bytes decide): the fused kernel reads the weight's own
tensor (2 bytes a parameter for bf16 / fp16, 4 for float32) and its channel exponents instead of its s int8 planes
(s bytes a parameter), and cuts each weight tile into the same digits in registers inside the K loop (``_magnitude``
/ ``_digit``: the slicer's own helpers), then the same diagonal sums and epilogue: the same bits.

``glue="torch"`` keeps the earlier path (core's torch slicing and finish around the products kernel, host
syncs included) selectable, for the benchmark's comparison.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.errors import UnsupportedError
from hal.kernels.triton import strict_math as sm
from hal.kernels.triton.dtypes import tl_dtype

from . import core
from .prepared import unpack

NO_EXP = tl.constexpr(core._NO_EXP)


@triton.jit
def _fields(bits):
    """float32 bits -> (finite, integer mantissa m, scale exponent q with |x| = m * 2**q, floor(log2|x|) or
    NO_EXP for 0 and non-finite values): core._fields. The leading bit of a subnormal's m from the exponent
    field of float32(m), exact for m < 2**24."""
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    finite = field != 0xFF
    normal = (field != 0) & finite
    m = tl.where(normal, frac | 0x800000, tl.where(finite, frac, 0))
    q = tl.where(normal, field, 1) - 150
    lead = ((m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(m != 0, q + lead, NO_EXP)
    return finite, m, q, e


@triton.jit
def _magnitude(bits, ex, S: tl.constexpr, DIGIT: tl.constexpr):
    """float32 bits -> (|T| int64, T < 0): |T| = m * 2**(q + 7s - 1 - E) truncated, E = ex (int64, broadcast against
    bits: a row's or a weight column's exponent); a non-finite value is 0. The one home of the slicing arithmetic
    (core.slice_rows'), shared by the slicer (_store_digits) and the fused kernel slicing the weight (W_SOURCE)."""
    finite, m, q, e = _fields(bits)
    d = q.to(tl.int64) + (DIGIT * S - 1) - ex
    d = tl.minimum(tl.maximum(d, -40), DIGIT * S)
    m64 = m.to(tl.int64)
    mag = tl.where(d >= 0, m64 << tl.maximum(d, 0), m64 >> tl.maximum(-d, 0))
    return mag, (bits < 0) & (mag != 0)


@triton.jit
def _digit(mag, neg, t: tl.constexpr, S: tl.constexpr, DIGIT: tl.constexpr):
    """Digit t (most significant first) of |T|, with T's sign: int8 in [-127, 127]."""
    dg = (mag >> (DIGIT * (S - 1 - t))) & 127
    return tl.where(neg, -dg, dg).to(tl.int8)


@triton.jit
def _store_digits(bits, ok, ex, d_rows, ks, sd_s, S: tl.constexpr, DIGIT: tl.constexpr):
    """The S signed digits of rows of values (E = ex, per row), stored."""
    mag, neg = _magnitude(bits, ex[:, None], S, DIGIT)
    for t in tl.static_range(S):
        tl.store(d_rows + t * sd_s + ks[None, :], _digit(mag, neg, t, S, DIGIT), mask=ok)


@triton.jit
def _slice_kernel(x_ptr, d_ptr, e_ptr, bad_ptr, R, K, sx_r, sx_k, sd_s, sd_r,
                  S: tl.constexpr, DIGIT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                  ONE_BLOCK: tl.constexpr, DIGITS: tl.constexpr):
    """Rows of x [R, K] -> digits [S, R, K] int8, exponents E [R] int64, non-finite flags [R] int8 (not DIGITS: the
    exponents and flags only, for the fused kernel that slices the weight itself, W_SOURCE).
    ONE_BLOCK (K <= BK): a row is one block, read once (the exponent and the digits from the same registers);
    else two passes over K (the exponent, a maximum; then the digits)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < R
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sx_r
    d_rows = d_ptr + rows.to(tl.int64)[:, None] * sd_r
    big = tl.full([BR, BK], NO_EXP, tl.int32)
    bad = tl.zeros([BR, BK], dtype=tl.int32)
    if ONE_BLOCK:
        ks = tl.arange(0, BK)
        ok = row_ok[:, None] & (ks < K)[None, :]
        bits = sm.widen(tl.load(x_rows + ks[None, :] * sx_k, mask=ok, other=0.0)).to(tl.int32, bitcast=True)
        finite, m, q, e = _fields(bits)
        big = tl.where(ok, e, NO_EXP)
        bad = (ok & ~finite).to(tl.int32)
        big_r = tl.max(big, axis=1)
        ex = tl.where(big_r == NO_EXP, 0, big_r).to(tl.int64)
        if DIGITS:
            _store_digits(bits, ok, ex, d_rows, ks, sd_s, S, DIGIT)
    else:
        for k0 in range(0, K, BK):  # pass 1: E = the maximum exponent (order-free), the non-finite flag
            ks = k0 + tl.arange(0, BK)
            ok = row_ok[:, None] & (ks < K)[None, :]
            bits = sm.widen(tl.load(x_rows + ks[None, :] * sx_k, mask=ok, other=0.0)).to(tl.int32, bitcast=True)
            finite, m, q, e = _fields(bits)
            big = tl.maximum(big, tl.where(ok, e, NO_EXP))
            bad = tl.maximum(bad, (ok & ~finite).to(tl.int32))
        big_r = tl.max(big, axis=1)
        ex = tl.where(big_r == NO_EXP, 0, big_r).to(tl.int64)
        if DIGITS:
            for k0 in range(0, K, BK):  # pass 2: the digits
                ks = k0 + tl.arange(0, BK)
                ok = row_ok[:, None] & (ks < K)[None, :]
                bits = sm.widen(tl.load(x_rows + ks[None, :] * sx_k, mask=ok, other=0.0)).to(tl.int32, bitcast=True)
                _store_digits(bits, ok, ex, d_rows, ks, sd_s, S, DIGIT)
    tl.store(e_ptr + rows, ex, mask=row_ok)
    tl.store(bad_ptr + rows, tl.max(bad, axis=1).to(tl.int8), mask=row_ok)


@triton.jit
def _limbs_kernel(a_ptr, w_ptr, hi_ptr, lo_ptr, M, N, K, k_per_split,
                  sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                  S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    hi = tl.zeros((BM, BN), dtype=tl.int64)
    lo = tl.zeros((BM, BN), dtype=tl.int64)
    for t in tl.static_range(S):
        for u in tl.static_range(S):
            acc = tl.zeros((BM, BN), dtype=tl.int32)
            for k0 in range(k_lo, k_hi, BK):
                rk = k0 + tl.arange(0, BK)
                km = rk < k_hi
                a = tl.load(a_ptr + t * sa_s + rm[:, None] * sa_m + rk[None, :] * sa_k,
                            mask=(rm[:, None] < M) & km[None, :], other=0)
                w = tl.load(w_ptr + u * sw_s + rk[:, None] * sw_k + rn[None, :] * sw_n,
                            mask=km[:, None] & (rn[None, :] < N), other=0)
                acc = tl.dot(a, w, acc, out_dtype=tl.int32)  # int8 x int8 -> int32 (Triton < 3.9 defaults to fp32)
            shift = DIGIT * (2 * S - 2 - t - u)
            if shift >= LIMB:
                hi += acc.to(tl.int64) * (1 << (shift - LIMB))
            else:
                lo += acc.to(tl.int64) * (1 << shift)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    if ATOMIC:  # several programs share this tile (split-K): integer adds, exact in any order
        tl.atomic_add(hi_ptr + offs, hi, mask=mask)
        tl.atomic_add(lo_ptr + offs, lo, mask=mask)
    else:
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)


@triton.jit
def _plane(ptr, t: tl.constexpr, s_plane, offs, mask):
    return tl.load(ptr + t * s_plane + offs, mask=mask, other=0)


@triton.jit
def _weight_digit(w_ptr, u: tl.constexpr, sw_s, w_offs, w_mask, w_mag, w_neg,
                  S: tl.constexpr, DIGIT: tl.constexpr, W_SOURCE: tl.constexpr):
    """Digit tile u of the weight [BK, BN]: its prepared plane, or (W_SOURCE) cut in registers from the magnitudes of
    the tile's own values (_magnitude, loaded once a K step)."""
    if W_SOURCE:
        w = _digit(w_mag, w_neg, u, S, DIGIT)
    else:
        w = _plane(w_ptr, u, sw_s, w_offs, w_mask)
    return w


@triton.jit
def _piece_limbs(a_ptr, w_ptr, rm, rn, M, N, k_lo, k_hi, sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                 S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, eb, W_SOURCE: tl.constexpr):
    """The limbs (hi, lo) of K range [k_lo, k_hi) of a [BM, BN] tile in one pass: each K step loads the S digit
    tiles of A and of W once and adds the S**2 int8 products into one int32 accumulator per diagonal d = t + u
    (2S - 1 of them: G_d = sum_{t+u=d} A_t W_u^T). A diagonal sums up to S products a term, so the range is at most
    INT32_SAFE_K // S long (the launchers' pieces): every G_d is exact in int32. Then core.combine's limbs,
    grouped: S = sum_d G_d * 2**(7(2S - 2 - d)), the same integers.
    W_SOURCE: w_ptr is the weight's own tensor [N, K] (strides sw_n, sw_k; sw_s unused), eb its channel exponents
    [BN] (int64); each K step loads the weight tile once and cuts it into the S digits the slicer would have stored."""
    g0 = tl.zeros((BM, BN), dtype=tl.int32)
    g1 = tl.zeros((BM, BN), dtype=tl.int32)
    g2 = tl.zeros((BM, BN), dtype=tl.int32)
    g3 = tl.zeros((BM, BN), dtype=tl.int32)
    g4 = tl.zeros((BM, BN), dtype=tl.int32)
    g5 = tl.zeros((BM, BN), dtype=tl.int32)
    g6 = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < k_hi
        a_offs = rm.to(tl.int64)[:, None] * sa_m + rk[None, :] * sa_k
        a_mask = (rm[:, None] < M) & km[None, :]
        w_offs = rk[:, None] * sw_k + rn.to(tl.int64)[None, :] * sw_n
        w_mask = km[:, None] & (rn[None, :] < N)
        if W_SOURCE:  # masked values load as 0.0: digits 0, as the planes' masked loads
            w_bits = sm.widen(tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)).to(tl.int32, bitcast=True)
            w_mag, w_neg = _magnitude(w_bits, eb[None, :], S, DIGIT)
        else:
            w_mag, w_neg = 0, 0  # unused: the digits come from the planes
        a0 = _plane(a_ptr, 0, sa_s, a_offs, a_mask)
        w0 = _weight_digit(w_ptr, 0, sw_s, w_offs, w_mask, w_mag, w_neg, S, DIGIT, W_SOURCE)
        g0 = tl.dot(a0, w0, g0, out_dtype=tl.int32)
        if S > 1:
            a1 = _plane(a_ptr, 1, sa_s, a_offs, a_mask)
            w1 = _weight_digit(w_ptr, 1, sw_s, w_offs, w_mask, w_mag, w_neg, S, DIGIT, W_SOURCE)
            g1 = tl.dot(a0, w1, g1, out_dtype=tl.int32)
            g1 = tl.dot(a1, w0, g1, out_dtype=tl.int32)
            g2 = tl.dot(a1, w1, g2, out_dtype=tl.int32)
        if S > 2:
            a2 = _plane(a_ptr, 2, sa_s, a_offs, a_mask)
            w2 = _weight_digit(w_ptr, 2, sw_s, w_offs, w_mask, w_mag, w_neg, S, DIGIT, W_SOURCE)
            g2 = tl.dot(a0, w2, g2, out_dtype=tl.int32)
            g2 = tl.dot(a2, w0, g2, out_dtype=tl.int32)
            g3 = tl.dot(a1, w2, g3, out_dtype=tl.int32)
            g3 = tl.dot(a2, w1, g3, out_dtype=tl.int32)
            g4 = tl.dot(a2, w2, g4, out_dtype=tl.int32)
        if S > 3:
            a3 = _plane(a_ptr, 3, sa_s, a_offs, a_mask)
            w3 = _weight_digit(w_ptr, 3, sw_s, w_offs, w_mask, w_mag, w_neg, S, DIGIT, W_SOURCE)
            g3 = tl.dot(a0, w3, g3, out_dtype=tl.int32)
            g3 = tl.dot(a3, w0, g3, out_dtype=tl.int32)
            g4 = tl.dot(a1, w3, g4, out_dtype=tl.int32)
            g4 = tl.dot(a3, w1, g4, out_dtype=tl.int32)
            g5 = tl.dot(a2, w3, g5, out_dtype=tl.int32)
            g5 = tl.dot(a3, w2, g5, out_dtype=tl.int32)
            g6 = tl.dot(a3, w3, g6, out_dtype=tl.int32)
    hi = tl.zeros((BM, BN), dtype=tl.int64)
    lo = tl.zeros((BM, BN), dtype=tl.int64)
    hi, lo = _add_diagonal(hi, lo, g0, 0, S, DIGIT, LIMB)
    if S > 1:
        hi, lo = _add_diagonal(hi, lo, g1, 1, S, DIGIT, LIMB)
        hi, lo = _add_diagonal(hi, lo, g2, 2, S, DIGIT, LIMB)
    if S > 2:
        hi, lo = _add_diagonal(hi, lo, g3, 3, S, DIGIT, LIMB)
        hi, lo = _add_diagonal(hi, lo, g4, 4, S, DIGIT, LIMB)
    if S > 3:
        hi, lo = _add_diagonal(hi, lo, g5, 5, S, DIGIT, LIMB)
        hi, lo = _add_diagonal(hi, lo, g6, 6, S, DIGIT, LIMB)
    return hi, lo


@triton.jit
def _diagonal_limbs_kernel(a_ptr, w_ptr, hi_ptr, lo_ptr, M, N, K, k_per_split,
                           sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                           S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    """_limbs_kernel's limbs in one K pass (_piece_limbs) per program: a program's K range is one piece (at most
    INT32_SAFE_K // S, launcher); the two-kernel path (split-K) under _finish_kernel."""
    pid_k = tl.program_id(2)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    hi, lo = _piece_limbs(a_ptr, w_ptr, rm, rn, M, N, k_lo, k_hi, sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                          S, DIGIT, LIMB, BM, BN, BK, 0, False)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if ATOMIC:  # several programs share this tile (K pieces / split-K): integer adds, exact in any order
        tl.atomic_add(hi_ptr + offs, hi, mask=mask)
        tl.atomic_add(lo_ptr + offs, lo, mask=mask)
    else:
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)


@triton.jit
def _add_diagonal(hi, lo, g, d: tl.constexpr, S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr):
    """(hi, lo) + G_d * 2**(7(2S - 2 - d)) in core.combine's limb layout."""
    shift: tl.constexpr = DIGIT * (2 * S - 2 - d)
    if shift >= LIMB:
        hi += g.to(tl.int64) * (1 << (shift - LIMB))
    else:
        lo += g.to(tl.int64) * (1 << shift)
    return hi, lo


@triton.jit
def _classes(bits):
    """float32 bits -> (NaN, +inf, -inf, zero, > 0, < 0): the sign tests include the infinities and exclude
    NaN and zeros (core.special_flags' classes, read on the bits: no float compare a flush could change)."""
    a = bits & 0x7FFFFFFF
    nan = a > 0x7F800000
    inf = a == 0x7F800000
    zero = a == 0
    value = ~nan & ~zero
    return nan, inf & (bits > 0), inf & (bits < 0), zero, value & (bits > 0), value & (bits < 0)


@triton.jit
def _special_codes(x_ptr, w_ptr, rm, rn, M, N, K, sx_m, sx_k, sw_n, sw_k,
                   BM: tl.constexpr, BN: tl.constexpr, BKS: tl.constexpr):
    """[BM, BN] int32: 1 where sum_k x[m,k] * w[n,k] is NaN (a NaN product -- NaN input, inf * 0 -- or +inf
    meets -inf), 2 where it is +inf, 3 where -inf, 0 where the finite value stands (core.apply_specials)."""
    nan = tl.zeros([BM, BN], dtype=tl.int32)
    pinf = tl.zeros([BM, BN], dtype=tl.int32)
    ninf = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BKS):
        ks = k0 + tl.arange(0, BKS)
        xa = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sx_m + ks[None, :] * sx_k,
                     mask=(rm < M)[:, None] & (ks < K)[None, :], other=0.0)
        wa = tl.load(w_ptr + rn.to(tl.int64)[:, None] * sw_n + ks[None, :] * sw_k,
                     mask=(rn < N)[:, None] & (ks < K)[None, :], other=0.0)
        an, ap, am, az, apos, aneg = _classes(sm.widen(xa).to(tl.int32, bitcast=True)[:, None, :])
        wn, wp, wm, wz, wpos, wneg = _classes(sm.widen(wa).to(tl.int32, bitcast=True)[None, :, :])
        n3 = an | wn | ((ap | am) & wz) | (az & (wp | wm))
        p3 = (ap & wpos) | (am & wneg) | (apos & wp) | (aneg & wm)
        m3 = (ap & wneg) | (am & wpos) | (apos & wm) | (aneg & wp)
        nan = tl.maximum(nan, tl.max(n3.to(tl.int32), axis=2))
        pinf = tl.maximum(pinf, tl.max(p3.to(tl.int32), axis=2))
        ninf = tl.maximum(ninf, tl.max(m3.to(tl.int32), axis=2))
    nan = nan | (pinf & ninf)
    return tl.where(nan > 0, 1, tl.where(pinf > 0, 2, tl.where(ninf > 0, 3, 0)))


@triton.jit
def _floor_log2(v):
    """floor(log2 v) for int64 0 < v < 2**63 (0 for v = 0), by six halving steps (shifts 32, 16, ..., 1): where
    v >> shift is nonzero, floor(log2 v) has that bit, and v moves down by it. Integers only."""
    lg = tl.zeros_like(v)
    for step in tl.static_range(6):
        t = v >> (32 >> step)
        lg += tl.where(t > 0, 32 >> step, 0)
        v = tl.where(t > 0, t, v)
    return lg


@triton.jit
def _round_limbs(hi, lo, q, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, LIMB: tl.constexpr):
    """The integer epilogue: S * 2**q (S = hi * 2**LIMB + lo, int64 limbs as _piece_limbs leaves them, q int64) rounded
    once, to nearest even, to a float of P significant bits and exponents EMIN..EMAX (float32 24 / -126 / 127,
    bfloat16 8 / -126 / 127, float16 11 / -14 / 15): overflow to +-inf, gradual underflow, an exact zero +0.0.
    Returned as the float32 that holds it exactly. core.to_f64_odd + core.round_from_f64_odd's value (round to odd,
    then to nearest: one correct rounding), computed on the integers: the leading bit of |S|, the bits kept,
    the guard bit and the sticky bits below it."""
    carry = lo >> LIMB  # an arithmetic shift is the floor: S = h * 2**LIMB + r, 0 <= r < 2**LIMB
    r = lo - (carry << LIMB)
    h = hi + carry
    neg = h < 0
    borrow = neg & (r != 0)  # |S| = hm * 2**LIMB + rm, 0 <= rm < 2**LIMB
    hm = tl.where(neg, -h - borrow.to(tl.int64), h)
    rm = tl.where(borrow, (1 << LIMB) - r, r)
    top = tl.where(hm != 0, _floor_log2(hm) + LIMB, _floor_log2(rm))  # 2**top <= |S| < 2**(top + 1)
    e = top + q  # the exponent of the exact value
    ux = tl.maximum(e, EMIN) - (P - 1)  # the exponent of the result's last bit (subnormals: EMIN's)
    k = ux - q - 1  # t = floor(|S| / 2**k): the kept bits and the guard bit, |S| mod 2**k the sticky ones
    a = tl.minimum(tl.maximum(k - LIMB, 0), 62)  # k >= LIMB: t from hm alone (hm < 2**53: a = 62 leaves 0)
    t_hi = hm >> a
    st_hi = ((hm & ((1 << a) - 1)) != 0) | (rm != 0)
    b = tl.minimum(tl.maximum(k, 0), LIMB - 1)  # 0 <= k < LIMB: t < 2**(P + 1), no overflow
    t_mid = (hm << (LIMB - b)) + (rm >> b)
    st_mid = (rm & ((1 << b) - 1)) != 0
    t_lo = rm << tl.minimum(tl.maximum(-k, 0), 62)  # k < 0: |S| < 2**P, exact (then hm = 0)
    t = tl.where(k >= LIMB, t_hi, tl.where(k >= 0, t_mid, t_lo))
    sticky = tl.where(k >= LIMB, st_hi, (k >= 0) & st_mid)
    mant = t >> 1
    mant += ((t & 1) != 0) & (sticky | ((mant & 1) != 0))  # to nearest, ties to even; 2**P after a carry
    over = ((e > EMAX) | ((e == EMAX) & (mant >> P != 0))) & ((hm | rm) != 0)  # S = 0 is +0.0 whatever q
    # the float32 bits of mant * 2**ux (exact: every value of these formats is a float32)
    lm = _floor_log2(mant)
    e32 = ux + lm
    frac = tl.where(lm > 23, mant >> tl.maximum(lm - 23, 0), mant << tl.maximum(23 - lm, 0)) & 0x7FFFFF
    mag = tl.where(e32 >= -126, ((e32 + 127) << 23) | frac, mant << tl.maximum(ux + 149, 0))
    mag = tl.where(over, 0x7F800000, tl.where(mant == 0, 0, mag))
    return (mag | (neg.to(tl.int64) << 31)).to(tl.int32).to(tl.float32, bitcast=True)  # an underflow keeps its sign


@triton.jit
def _finish_tile(hi, lo, rm, rn, ea_ptr, eb_ptr, rbad_ptr, cbad_ptr, x_ptr, w_ptr, b_ptr, out_ptr,
                 M, N, K, sx_m, sx_k, sw_n, sw_k, so_m, temp,
                 S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_TEMP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BKS: tl.constexpr):
    """A tile's limbs -> out (row stride so_m): the one rounding (_round_limbs, to the output dtype, or to float32
    before the bias), the special values of non-finite inputs, the bias, the temperature, the canonical NaN
    (core.finish)."""
    ea = tl.load(ea_ptr + rm, mask=rm < M, other=0)
    eb = tl.load(eb_ptr + rn, mask=rn < N, other=0)
    q = ea[:, None] + eb[None, :] - 2 * (DIGIT * S - 1)  # S's unit is 2**q
    if HAS_BIAS or OUT_DTYPE == tl.float32:
        y = _round_limbs(hi, lo, q, 24, -126, 127, LIMB)
    elif OUT_DTYPE == tl.bfloat16:
        y = _round_limbs(hi, lo, q, 8, -126, 127, LIMB)
    else:
        y = _round_limbs(hi, lo, q, 11, -14, 15, LIMB)
    rbad = tl.load(rbad_ptr + rm, mask=rm < M, other=0)
    cbad = tl.load(cbad_ptr + rn, mask=rn < N, other=0)
    if tl.max(rbad.to(tl.int32), axis=0) + tl.max(cbad.to(tl.int32), axis=0) > 0:  # a non-finite input here
        code = _special_codes(x_ptr, w_ptr, rm, rn, M, N, K, sx_m, sx_k, sw_n, sw_k, BM, BN, BKS)
        y = tl.where(code == 1, float("nan"),
                     tl.where(code == 2, float("inf"), tl.where(code == 3, float("-inf"), y)))
    if HAS_BIAS:  # one float32 addition after the rounded dot
        y = y + sm.widen(tl.load(b_ptr + rn, mask=rn < N, other=0.0))[None, :]
    if HAS_TEMP:
        y = sm.div(y, temp)
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * so_m + rn[None, :], sm.round_out(y, OUT_DTYPE), mask=ok)


@triton.jit
def _finish_kernel(hi_ptr, lo_ptr, ea_ptr, eb_ptr, rbad_ptr, cbad_ptr, x_ptr, w_ptr, b_ptr, out_ptr,
                   M, N, K, sx_m, sx_k, sw_n, sw_k, so_m, temp,
                   S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_TEMP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BKS: tl.constexpr):
    """The two-kernel path's second kernel: limbs (hi, lo) [M, N] from memory -> out [M, N] (_finish_tile)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    hi = tl.load(hi_ptr + offs, mask=ok, other=0)
    lo = tl.load(lo_ptr + offs, mask=ok, other=0)
    _finish_tile(hi, lo, rm, rn, ea_ptr, eb_ptr, rbad_ptr, cbad_ptr, x_ptr, w_ptr, b_ptr, out_ptr,
                 M, N, K, sx_m, sx_k, sw_n, sw_k, so_m, temp, S, DIGIT, LIMB, HAS_BIAS, HAS_TEMP, OUT_DTYPE,
                 BM, BN, BKS)


@triton.jit
def _fused_linear_kernel(a_ptr, w_ptr, ea_ptr, eb_ptr, rbad_ptr, cbad_ptr, x_ptr, src_ptr, b_ptr, out_ptr,
                         M, N, K, piece, sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                         sx_m, sx_k, src_n, src_k, so_m, temp,
                         S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_TEMP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                         ONE_PIECE: tl.constexpr, W_SOURCE: tl.constexpr):
    """The fast exact path, one kernel: an output tile's K in pieces of ``piece`` (<= INT32_SAFE_K // S; one
    piece when ONE_PIECE), each piece's 2S - 1 int32 diagonal sums (_piece_limbs) added as int64 limbs in
    registers, then the integer epilogue (_finish_tile). Digits a [S, M, K] / w [S, N, K]; x [M, K] and the weight
    src [N, K] are read only by a tile whose rows or columns hold a non-finite value (the flags).
    W_SOURCE (WEIGHT_SOURCE): w_ptr is the weight's own tensor (src), sliced tile by tile in the K loop with its
    channel exponents eb: no planes read."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if W_SOURCE:
        eb = tl.load(eb_ptr + rn, mask=rn < N, other=0)
    else:
        eb = 0  # unused
    if ONE_PIECE:
        hi, lo = _piece_limbs(a_ptr, w_ptr, rm, rn, M, N, 0, K, sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                              S, DIGIT, LIMB, BM, BN, BK, eb, W_SOURCE)
    else:
        hi = tl.zeros((BM, BN), dtype=tl.int64)
        lo = tl.zeros((BM, BN), dtype=tl.int64)
        for k_lo in range(0, K, piece):
            p_hi, p_lo = _piece_limbs(a_ptr, w_ptr, rm, rn, M, N, k_lo, tl.minimum(k_lo + piece, K),
                                      sa_s, sa_m, sa_k, sw_s, sw_n, sw_k, S, DIGIT, LIMB, BM, BN, BK, eb, W_SOURCE)
            hi += p_hi
            lo += p_lo
    _finish_tile(hi, lo, rm, rn, ea_ptr, eb_ptr, rbad_ptr, cbad_ptr, x_ptr, src_ptr, b_ptr, out_ptr,
                 M, N, K, sx_m, sx_k, src_n, src_k, so_m, temp, S, DIGIT, LIMB, HAS_BIAS, HAS_TEMP, OUT_DTYPE,
                 BM, BN, BKS)


#: the path exact_linear_triton takes by default: "kernels" (slicing kernel, then the fused kernel or the two-kernel
#: path; no host read) or "torch" (the earlier torch glue around the products kernel; host syncs).
#: benchmarks/gpu_perf.py times both
GLUE = "kernels"

#: the fast path: the products and the integer epilogue in one kernel (_fused_linear_kernel; no limbs in memory),
#: taken whenever split_k is 1. False (or split_k > 1): the two-kernel path, products kernel (PRODUCTS) writing int64
#: limbs, then _finish_kernel. Same bits; benchmarks/gpu_perf.py's exact-path rows time both on a device
FUSED = True

#: the products kernel of the two-kernel path (limbs()): "diagonal" (_diagonal_limbs_kernel: one K pass, 2s - 1 int32
#: accumulators) or "pairs" (_limbs_kernel: a K pass per slice pair, the first kernel). Same integers
PRODUCTS = "diagonal"

#: what the fused kernel reads of the weight: False (default) its s int8 digit planes, prepared once beside the source
#: (s bytes a parameter more); True its own tensor (bf16 / fp16 / float32 as stored: 2 / 2 / 4 bytes a parameter)
#: and its channel exponents, each weight tile cut into its s digits in registers inside the K loop (_magnitude /
#: _digit, the slicer's arithmetic): same digits, same bits, fewer bytes for decode. Only the fused kernel does it:
#: split_k > 1, FUSED = False, PRODUCTS = "pairs" or glue="torch" with it are refused (UnsupportedError). Opt-in until
#: benchmarks/gpu_perf.py's exact/s*/M*/weight-source rows decide on a device
WEIGHT_SOURCE = False

#: the GPU blocks: products tile (BM, BN, BK); the finish's output tile and the K step of its special-value pass (a
#: [BM, BN, BKS] block of classes); the slicer's K block beyond which it reads a row twice (two passes), and its
#: (rows, K step) then; the fused kernel's tile and warps by rows (few rows: a 16-row tile, the int8 dot's minimum;
#: 8 warps from 2048 outputs a tile, whose 2s - 1 int32 accumulators would not fit 4 warps' registers). Speed only:
#: no block changes a bit (not yet tuned on a device)
_PRODUCTS_BLOCK = (32, 32, 32)
_FINISH_BLOCK, _SPECIAL_K = (32, 32), 8
_SLICE_ONE_BLOCK_K, _SLICE_BLOCK = 8192, (4, 256)
_FUSED_BLOCKS = ((16, (16, 64, 128), 4), (64, (32, 64, 64), 8), (None, (64, 64, 64), 8))


def _interpreting() -> bool:
    from hal.kernels.triton.versions import interpreting
    return interpreting()


def _p2(v: int, lo: int, hi: int) -> int:
    """The power of two >= v, clamped to [lo, hi]."""
    return max(lo, min(hi, 1 << max(v - 1, 0).bit_length()))


def _blocks(m: int, n: int, k: int):
    """(products block, finish block, special K step, slicer block (rows, K step), fused block and warps): the
    GPU's, or in the interpreter few large programs (it pays per operation, not per element)."""
    if not _interpreting():
        slicer = ((max(1, 4096 // _p2(k, 16, 8192)), _p2(k, 16, 8192)) if k <= _SLICE_ONE_BLOCK_K else _SLICE_BLOCK)
        fused = next((b, w) for rows, b, w in _FUSED_BLOCKS if rows is None or m <= rows)
        return _PRODUCTS_BLOCK, _FINISH_BLOCK, _SPECIAL_K, slicer, fused
    bm, bn = _p2(m, 16, 64), _p2(n, 16, 256)
    bk_slice = _p2(k, 16, 4096)
    products = (bm, bn, _p2(k, 32, 2048))
    return (products, (bm, bn), _p2(k, 8, max(8, (1 << 18) // (bm * bn))),
            (_p2(m, 1, max(1, (1 << 16) // bk_slice)), bk_slice), (products, 4))


def slice_rows(x: torch.Tensor, s: int, digits: bool = True) -> tuple[core.Sliced, torch.Tensor]:
    """x [R, K] -> (its slices, int8 [R] non-finite flags) on the device, no host sync: core.slice_rows's
    digits and exponents (its ``finite`` field is left True: the flags say it per row). One read of x when a row
    fits one block (K <= 8192 on a GPU), else two. ``digits=False``: the exponents and flags only (``digits`` None;
    the weight of WEIGHT_SOURCE, sliced by the fused kernel itself), one read of x."""
    if x.dtype not in core.DTYPES:
        raise core.InputError(f"the exact policy takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    r, k = x.shape
    exp = torch.empty(r, dtype=torch.int64, device=x.device)
    planes = torch.empty((s, r, k) if digits else (1, 1, 1), dtype=torch.int8, device=x.device)
    bad = torch.empty(r, dtype=torch.int8, device=x.device)
    if r:
        br, bk = _blocks(r, 1, k)[3]
        _slice_kernel[(triton.cdiv(r, br),)](x, planes, exp, bad, r, k, *x.stride(), *planes.stride()[:2],
                                             S=s, DIGIT=core.DIGIT, BR=br, BK=bk, ONE_BLOCK=k <= bk, DIGITS=digits)
    return core.Sliced(planes if digits else None, exp, True), bad


def prepared_slices(w: torch.Tensor, s: int) -> core.Sliced:
    """core.slice_rows's result (its ``finite`` a Python bool: one host read, at preparation) from the kernel."""
    sliced, bad = slice_rows(w, s)
    return sliced._replace(finite=not bool(bad.any()))


def piece_k(s: int, bk: int | None = None, products: str = "diagonal") -> int:
    """The longest K range one int32 accumulator sums exactly: INT32_SAFE_K // s for a diagonal (it adds up to s
    products a term; at s = 4: 32,768, below the true bound 2**31 / (4 x 127**2) = 33,285), INT32_SAFE_K for one
    pair; with ``bk`` a multiple of it (no masked step inside a piece). Longer K is cut into pieces added in int64."""
    bound = core.INT32_SAFE_K // s if products == "diagonal" else core.INT32_SAFE_K
    return bound if bk is None else bound // bk * bk


def limbs(da: torch.Tensor, dw: torch.Tensor, block=None, split_k: int = 1, products: str | None = None,
          **launch):
    """Digits da [s, M, K], dw [s, N, K] (int8) -> limbs (hi, lo) [M, N] int64 (core.combine's); ``block``: the
    products tile (BM, BN, BK), default _blocks'; ``products``: the kernel, default PRODUCTS ("diagonal": one K
    pass, an int32 accumulator per diagonal; "pairs": a K pass per slice pair). Any K: longer K runs as pieces
    (programs along the grid's third axis) whose int32 sums stay exact, added in int64."""
    s, m, k = da.shape
    n = dw.shape[1]
    bm, bn, bk = block or _blocks(m, n, k)[0]
    products = products or PRODUCTS
    per = min(-(-k // split_k), piece_k(s, products=products)) if k else 1  # any split point; int32 sums stay exact
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, per))
    alloc = torch.zeros if grid[2] != 1 else torch.empty  # one split stores every element; K = 0 stores none
    hi = alloc((m, n), dtype=torch.int64, device=da.device)
    lo = alloc((m, n), dtype=torch.int64, device=da.device)
    if 0 in (m, n, k):
        return hi, lo
    kernel = _diagonal_limbs_kernel if products == "diagonal" else _limbs_kernel
    kernel[grid](da, dw, hi, lo, m, n, k, per, *da.stride(), *dw.stride(),
                 S=s, DIGIT=core.DIGIT, LIMB=core.LIMB, BM=bm, BN=bn, BK=bk, ATOMIC=grid[2] > 1, **launch)
    return hi, lo


def weight_slices(weight, spec, digits: bool = True) -> tuple[torch.Tensor, core.Sliced, torch.Tensor]:
    """A weight argument (a tensor, sliced here, or a fresh ``ExactWeight`` of ``spec``) -> (weight [N, K], its
    slices, int8 [N] non-finite flags of its channels). ``digits=False``: a tensor's exponents and flags only
    (WEIGHT_SOURCE: the fused kernel slices it; a prepared weight's planes stay, unread)."""
    w, sw = unpack(weight, spec)
    if sw is None:
        sw, bad = slice_rows(w, spec.slices, digits)
        return w, sw, bad
    if sw.finite:  # read at preparation
        return w, sw, torch.zeros(w.shape[0], dtype=torch.int8, device=w.device)
    return w, sw, (~torch.isfinite(w).all(-1)).to(torch.int8)  # a weight holding NaN / inf: a pass over it


def _weight_source(split_k: int, glue: str = "kernels", weight_source: bool | None = None) -> bool:
    """Whether the call slices the weight inside the fused kernel (``weight_source``, default WEIGHT_SOURCE); refuses a
    call that asks for it where the fused kernel does not run (other bits would need other paths' planes)."""
    on = WEIGHT_SOURCE if weight_source is None else weight_source
    fused = FUSED and split_k == 1 and PRODUCTS == "diagonal" and glue == "kernels"
    if on and not fused:
        raise UnsupportedError(f"WEIGHT_SOURCE (the exact policy's weight sliced inside the fused kernel) runs on the "
                               f"fused kernel only: split_k 1, FUSED, PRODUCTS 'diagonal', glue 'kernels'; got split_k "
                               f"{split_k}, FUSED {FUSED}, PRODUCTS {PRODUCTS!r}, glue {glue!r}")
    return on


def linear_from_slices(x2: torch.Tensor, sa: core.Sliced, xbad: torch.Tensor, w: torch.Tensor, sw: core.Sliced,
                       wbad: torch.Tensor, bias, s: int, out: torch.Tensor, temperature: float = 1.0, block=None,
                       split_k: int = 1, weight_source: bool | None = None, **launch) -> torch.Tensor:
    """out [M, N] (any row stride) = x2 [M, K] . w [N, K] under the exact policy with s slices, given both operands'
    slices and non-finite flags (slice_rows, weight_slices): the fused kernel (FUSED, split_k 1), else the products
    kernel and the finish kernel. ``weight_source`` (default WEIGHT_SOURCE): the fused kernel cuts w itself into
    digits with sw.exp (sw.digits unread; w must be the tensor they were cut from -- a caller handing planes of other
    values, the probe, passes False). Launches only: nothing is read on the host. Returns ``out``."""
    m, n, k = x2.shape[0], w.shape[0], x2.shape[1]
    from_source = _weight_source(split_k, weight_source=weight_source)
    if not from_source and sw.digits is None:
        raise core.InputError("weight slices without digit planes (slice_rows(..., digits=False)) serve only "
                              "WEIGHT_SOURCE, the fused kernel that slices the weight itself")
    if not (m and n):
        return out
    _, (fm, fn), bks, _, (fused_block, fused_warps) = _blocks(m, n, k)
    common = dict(S=s, DIGIT=core.DIGIT, LIMB=core.LIMB, HAS_BIAS=bias is not None, HAS_TEMP=temperature != 1.0,
                  OUT_DTYPE=tl_dtype(out.dtype))
    if FUSED and split_k == 1 and PRODUCTS == "diagonal":
        bm, bn, bk = block or fused_block
        launch = launch if block else {"num_warps": fused_warps, **launch}
        piece = piece_k(s, bk)
        w_digits, w_strides = (w, (0, *w.stride())) if from_source else (sw.digits, sw.digits.stride())
        _fused_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            sa.digits, w_digits, sa.exp, sw.exp, xbad, wbad, x2, w, bias if bias is not None else sa.exp, out,
            m, n, k, piece, *sa.digits.stride(), *w_strides, *x2.stride(), *w.stride(), out.stride(0),
            float(temperature), **common, BM=bm, BN=bn, BK=bk, BKS=bks, ONE_PIECE=k <= piece, W_SOURCE=from_source,
            **launch)
        return out
    hi, lo = limbs(sa.digits, sw.digits, block, split_k, **launch)
    _finish_kernel[(triton.cdiv(m, fm), triton.cdiv(n, fn))](
        hi, lo, sa.exp, sw.exp, xbad, wbad, x2, w, bias if bias is not None else hi, out,
        m, n, k, *x2.stride(), *w.stride(), out.stride(0), float(temperature), **common, BM=fm, BN=fn, BKS=bks)
    return out


def linear_sliced(x2: torch.Tensor, w: torch.Tensor, sw: core.Sliced, wbad: torch.Tensor, bias, s: int,
                  out: torch.Tensor, temperature: float = 1.0, block=None, split_k: int = 1,
                  **launch) -> torch.Tensor:
    """linear_from_slices with x2 sliced here (slice_rows). Returns ``out``."""
    sa, xbad = slice_rows(x2, s)
    return linear_from_slices(x2, sa, xbad, w, sw, wbad, bias, s, out, temperature, block, split_k, **launch)


def exact_linear_triton(x: torch.Tensor, weight, bias: torch.Tensor | None, spec,
                        block=None, split_k: int = 1, out_dtype: torch.dtype | None = None,
                        glue: str | None = None, **launch) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) under an ExactMatmulSpec; the reference's bits.

    ``weight``: a tensor (sliced here) or a prepared ``ExactWeight`` (the kernels read its int8 planes
    through their strides); ``out_dtype``: other than x's (float32 logits); ``block`` / ``launch``: the tile and
    the Triton launch options (num_warps, num_stages) of the fused kernel, or with ``split_k`` > 1 of the products
    kernel. No choice of block, split or launch changes a bit.
    ``glue``: default GLUE; "torch" is the earlier path, core's torch slicing and finish around the products
    kernel (host syncs: not graph-capturable), kept for the benchmark's comparison.
    """
    s = spec.slices
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    core.check_k("x / a", x2.shape[-1])
    out_dtype = out_dtype or x.dtype
    from_source = _weight_source(split_k, glue or GLUE)
    if (glue or GLUE) == "torch":
        w, sw = unpack(weight, spec)
        sa = core.slice_rows(x2, s)
        sw = sw if sw is not None else core.slice_rows(w, s)
        hi, lo = limbs(sa.digits, sw.digits, block, split_k, **launch)
        v = core.to_f64_odd(hi, lo, core.scale_exponent(sa.exp, sw.exp, s))
        flags = None if sa.finite and sw.finite else core.special_flags(x2, w)
        return core.finish(v, flags, bias, out_dtype).reshape(*x.shape[:-1], w.shape[0])
    w, sw, wbad = weight_slices(weight, spec, digits=not from_source)
    out = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    linear_sliced(x2, w, sw, wbad, bias, s, out, 1.0, block, split_k, **launch)
    return out.reshape(*x.shape[:-1], w.shape[0])


def exact_matmul_triton(a: torch.Tensor, b: torch.Tensor, spec, block=None, split_k: int = 1, **kw):
    """a [..., M, K] @ b [K, N] under an ExactMatmulSpec."""
    return exact_linear_triton(a, b.transpose(0, 1), None, spec, block, split_k, **kw)


def linear(x, weight, bias, spec, out_dtype=None):
    """The triton backend's exact linear (kernels/exact/cpu.py's signature)."""
    return exact_linear_triton(x, weight, bias, spec, out_dtype=out_dtype)


def matmul(a, b, spec):
    return exact_matmul_triton(a, b, spec)
