"""Compare hal.kernels.triton.strict_math with the reference bit for bit (run under TRITON_INTERPRET=1).

Run by tests/test_triton_strict_math.py in a subprocess (Triton decides interpreter vs compiler when
a kernel module is imported, so each mode gets its own process). Usage:
    TRITON_INTERPRET=1 python tests/scripts/triton_math_check.py [--npu] [--variant log_fused|tl_exp|div_seed]

--npu runs the Ascend variants (NPU=True: div/sqrt from the fma/int64 substitutes, fp16 rounding
without tensor shifts, log through the substituted division) against the same reference bits.
Prints one line per function and exits 1 on any differing bit pattern.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hal.kernels.reference import strict_math as ref  # noqa: E402
from hal.kernels.triton import strict_math as sm  # noqa: E402
from hal.kernels.triton.launch import launch, interpreter_problem, interpreting  # noqa: E402


@triton.jit
def _log_fused(x):
    """Negative control: lsm1 log with the contraction fp fusion would make (f - r*z -> one fma).

    The interpreter never fuses, so this writes out what ``enable_fp_fusion=True`` does on the GPU
    (the PTX lint catches the real thing there)."""
    tiny = x < sm.MIN_NORMAL
    xs = tl.where(tiny, x * 8388608.0, x)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 23, 0)
    mbits = (bits & 0x7FFFFF) | 0x3F800000
    big = mbits > sm.SQRT2_BITS
    mbits = tl.where(big, mbits - 0x00800000, mbits)
    e = e + big.to(tl.int32)
    m = mbits.to(tl.float32, bitcast=True)
    f = m - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    r = tl.fma(sm.LOG_C9 + tl.zeros_like(z), z, sm.LOG_C7)
    r = tl.fma(r, z, sm.LOG_C5)
    r = tl.fma(r, z, sm.LOG_C3)
    lp = tl.fma(-s, tl.fma(-r, z, f), f)  # the spec rounds r*z first
    ef = e.to(tl.float32)
    y = tl.fma(ef, sm.LN2_HI, tl.fma(ef, sm.LN2_LO, lp))
    return tl.where(x > 0.0, y, 0.0)


@triton.jit
def _div_seed(a, b):
    """Negative control: the division substitute's seed, truncated, without the exact int64 correction."""
    return tl.math.div_rn(a, b).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True) * (1.0 / b) * b


