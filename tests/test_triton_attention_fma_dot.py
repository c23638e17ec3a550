"""Strict prefill attention tiles as float32 ``ieee`` tl.dot on NVIDIA (issue 41 item 1, attention).

* interpreter (tests/scripts/triton_attn_fma_dot_check.py): prefill tiles run the FMA-dot variant and give the
  reference's raw bits (head dim off the dot tile, causal diagonals next to whole blocks, windows, GQA, p input,
  NaN / inf in unseen V rows, an output whose -0.0 depends on the padded keys); negative controls: V rows of
  unseen keys loaded as +0.0, and the fast kernels' two-rounding stand-in, are each caught;
* machine code (sm_90): the prefill kernel's dots are fma chains from +0.0 of the dot lanes on cp.async tiles (the
  lint's rules); split over dots of 16 lanes it spills at most a few loop invariants, where one dot per 64-lane tile
  (the negative control) spills hundreds of bytes.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_attn_fma_dot_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")


@needs_interpreter
def test_prefill_fma_dot_tiles_give_reference_bits():
    assert run_checks("bits", script=SCRIPT).count(": ok") == 5


@needs_interpreter
def test_wrong_padding_and_two_rounding_stand_in_are_caught():
    out = run_checks("negative", script=SCRIPT)
    assert out.count(": ok") == 3, out


@needs_interpreter
def test_signed_zero_golden_case_catches_plus_zero_padding():
    out = run_checks("golden", script=SCRIPT)
    assert out.count(": ok") == 2, out


def _case(name):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True) if c.name == name)


@needs_compiler
@pytest.mark.parametrize("name", ["attention[bf16,paged=False,one_split=False]",
                                  "attention[fp32,paged=True,one_split=False]"])
def test_prefill_dots_are_fma_chains_on_async_copies(name):
    from hal.kernels.checks import lint
    from hal.kernels.checks.sass_profile import profile
    case = _case(name)
    assert case.constexprs["FMA_DOT"] and case.constexprs["DK"] == 16
    compiled = lint.compile_case(case, "sm90", aligned=True)
    assert lint.lint(case, "sm90") == []
    assert set(lint.fma_chains(compiled.asm["ptx"])) >= {64}
    p = profile(compiled)
    # dots of 16 lanes (attention.DOT_K): a few loop-invariant registers spilled outside the key loop (docs/triton.md:
    # 24-48 B under Triton 3.6 and 3.9) where one dot per 64-lane tile spilled 312-496 B
    assert p.async_copies and p.stack <= 64, p


@needs_compiler
def test_one_dot_per_tile_spills():
    """Negative control of the spill bound above: the same kernel with one dot per head-dim tile and key block
    (DK 64: attention.DOT_K = 0, the earlier kernel) holds all 64 lanes' operands and spills hundreds of bytes."""
    import dataclasses

    from hal.kernels.checks import lint
    from hal.kernels.checks.sass_profile import profile
    case = _case("attention[bf16,paged=False,one_split=False]")
    wide = dataclasses.replace(case, constexprs=dict(case.constexprs, DK=64))
    p = profile(lint.compile_case(wide, "sm90", aligned=True))
    assert p.stack >= 256, p
