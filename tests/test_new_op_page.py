"""docs/architecture.md "A new op, step by step", proven: tests/fixtures/newop/lockstep_square.py, an op written
from that page alone and living outside the package, registers through one call (``hal.torch_ops.register``, its
record and its kernel) and gets every layer: each derived table holds it; it runs eagerly, compiled with
``fullgraph=True``, on fake tensors and under autograd (compiled too) with eager's raw bits; and its conformance
suite passes on the reference backend.

Negative controls: before the import no table holds it; a record missing its fake (or whose kernel breaks the
contract) is refused by name at registration and changes no table; a kernel with a second rounding fails the suite.
The fixture's registration is undone after the module (the tables restored), so no other test sees the op.
"""
from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys

import pytest
import torch

import hal
from hal import backend as hal_backend, backend_contract, ops_registry, torch_ops
from hal.backends.reference import ReferenceBackend
from hal.conformance import runner, suites

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "newop"


def _tables():
    return {"OPS": dict(ops_registry.OPS), "TORCH_OPS": dict(ops_registry.TORCH_OPS),
            "DTENSOR_RULES": set(ops_registry.DTENSOR_RULES), "SUITES": dict(hal_backend.CONFORMANCE_SUITES),
            "OUTSIDE": dict(hal_backend.OUTSIDE_SUITES), "contract": set(vars(backend_contract.BackendOps)),
            "reference": set(vars(ReferenceBackend))}


def _restore(saved):
    for live, key in ((ops_registry.OPS, "OPS"), (ops_registry.TORCH_OPS, "TORCH_OPS"),
                      (hal_backend.CONFORMANCE_SUITES, "SUITES"), (hal_backend.OUTSIDE_SUITES, "OUTSIDE")):
        live.clear()
        live.update(saved[key])
    ops_registry.DTENSOR_RULES.clear()
    ops_registry.DTENSOR_RULES.update(saved["DTENSOR_RULES"])
    for cls, key in ((backend_contract.BackendOps, "contract"), (ReferenceBackend, "reference")):
        for name in set(vars(cls)) - saved[key]:
            delattr(cls, name)


@pytest.fixture(scope="module")
def op():
    before = _tables()
    assert "square" not in before["OPS"] and "square" not in before["TORCH_OPS"]  # nothing holds it before
    assert importlib_missing("lockstep_square")
    sys.path.insert(0, str(FIXTURE))
    try:
        import lockstep_square
        yield lockstep_square
    finally:
        sys.path.remove(str(FIXTURE))
        sys.modules.pop("lockstep_square", None)
        _restore(before)


def importlib_missing(name):
    import importlib.util
    return importlib.util.find_spec(name) is None


