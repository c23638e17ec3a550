"""Gated delta rule with batch 0 (issue 21 item 14): one defined answer, decided in the public op before
dispatch, so every backend agrees: o is empty [0, T, HV, d_v] in v's dtype and the final state is a
zero-size float32 [0, HV, d_k, d_v] (or a state object holding 0 sequences)."""
import pytest
import torch

import hal
from hal import dispatch, spec as specs
from hal.gated_delta_rule import GatedDeltaRuleState, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from hal.ops_registry import OPS

OP_NAMES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
FNS = dict(zip(OP_NAMES, (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)))
T, H, HV, DK, DV = 5, 2, 4, 8, 6


def _backends(op):
    s = specs.resolve(OPS[op], None)
    return [n for n, b in dispatch.backends().items()
            if not b.supports(op, s, torch.float32, torch.device("cpu"))]


def _inputs(batch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, T, H, DK, generator=g)
    k = torch.randn(batch, T, H, DK, generator=g)
    v = torch.randn(batch, T, HV, DV, generator=g).to(torch.bfloat16)
    gate = -torch.rand(batch, T, HV, generator=g)
    beta = torch.rand(batch, T, HV, generator=g)
    return q, k, v.float().to(torch.bfloat16), gate, beta


@pytest.mark.parametrize("op", OP_NAMES)
def test_batch_zero_gives_empty_outputs_on_every_backend(op):
    names = _backends(op)
    assert "reference" in names and len(names) >= 2, names  # at least two backends must agree
    q, k, v, gate, beta = _inputs(0)
    q, k, gate, beta = (t.to(torch.bfloat16) for t in (q, k, gate, beta))
    for name in names:
        o, final = FNS[op](q, k, v, gate, beta, output_final_state=True, backend=name)
        assert o.shape == (0, T, HV, DV) and o.dtype == torch.bfloat16, name
        assert final.shape == (0, HV, DK, DV) and final.dtype == torch.float32, name
        o2, st = FNS[op](q, k, v, gate, beta, output_final_state="state", backend=name)
        assert isinstance(st, GatedDeltaRuleState) and st.batch_size == 0 and o2.shape == o.shape, name
        o3, none = FNS[op](q, k, v, gate, beta, initial_state=torch.zeros(0, HV, DK, DV), backend=name)
        assert none is None and o3.shape == o.shape, name


def test_batch_zero_still_checks_its_arguments():
    q, k, v, gate, beta = _inputs(0)
    with pytest.raises(hal.InputError, match="initial_state shape"):
        chunk_gated_delta_rule(q, k, v.float(), gate, beta, initial_state=torch.zeros(1, HV, DK, DV))