@triton.jit
def _unary(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr, NPU: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    y = tl.load(y_ptr + offs, mask=mask, other=1.0)
    if OP == "exp":
        r = sm.canonical_nan(sm.exp(x))
    elif OP == "log":
        r = sm.canonical_nan(sm.log(x, NPU))
    elif OP == "div":
        r = sm.canonical_nan(sm.div(x, y, NPU))
    elif OP == "sqrt":
        r = sm.canonical_nan(sm.sqrt(x, NPU))
    elif OP == "fma":
        r = sm.canonical_nan(sm.fma(x, y, x))
    elif OP == "bf16":
        r = sm.round_to_bf16(x).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        r = r.to(tl.float32, bitcast=True)
    elif OP == "fp16":
        r = sm.round_out(x, tl.float16, NPU).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        r = r.to(tl.float32, bitcast=True)
    elif OP == "sin":
        r = sm.canonical_nan(sm.sincos(x)[0])
    elif OP == "cos":
        r = sm.canonical_nan(sm.sincos(x)[1])
    elif OP == "widen":  # bfloat16 -> float32 by the bits (the interpreter's cast mangles subnormals)
        r = sm.canonical_nan(sm.widen(sm.round_to_bf16(x)))
    elif OP == "tl_sin":  # negative control: Triton's own sin
        r = sm.canonical_nan(tl.sin(x))
    elif OP == "div_seed":  # negative control
        r = sm.canonical_nan(_div_seed(x, y))
    elif OP == "log_fused":  # negative control
        r = sm.canonical_nan(_log_fused(x))
    else:  # "tl_exp": negative control, Triton's own exp
        r = sm.canonical_nan(tl.exp(x))
    tl.store(out_ptr + offs, r, mask=mask)


NPU = False
BLOCK = 4096


def run(op: str, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    y = x if y is None else y
    out = torch.empty_like(x)
    launch(_unary, (triton.cdiv(x.numel(), BLOCK),), x, y, out, x.numel(), OP=op, BLOCK=BLOCK, NPU=NPU)
    return out.view(torch.int32)


def canon32(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.int32).clone()
    bits[torch.isnan(t)] = 0x7FC00000
    return bits


def rne16_ref(x: torch.Tensor, dtype) -> torch.Tensor:
    """torch's own fp32 -> bf16/fp16 conversion (RNE on CPU), canonical NaN, as 16 bits in int32."""
    h = x.to(dtype)
    bits = h.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = 0x7FC0 if dtype == torch.bfloat16 else 0x7E00
    return torch.where(torch.isnan(x), torch.tensor(nan, dtype=torch.int32), bits)


def inputs() -> torch.Tensor:
    """Every bf16 pattern as float32, random float32 patterns (incl. subnormals), crafted values."""
    every_bf16 = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    g = torch.Generator().manual_seed(8)
    rand_bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    subn = torch.randint(0, 1 << 23, (1 << 12,), generator=g, dtype=torch.int32)
    subn = torch.cat([subn, subn | (-2 ** 31)])
    near = torch.randn(1 << 14, generator=g, dtype=torch.float32) * 30  # exp's busy range
    crafted = torch.tensor([0.0, -0.0, 1.0, -1.0, 88.72, 88.73, -87.3, -103.9, -110.0, -111.0, 100.0, 101.0,
                            float("inf"), float("-inf"), float("nan"), 1.17549435e-38, 1e-45, 65504.0, 65520.0,
                            65519.99, 2.0 ** -25, 2.0 ** -24, 1.5 * 2.0 ** -25, 2.0 ** -14, 0.5 * 2.0 ** -14])
    crafted_bits = torch.tensor([0x7F800001, 0xFFC00001 - (1 << 32), 0x3F808000, 0x3F818000, 0x477FEFFF,
                                 0x477FF000, 0x33000000, 0x33000001, 0x387FF000, 0x387FE000], dtype=torch.int32)
    return torch.cat([every_bf16, rand_bits.view(torch.float32), subn.view(torch.float32), near, crafted,
                      crafted_bits.view(torch.float32)])


def div_cases(g) -> tuple[torch.Tensor, torch.Tensor]:
    """Quotients near and inside float32's subnormal range (ties included), near overflow, exact ones."""
    k = torch.randint(1, 1 << 12, (1 << 13,), generator=g, dtype=torch.int32)
    sub = (k.view(torch.float32))                                 # k * 2**-149
    dx = torch.cat([sub, sub, torch.ldexp(torch.rand(1 << 13, generator=g) + 1, torch.randint(-30, 30, (1 << 13,), generator=g)),
                    torch.tensor([3e38, -3e38, 1.0, 6.0, 1e-45, 3e-45])])
    dy = torch.cat([torch.full_like(sub, 2.0), torch.full_like(sub, 4.0),
                    torch.ldexp(torch.rand(1 << 13, generator=g) + 1, torch.randint(100, 127, (1 << 13,), generator=g)),
                    torch.tensor([0.5, 0.25, 3.0, 3.0, 2.0, 2.0])])
    return dx.float(), dy.float()


def angles(g) -> torch.Tensor:
    """sin/cos arguments over the whole domain |x| < 2**24: uniform, log-uniform, near multiples of pi/2."""
    uni = (torch.rand(1 << 13, generator=g, dtype=torch.float64) * 2 - 1) * 2.0 ** 24
    logu = torch.exp2(torch.rand(1 << 13, generator=g, dtype=torch.float64) * 48 - 24) * torch.sign(torch.randn(1 << 13, generator=g))
    k = torch.randint(-2 ** 22, 2 ** 22, (1 << 12,), generator=g).double()
    near = k * (torch.pi / 2)
    edge = torch.tensor([2.0 ** 24, -2.0 ** 24, 2.0 ** 24 - 1, 2.0 ** 21 + 0.5, 1e-40, -1e-40], dtype=torch.float64)
    return torch.cat([uni, logu, near, edge]).float()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["log_fused", "tl_exp", "div_seed", "tl_sin"], default=None,
                    help="negative control: run a deliberately wrong variant; it must differ")
    ap.add_argument("--npu", action="store_true", help="the Ascend variants (NPU=True)")
    args = ap.parse_args()
    global NPU
    NPU = args.npu
    assert interpreting(), "run with TRITON_INTERPRET=1"
    problem = interpreter_problem()
    if problem:
        print("interpreter refused:", problem)
        return 2
    x = inputs()
    pos = x.abs()
    g = torch.Generator().manual_seed(9)
    y = (torch.randint(-2 ** 31, 2 ** 31 - 1, x.shape, generator=g, dtype=torch.int64).to(torch.int32)
         ).view(torch.float32)
    if args.variant == "div_seed":
        diff = int((run("div_seed", x, y) != canon32(x / y)).sum())
        print(f"div_seed: {x.numel()} inputs, {diff} differ")
        return 0 if diff else 1
    if args.variant is not None:
        fn, arg = {"log_fused": (ref.log, pos), "tl_exp": (ref.exp, x), "tl_sin": (ref.sin, angles(g))}[args.variant]
        got = run(args.variant, arg)
        want = torch.where(arg > 0, canon32(fn(arg)), 0) if args.variant == "log_fused" else canon32(fn(arg))
        diff = int((got != want).sum())
        print(f"{args.variant}: {arg.numel()} inputs, {diff} differ")
        return 0 if diff else 1  # a negative control passes when the check sees the difference
    dx, dy = div_cases(g)
    ang = torch.cat([x, angles(g)])
    checks = {
        "exp": (run("exp", x), canon32(ref.exp(x))),
        "log": (run("log", x), canon32(ref.log(x))),
        "log(|x|)": (run("log", pos), canon32(ref.log(pos))),
        "div": (run("div", x, y), canon32(x / y)),
        # correctly rounded sqrt: float64 sqrt rounded to float32 (innocuous double rounding, 53 >= 2*24+2);
        # NOT torch.sqrt on float32, which on CPU is off by one ulp for ~0.6% of patterns (torch 2.13)
        "sqrt": (run("sqrt", x), canon32(torch.sqrt(x.double()).float())),
        "div(subnormal results)": (run("div", dx, dy), canon32(dx / dy)),
        "fma": (run("fma", x, y), canon32(ref.fma_exact(x, y, x))),
        "sin": (run("sin", ang), canon32(ref.sin(ang))),
        "cos": (run("cos", ang), canon32(ref.cos(ang))),
        "widen(bf16)": (run("widen", x), canon32(x.to(torch.bfloat16).float())),
        "bf16": (run("bf16", x), rne16_ref(x, torch.bfloat16)),
        "fp16": (run("fp16", x), rne16_ref(x, torch.float16)),
    }
    bad = 0
    for name, (got, want) in checks.items():
        diff = int((got != want).sum())
        bad += diff
        print(f"{name}: {got.numel()} inputs, {diff} differ")
        if diff:
            i = int((got != want).nonzero()[0])
            print(f"  first: input bits {int(x.view(torch.int32)[i]) & 0xFFFFFFFF:#010x} "
                  f"got {int(got[i]) & 0xFFFFFFFF:#x} want {int(want[i]) & 0xFFFFFFFF:#x}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
