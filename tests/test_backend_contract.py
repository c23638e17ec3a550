"""Every backend's op methods take exactly the arguments the contract (hal/backend_contract.py) declares."""
import pytest

import hal
from hal.dispatch import backends
from hal.backend_contract import BackendOps, parameters, violations
from hal.ops_registry import OPS


def test_every_op_has_a_contract():
    assert sorted(op for op in OPS if not hasattr(BackendOps, op)) == []


@pytest.mark.parametrize("name", sorted(backends()))
def test_registered_backend_keeps_the_contract(name):
    assert violations(hal.get_backend(name)) == []


def test_a_wrong_signature_is_caught():
    """Negative control: a backend whose rms_norm forgot ``residual`` (and one taking ``*args``) is reported."""
    class Wrong(hal.Backend):
        name = "wrong"

        def rms_norm(self, x, weight, eps, spec):
            return x

        def silu(self, *args):
            return args[0]

        def sigmoid(self, x, spec):  # right: not reported
            return x

    found = violations(Wrong())
    assert len(found) == 2
    assert "wrong.rms_norm(x, weight, eps, spec)" in found[0] and "residual" in found[0]
    assert "wrong.silu(args)" in found[1]


def test_parameters_see_through_the_running_marker():
    """Backend.__init_subclass__ wraps each op (functools.wraps): the contract checks the method itself."""
    assert parameters(type(hal.get_backend("reference")).linear) == ["x", "weight", "bias", "spec"]