def _bits(t):
    return t.contiguous().view({torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16))


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _x(dtype=torch.float32, grad=False, nan=True):
    x = (torch.randn(6, 33, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    if nan:
        x[1, 2] = float("nan")
    return x.requires_grad_(grad)


def test_every_derived_table_holds_it(op):
    from hal.spec import STRICT
    assert ops_registry.OPS["square"] == "elementwise"
    assert ops_registry.TORCH_OPS["square"].public == "square" and "square" in torch_ops.registered()
    assert hasattr(torch.ops.lockstep, "square") and hasattr(torch.ops.lockstep, "square_backward")
    assert str(torch.ops.lockstep.square.default._schema).endswith("(Tensor x, str? spec, str? backend) -> Tensor")
    assert "square" in ops_registry.DTENSOR_RULES
    assert backend_contract.parameters(backend_contract.BackendOps.square) == ["x", "spec"]
    assert hal_backend.CONFORMANCE_SUITES["square"] == (("square",), (STRICT,))
    assert suites.get("square") is op.SUITE and "square" in suites.names()
    ref = hal.get_backend("reference")
    assert "square" in ref.ops() and "square" in ref.suites and backend_contract.violations(ref) == []
    # a backend without its kernel is refused by name, never answered by another
    with pytest.raises(hal.UnsupportedError, match="does not implement square"):
        op.square(_x(), backend="stock")


def test_routing_sends_a_dtensor_to_its_rule(op, monkeypatch):
    import types

    class StandIn(torch.Tensor):
        pass
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.SimpleNamespace(DTensor=StandIn))
    d = torch.Tensor._make_subclass(StandIn, torch.randn(3, 4))
    assert ops_registry.routing("square", d) is ops_registry.DTENSOR


def test_eager_bits(op):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _x(dtype)
        y = op.square(x)
        assert _same(y[~x.isnan()], (x * x)[~x.isnan()])  # one rounding of the exact product, as torch's
        assert torch.isnan(y[1, 2])


def test_compiled_fullgraph_fake_and_opcheck(op):
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = _x()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    fn = torch.compile(lambda x: op.square(x) + 1, fullgraph=True, backend=recording)
    assert _same(fn(x), op.square(x) + 1)
    assert any(n.target in (torch.ops.lockstep.square, torch.ops.lockstep.square.default) for n in graphs[0].graph.nodes)
    assert _same(torch.compile(lambda x: op.square(x) + 1, fullgraph=True)(x), op.square(x) + 1)  # Inductor
    mode = FakeTensorMode()
    fake = mode.from_tensor(x.to(torch.bfloat16))
    with mode:
        out = torch.ops.lockstep.square(fake, None, None)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    # schema, fake, autograd registration, AOT dispatch (opcheck compares with allclose: no NaN in the input)
    torch.library.opcheck(torch.ops.lockstep.square.default, (_x(grad=True, nan=False), None, None))


def test_autograd_eager_and_compiled(op):
    x = _x(grad=True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (op.square(x) * g).sum().backward()
    want = x.grad.clone()
    assert _same(want[~x.isnan()], (2 * g * x.detach())[~x.isnan()])
    x.grad = None
    with torch_ops.routed(), torch_ops.op_calls() as calls:
        (op.square(x) * g).sum().backward()
    assert calls == {"square": 1, "square_backward": 1} and _same(x.grad, want)
    x.grad = None
    torch.compile(lambda x: (op.square(x) * g).sum(), fullgraph=True, backend="aot_eager")(x).backward()
    assert _same(x.grad, want)


def test_its_conformance_suite_passes_on_the_reference_backend(op):
    records = runner.run(["reference"], ["square"])
    assert records and runner.exit_status(records) == 0
    assert {(r.level, r.status, r.claimed) for r in records} == {(lvl, "pass", True) for lvl in ("L0", "L1", "L3", "A")}
    assert {r.dtype for r in records} == {"fp32", "bf16", "fp16"}


def test_negative_control_a_second_rounding_fails_the_suite(op, monkeypatch):
    def twice(self, x, spec):  # rounds the product to bf16 first, then to x's dtype
        return (x.float() * x.float()).to(torch.bfloat16).to(x.dtype)
    monkeypatch.setattr(ReferenceBackend, "square", twice)
    bad = runner.run(["reference"], ["square"], dtypes=["fp32"])
    assert runner.exit_status(bad) == 1
    assert {r.level for r in bad if r.status == "fail"} == {"A"}


def test_negative_control_a_record_missing_its_fake_is_refused_by_name(op):
    class Contract:
        def cube(self, x, spec):
            """x * x * x"""
    before = _tables()
    good = op.RECORD
    t = dataclasses.replace(good.torch_ops[0], name="cube", fake=None)
    no_fake = dataclasses.replace(good, name="cube", torch_ops=(t,), contract=Contract.cube, suites=(), conformance=(),
                                  kernels=())
    with pytest.raises(ValueError, match="op 'cube': torch op 'cube' has no fake kernel"):
        torch_ops.register(no_fake)

    def wrong(self, x, scale, spec):
        return x
    bad_kernel = dataclasses.replace(no_fake, torch_ops=(dataclasses.replace(t, fake=good.torch_ops[0].fake),),
                                     kernels=(("reference", wrong),))
    with pytest.raises(ValueError, match=r"op 'cube': its reference kernel takes \(x, scale, spec\)"):
        torch_ops.register(bad_kernel)
    with pytest.raises(ValueError, match="op 'square' is already registered"):
        torch_ops.register(copy.copy(good))
    assert _tables() == before and not hasattr(torch.ops.lockstep, "cube")
