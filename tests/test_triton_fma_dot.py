"""Strict matmul tiles as float32 ``ieee`` tl.dot on NVIDIA (issue 41 item 1).

* interpreter (tests/scripts/triton_fma_dot_check.py): above 16 rows the FMA-dot kernel variant runs and gives the
  reference's raw bits (K off the tile, k_tile not a power of two, NaN / inf, every dtype); negative control: the
  fast kernels' stand-in (two roundings per step) in place of the strict one is caught;
* machine code (sm_90): the tile's K steps are ``fma.rn.f32`` chains of 64 from +0.0 (lint.fma_chains), on 16-byte
  cp.async operand tiles, without spills; negative control: dots chained across K tiles are flagged by the same
  check. The dot rules of the lint itself (fp32 x fp32, ieee, zero accumulator, none in the AMD / Ascend variant)
  have their negative controls in tests/test_triton_lint.py.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_fma_dot_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")


@needs_interpreter
def test_fma_dot_tiles_give_reference_bits():
    assert run_checks("bits", script=SCRIPT).count(": ok") == 8  # 4 cases x (interpreter, GPU) blocks


@needs_interpreter
def test_two_rounding_stand_in_is_caught():
    assert "is caught in the float32 cases: ok" in run_checks("negative", script=SCRIPT)


def _case(name):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True) if c.name == name)


@needs_compiler
@pytest.mark.parametrize("name", ["matmul[bf16]", "matmul[fp32]", "matmul[fp16]"])
def test_dot_tile_is_64_step_fma_chains_without_spill(name):
    from hal.kernels.checks import lint
    from hal.kernels.checks.sass_profile import profile
    compiled = lint.compile_case(_case(name), "sm90", aligned=True)
    assert lint.dot_chain_problems(compiled.asm["ptx"], 64) == []
    p = profile(compiled)
    c = _case(name).constexprs
    threads = 32 * _case(name).num_warps
    assert not p.stack and p.ffma == c["BM"] * c["BN"] * 64 // threads and p.async_copies, p  # chains of 64, unrolled
    assert {op for op in p.global_loads if op.startswith("LDGSTS")} == {"LDGSTS.E.BYPASS.128"}, p


@needs_compiler
def test_dots_chained_across_tiles_are_flagged():
    import test_triton_lint as tlint
    from hal.kernels.checks import lint
    chained = lint.compile_case(tlint._case(tlint._dot_chain, "fp32", 16), "sm90").asm["ptx"]
    single = lint.compile_case(tlint._case(tlint._fp32_dot, "fp32", 16, PREC="ieee", FMA_DOT=True), "sm90").asm["ptx"]
    assert lint.dot_chain_problems(single, 16) == [] and lint.dot_chain_problems(chained, 16) != []


@needs_compiler
def test_lm_head_dot_tile_is_64_step_fma_chains_without_spill():
    # token_logprobs' logits for row blocks of >= 16 (_max_dot_kernel): the matmul tile's chains, linted in full
    from hal.kernels.checks import lint
    from hal.kernels.checks.sass_profile import profile
    case = _case("token_logprobs.max_dot")
    compiled = lint.compile_case(case, "sm90", aligned=True)
    assert lint.lint(case, "sm90") == [] and lint.dot_chain_problems(compiled.asm["ptx"], 64) == []
    p = profile(compiled)
    assert not p.stack and p.async_copies and p.shared_bytes <= 227 * 1024, p


@needs_compiler
@pytest.mark.parametrize("name", ["gdn.chunked", "gdn.chunked.decode"])
def test_gdn_chunked_products_are_dtp_step_fma_chains(name):
    # the GDN chunked products (gated_delta_rule._products_fma_dot): 4 fp32 ieee products, each d_k tile's chain from a
    # zero accumulator through DTP / DOT_K dots (the full chunk: 2 of 32 lanes; decode: 1), linted in full (the state
    # update chains from S0 * gamma, explicit fma, not from +0.0); its AMD variant holds no dot
    import re
    from hal.kernels.checks import lint
    case = _case(name)
    c = case.constexprs
    assert c["FMA_DOT"] and lint.lint(case, "sm90") == []
    assert c["DOT_K"] == (32 if name == "gdn.chunked" else c["DTP"])  # gated_delta_rule._dot_k
    compiled = lint.compile_case(case, "sm90")
    ttir, ptx = compiled.asm["ttir"], compiled.asm["ptx"]
    assert ttir.count("tt.dot") == 4 * (c["DTP"] // c["DOT_K"]) and lint.dot_chain_problems(ptx, c["DTP"]) == []
    assert lint.dot_chain_problems(ptx, 32) != []  # chains of another length are flagged
    hip = _case(f"{name}[hip]")
    assert not hip.constexprs["FMA_DOT"] and lint.lint(hip, "sm90") == []
    assert "tt.dot" not in lint.compile_case(hip, "sm90").asm["ttir"]
    # negative controls on this kernel's own TTIR: its dots where none may be (AMD / Ascend), and a dot whose
    # accumulator is not the zero constant (one chain across tiles)
    assert any("variant without FMA dots" in p for p in lint.ttir_problems(ttir, False, dots_allowed=False))
    chained = re.sub(r"(tt\.dot\s+%[\w#]+,\s*%[\w#]+,\s*)%[\w#]+", r"\1%running_total", ttir, count=1)
    assert lint.ttir_problems(ttir, False) == []
    assert any("non-zero accumulator %running_total" in p for p in lint.ttir_problems(chained, False))
    if c["DOT_K"] < c["DTP"]:
        # a continuing dot (the tile's second) given the operand built just before it as accumulator: the definition the
        # lint reads is the nearest above the dot (names repeat across the four loops' bodies), which is not a dot
        second = next(m for m in re.finditer(r"tt\.dot\s+%[\w#]+,\s*(%[\w#]+),\s*(%[\w#]+)", ttir)
                      if not re.search(rf"^\s*{re.escape(m.group(2))}\s*=\s*arith\.constant", ttir, re.M))
        bad = ttir[:second.start(2)] + second.group(1) + ttir[second.end(2):]
        assert any(f"non-zero accumulator {second.group(1)}" in p for p in lint.ttir_problems(bad, False))
