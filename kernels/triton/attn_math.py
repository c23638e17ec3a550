"""Strict float32 building blocks for the attention / gated-delta-rule Triton kernels.

Device ports of ``kernels/reference/strict_math.py`` (lsm1 exp/log with ``tl.fma``), correctly
rounded division, output rounding with integer operations (the interpreter's float32 -> bfloat16
cast truncates; ``cvt.rn`` on the GPU rounds to nearest even: the integer form is right on both)
and the canonical NaN of every output dtype. Kernels that use them must be launched with
``enable_fp_fusion=False`` (see :data:`LAUNCH`): with fusion on, ``a * b + c`` may become an fma.

TODO(merge): the ``triton`` branch's ``kernels/triton/strict_math.py`` holds the shared versions;
once it lands this module becomes a thin re-export of it (one place for each idea).
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Launch options of every strict kernel.
LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def pow2(k):
    """2**k as float32 for integer-valued float32 k in [-126, 127] (exact, from the bits)."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """lockstep's float32 exp (lsm1), the same steps as the reference."""
    xc = tl.where(x < -110.0, -110.0, tl.where(x > 100.0, 100.0, x))
    k = tl.floor(tl.fma(xc, 1.4426950408889634, 0.5))
    r = tl.fma(-k, 0.693145751953125, xc)
    r = tl.fma(-k, 1.4286067653e-06, r)
    p = tl.full(r.shape, 1.0 / 5040.0, tl.float32)
    p = tl.fma(p, r, 1.0 / 720.0)
    p = tl.fma(p, r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    k1 = tl.floor(k * 0.5)
    y = (p * pow2(k1)) * pow2(k - k1)
    return tl.where(x != x, x, y)


@triton.jit
def log(x):
    """lockstep's float32 natural log (lsm1), the same steps as the reference."""
    tiny = x < 1.1754943508222875e-38
    xs = tl.where(tiny, x * 8388608.0, x)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 23, 0)
    mbits = (bits & 0x7FFFFF) | 0x3F800000
    big = mbits > 0x3FB504F3
    mbits = tl.where(big, mbits - 0x00800000, mbits)
    e = e + big.to(tl.int32)
    m = mbits.to(tl.float32, bitcast=True)
    f = m - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    r = tl.full(z.shape, 2.0 / 9.0, tl.float32)
    r = tl.fma(r, z, 2.0 / 7.0)
    r = tl.fma(r, z, 2.0 / 5.0)
    r = tl.fma(r, z, 2.0 / 3.0)
    r = r * z
    lp = tl.fma(-s, f - r, f)
    ef = e.to(tl.float32)
    y = tl.fma(ef, 0.693145751953125, tl.fma(ef, 1.4286067653e-06, lp))
    y = tl.where(x == 0, float("-inf"), y)
    y = tl.where(x < 0, float("nan"), y)
    y = tl.where(x == float("inf"), float("inf"), y)
    return tl.where(x != x, x, y)


@triton.jit
def canon_f32(x):
    """x with every NaN replaced by the canonical float32 NaN 0x7FC00000."""
    return tl.where(x != x, (tl.full(x.shape, 0x7FC00000, tl.int32)).to(tl.float32, bitcast=True), x)


@triton.jit
def bf16_bits(x):
    """float32 -> bfloat16 bit pattern (int32 in [0, 0xFFFF]), nearest-even; NaN -> 0x7FC0."""
    b = x.to(tl.int32, bitcast=True)
    lsb = (b >> 16) & 1
    r = ((b + 0x7FFF + lsb) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, r)


@triton.jit
def round_to(x, OUT: tl.constexpr):
    """float32 x rounded once to OUT (0 float32, 1 bfloat16, 2 float16), as that dtype, canonical NaN."""
    if OUT == 1:
        return bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif OUT == 2:
        h = x.to(tl.float16)  # cvt.rn / numpy: correctly rounded, no flush to zero
        return tl.where(x != x, tl.full(x.shape, 0x7E00, tl.int16).to(tl.float16, bitcast=True), h)
    else:
        return canon_f32(x)


@triton.jit
def round_trip(x, OUT: tl.constexpr):
    """x rounded to OUT and widened back to float32 (exact widening)."""
    if OUT == 1:
        return (bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif OUT == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def out_code(dtype) -> int:
    import torch
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
