"""Decode GEMV on the triton backend: the reference's bits in the interpreter, vector loads in the machine code.

* tests/triton_gemv_check.py (a subprocess with TRITON_INTERPRET=1): both decode kernels give the reference's raw
  bits on edge shapes; a chain with two neighbours swapped is caught.
* the compiled kernels (sm_90 cubin, disassembled; hal.kernels.triton.sass_profile): the vector kernel reads its
  operands only with 16-byte loads and moves nothing through shared memory; negative control: the
  element-per-step kernel, which the same check flags (2-byte loads, layout conversions through shared memory).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "triton_gemv_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")


@needs_interpreter
def test_decode_kernels_give_reference_bits():
    out = run_checks("bits", script=SCRIPT)
    assert out.count(": ok") == 5


@needs_interpreter
def test_swapped_chain_order_is_caught():
    assert "swapped neighbours in the chain are caught: ok" in run_checks("negative", script=SCRIPT)


def _case(name):
    from hal.kernels.triton import lint
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
    from hal.kernels.triton.sass_profile import profile_case
    p = profile_case(_case(name))
    assert _streams_vectors(p) is None, (name, p)
    assert p.ffma == 64 * int(name.split("rows=")[1].rstrip("]"))  # one K tile of 64 per chain, unrolled


@needs_compiler
def test_element_per_step_kernel_is_flagged():
    from hal.kernels.triton.sass_profile import profile_case
    p = profile_case(_case("matmul.gemv_partials[bf16]"))
    assert _streams_vectors(p) is not None and p.narrow_loads, p
