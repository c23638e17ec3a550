"""The cpu backend's compiled slicing of the exact policy gives core.slice_rows' digits, bit for bit."""
import pytest
import torch

pytest.importorskip("numba")

from hal.kernels.exact import core  # noqa: E402
from hal.kernels.cpu import exact_slice  # noqa: E402

F32 = torch.float32


def _awkward(rows: int, k: int, dtype, seed: int) -> torch.Tensor:
    """Random values over many binades, plus subnormals, zeros of both signs, NaN, inf and rows
    without a finite non-zero value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, k), generator=g).float())
    pick = torch.rand(rows, k, generator=g)
    tiny = torch.finfo(dtype).tiny
    x = torch.where(pick < 0.05, x.sign() * tiny * torch.rand(rows, k, generator=g), x)  # subnormals
    x = torch.where((pick > 0.05) & (pick < 0.08), torch.tensor(-0.0), x)
    x = torch.where((pick > 0.08) & (pick < 0.09), torch.tensor(float("nan")), x)
    x = torch.where((pick > 0.09) & (pick < 0.10), torch.tensor(float("-inf")), x)
    x[0] = 0.0
    x[1] = float("inf")
    return x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).where(x.isfinite(), x).to(dtype)


def _same(a: core.Sliced, b: core.Sliced) -> None:
    assert a.digits.dtype == b.digits.dtype == torch.int8 and a.digits.shape == b.digits.shape
    assert torch.equal(a.digits, b.digits)
    assert torch.equal(a.exp, b.exp)
    assert a.finite == b.finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [2, 3, 4])
def test_compiled_slicing_matches_core(dtype, s):
    x = _awkward(13, 300, dtype, seed=s)
    _same(exact_slice.slice_rows(x, s), core.slice_rows(x, s))
    finite = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)
    _same(exact_slice.slice_rows(finite, s), core.slice_rows(finite, s))
    e = torch.randint(-20, 40, (13,))  # tensor parallelism: exponents agreed over shards
    _same(exact_slice.slice_rows(x, s, e), core.slice_rows(x, s, e))


def test_rounding_instead_of_truncation_is_caught():
    """Negative control: the same digits built from round-to-nearest instead of truncation differ."""
    x = _awkward(8, 256, F32, seed=7)
    got = exact_slice.slice_rows(x, 3)
    v = torch.nan_to_num(x.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    t = torch.round(v * torch.exp2((20 - got.exp).to(torch.float64)).unsqueeze(-1)).to(torch.int64)
    mag, sign = t.abs(), t.sign()
    rounded = torch.stack([(sign * ((mag >> (7 * (2 - i))) & 127)).to(torch.int8) for i in range(3)])
    assert not torch.equal(rounded, got.digits)


def test_cpu_backend_exact_linear_bits_and_shapes():
    import hal
    g = torch.Generator().manual_seed(3)
    for m, k, n in [(1, 1, 1), (5, 70, 9), (0, 8, 3), (4, 0, 2)]:
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        ref = hal.linear(x, w, spec="matmul.exact.s4.v2", backend="reference")
        got = hal.linear(x, w, spec="matmul.exact.s4.v2", backend="cpu")
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
