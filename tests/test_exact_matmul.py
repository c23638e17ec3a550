"""The exact matmul policy: correct rounding (checked against Python fractions, an independent
implementation of the spec's words), order freedom under random splits / tilings / permutations
with negative controls, NaN/Inf/overflow/subnormal cases, bad input errors."""
from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

import hal
from hal.conformance.bits import first_divergence
from hal.kernels.exact import core
from hal.kernels.exact.cpu import products_int_mm
from hal.kernels.reference import exact_matmul as ref
from hal.spec import ExactMatmulSpec, MatmulSpec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (precision bits, min normal exponent, max exponent) of each output format
FORMAT = {torch.float32: (24, -126, 127), torch.bfloat16: (8, -126, 127), torch.float16: (11, -14, 15)}
CANON = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def assert_bits(label, expected, got):
    d = first_divergence(label, expected, got)
    assert d is None, str(d)


# ----------------------------------------------------------------- an independent model of the spec


def _slice(values: list[float], s: int) -> list[Fraction]:
    finite = [v for v in values if math.isfinite(v) and v != 0]
    e = max(math.frexp(v)[1] - 1 for v in finite) if finite else 0
    unit = Fraction(2) ** (e - 7 * s + 1)
    return [Fraction(int(Fraction(v) / unit)) * unit if math.isfinite(v) else Fraction(0) for v in values]


def _round(x: Fraction, dtype) -> float:
    """Round to nearest even in dtype's format (gradual underflow, overflow to inf)."""
    p, emin, emax = FORMAT[dtype]
    if x == 0:
        return 0.0
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - (p - 1))
    n = a / quantum
    r = math.floor(n)
    if n - r > Fraction(1, 2) or (n - r == Fraction(1, 2) and r % 2 == 1):
        r += 1
    y = r * quantum
    if y >= Fraction(2) ** (emax + 1):
        return sign * math.inf
    return sign * float(y)


def model_matmul(a: torch.Tensor, b: torch.Tensor, s: int) -> torch.Tensor:
    """Finite inputs only: the correctly rounded dot of the sliced inputs, in Python fractions."""
    rows = [_slice(r, s) for r in a.double().tolist()]
    cols = [_slice(c, s) for c in b.double().T.tolist()]
    out = [[_round(sum((x * y for x, y in zip(r, c)), Fraction(0)), a.dtype) for c in cols] for r in rows]
    return torch.tensor(out, dtype=torch.float64).to(a.dtype)  # exact: every value is representable


