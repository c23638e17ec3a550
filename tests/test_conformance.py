"""The conformance suite on the foundation ops: reference passes every level it claims; the stock
negative control is caught; golden files are verified."""
import json
import shutil

import pytest
import torch

from hal import errors as hal_errors
from hal.conformance import golden, inputs, runner, suites
from hal.conformance.bits import first_divergence

FOUNDATION = ["matmul", "rms_norm", "softmax", "token_logprobs"]


@pytest.fixture(scope="module")
def reference_records():
    return runner.run(["reference"], FOUNDATION)


@pytest.fixture(scope="module")
def stock_records():
    return runner.run(["stock"], FOUNDATION)


@pytest.mark.parametrize("suite", FOUNDATION)
def test_reference_passes_every_level(reference_records, suite):
    recs = [r for r in reference_records if r.op == suite]
    assert {r.dtype for r in recs} == {"fp32", "bf16", "fp16"}
    assert {r.level for r in recs} == set(suites.get(suite).levels)
    bad = [f"{r.dtype} {r.level}: {r.detail}" for r in recs if r.status != "pass"]
    assert not bad, bad
    assert all(r.cases > 0 for r in recs)


def _status(records, op, dtype, level):
    (r,) = [r for r in records if (r.op, r.dtype, r.level) == (op, dtype, level)]
    return r


def test_stock_linear_is_caught_at_L1_with_first_divergence(stock_records):
    r = _status(stock_records, "matmul", "fp32", "L1")
    assert r.status == "fail" and not r.claimed
    fd = r.first_divergence
    assert fd["expected_bits"] != fd["got_bits"] and fd["index"] is not None and fd["ulp"] >= 1


def test_stock_is_caught_at_L4_for_every_op(stock_records):
    for op in FOUNDATION:
        assert _status(stock_records, op, "fp32", "L4").status == "fail", op


def test_stock_claims_nothing_so_exit_status_is_zero(stock_records):
    assert runner.exit_status(stock_records) == 0


def test_exit_status_fails_on_a_claimed_failure(stock_records):
    r = _status(stock_records, "matmul", "fp32", "L1")
    claimed = [runner.Record(**{**r.to_dict(), "claimed": True})]
    assert runner.exit_status(claimed) == 1


def test_bit_comparison_distinguishes_signed_zero_and_nan_payloads():
    assert first_divergence("z", torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert first_divergence("n", nan1, nan2) is not None
    assert first_divergence("same", nan1, nan1.clone()) is None
    d = first_divergence("x", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000002]))
    assert d.index == [1] and d.ulp == 1 and d.count == 1


def test_generator_is_counter_based_and_stable():
    # Pinned values: changing the generator must be deliberate (it makes every golden stale).
    assert inputs.hash64("lockstep", 2).tolist() == [16774306743383511405, 16435748577359767651]
    assert inputs.tensor_sha256(inputs.randn("lockstep/pinned", (4,))) == \
        "b9c344fe0e7de87d9b546e9ea6e77f48165199fd766c228edf8333674b43a967"
    a = inputs.randn("k", (3, 4))
    assert torch.equal(a, inputs.randn("k", (3, 4)))
    assert not torch.equal(a, inputs.randn("k2", (3, 4)))
    # counter-based: element i depends only on (key, i), not on how many were asked for
    assert (inputs.hash64("k", 6, offset=4) == inputs.hash64("k", 10)[4:]).all()


@pytest.fixture
def golden_copy(tmp_path):
    dst = tmp_path / "golden"
    shutil.copytree(golden.ROOT / "softmax", dst / "softmax")
    return dst


def _softmax_case():
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == "r3_n7.fp32")
    return fam, case


def test_flipped_byte_in_golden_names_file_and_case(golden_copy):
    fam, case = _softmax_case()
    meta = json.loads((golden_copy / "softmax" / "manifest.json").read_text())
    entry = meta["entries"][f"{case.spec.id}/{case.id}"]
    path = golden_copy / "softmax" / entry["outputs"]["softmax"]["file"]
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(golden.GoldenError) as e:
        golden.load("softmax", case, fam.make_inputs(case), golden_copy)
    assert str(path) in str(e.value) and case.id in str(e.value) and "corrupt" in str(e.value)
    # and the runner reports it as an L4 failure of a claimed level
    recs = runner.run(["reference"], ["softmax"], dtypes=["fp32"], golden_root=golden_copy)
    l4 = [r for r in recs if r.level == "L4"][0]
    assert l4.status == "fail" and case.id in l4.detail and runner.exit_status(recs) == 1


def test_stale_missing_and_malformed_goldens(golden_copy):
    fam, case = _softmax_case()
    x = fam.make_inputs(case)
    x["x"] = x["x"] + 1
    with pytest.raises(golden.GoldenError, match="stale"):
        golden.load("softmax", case, x, golden_copy)
    with pytest.raises(golden.GoldenError, match="missing"):
        golden.load("matmul", case, x, golden_copy)
    (golden_copy / "softmax" / "manifest.json").write_text("{not json")
    with pytest.raises(golden.GoldenError, match="not valid JSON"):
        golden.load("softmax", case, fam.make_inputs(case), golden_copy)


def test_checks_catch_a_planted_batch_dependence():
    """A backend that perturbs the last bit when M > 1 must fail L1 (the checks can fail)."""
    from hal.backends.reference import ReferenceBackend
    import hal

    class Sneaky(ReferenceBackend):
        name = "sneaky"

        def linear(self, x, weight, bias, spec):
            y = super().linear(x, weight, bias, spec)
            if x.shape[0] > 1:
                y = torch.nextafter(y, torch.full_like(y, float("inf")))
            return y

    hal.register_backend(Sneaky())
    try:
        recs = runner.run(["sneaky"], ["matmul"], dtypes=["fp32"])
    finally:
        hal.unregister_backend("sneaky")
    status = {r.level: r.status for r in recs}
    assert status["L1"] == "fail" and status["L4"] == "fail" and status["L0"] == "pass"


def test_a_backend_that_refuses_everything_is_not_certified():
    """A plug-in whose supports() refuses every call claims every level but compares nothing: the run fails
    and says what compared nothing and every reason (issue 21 item 11)."""
    from hal.backends.reference import ReferenceBackend
    import hal

    class RefusesAll(ReferenceBackend):
        name = "refuses-all"

        def supports(self, op, spec, dtype, device):
            return [f"refuses-all: never serves {op}", "refuses-all: a second reason"]

    hal.register_backend(RefusesAll())
    try:
        recs = runner.run(["refuses-all"], ["softmax"], dtypes=["fp32"])
    finally:
        hal.unregister_backend("refuses-all")
    assert recs and all(r.status == "unsupported" and r.claimed and r.comparisons == 0 for r in recs)
    assert runner.exit_status(recs) == 1
    why = runner.compared_nothing(recs)
    assert len(why) == 1 and why[0].startswith("refuses-all softmax fp32 softmax.strict.t256.lsm1.v2 L0 L1 L3 L4 A: "
                                               "claimed, but compared nothing")
    assert all("never serves log_softmax" in w and "never serves softmax" in w and "a second reason" in w
               for w in why)


def test_a_run_that_compared_nothing_fails():
    assert runner.exit_status([]) == 1 and "compared nothing" in runner.compared_nothing([])[0]
    with pytest.raises(hal_errors.InputError, match="dtypes must be a non-empty list"):
        runner.run(["reference"], ["softmax"], dtypes=[])
    with pytest.raises(hal_errors.InputError, match="dtypes must be a non-empty list"):
        runner.run(["reference"], ["softmax"], dtypes=["fp8"])
