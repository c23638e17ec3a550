"""The gated_delta_rule conformance suite: the reference passes every level; the stock backend
(transformers' Qwen3-Next functions) is caught at L2 by both negative controls; a planted
call-boundary rounding of the state is caught at L2. (The full run over every case is
`hal conformance run --backend reference --ops gated_delta_rule`.)"""
import pytest
import torch

import hal
from hal.backends.reference import ReferenceBackend
from hal.conformance import runner, suites
from hal.kernels.reference.gated_delta_rule import Parts

FAM = suites.get("gated_delta_rule")
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _case(name, variant, dtype):
    return next(c for c in FAM.cases() if c.name == name and c.spec.variant == variant and c.dtype == dtype)


def _run(backend, case):
    out = {lvl: runner._Outcome() for lvl in FAM.levels}
    runner.run_case(FAM, hal.get_backend(backend) if isinstance(backend, str) else backend, case,
                    torch.device("cpu"), FAM.levels, out)
    return out


def _labels(outcome):
    return [d.label for _, d in outcome.failures]


@pytest.mark.parametrize("name,variant,dtype", [
    ("sweep_gva_h1v2_d16", "chunked", torch.float32),
    ("sweep_gva_h1v2_d16", "serial", torch.float16),
    ("gva_h2v4_d64_nol2_init", "chunked", torch.bfloat16),
])
def test_reference_passes_every_level(name, variant, dtype):
    out = _run("reference", _case(name, variant, dtype))
    for lvl, o in out.items():
        assert not o.failures, (lvl, [str(d) for _, d in o.failures])
        assert o.cases == 1 and o.checks > 0, lvl


def test_stock_is_caught_by_both_negative_controls_at_L2():
    case = _case("sweep_gva_h1v2_d16", "chunked", torch.float32)
    out = _run("stock", case)
    l2 = _labels(out["L2"])
    # transformers' chunk form continued from its final state: the grid restarts at the split
    assert any(lab.startswith("split-sweep/split-at-") for lab in l2), l2
    # its chunk form vs its recurrent form
    assert any(lab.startswith("recurrent-op/") for lab in l2), l2
    assert out["L3"].failures and out["L4"].failures
    assert not out["A"].failures  # it is accurate; it is just not the same bits at every split
    div = out["L2"].failures[0][1]
    assert div.index is not None and div.expected_bits != div.got_bits


def test_stock_split_divergence_is_at_the_non_aligned_points():
    """Per split point: transformers' chunk form continued from the bare state diverges at points that
    are not multiples of 64 (the reference is exact at all of them: test above)."""
    case = _case("sweep_gva_h1v2_d16", "chunked", torch.float32)
    inputs = FAM.make_inputs(case)
    with torch.no_grad():
        base = FAM.run("stock", case, inputs)
        sweep = dict(FAM.checks["L2"])["split-sweep"]
        pairs = list(sweep("stock", case, inputs, base))
    diverged = {}
    for label, want, got in pairs:
        p = int(label.split("split-at-")[1].split(":")[0])
        diverged[p] = diverged.get(p, False) or not torch.equal(want, got)
    off = [p for p in diverged if p % 64]
    assert sum(diverged[p] for p in off) >= 0.9 * len(off), sorted(p for p in off if not diverged[p])


class _RoundsStateAtCallEnd(ReferenceBackend):
    """A plausible bug: the carried state is stored in bf16 between calls (docs/design.md, principle 4)."""
    name = "rounds-state"

    def chunk_gated_delta_rule(self, *args):
        o, p = super().chunk_gated_delta_rule(*args)
        r = lambda t: None if t is None else t.to(torch.bfloat16).to(t.dtype)  # noqa: E731
        return o, Parts(p.position, r(p.S), p.open_k, p.open_v, p.open_g, p.open_beta, p.final)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule


def test_planted_state_rounding_at_call_boundaries_is_caught_at_L2():
    b = _RoundsStateAtCallEnd()
    case = _case("sweep_gva_h1v2_d16", "chunked", torch.float32)
    out = _run(b, case)
    assert not out["L0"].failures and not out["L1"].failures  # single calls are unaffected
    labels = _labels(out["L2"])
    assert labels and labels[0].startswith("split-sweep/split-at-64")  # the first split past a boundary