def _spread(shape, dtype, seed):
    """Values over many binades (so rows truncate low bits), with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    x[torch.rand(shape, generator=g) < 0.1] = 0
    return x.to(dtype)


@pytest.mark.parametrize("s", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_correctly_rounded_against_fractions(dtype, s):
    a, b = _spread((5, 23), dtype, 1), _spread((23, 4), dtype, 2)
    got = hal.matmul(a, b, spec=ExactMatmulSpec(slices=s), backend="reference")
    assert_bits(f"{dtype} s{s}", model_matmul(a, b, s), got)


def _t(vals, dtype):
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


ROUNDING_CASES = [
    # (label, dtype, a row, b column, s): ties, the double-rounding trap, overflow, subnormal results
    ("tie-to-even-down", torch.float32, [1.0, 2.0 ** -24], [1.0, 1.0], 4),
    ("tie-to-even-up", torch.float32, [1.0 + 2.0 ** -23, 2.0 ** -24], [1.0, 1.0], 4),
    ("bf16-no-double-rounding", torch.bfloat16, [1.0, 2.0 ** -8, 2.0 ** -14], [1.0, 1.0, 2.0 ** -14], 4),
    ("bf16-tie", torch.bfloat16, [1.0, 2.0 ** -8], [1.0, 1.0], 3),
    ("fp16-overflow", torch.float16, [200.0, 200.0], [400.0, 400.0], 3),
    ("fp16-just-below-overflow", torch.float16, [65504.0, 8.0], [1.0, 1.0], 3),
    ("fp32-overflow", torch.float32, [3e38, 3e38], [2.0, 1.0], 3),
    ("fp32-subnormal", torch.float32, [1e-20, 3e-21], [1e-20, -1e-21], 3),
    ("fp16-subnormal", torch.float16, [2.0 ** -12, 2.0 ** -13], [2.0 ** -13, 2.0 ** -14], 3),
    ("bf16-subnormal", torch.bfloat16, [2.0 ** -70, 2.0 ** -71], [2.0 ** -60, 2.0 ** -61], 3),
    ("cancellation-to-zero", torch.float32, [1.0, 1.0], [1.0, -1.0], 3),
    ("fp32-subnormal-inputs", torch.float32, [1e-40, -3e-42, 1e-45], [1e30, 3e29, -1e30], 3),
    ("fp32-subnormal-row-max", torch.float32, [2.0 ** -149, -2.0 ** -148], [2.0 ** 100, 2.0 ** 99], 4),
    ("fp16-subnormal-inputs", torch.float16, [2.0 ** -20, 2.0 ** -24, -3 * 2.0 ** -24], [1.0, 1.0, 1.0], 2),
    ("bf16-subnormal-inputs", torch.bfloat16, [1e-39, 3e-40, -2e-40], [1e20, 1e20, 3e20], 3),
]


@pytest.mark.parametrize("label,dtype,row,col,s", ROUNDING_CASES, ids=[c[0] for c in ROUNDING_CASES])
def test_rounding_cases(label, dtype, row, col, s):
    a, b = _t([row], dtype), _t([col], dtype).T.contiguous()
    want = model_matmul(a, b, s)
    got = hal.matmul(a, b, spec=ExactMatmulSpec(slices=s), backend="reference")
    assert_bits(label, want, got)
    assert_bits(label + " (int_mm)", want, core.exact_linear(a, b.T, None, s, products_int_mm))


def test_double_rounding_trap_is_real():
    """The bf16 case above would round wrongly via float32: 1 + 2**-8 + 2**-28 -> fp32 -> bf16 gives 1.0."""
    exact = torch.tensor(1.0 + 2.0 ** -8 + 2.0 ** -28, dtype=torch.float64)
    via32 = exact.to(torch.float32).to(torch.bfloat16)
    got = hal.matmul(_t([[1.0, 2.0 ** -8, 2.0 ** -14]], torch.bfloat16), _t([[1.0], [1.0], [2.0 ** -14]], torch.bfloat16),
                     spec=ExactMatmulSpec(slices=4), backend="reference")
    assert float(via32) == 1.0 and float(got) == 1.0 + 2.0 ** -7


# ----------------------------------------------------------------- order freedom


def _random_split_products(rng: random.Random):
    """Slice products over random K pieces, in random order, with a random permutation of K."""
    def products(da, dw):
        k = da.shape[-1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        da, dw = da[..., perm], dw[..., perm]
        cuts = sorted(rng.sample(range(1, k), min(rng.randint(1, 6), k - 1))) if k > 1 else []
        pieces = list(zip([0] + cuts, cuts + [k]))
        rng.shuffle(pieces)
        total = 0
        for lo, hi in pieces:
            total = total + products_int_mm(da[..., lo:hi].contiguous(), dw[..., lo:hi].contiguous())
        return total
    return products


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_splits_and_permutations_give_reference_bits(dtype):
    rng = random.Random(7)
    for trial in range(6):
        m, k, n = rng.randint(1, 9), rng.randint(1, 700), rng.randint(1, 9)
        s = rng.choice([2, 3, 4])
        x, w = _spread((m, k), dtype, 10 + trial), _spread((n, k), dtype, 20 + trial)
        bias = _spread((n,), dtype, 30 + trial) if trial % 2 else None
        spec = ExactMatmulSpec(slices=s)
        want = ref.linear(x, w, bias, spec)
        got = core.exact_linear(x, w, bias, s, _random_split_products(rng))
        assert_bits(f"trial {trial} {m}x{k}x{n} s{s}", want, got)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(trial))
        assert_bits(f"trial {trial} permuted K", want, ref.linear(x[:, perm], w[:, perm], bias, spec))


def test_negative_controls_change_bits_under_permutation_and_split():
    """The same comparisons catch the strict k64 chain (K permuted) and stock F.linear (split-K)."""
    x, w = _spread((4, 1000), torch.float32, 3), _spread((6, 1000), torch.float32, 4)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    strict = MatmulSpec()
    base = hal.linear(x, w, spec=strict, backend="reference")
    assert first_divergence("strict permuted", base, hal.linear(x[:, perm], w[:, perm], spec=strict,
                                                                 backend="reference")) is not None
    stock = torch.nn.functional.linear(x, w)
    split = torch.nn.functional.linear(x[:, :333], w[:, :333]) + torch.nn.functional.linear(x[:, 333:], w[:, 333:])
    assert first_divergence("stock split-K", stock, split) is not None
    exact = ExactMatmulSpec(slices=4)
    assert_bits("exact permuted", hal.linear(x, w, spec=exact, backend="reference"),
                hal.linear(x[:, perm], w[:, perm], spec=exact, backend="reference"))


def test_int_mm_large_k_is_split_exactly():
    """K > 131072: torch._int_mm's int32 sums would wrap; the host code cuts K and adds in int64."""
    k = 140_000
    da = torch.full((1, 1, k), 127, dtype=torch.int8)
    dw = torch.full((1, 2, k), -127, dtype=torch.int8)
    assert products_int_mm(da, dw)[0, 0].tolist() == [[-127 * 127 * k] * 2]


def test_batch_invariance_and_matmul_linear_agree():
    x, w = _spread((2, 5, 40), torch.bfloat16, 5), _spread((3, 40), torch.bfloat16, 6)
    spec = ExactMatmulSpec(slices=3)
    full = hal.linear(x, w, spec=spec, backend="reference")
    assert_bits("row alone", full[1, 2:3], hal.linear(x[1, 2:3], w, spec=spec, backend="reference"))
    assert_bits("matmul == linear", full, hal.matmul(x, w.T.contiguous(), spec=spec, backend="reference"))


