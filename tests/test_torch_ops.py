"""torch.ops.lockstep.*: every op of the table is registered, passes torch.library.opcheck (schema, fake
kernel, autograd registration, AOT dispatch) across dtypes and edge shapes, and gives the public op's
raw bits."""
from __future__ import annotations

import pytest
import torch

import hal
from hal import ops_registry, torch_ops
from hal.ops_registry import OPS, TORCH_OPS

from _torch_op_cases import BF16, F32, op_args, public


CASES = [(F32, 3, False), (BF16, 1, False), (F32, 4, True)]  # grads; one bf16 row; non-contiguous


def test_every_public_op_of_the_group_a_table_is_a_registered_torch_op():
    registered = set(torch_ops.registered())
    assert registered == set(TORCH_OPS)
    for op in TORCH_OPS.values():
        assert op.public in OPS and op.family == OPS[op.public]
        assert op.fake is not None
        schema = str(getattr(torch.ops.lockstep, op.name).default._schema)
        assert schema.endswith(f"str? spec, str? backend) -> {op.returns}".replace("(Tensor, Tensor)",
                                                                                 "(Tensor, Tensor)"))
    public_with_op = {op.public for op in TORCH_OPS.values()}
    assert set(OPS) == public_with_op  # every public op of the table is a torch op
    # the integration's own ops are registered by the integration (hal.integrations.hf_*), never by the core
    assert {"hf_attention", "hf_gated_delta_net"} <= registered


def test_the_table_reads_mutated_arguments_from_the_schema():
    op = ops_registry.TorchOp("probe", "linear", hal.linear, "Tensor(a!) cache, Tensor x", "Tensor")
    assert op.mutates == ("cache",)
    assert TORCH_OPS["linear"].mutates == ()


@pytest.mark.parametrize("name", list(TORCH_OPS))
@pytest.mark.parametrize("dtype,rows,noncontig", CASES, ids=["f32-grad", "bf16-1row", "f32-noncontig"])
def test_opcheck(name, dtype, rows, noncontig):
    args = op_args(name, dtype, rows, noncontig)
    torch.library.opcheck(getattr(torch.ops.lockstep, name).default, (*args, None, None))


@pytest.mark.parametrize("name", list(TORCH_OPS))
def test_torch_op_gives_the_public_ops_bits(name):
    args = op_args(name, F32)
    copy = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # kvcache writes its caches
    with torch.no_grad():
        got = getattr(torch.ops.lockstep, name)(*args, None, None)
        want = public(name, copy)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(args, copy) if isinstance(a, torch.Tensor))  # same writes


def test_routed_eager_calls_reach_the_torch_ops_and_are_counted():
    x, w, b = op_args("linear")
    with torch_ops.routed(), torch_ops.op_calls() as calls:
        y = hal.linear(x, w, b)
    assert calls == {"linear": 1}
    assert torch.equal(y.view(torch.int32), hal.linear(x, w, b).view(torch.int32))
    with torch_ops.op_calls() as calls:  # negative control: the direct eager path makes no torch op call
        hal.linear(x, w, b)
    assert calls == {}


def test_a_prepared_exact_weight_is_refused_under_compile_naming_the_feature():
    x, w, _ = op_args("linear")
    prepared = hal.exact_weight(w.detach(), spec="matmul.exact.s4.v2")
    with torch_ops.routed(), pytest.raises(hal.UnsupportedError, match="exact_weight"):
        hal.linear(x, prepared, spec="matmul.exact.s4.v2")


def test_kernel_errors_are_the_public_ops_messages():
    hidden, w, tokens, t = op_args("token_logprobs")
    with pytest.raises(hal.InputError, match=r"tokens must be in \[0, 32\)"):
        torch.ops.lockstep.token_logprobs(hidden, w, tokens + 100, t, None, None)
