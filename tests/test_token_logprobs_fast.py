"""token_logprobs with fast LM-head logits (TokenLogprobsSpec(matmul=FastMatmulSpec / FastMatmulV3Spec)): the spec, its
id and words, the switch's table, refusals by name on every backend without the fast policy, and (Triton interpreter)
tests/scripts/token_logprobs_fast_check.py: the logits are the fast matmul's float32 accumulator and the log-softmax
the strict one (raw bits; negative control: another launch's logits), the token_logprobs_fast suite catches a launch
chosen from the batch, hal.use(policy="fast") runs it (negative control: outside the switch, strict). The suite's
quick set: tests/test_triton_interpreter.py. Full: `TRITON_INTERPRET=1 hal conformance run --backend triton
--device cpu --ops token_logprobs_fast`.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

import hal
from hal import dispatch, spec as specs
from hal.errors import InputError, SpecError, UnsupportedError
from hal.kernels.triton.versions import interpreting
from hal.spec import (FAST, POLICY_SPECS, ExactMatmulSpec, FastMatmulSpec, FastMatmulV3Spec, MatmulSpec,
                      TokenLogprobsSpec)

from _triton_seq_run import ROOT, needs_interpreter, run_checks

SPEC = TokenLogprobsSpec(matmul=FastMatmulSpec())
ID = "token_logprobs.strict.fast-m128-n128-k64-w8-s3-v2.v256.lsm1.v2"
CPU = torch.device("cpu")


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 32, generator=g).to(dtype), torch.randn(40, 32, generator=g).to(dtype),
            torch.randint(0, 40, (3,), generator=g))


def test_spec_id_round_trips_and_names_the_matmul():
    assert SPEC.id == ID and specs.get(ID) is POLICY_SPECS[FAST]["token_logprobs"] == SPEC
    assert SPEC.policies_used() == {"strict", "fast"}
    for s in (SPEC, TokenLogprobsSpec(matmul=FastMatmulV3Spec(), vocab_tile=128),
              TokenLogprobsSpec(matmul=FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2))):
        assert specs.from_id(s.id) == s and specs.resolve("token_logprobs", s.id) == s
    assert TokenLogprobsSpec(matmul=FastMatmulV3Spec()).id == "token_logprobs.strict.fast-wgmma-k16-t1-v3.v256.lsm1.v2"
    words = " ".join(SPEC.describe())
    assert "matmul.fast.m128.n128.k64.w8.s3.v2" in words and "no output rounding" in words and "no L4" in words
    assert "same bits on every backend" not in words  # the strict words' L4 promise does not hold for fast logits
    # ids that name no fast matmul (a bad field, a strict matmul's form, an unknown version) parse to nothing
    for bad in ("token_logprobs.strict.fast-m100-n128-k64-w8-s3-v2.v256.lsm1.v2",
                "token_logprobs.strict.fast-k64-v2.v256.lsm1.v2",
                "token_logprobs.strict.fast-strict-k64-v2.v256.lsm1.v2",
                "token_logprobs.strict.fast-m128-n128-k64-w8-s3-v9.v256.lsm1.v2"):
        assert specs.from_id(bad) is None, bad
    # the strict and exact ids are unchanged
    assert specs.DEFAULTS["token_logprobs"].id == "token_logprobs.strict.h64.v256.lsm1.v2"
    assert TokenLogprobsSpec(matmul=ExactMatmulSpec(slices=4)).id == "token_logprobs.strict.exact-s4.v256.lsm1.v2"


def test_spec_validation_names_the_field():
    with pytest.raises(SpecError, match="hidden_tile does not apply with the matmul matmul.fast"):
        TokenLogprobsSpec(hidden_tile=32, matmul=FastMatmulSpec())
    with pytest.raises(SpecError, match="ExactMatmulSpec, a FastMatmulSpec or a FastMatmulV3Spec"):
        TokenLogprobsSpec(matmul=MatmulSpec())
    with pytest.raises(SpecError, match="power of two"):
        TokenLogprobsSpec(matmul=FastMatmulSpec(block_k=48))


def test_the_switch_covers_token_logprobs():
    assert specs.policy_spec("token_logprobs", FAST) is POLICY_SPECS[FAST]["token_logprobs"] == SPEC
    assert dispatch.switched_spec("token_logprobs", FAST) == SPEC
    assert dispatch.switched_spec("token_logprobs", "strict") is specs.DEFAULTS["token_logprobs"]
    assert dispatch.suite_of("token_logprobs", SPEC) == "token_logprobs_fast"
    with hal.use(policy="fast"):
        assert dispatch.call_spec("token_logprobs", None) == SPEC
        assert dispatch.call_spec("softmax", None) is specs.DEFAULTS["softmax"]  # no fast softmax spec: strict


def test_backends_without_the_fast_policy_refuse_by_name():
    for name in ("reference", "cpu", "ascend", "jax"):
        be = dispatch.backends().get(name)
        if be is None:
            continue
        reasons = be.supports("token_logprobs", SPEC, torch.bfloat16, CPU)
        assert any(f"not 'fast' (spec {ID})" in r for r in reasons), (name, reasons)
        assert be.claimed_levels("token_logprobs_fast", SPEC) == frozenset()
        assert "token_logprobs_fast" not in be.suites
    h, w, t = _inputs()
    with pytest.raises(UnsupportedError, match=f"backend 'reference'.*{ID}"):
        hal.token_logprobs(h, w, t, spec=SPEC, backend="reference")
    triton = hal.get_backend("triton")
    assert triton.claimed_levels("token_logprobs_fast", SPEC) == frozenset({"L0", "L1", "L3", "A"})  # never L4
    assert triton.claimed_levels("token_logprobs", specs.DEFAULTS["token_logprobs"]) >= {"L4"}
    assert any("bfloat16/float16 tensor cores only, not torch.float32" in r and ID in r
               for r in triton.supports("token_logprobs", SPEC, torch.float32, CPU))
    assert not any("tensor cores only" in r for r in triton.supports("token_logprobs", SPEC, torch.bfloat16, CPU))


def test_hal_jax_refuses_a_fast_spec_by_name():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import hal.jax as hj
    a = jnp.ones((2, 4), jnp.bfloat16)
    with pytest.raises(UnsupportedError, match=f"hal.jax: spec {ID} uses the fast policy"):
        hj.token_logprobs(a, a, jnp.zeros((2,), jnp.int32), spec=SPEC)
    with pytest.raises(UnsupportedError, match="hal.jax: spec matmul.fast"):
        hj.matmul(a, a.T, spec=FastMatmulSpec())


def test_an_exact_weight_is_refused_under_the_fast_spec():
    h, w, t = _inputs()
    prepared = hal.exact_weight(w, spec=ExactMatmulSpec(slices=4))
    with pytest.raises(InputError, match=re.escape(f"holds slices for matmul.exact.s4.v2, but the call's spec {ID} "
                                                   "does not use the exact policy")):
        hal.token_logprobs(h, prepared, t, spec=SPEC, backend="stock")


@pytest.mark.skipif(interpreting() or torch.cuda.is_available(), reason="the refusal where no backend claims fast")
def test_fast_switch_refuses_token_logprobs_on_cpu():
    h, w, t = _inputs()
    with hal.use(policy="fast"):
        with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: no backend that claims "
                                                   r"'token_logprobs_fast' can run token_logprobs") as e:
            hal.token_logprobs(h, w, t)
    assert any("TRITON_INTERPRET=1" in r for r in e.value.reasons)
    with hal.use("stock", policy="fast"):  # the stock control serves every spec, claims nothing: refused
        with pytest.raises(UnsupportedError, match="the requested backend 'stock' claims no level of conformance "
                                                   "suite 'token_logprobs_fast'"):
            hal.token_logprobs(h, w, t)


@needs_interpreter
def test_fast_token_logprobs_in_interpreter():
    pytest.importorskip("triton")
    out = run_checks(script=os.path.join(ROOT, "tests", "scripts", "token_logprobs_fast_check.py"))  # ~45 s here
    assert out.count("wrong variant caught") == 3 and out.count("identical") == 3