# ----------------------------------------------------------------- non-finite inputs, zeros, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_and_zero_rows(dtype):
    inf, nan = math.inf, math.nan
    a = _t([[1.0, 2.0, 3.0], [inf, 1.0, 0.0], [nan, 1.0, 1.0], [0.0, 0.0, 0.0], [inf, -inf, 1.0], [-inf, 2.0, 1.0]], dtype)
    b = _t([[1.0, 1.0, 0.0], [2.0, -1.0, 1.0], [1.0, 1.0, 1.0]], dtype)  # columns: (1,2,1), (1,-1,1), (0,1,1)
    got = hal.matmul(a, b, spec=ExactMatmulSpec(slices=3), backend="reference")
    N, P, M = "nan", inf, -inf
    want = [[8.0, 2.0, 5.0], [P, P, N], [N, N, N], [0.0, 0.0, 0.0], [N, P, N], [M, M, N]]
    for i, row in enumerate(want):
        for j, v in enumerate(row):
            g = got[i, j]
            if v == "nan":
                assert int(g.view(torch.int32 if dtype == torch.float32 else torch.int16)) & \
                    (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF) == CANON[dtype], (i, j)
            else:
                assert_bits(f"[{i},{j}]", torch.tensor(v, dtype=dtype), g)  # zeros must be +0.0


def test_nan_in_b_column_only_hits_that_column():
    a = _t([[1.0, 2.0]], torch.float32)
    b = _t([[1.0, math.nan], [1.0, 1.0]], torch.float32)
    got = hal.matmul(a, b, spec=ExactMatmulSpec(slices=3), backend="reference")
    assert float(got[0, 0]) == 3.0 and int(got[0, 1].view(torch.int32)) == CANON[torch.float32]


def test_bias_is_one_float32_addition_after_the_rounded_dot():
    x, w = _spread((3, 50), torch.bfloat16, 8), _spread((4, 50), torch.bfloat16, 9)
    bias = _spread((4,), torch.bfloat16, 10)
    spec = ExactMatmulSpec(slices=3)
    dot32 = core.exact_linear(x.float(), w.float(), None, 3, products_int_mm)  # same slices: fp32 holds bf16 exactly
    want = (dot32 + bias.float()).to(torch.bfloat16)
    assert_bits("bias", want, hal.linear(x, w, bias, spec=spec, backend="reference"))


# ----------------------------------------------------------------- errors


def test_bad_specs_and_inputs():
    with pytest.raises(hal.SpecError, match="slices"):
        ExactMatmulSpec(slices=5)
    with pytest.raises(hal.SpecError, match="ExactMatmulSpec"):
        MatmulSpec(policy="exact")
    with pytest.raises(hal.SpecError, match="policy"):
        hal.spec.RMSNormSpec(policy="exact")
    assert hal.spec.get("matmul.exact.s3.v2") == ExactMatmulSpec(slices=3)
    big = torch.zeros(1, 2 ** 24 + 1, dtype=torch.bfloat16)
    with pytest.raises(hal.InputError, match="2\\*\\*24"):
        hal.linear(big, big, spec=ExactMatmulSpec(slices=3), backend="reference")
    with pytest.raises(hal.InputError):
        hal.matmul(torch.zeros(2, 3), torch.zeros(4, 2), spec=ExactMatmulSpec(), backend="reference")


# ----------------------------------------------------------------- conformance suite


def test_conformance_family_reference_passes_and_stock_is_caught():
    """Two cases per spec (the full suite: `hal conformance run --backend reference,stock --ops matmul_exact`)."""
    from hal import dispatch
    from hal.conformance import runner, suites
    fam = suites.get("matmul_exact")
    cases = [c for c in fam.cases() if c.id in ("m7_k129_n33.fp32", "m1_k7_n5.fp32")]
    assert len(cases) == 4
    for bname in ("reference", "stock"):
        for case in cases:
            out = {lvl: runner._Outcome() for lvl in fam.levels}
            runner.run_case(fam, dispatch.get_backend(bname), case, torch.device("cpu"), fam.levels, out)
            failed = {lvl for lvl, o in out.items() if o.failures}
            if bname == "reference":
                assert not failed and all(o.cases == 1 for o in out.values()), (case.id, failed)
            else:
                assert {"L2", "L4"} <= failed, (case.id, failed)


def test_empty_k_and_empty_batch():
    spec = ExactMatmulSpec(slices=3)
    bias = torch.tensor([1.5, -0.0])
    want = torch.tensor([[1.5, 0.0]] * 3)  # +0.0 (the empty dot) + -0.0 = +0.0
    assert_bits("K = 0", want, hal.linear(torch.zeros(3, 0), torch.zeros(2, 0), bias, spec=spec, backend="reference"))
    assert_bits("K = 0 int_mm", want, core.exact_linear(torch.zeros(3, 0), torch.zeros(2, 0), bias, 3, products_int_mm))
    assert hal.linear(torch.zeros(0, 4), torch.zeros(2, 4), spec=spec, backend="reference").shape == (0, 2)
