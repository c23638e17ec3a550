"""PTX / TTIR lint of the strict Triton kernels (no GPU needed), each rule with a negative control.

CI compiles a few strict kernels for sm_80 and sm_90 (Triton caches compiles on disk); every kernel
and variant: ``python -m hal.kernels.checks.lint --full``.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the lint compiles kernels; under TRITON_INTERPRET=1 they are interpreter objects",
                allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hal.kernels.checks import lint  # noqa: E402
from hal.kernels.triton import strict_math as sm  # noqa: E402


@pytest.mark.parametrize("case", lint.strict_kernels(full=False), ids=lambda c: c.name)
@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_strict_kernel_passes_lint(case, target):
    assert lint.lint(case, target) == []


@pytest.mark.parametrize("case", lint.backward_kernels(full=False), ids=lambda c: c.name)
@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_backward_kernel_passes_backward_lint(case, target):
    assert lint.lint(case, target) == []
    ptx = lint.compile_case(case, target, True).asm["ptx"]
    if case.name.startswith("gdn_bwd."):  # float32 products with input_precision="ieee": FMAs, no tf32 tensor cores
        assert "mma" not in ptx
    elif "preprocess" not in case.name:  # bf16 products on tensor cores, as intended (not a strict kernel)
        assert "mma" in ptx


# ------------------------------------------------------------------ negative controls


@triton.jit
def _slash_div(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i) / tl.load(y_ptr + i))


@triton.jit
def _unary(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr, OP: tl.constexpr):
    """tl.exp / tl.sqrt / tl.floor (OP): each lowers to an instruction a strict kernel must not use."""
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    if OP == "exp":
        y = tl.exp(x)
    elif OP == "sqrt":
        y = tl.sqrt(x)
    else:
        y = tl.floor(x)
    tl.store(out_ptr + i, y)


@triton.jit
def _mul_add(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, x * tl.load(y_ptr + i) + x)


@triton.jit
def _atomic_sum(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr, tl.sum(tl.load(x_ptr + i), axis=0))


@triton.jit
def _bf16_dot(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = i[:, None] * BLOCK + i[None, :]
    a = tl.load(x_ptr + offs)
    b = tl.load(y_ptr + offs)
    tl.store(out_ptr + offs, tl.dot(a, b))


@triton.jit
def _dot_chain(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = i[:, None] * BLOCK + i[None, :]
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k in range(0, 4):
        a = tl.load(x_ptr + offs + k * BLOCK * BLOCK)
        b = tl.load(y_ptr + offs + k * BLOCK * BLOCK)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # one chain across K tiles: not the spec's order
    tl.store(out_ptr + offs, acc)


@triton.jit
def _fp32_dot(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr, PREC: tl.constexpr, FMA_DOT: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = i[:, None] * BLOCK + i[None, :]
    a = tl.load(x_ptr + offs)
    b = tl.load(y_ptr + offs)
    tl.store(out_ptr + offs, tl.dot(a, b, tl.zeros([BLOCK, BLOCK], dtype=tl.float32), input_precision=PREC))


@triton.jit
def _neg_zero_other(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < 100, other=-0.0))  # Triton 3.6 fills +0.0


@triton.jit
def _neg_zero_literal(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.where(i < 100, tl.load(x_ptr + i), -0.0))  # Triton 3.6 selects +0.0


@triton.jit
def _neg_zero_from_bits(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, sm.neg_zero_where(i < 100, tl.load(x_ptr + i, mask=i < 100, other=0.0)))


def _case(fn, dtype="fp32", block=128, **constexprs):
    return lint.KernelCase(fn.__name__, fn, {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "out_ptr": "*fp32"},
                           {"BLOCK": block, **constexprs})


@pytest.mark.parametrize("fn, dtype, block, constexprs, target, expect", [
    (_slash_div, "fp32", 128, {}, "sm90", "div.full"),
    (_unary, "fp32", 128, {"OP": "exp"}, "sm90", "ex2"),
    (_unary, "fp32", 128, {"OP": "sqrt"}, "sm90", ".approx"),
    (_unary, "fp32", 128, {"OP": "floor"}, "sm90", ".ftz"),
    (_atomic_sum, "fp32", 128, {}, "sm80", "float atomic"),
    (_bf16_dot, "bf16", 16, {}, "sm80", "mma"),
    (_dot_chain, "fp32", 16, {}, "sm80", "non-zero accumulator"),
    (_bf16_dot, "bf16", 16, {}, "sm90", "float32 operands"),
    (_fp32_dot, "fp32", 16, {"PREC": "tf32", "FMA_DOT": True}, "sm90", "not ieee"),
    (_fp32_dot, "fp32", 16, {"PREC": "ieee", "FMA_DOT": False}, "sm90", "variant without FMA dots"),
    (_neg_zero_other, "fp32", 128, {}, "sm90", "-0.0 constant"),
    (_neg_zero_literal, "fp32", 128, {}, "sm90", "-0.0 constant"),
], ids=["slash-div", "tl.exp", "tl.sqrt", "tl.floor", "atomic-add", "bf16-dot", "dot-accumulator", "bf16-dot-operands",
        "tf32-dot", "dot-in-amd-variant", "neg-zero-other", "neg-zero-literal"])
def test_lint_catches_bad_kernel(fn, dtype, block, constexprs, target, expect):
    problems = lint.lint(_case(fn, dtype, block, **constexprs), target)
    assert any(expect in p for p in problems), problems


def test_fp32_ieee_dot_from_zero_passes():
    # the strict NVIDIA tile (the positive control of the three dot rules above): fp32 x fp32, ieee, zero accumulator
    assert lint.lint(_case(_fp32_dot, "fp32", 16, PREC="ieee", FMA_DOT=True), "sm90") == []


def test_backward_lint_catches_float_atomics_only():
    atomic = lint.KernelCase("atomic_sum", _atomic_sum, _case(_atomic_sum).signature, {"BLOCK": 128}, strict=False)
    assert any("float atomic" in p for p in lint.lint(atomic, "sm90")), "a float atomic_add must be caught"
    dot = lint.KernelCase("bf16_dot", _bf16_dot, _case(_bf16_dot, "bf16").signature, {"BLOCK": 16}, strict=False)
    assert lint.lint(dot, "sm80") == []  # tensor cores are allowed under the backward rules
    assert any("mma" in p for p in lint.lint(_case(_bf16_dot, "bf16", 16), "sm80"))  # not under the strict ones


def test_lint_catches_fp_fusion():
    case = _case(_mul_add)
    assert lint.lint(case, "sm90") == []  # fusion off (the launcher's options): mul.rn + add.rn
    problems = lint.lint(case, "sm90", options_fusion=True)
    assert any("fusion ON" in p for p in problems), problems
    assert "fma.rn.f32" in lint.compile_case(case, "sm90", True).asm["ptx"]  # what fusion does


def test_ptx_rule_rejects_float_arithmetic_without_rn():
    # add.f32 without a rounding modifier lets ptxas contract it with a multiply into an fma
    assert any(".rn" in p for p in lint.ptx_problems("\tadd.f32 \t%r1, %r2, %r3;\n"))
    assert lint.ptx_problems("\tadd.rn.f32 \t%r1, %r2, %r3;\n\tadd.s32 \t%r4, %r5, 1;\n") == []


def test_neg_zero_from_its_bits_passes_and_is_neg_zero():
    # the positive control of the -0.0 rule: strict_math.neg_zero_where keeps -0.0 (its PTX selects 0x80000000)
    assert lint.lint(_case(_neg_zero_from_bits), "sm90") == []
    ptx = lint.compile_case(_case(_neg_zero_from_bits), "sm90").asm["ptx"]
    assert "-2147483648" in ptx, ptx
