"""The dot-free strict loops are software-pipelined (issue 41, item 2), read from the sm_90 machine code.

Triton pipelines a loop's loads (cp.async, ``LDGSTS``) only when the loop holds a ``tl.dot`` or is written
``tl.range(..., num_stages=k)``; the streaming loops of the strict kernels hold no dot, so each names its stages
(``common.STAGES``). The bits do not depend on it (the same operations in the same order; the interpreter ignores
it): the conformance suites and the interpreter tests of each kernel check those. Here: each pipelined kernel
issues asynchronous copies, does not spill, and fits in an sm_90 program's shared memory (the LM head's hidden
loop is not pipelined for that reason: its unrolled tile would need ~576 KB per program; loops with a constant trip
count stay unrolled, their loads already issued ahead). Negative control: the
same loop written with a plain ``range`` gets no asynchronous copy.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")

SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one program (CTA) may use on sm_90

PIPELINED = ["rms_norm[bf16,residual]", "rms_norm[fp32,residual]", "softmax[bf16,mode0]", "softmax[fp32,mode1]",
             "softmax[fp16,mode2]", "matmul.gemv_combine[bf16]", "token_logprobs.stats", "token_logprobs.sum",
             "token_logprobs.finish", "attention.merge[bf16]", "gdn.serial"]


def _case(name):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True) if c.name == name)


@needs_compiler
@pytest.mark.parametrize("name", PIPELINED)
def test_dot_free_loops_get_async_copies(name):
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case(name))
    assert p.async_copies and not p.stack and p.shared_bytes <= SM90_SHARED_BYTES, (name, p)


@needs_compiler
@pytest.mark.parametrize("name", ["token_logprobs.max", "token_logprobs.sum"])
def test_lm_head_fits_in_shared_memory(name):
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case(name))
    assert p.shared_bytes <= SM90_SHARED_BYTES, (name, p)


@triton.jit
def _stream_sum(x_ptr, out_ptr, n, PIPELINE: tl.constexpr):
    cols = tl.arange(0, 128)
    s = tl.zeros([128], dtype=tl.float32)
    if PIPELINE:
        for c0 in tl.range(0, n, 128, num_stages=3):
            s = s + tl.load(x_ptr + c0 + cols, mask=c0 + cols < n, other=0.0)
    else:
        for c0 in range(0, n, 128):
            s = s + tl.load(x_ptr + c0 + cols, mask=c0 + cols < n, other=0.0)
    tl.store(out_ptr + cols, s)


@needs_compiler
def test_plain_range_loop_is_not_pipelined():
    from hal.kernels.checks.lint import KernelCase
    from hal.kernels.checks.sass_profile import profile_case
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    plain = profile_case(KernelCase("stream_sum[range]", _stream_sum, sig, {"PIPELINE": False}, divisible=("n",)))
    staged = profile_case(KernelCase("stream_sum[tl.range]", _stream_sum, sig, {"PIPELINE": True}, divisible=("n",)))
    assert plain.async_copies == 0 and staged.async_copies > 0, (plain, staged)
