"""The fast policy (FastMatmulSpec, FastAttentionSpec: Triton tensor cores), verified without a GPU.

* spec: every knob that decides bits is in the id; float32 and the strict-only backends are refused clearly;
* interpreter (tests/scripts/fast_policy_check.py, TRITON_INTERPRET=1, deterministic tl.dot stand-in): matmul L1 raw
  bits across batch compositions, two wrong variants caught (block_k chosen from the batch, split-K);
  attention L2 (prefill == chunked == decode with 1/8 splits == paged), its wrong variant (split partials
  merged in reverse) caught; attention's interior-block path == the general block step in raw bits on NaN / inf /
  -0.0 inputs, its three wrong variants caught; the decode-tile spec (FAST_ATTENTION_DECODE) through the
  attention_fast suite's own L2 checks against its prefill, a wrong-head variant caught; LOCKSTEP_FULL=1 adds
  attention L1, a second wrong variant and the interior path on finite, huge-score and overflowing inputs, every
  spec x dtype, and every L2 check of the decode-tile case;
* conformance: matmul_fast (and, with LOCKSTEP_FULL=1, attention_fast) run in tests/test_triton_interpreter.py;
  here the stock backend (negative control) fails matmul_fast (L0, L1) and attention_fast (L2);
* fast lint: the kernel compiled for sm_80/sm_90 uses mma/wgmma and no float atomics; the strict matmul
  kernel fails that lint, and the strict lint rejects the fast kernel (each lint is kept to its policy).
"""
from __future__ import annotations

import os

import pytest
import torch

import hal
from hal.errors import SpecError, UnsupportedError
from hal.spec import AttentionSpec, FastAttentionSpec, FastMatmulSpec, MatmulSpec

from _triton_seq_run import ROOT, interpreter_ok, run_checks

SCRIPT = os.path.join(ROOT, "tests", "scripts", "fast_policy_check.py")


def test_fast_spec_id_names_every_knob():
    assert FastMatmulSpec().id == "matmul.fast.m128.n128.k64.w8.s3.v2"
    assert FastMatmulSpec(block_k=32).id != FastMatmulSpec().id
    assert FastMatmulSpec(num_stages=4).id != FastMatmulSpec().id
    assert hal.spec.get("matmul.fast.m64.n64.k32.w4.s2.v2") == FastMatmulSpec(block_m=64, block_n=64, block_k=32,
                                                                               num_warps=4, num_stages=2)
    words = "\n".join(FastMatmulSpec().describe())
    assert "no L4" in words and "no split-K" in words and "float32 is refused" in words


def test_fast_spec_validation():
    with pytest.raises(SpecError, match="block_k must be a power of two >= 16"):
        FastMatmulSpec(block_k=24)
    with pytest.raises(SpecError, match="use FastMatmulSpec"):
        MatmulSpec(policy="fast")
    with pytest.raises(SpecError, match="positive int"):
        FastMatmulSpec(num_stages=0)
    with pytest.raises(SpecError, match="use FastAttentionSpec"):
        AttentionSpec(policy="fast")
    with pytest.raises(SpecError, match="multiple of kv_block"):
        FastAttentionSpec(kv_block=64, kv_split=96)
    assert FastAttentionSpec().id == "attention.fast.m128.b64.s512.w8.st2.v2"


def test_fast_v3_spec_is_opt_in_and_names_its_hypothesis():
    """v3 beside v2 (both ids resolve; v2 stays the fast default used by the docs and benchmarks); v3's id round
    trips, its fixed parts cannot be changed (no other instruction, K step or table exists), and its words say that
    its tile freedom is a hypothesis no GPU has checked."""
    from hal.spec import FAST_MATMUL_V3_TABLE, FastMatmulV3Spec, from_id
    v3 = FastMatmulV3Spec()
    assert v3.id == "matmul.fast.wgmma.k16.t1.v3" and from_id(v3.id) == v3 and hal.spec.get(v3.id) == v3
    assert from_id(FastMatmulSpec().id) == FastMatmulSpec() and FastMatmulSpec().version == 2
    for bad in (dict(k_step=32), dict(instruction="mma"), dict(table="t2"), dict(version=2)):
        with pytest.raises(SpecError, match="FastMatmulV3Spec"):
            FastMatmulV3Spec(**bad)
    words = " ".join(v3.describe())
    assert "HYPOTHESIS, not yet checked on a GPU" in words and "a launch outside the table is refused" in words
    assert [v3.launch_entry(m)[:3] for m in (1, 64, 65, 256, 257)] == [(64, 32, 256)] * 2 + [(64, 64, 128)] * 2 + \
        [(128, 256, 64)]
    assert all(bm >= 64 and w % 4 == 0 for _, bm, _, _, w, *_ in FAST_MATMUL_V3_TABLE)  # wgmma's shape rule


def test_fast_refusals_name_the_reason():
    x, w = torch.ones(2, 32), torch.ones(4, 32)
    with pytest.raises(UnsupportedError, match="fast policy runs bfloat16/float16 tensor cores only"):
        hal.linear(x, w, spec=FastMatmulSpec(), backend="triton")
    with pytest.raises(UnsupportedError, match="not 'fast'"):  # no goldens, no fast reference
        hal.linear(x.bfloat16(), w.bfloat16(), spec=FastMatmulSpec(), backend="reference")
    with pytest.raises(UnsupportedError, match="not 'fast'"):
        hal.linear(x.bfloat16(), w.bfloat16(), spec=FastMatmulSpec(), backend="cpu")


