"""L4 must prove it compared something (issue 7, section 5): the family's outputs, not the manifest,
say what is compared; a manifest that lost a case or an output fails naming it; records count the
elements compared."""
import json
import shutil

import pytest
import torch

import hal
from hal.conformance import golden, report, runner, suites


@pytest.fixture
def golden_copy(tmp_path):
    dst = tmp_path / "golden"
    shutil.copytree(golden.ROOT / "softmax", dst / "softmax")
    return dst


CASE_ID = "r3_n7.fp32"


def _l4(golden_root, case_id=CASE_ID):
    """The L4 record of one softmax case on the reference backend."""
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == case_id)
    outcomes = {"L4": runner._Outcome()}
    runner.run_case(fam, hal.get_backend("reference"), case, torch.device("cpu"), ["L4"], outcomes, golden_root)
    return runner._record("reference", "softmax", "fp32", case.spec.id, "L4", outcomes["L4"], True), case


def _edit_manifest(root, fn):
    path = root / "softmax" / "manifest.json"
    body = json.loads(path.read_text())
    fn(body["entries"])
    path.write_text(json.dumps(body))


def _key(case):
    return f"{case.spec.id}/{case.id}"


def test_intact_goldens_pass_and_count_elements(golden_copy):
    rec, case = _l4(golden_copy)
    n = 3 * 7  # softmax, log_softmax [3, 7] + logsumexp [3]
    assert rec.status == "pass", rec.detail
    assert rec.comparisons == 3 and rec.elements == 2 * n + 3
    assert rec.detail == f"1 cases, 3 comparisons, {2 * n + 3} elements"
    assert json.loads(report.to_json([rec], {}))["records"][0]["elements"] == 2 * n + 3


def test_manifest_with_the_outputs_removed_fails_L4(golden_copy):
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == CASE_ID)
    _edit_manifest(golden_copy, lambda e: e[_key(case)].update(outputs={}))
    rec, _ = _l4(golden_copy)
    assert rec.status == "fail" and rec.comparisons == 0
    assert CASE_ID in rec.detail and "missing output(s) ['log_softmax', 'logsumexp', 'softmax']" in rec.detail


def test_manifest_missing_one_output_fails_L4_naming_it(golden_copy):
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == CASE_ID)
    _edit_manifest(golden_copy, lambda e: e[_key(case)]["outputs"].pop("logsumexp"))
    rec, _ = _l4(golden_copy)
    assert rec.status == "fail" and "missing output(s) ['logsumexp']" in rec.detail and CASE_ID in rec.detail


def test_manifest_with_an_unknown_output_fails_L4(golden_copy):
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == CASE_ID)

    def add(e):
        e[_key(case)]["outputs"]["extra"] = dict(e[_key(case)]["outputs"]["softmax"])
    _edit_manifest(golden_copy, add)
    rec, _ = _l4(golden_copy)
    assert rec.status == "fail" and "unknown output(s) ['extra']" in rec.detail


def test_manifest_missing_a_case_fails_L4_naming_it(golden_copy):
    fam = suites.get("softmax")
    case = next(c for c in fam.cases() if c.id == CASE_ID)
    _edit_manifest(golden_copy, lambda e: e.pop(_key(case)))
    rec, _ = _l4(golden_copy)
    assert rec.status == "fail" and f"no golden for case {CASE_ID}" in rec.detail


def test_a_level_that_compared_nothing_fails():
    o = runner._Outcome()
    o.cases = 4
    rec = runner._record("reference", "softmax", "fp32", "s", "L4", o, True)
    assert rec.status == "fail" and "nothing was compared" in rec.detail


def test_element_counts_read_well():
    assert [runner._count(n) for n in (340, 9999, 12_345, 1_234_567)] == ["340", "9999", "12.3k", "1.2M"]
