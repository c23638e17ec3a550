"""The routing call at every public op's head (hal.ops_registry.routing): direct eager path, torch op while
tracing (or routed()), the op's DTensor rule -- and a DTensor given to an op without a rule is refused by
name, never run through plain-tensor code.

A stand-in DTensor class (a plain tensor subclass put where routing looks the class up) keeps this in one
process; tests/test_tensor_parallel.py runs the real DTensor rules on 2 gloo ranks."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import hal
from hal import ops_registry, torch_ops
from hal.ops_registry import DIRECT, DTENSOR, DTENSOR_RULES, TORCH_OP, routing


class StandInDTensor(torch.Tensor):
    pass


@pytest.fixture
def dtensor(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.SimpleNamespace(DTensor=StandInDTensor))
    return torch.Tensor._make_subclass(StandInDTensor, torch.randn(3, 16))


def test_plain_tensors_run_direct_and_routed_calls_the_torch_op(dtensor):
    x = torch.randn(3, 16)
    assert routing("linear", x, torch.nn.Parameter(x), None) is DIRECT
    assert routing("linear", x, 2, "not a tensor") is DIRECT  # other values are never DTensors
    with torch_ops.routed():
        assert routing("linear", x) is TORCH_OP
        # a DTensor wins over tracing: its rule runs traced (compiled DTensor calls keep eager's bits and refusals)
        assert routing("linear", x, dtensor) is DTENSOR
        with pytest.raises(hal.UnsupportedError, match="sigmoid: DTensor arguments are not supported"):
            routing("sigmoid", dtensor)


def test_a_dtensor_takes_the_rule_of_the_ops_that_have_one(dtensor):
    x = torch.randn(3, 16)
    for op in DTENSOR_RULES:
        assert routing(op, x, dtensor) is DTENSOR
    assert ops_registry.has_dtensor(x, dtensor) and not ops_registry.has_dtensor(x, None)


@pytest.mark.parametrize("op,call", [
    ("sigmoid", lambda d: hal.sigmoid(d)),
    ("logsumexp", lambda d: hal.logsumexp(d)),
    ("matmul", lambda d: hal.matmul(d, torch.randn(16, 4))),
    ("flash_attn_varlen_func", lambda d: hal.flash_attn_varlen_func(
        d.reshape(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32), 3, 3)),
])
def test_a_dtensor_given_to_an_op_without_a_rule_is_refused_by_name(dtensor, op, call):
    assert op not in DTENSOR_RULES
    with pytest.raises(hal.UnsupportedError, match=f"{op}: DTensor arguments are not supported"):
        call(dtensor)


def test_negative_control_without_the_stand_in_class_the_same_tensor_runs_direct(dtensor, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.SimpleNamespace(DTensor=None))
    assert routing("sigmoid", dtensor) is DIRECT  # so the refusals above come from the DTensor check
