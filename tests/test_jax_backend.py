"""hal.jax and the jax backend: the FMA helper, conformance of the implemented suites, the example.

Skipped (with the reason) when jax is not installed. Quick by default; LOCKSTEP_FULL=1 adds the
1 M random fma triples (in-process and under --xla_cpu_max_isa=SSE4_2) and every dtype of the
conformance suites.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("jax", reason="jax is not installed (pip install 'lockstep[jax]')")

import hal  # noqa: E402
from hal.conformance import runner  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.jax import fma_check  # noqa: E402

FULL = os.environ.get("LOCKSTEP_FULL") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_RANDOM = 1_000_000 if FULL else 60_000


def _fma_check(*args, xla_flags=None) -> dict:
    """python -m hal.jax.fma_check in a fresh process (XLA reads XLA_FLAGS once per process)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    p = subprocess.run([sys.executable, "-m", "hal.jax.fma_check", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- import hygiene


def test_import_hal_never_imports_jax():
    code = ("import sys, torch, hal; hal.backends(); hal.softmax(torch.ones(2, 3)); "
            "hal.get_backend('jax'); assert 'jax' not in sys.modules, 'jax imported'; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


# ---------------------------------------------------------------- the FMA helper


def test_fma_crafted_jit_and_eager():
    t = fma_check.crafted()
    want = fma_check.expected(t)
    for eager in (False, True):
        res = fma_check.compare(t, fma_check.run(t, eager=eager), want)
        assert res["mismatches"] == 0, (eager, res)
    assert t.shape[0] > 20_000


@pytest.mark.parametrize("variant", ["xla-convert", "no-odd"])
def test_fma_crafted_cases_catch_wrong_variants(variant):
    """Negative controls: XLA's own converts (flush subnormals) and no round-to-odd step must fail."""
    t = fma_check.crafted()
    res = fma_check.compare(t, fma_check.run(t, variant=variant), fma_check.expected(t))
    assert res["mismatches"] > 0, res


def test_fma_random_triples():
    t = fma_check.random_triples(N_RANDOM, seed=7)
    res = fma_check.compare(t, fma_check.run(t), fma_check.expected(t))
    assert res == {"cases": N_RANDOM, "mismatches": 0, "first": None}


def test_fma_under_sse42_isa():
    res = _fma_check("--random", str(N_RANDOM), xla_flags="--xla_cpu_max_isa=SSE4_2")
    assert res["mismatches"] == 0 and res["cases"] > N_RANDOM, res


def test_fast_math_breaks_it_and_is_refused():
    """Negative control: with fast-math XLA reassociates and the emulation fails; hal.jax refuses."""
    flag = "--xla_cpu_enable_fast_math=true"
    res = _fma_check(xla_flags=flag)
    assert res["mismatches"] > 0, res
    code = ("import torch, hal, hal.jax as hj, jax.numpy as jnp\n"
            "why = hal.get_backend('jax').unavailable_reason(); assert why and 'fast_math' in why, why\n"
            "try:\n    hj.softmax(jnp.ones((2, 3)))\nexcept hal.BackendUnavailable as e:\n    print('refused:', e)\n")
    env = dict(os.environ, XLA_FLAGS=flag)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "refused:" in p.stdout, p.stdout + p.stderr[-2000:]
    code_info = subprocess.run([sys.executable, "-m", "hal.cli", "info"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
    assert "jax" in code_info.stdout and "xla_cpu_enable_fast_math" in code_info.stdout, code_info.stdout


# ---------------------------------------------------------------- backend selection


def test_jax_backend_is_named_never_auto_for_cpu():
    b = hal.get_backend("jax")
    assert b.unavailable_reason() is None
    s = hal.spec.DEFAULTS["matmul"]
    assert hal.select("linear", s, torch.float32, torch.device("cpu")).name != "jax"
    assert hal.select("linear", s, torch.float32, torch.device("cpu"), backend="jax") is b


def test_unimplemented_op_is_unsupported_not_wrong(monkeypatch):
    """The jax backend implements every op; one it lacked would be refused by name, never computed otherwise."""
    b = hal.get_backend("jax")
    assert [op for op in hal.ops_registry.OPS if op not in b.ops()] == []
    monkeypatch.setattr(type(b), "chunk_gated_delta_rule", None)
    spec = hal.spec.DEFAULTS["gated_delta_rule"]
    with pytest.raises(hal.UnsupportedError, match="does not implement"):
        hal.select("chunk_gated_delta_rule", spec, torch.float32, torch.device("cpu"), backend="jax")


# ---------------------------------------------------------------- conformance


# CI: a few decisive cases per suite through the runner's own per-case checks (every level the
# suite has); LOCKSTEP_FULL=1: every case of every suite hal.jax implements, every dtype.
QUICK_CASES = {
    "matmul": ["m6_k70_n9_subnormal_negzero.fp32", "m6_k70_n9_subnormal_negzero.bf16", "m7_k129_n33.fp16"],
    "rms_norm": ["n7_h129_res.bf16"],
    "softmax": ["r5_n129.bf16"],
    "token_logprobs": ["n5_h96_v515_t0.7.bf16"],
    "token_logprobs_exact": ["n4_h70_v300_t1.0.bf16"],  # exact matmul: tests/test_exact_jax.py
    "elementwise": ["silu_mul_n7_w129.bf16", "softplus_n7_w129.fp32"],
    "rotary": ["apply_interleaved_t17_h2_d80_r32.bf16"],
    "gdn_layer": ["b2_t9_d8_k4_hv2.bf16"],
    # varlen (packing, chunked prefill) and paged kv-cache (decode, prefix reuse, num_splits) at every level
    "attention": ["nan_gqa_h2kv1_d32.fp32"],
    # both specs (the case id is the same): splits, decode, mixed batches, NaN inputs, goldens
    "gated_delta_rule": ["nan_gva_h1v2_d16.fp32", "nan_gva_h1v2_d16.fp32"],
}
FULL_SUITES = ["matmul", "rms_norm", "softmax", "token_logprobs", "elementwise", "rotary", "gdn_layer", "attention",
               "matmul_exact", "token_logprobs_exact", "gated_delta_rule"]


def _run_cases(suite_name: str, wanted):
    from hal.conformance import suites
    fam = suites.get(suite_name)
    cases = [c for c in fam.cases() if wanted is None or c.id in wanted]
    if wanted is not None:
        assert sorted(c.id for c in cases) == sorted(wanted), [c.id for c in fam.cases()]
    backend = hal.get_backend("jax")
    problems = []
    for case in cases:
        outcomes = {lvl: runner._Outcome() for lvl in fam.levels}
        runner.run_case(fam, backend, case, torch.device("cpu"), fam.levels, outcomes)
        for lvl, o in outcomes.items():
            if o.unsupported or o.failures or o.cases != 1:
                problems.append(f"{case.id} {lvl}: {o.unsupported or [str(d) for _, d in o.failures]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("suite", sorted(QUICK_CASES))
def test_conformance_quick(suite):
    _run_cases(suite, QUICK_CASES[suite])


@pytest.mark.skipif(not FULL, reason="every case: LOCKSTEP_FULL=1 (slow: ~minutes per suite)")
@pytest.mark.parametrize("suite", FULL_SUITES)
def test_conformance_full(suite):
    records = runner.run(["jax"], [suite])
    bad = [r for r in records if r.status != "pass"]
    assert records and not bad, "\n".join(f"{r.op} {r.dtype} {r.level}: {r.status}: {r.detail}" for r in bad)


def test_flushing_variant_is_caught_by_matmul_goldens(monkeypatch):
    """Negative control: widening with XLA's convert (subnormals read as zero) fails L4 on the
    matmul family's subnormal/-0.0 case."""
    import jax
    import jax.numpy as jnp
    from hal.conformance import golden
    from hal.conformance.suites import matmul as mm
    from hal.jax import strict_math as sm
    case = next(c for c in mm.SUITE.cases() if c.p.get("special") and c.dtype == torch.float32)
    x = mm.SUITE.make_inputs(case)
    gold = golden.load("matmul", case, x)
    got = mm.SUITE.run(hal.get_backend("jax"), case, x)
    assert first_divergence("jax", gold["linear"], got["linear"]) is None
    monkeypatch.setattr(sm, "widen", lambda a: a.astype(jnp.float64))
    jax.clear_caches()
    try:
        bad = mm.SUITE.run(hal.get_backend("jax"), case, x)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert first_divergence("flushing", gold["linear"], bad["linear"]) is not None


# ---------------------------------------------------------------- JAX-side API


def test_jit_and_grad():
    import jax
    import jax.numpy as jnp
    import hal.jax as hj
    from examples.jax_parity import to_jax
    from hal.conformance import inputs as gen
    x = gen.randn("tj.x", (3, 70), torch.float32)
    w = gen.randn("tj.w", (5, 70), torch.float32, scale=0.1)
    ref = hal.linear(x, w, backend="reference")
    xj, wj = to_jax(x), to_jax(w)
    eager = hj.linear(xj, wj)
    jitted = jax.jit(hj.linear)(xj, wj)
    from examples.jax_parity import from_jax
    assert first_divergence("eager", ref, from_jax(eager)) is None
    assert first_divergence("jit", ref, from_jax(jitted)) is None
    gx = jax.grad(lambda a: hj.linear(a, wj).sum())(xj)
    gx_stock = jax.grad(lambda a: (a @ wj.T).sum())(xj)
    assert jnp.allclose(gx, gx_stock, rtol=1e-5, atol=1e-6)  # values, not a bit claim


def test_example_parity():
    from examples import jax_parity
    r = jax_parity.run("bf16", verbose=False)
    assert r["lockstep"]["bitwise_equal"], r["lockstep"]["divergence"]
    assert not r["stock"]["bitwise_equal"]  # the negative control is caught
