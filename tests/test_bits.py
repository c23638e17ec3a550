"""The raw-bit helpers tests use for bit claims catch what torch.equal does not."""
import pytest
import torch

from hal.conformance.bits import assert_same_bits, same_bits


def test_signed_zero_and_nan_payloads_differ():
    pz, nz = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(pz, nz)  # why torch.equal cannot back a bit claim
    assert not same_bits(pz, nz)
    with pytest.raises(AssertionError, match="first divergence at index"):
        assert_same_bits(pz, nz)
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not same_bits(a, b) and same_bits(a, a.clone())


def test_dtype_and_shape_count():
    x = torch.ones(3)
    assert not same_bits(x, x.double()) and not same_bits(x, x.reshape(1, 3))
    assert same_bits(x.bfloat16(), torch.ones(3, dtype=torch.bfloat16))
