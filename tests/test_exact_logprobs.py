"""token_logprobs with exact LM-head logits (TokenLogprobsSpec(matmul=ExactMatmulSpec)): the spec and
its id, reference == cpu bits (vocab and token tiling forced small), batch invariance and raw-bit
invariance under a random permutation of the hidden axis, negative controls (the strict k64 chain
and stock torch change bits under the same permutation), clean refusal by strict-only backends.

The full conformance suite: `hal conformance run --backend reference,cpu,stock --ops token_logprobs_exact`.
"""
from __future__ import annotations

import pytest
import torch

import hal
from hal import spec as specs
from hal.spec import ExactMatmulSpec, TokenLogprobsSpec
from test_exact_matmul import assert_bits

SPEC = TokenLogprobsSpec(matmul=ExactMatmulSpec(slices=4))
ID = "token_logprobs.strict.exact-s4.v256.lsm1.v2"


def _inputs(n=9, h=96, v=515, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g).to(dtype)
    hid[:, 3] *= 500  # a massive-activation channel
    w = (torch.randn(v, h, generator=g) * 4 * h ** -0.5).to(dtype)
    return hid, w, torch.randint(0, v, (n,), generator=g)


def test_spec_id_default_unchanged_and_errors():
    assert SPEC.id == ID and specs.get(ID) == SPEC
    assert specs.DEFAULTS["token_logprobs"].id == "token_logprobs.strict.h64.v256.lsm1.v2"
    assert SPEC.policies_used() == {"strict", "exact"}
    assert "matmul.exact.s4.v2" in " ".join(SPEC.describe())
    with pytest.raises(hal.SpecError, match="hidden_tile"):
        TokenLogprobsSpec(hidden_tile=32, matmul=ExactMatmulSpec(slices=4))
    with pytest.raises(hal.SpecError, match="ExactMatmulSpec"):
        TokenLogprobsSpec(matmul=specs.MatmulSpec())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_matches_reference_across_tiles(monkeypatch, temperature):
    """cpu's vocab tiles and token chunks forced small (several of each) and NaN/inf rows: the reference's bits."""
    from hal.kernels.cpu import exact_logprobs
    monkeypatch.setattr(exact_logprobs, "VOCAB_TILE", 128)
    monkeypatch.setattr(exact_logprobs, "_ROW_CHUNK", 4)
    hid, w, tok = _inputs()
    hid[1, 5], hid[2, 7] = float("nan"), float("inf")
    ref = hal.token_logprobs(hid, w, tok, temperature, spec=SPEC, backend="reference")
    assert_bits("cpu", ref, hal.token_logprobs(hid, w, tok, temperature, spec=SPEC, backend="cpu"))
    assert torch.isnan(ref).tolist() == [i in (1, 2) for i in range(9)]  # an inf logit poisons its row


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_batch_and_hidden_permutation_invariance(backend):
    hid, w, tok = _inputs(seed=1)
    base = hal.token_logprobs(hid, w, tok, spec=SPEC, backend=backend)
    assert_bits("row alone", base[4:5], hal.token_logprobs(hid[4:5], w, tok[4:5], spec=SPEC, backend=backend))
    perm = torch.randperm(hid.shape[1], generator=torch.Generator().manual_seed(2))
    assert_bits("hidden permuted", base, hal.token_logprobs(hid[:, perm], w[:, perm], tok, spec=SPEC, backend=backend))


@pytest.mark.parametrize("backend,spec", [("reference", None), ("stock", SPEC)])
def test_negative_controls_change_bits_under_the_permutation(backend, spec):
    """The strict k64 chain (order fixed, not free) and stock torch are caught by the same check."""
    hid, w, tok = _inputs(n=16, h=512, v=300, dtype=torch.float32, seed=3)
    base = hal.token_logprobs(hid, w, tok, spec=spec, backend=backend)
    perm = torch.randperm(hid.shape[1], generator=torch.Generator().manual_seed(2))
    got = hal.token_logprobs(hid[:, perm], w[:, perm], tok, spec=spec, backend=backend)
    assert not torch.equal(base.view(torch.int32), got.view(torch.int32))


def test_jax_matches_reference():
    pytest.importorskip("jax", reason="jax is not installed")
    hid, w, tok = _inputs(n=5, h=70, v=300, dtype=torch.float16, seed=4)
    hid[2, 5] = float("nan")
    ref = hal.token_logprobs(hid, w, tok, 0.7, spec=SPEC, backend="reference")
    assert_bits("jax", ref, hal.token_logprobs(hid, w, tok, 0.7, spec=SPEC, backend="jax"))


def test_strict_only_backends_refuse_by_name():
    """A backend without the exact policy (ascend, ...) names the spec and the missing policy."""
    from hal.backend import Backend

    class StrictOnly(Backend):
        name = "strict-only"
        device_types = ("cpu",)

        def token_logprobs(self, *a):
            raise AssertionError("must not run")
    reasons = StrictOnly().supports("token_logprobs", SPEC, torch.float32, torch.device("cpu"))
    assert reasons == [f"strict-only: implements policies ['strict'], not 'exact' (spec {ID})"]
    assert StrictOnly().supports("token_logprobs", specs.DEFAULTS["token_logprobs"], torch.float32,
                                 torch.device("cpu")) == []
    assert any(f"not 'exact' (spec {ID})" in r
               for r in hal.get_backend("ascend").supports("token_logprobs", SPEC, torch.float32, torch.device("cpu")))
    # the triton backend serves the exact policy (its kernels: tests/test_triton_interpreter.py's conformance)
    assert not any("not 'exact'" in r
                   for r in hal.get_backend("triton").supports("token_logprobs", SPEC, torch.float32, torch.device("cpu")))


def test_hidden_longer_than_the_exact_limit_is_refused():
    hid = torch.zeros(1, 2 ** 24 + 1, dtype=torch.bfloat16)
    for backend in ("reference", "cpu"):
        with pytest.raises(hal.InputError, match="2\\*\\*24"):
            hal.token_logprobs(hid, hid, torch.zeros(1, dtype=torch.long), spec=SPEC, backend=backend)


def test_conformance_quick_reference_passes_and_stock_is_caught():
    from hal import dispatch
    from hal.conformance import runner, suites
    fam = suites.get("token_logprobs_exact")
    case = next(c for c in fam.quick_cases() if c.id == "n4_h70_v300_t1.0.bf16")
    for bname in ("reference", "stock"):
        out = {lvl: runner._Outcome() for lvl in fam.levels}
        runner.run_case(fam, dispatch.get_backend(bname), case, torch.device("cpu"), fam.levels, out)
        failed = {lvl for lvl, o in out.items() if o.failures}
        if bname == "reference":
            assert not failed and all(o.cases == 1 for o in out.values()), failed
        else:
            assert {"L2", "L4"} <= failed, failed


def test_cpu_backend_serves_exact_linear_with_reference_bits():
    """The cpu backend now implements the exact policy (torch._int_mm) and is auto-selected for it."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 4, 70, generator=g).half(), torch.randn(9, 70, generator=g).half(), torch.randn(9).half()
    spec = ExactMatmulSpec(slices=3)
    assert hal.select("linear", spec, torch.float16, torch.device("cpu")).name == "cpu"
    assert_bits("cpu linear", hal.linear(x, w, b, spec=spec, backend="reference"), hal.linear(x, w, b, spec=spec, backend="cpu"))
    assert_bits("cpu matmul", hal.matmul(x, w.T, spec=spec, backend="reference"), hal.matmul(x, w.T, spec=spec, backend="cpu"))