def test_fast_attention_refuses_float32():
    q = torch.ones(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="fast policy runs bfloat16/float16"):
        hal.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True, spec=FastAttentionSpec(), backend="triton")
    with pytest.raises(UnsupportedError, match="not 'fast'"):
        hal.flash_attn_varlen_func(q.bfloat16(), q.bfloat16(), q.bfloat16(), cu, cu, 4, 4, spec=FastAttentionSpec(),
                                   backend="reference")


def test_triton_claims_no_L4_for_fast():
    be = hal.get_backend("triton")
    assert be.claimed_levels("attention_fast", FastAttentionSpec()) == frozenset({"L0", "L1", "L2", "L3", "A"})
    assert be.claimed_levels("matmul_fast", FastMatmulSpec()) == frozenset({"L0", "L1", "L3", "A"})
    assert "L4" in be.claimed_levels("matmul", MatmulSpec())


@pytest.mark.skipif(not interpreter_ok(), reason="the Triton interpreter before 3.9 rounds tl.fma twice")
def test_fast_kernels_structure_in_interpreter():
    pytest.importorskip("triton")
    full = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")
    ci = ["mm_batch_invariance", "mm_tiles_from_batch_negative", "mm_split_k_negative", "mm_nonfinite",
          "mm_v3_table_same_bits",
          "attn_split_invariance", "attn_reverse_merge_negative", "attn_wrong_head_negative", "attn_interior_path",
          "attn_interior_negative", "attn_decode_tile"]
    out = run_checks(*([] if full else ci), script=SCRIPT)  # ~2 min here; every check: LOCKSTEP_FULL=1
    assert out.count("wrong variant caught") >= 10 and "outputs identical" in out
    assert "mm-v3-table[torch.bfloat16]: ok" in out and "mm-v3-rows-alone-vs-batch: ok" in out
    assert "attn-interior-path[" in out and out.count("attn-interior-negative[") >= 3
    assert "attn-decode-tile[attention.fast.m16." in out and "attn-decode-tile-wrong-head-negative[" in out


def test_stock_fails_the_fast_family():
    from hal.conformance import runner
    recs = runner.run(["stock"], ["attention_fast"], dtypes=["bf16"], quick=True)  # SDPA per call
    assert {r.level for r in recs if r.status == "fail"} == {"L2"} and not any(r.claimed for r in recs)
    recs = runner.run(["stock"], ["matmul_fast"], dtypes=["bf16"], quick=True)
    assert not any(r.claimed for r in recs) and all(r.level != "L4" for r in recs)  # no L4: the report shows "-"
    failed = {r.level for r in recs if r.status == "fail"}
    if "L1" not in failed:  # seen on 2026-12-01's CI machine, on 78840c1 too: that CPU's bf16 GEMM is row-invariant
        pytest.xfail("torch's bf16 matmul is batch-invariant on this CPU for the quick cases: stock is no negative "
                     "control of matmul_fast L1 here (a batch-variant fixture backend must replace it)")


needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="the lint compiles kernels; under TRITON_INTERPRET=1 they are interpreter objects")


@needs_compiler
@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_fast_kernel_uses_tensor_cores(target):
    pytest.importorskip("triton")
    from hal.kernels.checks import fast_lint, lint
    kernels = fast_lint.fast_kernels()
    decodes = [k for k in kernels if k[0].name.startswith("fast_attention[bf16,paged=True")]  # default, decode tile
    assert len(decodes) == 2
    for case, warps, stages in kernels[:1] + decodes:  # matmul, decode attention (128 rows: wgmma; 16: mma on sm_90)
        assert fast_lint.lint(case, target, warps, stages) == [], case.name
    if target == "sm90":  # the decode tile's 16-row dot is mma.sync there: held to wgmma's rule, it fails
        case, warps, stages = decodes[1]
        k = lint.compile_case(case, target, fast_lint.STRICT_OPTIONS["enable_fp_fusion"], warps, stages)
        assert any("wgmma" in p for p in fast_lint.fast_problems(k.asm["ttir"], k.asm["ptx"], target))
    case, warps, stages = fast_lint.fast_kernels()[0]
    # the strict lint must reject it (tensor cores): the two lints are never swapped
    assert any("tensor-core" in p for p in lint.lint(case, target))


@needs_compiler
def test_fast_lint_rejects_the_strict_kernel():
    pytest.importorskip("triton")
    from hal.kernels.checks import fast_lint, lint
    strict = next(c for c in lint.strict_kernels() if c.name == "matmul[bf16]")
    problems = fast_lint.lint(strict, "sm90")  # its fp32 ieee tt.dot lowers to FMA chains (issue 41): no tensor cores
    assert any("no tensor-core instruction" in p for p in problems)
    amd = next(c for c in lint.strict_kernels(full=True) if c.name == "matmul[bf16,hip]")  # the explicit chains
    assert any("no tt.dot" in p for p in fast_lint.lint(amd, "sm90"))


def test_v3_launch_table_lint():
    """Every launch of FastMatmulV3Spec's table compiled for sm_90 by the installed Triton (the GPU image's 3.6:
    `python -m hal.kernels.checks.fast_lint --table --triton-venv /work/triton36`): wgmma, no spills, asynchronous
    loads. Negative controls: a 32-row tile lowers to mma.sync, a 128 x 256 x 128 tile on 4 warps spills."""
    pytest.importorskip("triton")
    from hal.kernels.checks.fast_lint import table_problems
    from hal.kernels.triton import fast_matmul as fm
    assert {name: table_problems(lt, "bf16") for name, lt in fm.table_launches()} == {
        name: [] for name, _ in fm.table_launches()}
    assert any("wgmma.mma_async" in p for p in table_problems(fm.Launch(32, 128, 64, 4, 3), "bf16"))
    assert any(p.startswith("spills:") for p in table_problems(fm.Launch(128, 256, 128, 4, 3), "bf16"))
