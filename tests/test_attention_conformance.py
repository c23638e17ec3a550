"""The attention conformance suite through the runner: the reference passes every level it claims;
the negative controls (torch's SDPA, and a reference that changes its block size for decode) are
caught at L2 with the first divergence. The full suite runs with
`hal conformance run --backend reference --ops attention`; here a subset keeps the tests short."""
import pytest
import torch

import hal
from hal.backends.reference import ReferenceBackend
from hal.conformance import runner, suites
from hal.conformance.bits import first_divergence
from hal.conformance.suite import DTYPE_NAMES
from hal.spec import AttentionSpec

FAM = suites.get("attention")


# rows are thread-count invariant (L0 still runs 1 and 2 threads): one thread keeps the reference fast
pytestmark = pytest.mark.usefixtures("one_thread")


def _cases(name, dtypes=("fp32", "bf16", "fp16")):
    return [c for c in FAM.cases() if c.name == name and DTYPE_NAMES[c.dtype] in dtypes]


def _run(backend, cases, levels):
    """{level: _Outcome} over the cases, through the runner's own per-case code."""
    outcomes = {lvl: runner._Outcome() for lvl in levels}
    for case in cases:
        runner.run_case(FAM, hal.get_backend(backend) if isinstance(backend, str) else backend, case,
                        torch.device("cpu"), levels, outcomes)
    return outcomes


def test_family_shape():
    assert FAM.levels == ("L0", "L1", "L2", "L3", "L4", "A")
    assert {DTYPE_NAMES[c.dtype] for c in FAM.cases()} == {"fp32", "bf16", "fp16"}
    names = {c.name for c in FAM.cases()}
    assert any("d64" in n for n in names) and any("d128" in n for n in names) and any("d40" in n for n in names)
    assert any("window" in n for n in names) and any("kv1" in n for n in names)
    l2 = [n for n, _ in FAM.checks["L2"]]
    assert {"chunked-prefill-varlen", "chunked-prefill-kvcache", "decode", "mixed-prefill-decode",
            "paged-vs-contiguous", "num-splits", "prefix-cache-reuse"} <= set(l2)


@pytest.mark.parametrize("name,dtypes", [("mqa_h3kv1_d40_window37", ("fp32", "bf16", "fp16")),
                                         ("gqa_h2kv1_d64_prounded", ("bf16",)),
                                         ("gqa_h4kv2_d64_causal", ("fp32",))])
def test_reference_passes_every_level(name, dtypes):
    outcomes = _run("reference", _cases(name, dtypes), FAM.levels)
    for lvl, o in outcomes.items():
        assert o.cases == len(dtypes) and o.checks > 0, lvl
        assert not o.failures, f"{lvl}: {o.failures[0][0]}: {o.failures[0][1]}"
    assert outcomes["L2"].checks >= 50  # every transform compared something


def test_stock_sdpa_is_caught_at_L2_with_first_divergence(capsys):
    cases = _cases("gqa_h4kv2_d64_causal", ("fp32",)) + _cases("mha_h2_d128_causal", ("bf16",))
    outcomes = _run("stock", cases, ("L2",))
    o = outcomes["L2"]
    assert {c for c, _ in o.failures} == {c.id for c in cases}
    case_id, div = o.failures[0]
    assert div.index is not None and div.expected_bits != div.got_bits and div.ulp >= 1
    print(f"stock L2 first divergence ({case_id}): {div}")
    # the decode transform alone (SDPA with 1 query vs the full prefill) diverges
    case = cases[0]
    inputs = FAM.make_inputs(case)
    stock = hal.get_backend("stock")
    with torch.no_grad():
        base = FAM.run(stock, case, inputs)
    decode = dict(FAM.checks["L2"])["decode"]
    divs = [d for d in (first_divergence(lab, e, g) for lab, e, g in decode(stock, case, inputs, base)) if d]
    assert divs
    print(f"stock decode vs prefill: {divs[0]}")
    assert "first divergence" in capsys.readouterr().out


class _BlockByQueryCount(ReferenceBackend):
    """Mutant: picks a smaller KV block for single-query (decode) calls, as shape-tuned kernels do."""
    name = "mutant-decode-block"

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        if q.shape[1] == 1:
            spec = AttentionSpec(kv_block=spec.kv_block // 2, kv_split=spec.kv_split, dot_tile=spec.dot_tile)
        return super().flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                               num_splits, spec)


def test_shape_dependent_block_size_is_caught_by_decode_check():
    case = _cases("mha_h2_d128_causal", ("fp32",))[0]
    mutant = _BlockByQueryCount()
    outcomes = _run(mutant, [case], ("L1", "L2"))
    assert not outcomes["L1"].failures  # varlen is untouched by the mutation...
    failed = {d.label.split("/")[0] for _, d in outcomes["L2"].failures}
    # ...decode (and the 1-token chunks of the cut-everywhere prefill) have Sq == 1; varlen paths do not
    assert "decode" in failed and not failed & {"chunked-prefill-varlen", "mixed-prefill-decode"}, failed
