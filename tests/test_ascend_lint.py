"""The Ascend API-subset lint: the real kernels pass; a deliberately wrong kernel is caught by every rule."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

from hal.kernels.checks import ascend_lint  # noqa: E402
from hal.kernels.triton import strict_math as sm  # noqa: E402


@triton.jit
def _negative_control(x_ptr, out_ptr, NPU: tl.constexpr):
    offs = tl.arange(0, 16)
    x = tl.load(x_ptr + offs)
    if NPU:
        a = tl.math.div_rn(x, x)                                  # untrusted rounding on Ascend
        b = (x.to(tl.int32, bitcast=True) >> offs).to(tl.float32)  # shift by a tensor amount
        c = tl.cumsum(x, 0)                                       # forbidden: scan order
        d = tl.erf(x)                                             # outside the documented subset
        tl.atomic_add(out_ptr + offs, x)                          # order-dependent
        e = sm.sqrt(x, NPU) + sm.round_to_fp16(x).to(tl.float32)  # helper with tensor shifts
        f = sm.div(x, x)                                          # NPU not passed on: div_rn would run
        tl.store(out_ptr + offs, a + b + c + d + e + f)
    else:
        tl.store(out_ptr + offs, tl.math.sqrt_rn(x))               # the GPU side is not linted


def test_real_ascend_kernels_pass():
    results = ascend_lint.lint_all()
    assert len(results) == len(ascend_lint.ascend_kernels()) >= 19
    assert {"_attn_kernel", "_merge_kernel", "_chunked_kernel", "_serial_kernel", "_conv_kernel"} <= set(results)
    assert all(not p for p in results.values()), {k: [str(x) for x in v] for k, v in results.items() if v}


def test_negative_control_is_caught_by_every_rule():
    problems = [str(p) for p in ascend_lint.lint_function(_negative_control)]
    text = "\n".join(problems)
    assert "tl.div_rn" in text
    assert "shift by a tensor amount (x.to(tl.int32, bitcast=True) >> offs)" in text
    assert "tl.cumsum" in text and "tl.atomic_add" in text
    assert "tl.erf is outside the documented subset" in text
    assert "strict_math.round_to_fp16" in text  # followed into the helper
    assert "sm.div(...) without NPU" in text and "sm.sqrt(...) without NPU" not in text
    assert "sqrt_rn" not in text  # the NPU=False side is not reached


def test_npu_variant_compiles_with_the_triton_compiler():
    # triton-ascend cannot be installed here; community Triton's compiler (sm_80 target, no GPU needed)
    # at least proves the NPU=True source (int64 tests, substitutes, persistent loop) is valid Triton
    from hal.kernels.checks import lint
    wanted = {"rms_norm[fp16,residual]", "softmax[fp16,mode1]", "token_logprobs.finish", "attention.merge[bf16]",
              "gdn.serial", "gdn.gating"}
    cases = [c for c in lint.strict_kernels(full=True, npu=True) if c.name in wanted]
    assert {c.name for c in cases} == wanted
    for case in cases:
        assert case.constexprs["NPU"] is True
        k = lint.compile_case(case, "sm80")
        assert "scf.for" in k.asm["ttir"]  # the persistent loop is there
