"""Conformance of the Qwen3-Next layer pieces (gdn_gating, gdn_causal_conv1d): reference passes every
level; the stock path (torch's exp/softplus/sigmoid gates, F.conv1d + F.silu) is caught."""
import pytest

from hal.conformance import runner, suites


@pytest.fixture(scope="module")
def records():
    return runner.run(["reference", "stock"], ["gdn_layer"])


def test_reference_passes_every_level(records):
    ref = [r for r in records if r.backend == "reference"]
    assert {r.dtype for r in ref} == {"fp32", "bf16", "fp16"}
    assert {r.level for r in ref} == set(suites.get("gdn_layer").levels)
    bad = [f"{r.dtype} {r.level}: {r.detail}" for r in ref if r.status != "pass"]
    assert not bad, bad


@pytest.mark.parametrize("level", ["L2", "L4"])
def test_stock_is_caught(records, level):
    stock = [r for r in records if r.backend == "stock" and r.level == level]
    assert stock and all(r.status == "fail" and not r.claimed for r in stock)
    assert all(r.first_divergence and r.first_divergence.get("case") for r in stock)
