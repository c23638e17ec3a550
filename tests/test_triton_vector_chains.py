"""Chains fed by 16-byte vector loads (decode GEMV, the LM head of token_logprobs) on the triton backend.

* tests/scripts/triton_vector_chain_check.py (a subprocess with TRITON_INTERPRET=1): the reference's raw bits on edge
  shapes, with the interpreter's and the GPU's block sizes, the GEMV also through the int64-word chains (Triton 3.6's
  formulation, common.dot_tile_words); a chain with two neighbours swapped is caught in each.
* the compiled kernels (sm_90 cubin, disassembled; hal.kernels.checks.sass_profile): the vector GEMV reads its
  operands only with 16-byte loads and moves nothing through shared memory, the LM-head kernel reads the hidden
  states and weights only with 16-byte loads, without spills, and the tile-sum pass and the finish read the kept
  logits and tile sums with 16-byte loads; negative control: the element-per-step GEMV
  kernel, which the same check flags (2-byte loads, layout conversions through shared memory).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_vector_chain_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("check,cases", [("gemv", 10), ("gemv_words", 11), ("gemv_variants", 22), ("lm_head", 10),
                                         ("lm_head_words", 6), ("odd_tiles", 3)])
def test_reference_bits_with_interpreter_and_gpu_blocks(check, cases):
    assert run_checks(check, script=SCRIPT).count(": ok") == cases


@needs_interpreter
def test_swapped_chain_order_is_caught():
    out = run_checks("negative", script=SCRIPT)
    assert "caught by the gemv check: ok" in out and "caught by the lm_head check: ok" in out
    assert "caught by the lm_head_words check: ok" in out
    assert "caught by the gemv_variants rows check: ok" in out  # 33-40 rows through the GEMV
    for dt in ("float32", "bfloat16", "float16"):  # the int64-word chains (Triton 3.6's), each extraction
        assert f"caught by the gemv_words check ({dt}): ok" in out


def _case(name):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True) if c.name == name)


def _streams_vectors(p) -> str | None:
    """Why a profile is not 'operands through 16-byte loads, no layout conversion', or None."""
    if p.narrow_loads or not p.vector_loads:
        return f"global loads {p.global_loads}"
    if p.shared or p.barriers or p.stack:
        return f"shared-memory instructions {p.shared}, barriers {p.barriers}, stack {p.stack}"
    return None


@needs_compiler
@pytest.mark.parametrize("name", ["matmul.gemv_vec[bf16,rows=1]", "matmul.gemv_vec[fp32,rows=1]",
                                  "matmul.gemv_vec[bf16,rows=8]"])
def test_vector_kernel_streams_16_byte_loads(name):
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case(name))
    assert _streams_vectors(p) is None, (name, p)
    assert p.ffma == 64 * int(name.split("rows=")[1].rstrip("]"))  # one K tile of 64 per chain, unrolled


@needs_compiler
def test_lm_head_kernel_streams_16_byte_loads():
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case("token_logprobs.max"))
    assert p.vector_loads and not p.narrow_loads and set(p.global_loads) == {"LDG.E.128"} and not p.stack, p


@needs_compiler
def test_tile_sum_pass_streams_the_kept_logits():
    # the sum pass reads the kept float32 logits (no LM head): 16-byte pipelined copies, each (row, tile) chain in
    # one thread (no layout conversion), no spill; the finish reads 4 tile sums per 16-byte load
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case("token_logprobs.sum"))
    assert set(p.global_loads) - {"LDG.E"} == {"LDGSTS.E.BYPASS.128"} and not p.shared_stores and not p.stack, p
    f = profile_case(_case("token_logprobs.finish"))
    assert any(".128" in op for op in f.global_loads) and not f.narrow_loads and not f.stack, f


@needs_compiler
def test_element_per_step_kernel_is_flagged():
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case("matmul.gemv_partials[bf16]"))
    assert _streams_vectors(p) is not None and p.narrow_loads, p
