"""The fast gated delta rule (FastGatedDeltaRuleSpec): its spec, who serves it, its conformance suite's controls.

The suite's quick set in the interpreter runs in tests/test_triton_interpreter.py (every level passes); here: the
spec's id and refusals, every other backend (and hal.jax, and the layer ops) refusing it by name, float32 refused,
and the negative controls: transformers' chunk form (the stock backend), the triton kernel with its chunk grid
restarted at each call and the kernel with P kept past the diagonal all fail the suite's L2 checks. Full run: ``TRITON_INTERPRET=1 hal conformance run
--backend triton --device cpu --ops gated_delta_rule_fast`` (every case)."""
from __future__ import annotations

import os

import pytest
import torch

import hal
from hal import spec as specs
from hal.conformance import runner, suites
from hal.spec import FastGatedDeltaRuleSpec, GatedDeltaRuleSpec

from _triton_seq_run import needs_interpreter, run_checks

CHECKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "gdn_fast_check.py")
FAM = suites.get("gated_delta_rule_fast")
ID = "gated_delta_rule.fast.c64.v32.w8.sbf16.lsm1.v2"


def _inputs(dtype=torch.bfloat16, T=5):
    q = torch.randn(1, T, 1, 16).to(dtype)
    v = torch.randn(1, T, 2, 16).to(dtype)
    g = -torch.rand(1, T, 2)
    return q, q.clone(), v, g, torch.rand(1, T, 2).to(dtype)


def test_spec_id_parses_back_and_bad_fields_are_refused():
    s = FastGatedDeltaRuleSpec()
    assert s.id == ID and specs.get(ID) == s and specs.resolve("gated_delta_rule", ID) == s
    assert specs.from_id("gated_delta_rule.fast.c64.v16.w4.sbf16.lsm1.v2") == FastGatedDeltaRuleSpec(block_dv=16,
                                                                                                    num_warps=4)
    assert specs.from_id("gated_delta_rule.fast.c64.v32.w8.stf32.lsm1.v2") is None  # no tf32 state format (yet)
    with pytest.raises(hal.SpecError, match="state_format"):
        FastGatedDeltaRuleSpec(state_format="tf32")
    with pytest.raises(hal.SpecError, match="power of two >= 16"):
        FastGatedDeltaRuleSpec(block_dv=24)
    with pytest.raises(hal.SpecError, match="not available"):
        GatedDeltaRuleSpec(policy="fast")  # the strict class describes strict bits only
    assert "L4" not in FAM.levels and "fast" in " ".join(s.describe())


def test_backends_without_the_fast_policy_refuse_it_by_name():
    q, k, v, g, beta = _inputs()
    for name in ("reference", "cpu"):
        with pytest.raises(hal.UnsupportedError, match=f"{name}.*not 'fast'"):
            hal.chunk_gated_delta_rule(q, k, v, g, beta, spec=ID, backend=name)
    with pytest.raises(hal.UnsupportedError, match="no backend can run"):  # no silent strict for a fast id
        hal.fused_recurrent_gated_delta_rule(q, k, v, g, beta, spec=ID)
    with pytest.raises(hal.UnsupportedError, match="strict bits only"):  # the layer ops are strict companions
        hal.gdn_gating(torch.zeros(2), torch.zeros(3, 2), torch.zeros(2), torch.zeros(3, 2), spec=ID, backend="stock")


def test_hal_jax_refuses_the_fast_spec():
    jnp = pytest.importorskip("jax.numpy")
    import hal.jax as hj
    q = jnp.zeros((1, 3, 1, 16), jnp.bfloat16)
    with pytest.raises(hal.UnsupportedError, match="strict gated delta rule specs only"):
        hj.chunk_gated_delta_rule(q, q, q, jnp.zeros((1, 3, 1)), jnp.zeros((1, 3, 1)), spec=ID)


def test_triton_refuses_float32_and_claims_no_L4(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hal.backends.triton import TritonBackend
    why = TritonBackend().supports("chunk_gated_delta_rule", specs.get(ID), torch.float32, torch.device("cpu"))
    assert any("bfloat16/float16 tensor cores only" in r for r in why), why
    assert TritonBackend().claimed_levels("gated_delta_rule_fast", specs.get(ID)) == frozenset(
        {"L0", "L1", "L2", "L3", "A"})


def test_stock_chunk_form_fails_L2():
    pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    case = next(c for c in FAM.cases() if c.id == FAM.quick[0])
    out = {lvl: runner._Outcome() for lvl in ("L2", "A")}
    runner.run_case(FAM, hal.get_backend("stock"), case, torch.device("cpu"), ("L2", "A"), out)
    labels = [d.label for _, d in out["L2"].failures]
    assert any(lab.startswith("split-sweep/split-at-") for lab in labels), labels


@needs_interpreter
def test_wrong_kernels_fail_L2_in_the_interpreter():
    """The chunk grid restarted at each call, and P not zeroed past the diagonal: both caught by the suite's L2."""
    out = run_checks("gdn-fast-restart", "gdn-fast-causal-mask", "gdn-fast-wide-head", script=CHECKS)
    assert out.count("wrong variant caught") == 2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="the lint compiles kernels; under TRITON_INTERPRET=1 they are interpreter objects")
def test_fast_lint_finds_tensor_cores_in_the_kernel():
    """Compiled for sm_90 (no GPU needed) the fast GDN kernel's dots reach wgmma, and no float atomic is used."""
    pytest.importorskip("triton")
    from hal.kernels.checks import fast_lint
    case, warps, stages = next(c for c in fast_lint.fast_kernels() if c[0].name.startswith("fast_gdn"))
    assert warps == FastGatedDeltaRuleSpec().num_warps
    assert fast_lint.lint(case, "sm90", warps, stages) == []


def test_gpu_perf_rows_time_fla_when_it_imports(monkeypatch):
    """The fast GDN gpu_perf rows call FLA's kernels (value-head-expanded q / k, the L2 norm in kernel) when ``fla``
    imports; without it the target is None (the row then says "no FLA: no ratio": the dry run shows it)."""
    import sys
    import types

    from benchmarks import gpu_perf
    seen = []
    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = lambda q, k, v, g, beta, **kw: seen.append(("chunk", q.shape, k.shape, kw))
    fake.fused_recurrent_gated_delta_rule = lambda q, k, v, g, beta, **kw: seen.append(("step", q.shape, kw))
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    case = next(c for c in gpu_perf.cases(gpu_perf.TINY, "cpu") if c.id.startswith("gdn_chunked/fast/"))
    _, _, tensors = case.build(0)
    case.target(tensors)()
    H, HV = gpu_perf.TINY.gdn[:2]
    assert seen and seen[0][0] == "chunk" and seen[0][1][2] == HV and seen[0][2][2] == HV
    assert seen[0][3]["use_qk_l2norm_in_kernel"] is True
    monkeypatch.delitem(sys.modules, "fla.ops.gated_delta_rule")
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla fails
    case = next(c for c in gpu_perf.cases(gpu_perf.TINY, "cpu") if c.id.startswith("gdn_chunked/fast/"))
    assert case.target(case.build(0)[2]) is None
