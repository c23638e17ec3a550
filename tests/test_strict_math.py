"""The strict arithmetic: exact fma, and lockstep's exp/log accuracy and special values."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from hal.kernels.reference.strict_math import exp, fma, fma_exact, log


def _rn32(fr: Fraction) -> float:
    """Correctly rounded float32 of an exact rational (ties to even), by checking neighbours."""
    c = np.float32(float(fr))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    cands = [x for x in cands if np.isfinite(x)]
    return float(min(cands, key=lambda x: (abs(Fraction(float(x)) - fr), int(np.array(x).view(np.int32)) & 1)))


def test_fma_is_correctly_rounded_where_double_rounding_would_fail():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 sits exactly half-way between float32 neighbours; a tiny c
    # pushes it up. float64 rounding first would land on the midpoint and then round down (wrong).
    a = torch.tensor([1 + 2 ** -12], dtype=torch.float32)
    c = torch.tensor([2.0 ** -80], dtype=torch.float32)
    got = fma(a, a, c).item()
    assert got == _rn32(Fraction(float(a)) ** 2 + Fraction(2.0 ** -80))
    naive = ((a.double() * a.double()) + c.double()).float().item()
    assert naive != got  # the negative control: plain double rounding gets this wrong


def test_fma_matches_exact_rational_on_random_operands():
    g = torch.Generator().manual_seed(1)
    n = 3000
    a = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())).float()
    b = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())).float()
    c = (-(a.double() * b.double())).float() * (1 + torch.randn(n, generator=g) * 1e-6).float()
    got = fma(a, b, c)
    for i in range(n):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i].item() == _rn32(exact) or (got[i].item() == 0 and exact == 0)


def test_fma_special_values():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([inf, 0.0, 1.0, 3e38, -0.0], dtype=torch.float32)
    b = torch.tensor([0.0, 5.0, nan, 10.0, 1.0], dtype=torch.float32)
    c = torch.tensor([1.0, -0.0, 1.0, 0.0, -0.0], dtype=torch.float32)
    out = fma(a, b, c)
    assert torch.isnan(out[0]) and torch.isnan(out[2])
    assert out[1].item() == 0.0 and out[3].item() == inf
    assert torch.signbit(out[4])  # -0 * 1 + -0 = -0


def _ordered(x):
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _ulp_error(f, ref, x):
    y, r = f(x), ref(x.double()).float()
    ok = torch.isfinite(r)
    return (_ordered(y) - _ordered(r)).abs()[ok].max().item()


def _float32_grid(step=997):
    return torch.arange(0, 2 ** 31, step, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_exp_within_one_ulp_over_softmax_range():
    x = _float32_grid()
    x = torch.cat([x, -x])
    x = x[torch.isfinite(x) & (x > -103.9) & (x < 88.7)]
    assert _ulp_error(exp, torch.exp, x) <= 1


def test_log_within_one_ulp_over_positive_floats():
    x = _float32_grid()
    x = x[torch.isfinite(x) & (x > 0)]
    assert _ulp_error(log, torch.log, x) <= 1


def test_exp_log_special_values():
    inf, nan = float("inf"), float("nan")
    e = exp(torch.tensor([-inf, inf, nan, 0.0, -200.0, 200.0, -0.0]))
    assert e.tolist()[:2] == [0.0, inf] and torch.isnan(e[2]) and e[3] == 1.0 and e[4] == 0 and e[5] == inf and e[6] == 1.0
    lg = log(torch.tensor([0.0, -0.0, -1.0, inf, nan, 1.0, 1e-45]))
    assert lg[0] == -inf and lg[1] == -inf and torch.isnan(lg[2]) and lg[3] == inf and torch.isnan(lg[4])
    smallest = torch.tensor(1e-45).item()  # the smallest subnormal, 2**-149
    assert lg[5] == 0.0 and abs(lg[6].item() - np.log(smallest)) < 1e-5


def test_exp_differs_from_torch_exp_somewhere():
    # torch, numpy and jax disagree on float32 exp bits; lockstep's is its own. The point of the spec.
    x = torch.linspace(-20, 20, 100001)
    assert not torch.equal(exp(x), torch.exp(x))


def test_fast_fma_path_equals_round_to_odd_fma_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    c = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    # crafted: exact sum lands a hair off a float32 midpoint (double rounding would go wrong),
    # subnormal results, signed zeros, inf and NaN
    one_odd = torch.tensor(1.0 + 2.0 ** -23)
    crafted_a = torch.tensor([1 + 2.0 ** -23, 1 + 2.0 ** -23, 1e-20, -0.0, 0.0, float("inf"), float("nan"), 3.0])
    crafted_b = torch.tensor([2.0 ** -24 * (1 - 2.0 ** -23), -(2.0 ** -24) * (1 - 2.0 ** -23), 1e-20, 5.0, -5.0,
                              0.0, 1.0, float("inf")])
    crafted_c = torch.stack([one_odd, one_odd, torch.tensor(1e-39), torch.tensor(-0.0), torch.tensor(-0.0),
                             torch.tensor(1.0), torch.tensor(1.0), torch.tensor(float("-inf"))])
    a, b, c = torch.cat([a, crafted_a]), torch.cat([b, crafted_b]), torch.cat([c, crafted_c])
    want = fma_exact(a, b, c)
    got = fma(a, b, c)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    # the crafted midpoint cases really are ones where plain double rounding is wrong
    naive = (a.double() * b.double() + c.double()).float()
    assert not torch.equal(naive[-8:-6].view(torch.int32), want[-8:-6].view(torch.int32))


def _spec_dot(a, b, t):
    """The canonical tiled dot of two float32 vectors, one scalar operation at a time."""
    partials = []
    for s in range(0, max(1, len(a)), t):
        acc = torch.tensor(0.0)
        for i in range(s, min(s + t, len(a))):
            acc = fma_exact(a[i:i + 1], b[i:i + 1], acc.reshape(1))[0]
        partials.append(acc)
    total = torch.tensor(0.0)
    for p in partials:
        total = total + p
    return total


@pytest.mark.parametrize("n,t", [(0, 4), (1, 4), (7, 4), (8, 4), (9, 4), (65, 16), (130, 64)])
def test_tiled_dot_and_sum_follow_the_spec_order(n, t):
    from hal.kernels.reference.reduce import tiled_dot, tiled_sum
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(3, n, generator=g) * 1e3).float()
    b = torch.randn(3, n, generator=g).float()
    if n:
        a[1, 0], b[1, 0] = -1e-30, 1e-30  # a product that underflows to -0.0, then exact zeros
        a[1, 1:], b[1, 1:] = 0.0, 0.0
    got = tiled_dot(a, b, t)
    for r in range(3):
        assert got[r].view(torch.int32) == _spec_dot(a[r], b[r], t).view(torch.int32)
    ones = torch.ones_like(a)
    sums = tiled_sum(a, t)
    for r in range(3):
        assert sums[r].view(torch.int32) == _spec_dot(a[r], ones[r], t).view(torch.int32)
