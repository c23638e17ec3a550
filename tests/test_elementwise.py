"""Strict elementwise ops and rotary embedding: conformance (reference passes, stock is caught), the
edge semantics on raw bits, trainer vs sampler rotary tables, lsm1 sin/cos, validation, gradients,
and that gdn_gating shares the one sigmoid/softplus."""
import math

import pytest
import torch
import torch.nn.functional as F

import hal
from hal.conformance import runner, suites
from hal.conformance.bits import first_divergence, raw_bits
from hal.kernels.reference.strict_math import sincos

SUITES = ["elementwise", "rotary"]


@pytest.fixture(scope="module")
def records():
    return runner.run(["reference", "stock"], SUITES)


def _bits_equal(a, b) -> bool:
    return first_divergence("t", a, b) is None


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("suite", SUITES)
def test_reference_passes_every_level(records, suite):
    ref = [r for r in records if r.backend == "reference" and r.op == suite]
    assert {r.dtype for r in ref} == {"fp32", "bf16", "fp16"}
    assert {r.level for r in ref} == set(suites.get(suite).levels)
    bad = [f"{r.dtype} {r.level}: {r.detail}" for r in ref if r.status != "pass"]
    assert not bad, bad


@pytest.mark.parametrize("suite", SUITES)
def test_stock_is_caught_at_l4_in_every_dtype(records, suite):
    stock = [r for r in records if r.backend == "stock" and r.op == suite and r.level == "L4"]
    assert {r.dtype for r in stock} == {"fp32", "bf16", "fp16"}
    assert all(r.status == "fail" and not r.claimed and r.first_divergence for r in stock)


def _position_variant(stock) -> bool:
    """Whether torch's float32 ``stock`` gives a value different bits alone than inside a long tensor
    on this machine (it does on AVX-512 CPUs: vector body vs scalar tail)."""
    from hal.conformance import inputs as gen
    x = gen.randn("test_elementwise/position", (4099,), torch.float32, scale=4.0)
    alone = torch.cat([stock(x[i:i + 1]) for i in range(0, 4099, 7)])
    return first_divergence("stock", stock(x)[::7], alone) is not None


STOCK = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}


@pytest.mark.parametrize("op", list(STOCK))
def test_stock_float32_activations_are_caught_at_l1(records, op):
    """The suite's L1 names a failing case for each of torch's float32 activations that is position-variant."""
    if not _position_variant(STOCK[op]):
        pytest.skip(f"torch's float32 {op} is position-invariant on this CPU: no L1 negative control here "
                    "(stock is still caught at L4)")
    (l1,) = [r for r in records if r.backend == "stock" and r.op == "elementwise" and r.level == "L1" and r.dtype == "fp32"]
    assert l1.status == "fail" and any(c.startswith(op + "_n") for c in l1.failed_cases), l1.failed_cases


@pytest.mark.parametrize("op", list(STOCK))
def test_same_finite_value_same_bits_anywhere(op):
    """A finite value alone vs inside a long tensor: lockstep gives one answer (the torch negative control
    is the test above)."""
    from hal.conformance import inputs as gen
    fn = getattr(hal, op)
    x = gen.randn("test_elementwise/position", (4099,), torch.float32, scale=4.0)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(0, 4099, 41)])
    assert _bits_equal(fn(x)[::41], alone)


# ---------------------------------------------------------------- edge semantics (raw bits)


def _f32(vals):
    return torch.tensor(vals, dtype=torch.float32)


def test_edge_values_float32_bits():
    inf = float("inf")
    x = _f32([-inf, inf, 0.0, -0.0, -100.0, 100.0, -1e30, 1e30])
    assert raw_bits(hal.sigmoid(x)).tolist() == raw_bits(_f32([0.0, 1.0, 0.5, 0.5, 0.0, 1.0, 0.0, 1.0])).tolist()
    assert raw_bits(hal.silu(x)).tolist() == raw_bits(_f32([-0.0, inf, 0.0, -0.0, -0.0, 100.0, -0.0, 1e30])).tolist()
    assert raw_bits(hal.softplus(x)[[0, 1, 6, 7]]).tolist() == raw_bits(_f32([0.0, inf, 0.0, 1e30])).tolist()
    # no flush to zero: sigmoid(-88) and softplus(-100) are subnormal / tiny, not 0
    assert 0 < hal.sigmoid(_f32([-88.0])).item() < 2 ** -126
    assert hal.softplus(_f32([-100.0])).item() > 0


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 0x7FC00000), (torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00)])
def test_nan_outputs_are_canonical(dtype, bits):
    payload = {torch.float32: -0x3FFFFF, torch.bfloat16: -0x3F, torch.float16: -0x1FF}[dtype]  # sign + payload
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    x = torch.tensor([payload, payload], dtype=itype).view(dtype)
    mask = (1 << (8 * x.element_size())) - 1
    outs = [hal.sigmoid(x), hal.silu(x), hal.softplus(x), hal.silu_mul(x, x)]
    c, s = torch.ones(1, 1), torch.zeros(1, 1)
    outs.append(hal.apply_rotary(x.reshape(1, 2), c.to(dtype), s.to(dtype)))
    outs.append(hal.apply_rotary(torch.cat([torch.ones(2, dtype=dtype), x]).reshape(1, 4), c.to(dtype), s.to(dtype))[:, 2:])
    for o in outs:
        assert all(v & mask == bits for v in raw_bits(o).reshape(-1).tolist()), raw_bits(o)


def test_silu_mul_is_float32_silu_times_b_rounded_once():
    from hal.conformance import inputs as gen
    a = gen.randn("test_elementwise/a", (999,), torch.bfloat16, scale=3.0)
    b = gen.randn("test_elementwise/b", (999,), torch.bfloat16, scale=3.0)
    once = (hal.silu(a.float()) * b.float()).to(torch.bfloat16)
    assert _bits_equal(hal.silu_mul(a, b), once)
    twice = hal.silu(a) * b  # silu rounded to bf16 first: a different (double-rounded) answer
    assert first_divergence("twice", once, twice) is not None


# ---------------------------------------------------------------- rotary: trainer vs sampler


def test_rotary_tables_trainer_vs_sampler_bitwise():
    """A trainer builds the table for a packed batch [T] (int64); a sampler token by token, or per
    sequence as int32 [B, T]: the same bits at every position, up to positions near 2**24."""
    pos = torch.cat([torch.arange(300), torch.tensor([2 ** 24 - 1, 2 ** 23 + 1, 1000003])])
    for r, base in ((128, 10000.0), (64, 500000.0), (6, 10000.0)):
        c, s = hal.rotary_cos_sin(pos, r, base)
        assert c.dtype == torch.float32 and c.shape == (pos.numel(), r // 2)
        for i in (0, 1, 7, 299, 300, 301, 302):
            ci, si = hal.rotary_cos_sin(pos[i:i + 1].to(torch.int32), r, base)
            assert _bits_equal(c[i:i + 1], ci) and _bits_equal(s[i:i + 1], si)
        c2, s2 = hal.rotary_cos_sin(pos[:300].reshape(3, 100).to(torch.int32), r, base)
        assert _bits_equal(c[:300], c2.reshape(300, -1)) and _bits_equal(s[:300], s2.reshape(300, -1))
    # negative control: two plausible float32 tables (HF's 1 / base**(i/R) vs exp(-(i/R) log base)) differ
    ar = torch.arange(0, 128, 2).float() / 128
    hf = pos[:300, None].float() * (1.0 / 10000.0 ** ar)
    alt = pos[:300, None].float() * torch.exp(-ar * math.log(10000.0))
    assert first_divergence("tables", torch.cos(hf), torch.cos(alt)) is not None


def test_apply_rotary_half_split_and_interleaved_against_hf_formula():
    from hal.conformance import inputs as gen
    x = gen.randn("test_elementwise/x", (5, 3, 80), torch.float64)
    c, s = hal.rotary_cos_sin(torch.arange(5), 32)
    c, s = c.double()[:, None], s.double()[:, None]
    got = hal.apply_rotary(x, c, s)  # float64: the oracle
    rot = x[..., :32]
    hf = rot * torch.cat([c, c], -1) + torch.cat([-rot[..., 16:], rot[..., :16]], -1) * torch.cat([s, s], -1)
    assert torch.allclose(got[..., :32], hf, atol=1e-12) and _bits_equal(got[..., 32:], x[..., 32:])
    gi = hal.apply_rotary(x, c, s, interleaved=True)
    e, o = x[..., 0:32:2], x[..., 1:32:2]
    assert torch.allclose(gi[..., 0:32:2], e * c - o * s, atol=1e-12)
    assert torch.allclose(gi[..., 1:32:2], o * c + e * s, atol=1e-12)
    # float32: dims past R are copied bit for bit, -0.0 included
    x32 = torch.tensor([[1.0, 2.0, -0.0, float("-inf")]])
    out = hal.apply_rotary(x32, torch.ones(1, 1), torch.zeros(1, 1))
    assert raw_bits(out).tolist() == raw_bits(x32).tolist()


# ---------------------------------------------------------------- lsm1 sin / cos


def _ulp_dist(a, b):
    def o(t):
        i = t.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (o(a) - o(b)).abs()


def test_sincos_accuracy_and_special_values():
    g = torch.Generator().manual_seed(3)
    for hi in (1.0, 2.0 ** 10, 2.0 ** 20, 2.0 ** 24):
        x = ((torch.rand(20000, generator=g, dtype=torch.float64) * 2 - 1) * hi).float()
        s, c = sincos(x)
        assert int(_ulp_dist(s, torch.sin(x.double()).float()).max()) <= 2
        assert int(_ulp_dist(c, torch.cos(x.double()).float()).max()) <= 2
    s, c = sincos(_f32([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 2.0 ** 24, -(2.0 ** 24), 1e30]))
    assert raw_bits(s[:2]).tolist() == raw_bits(_f32([0.0, -0.0])).tolist()
    assert c[:2].tolist() == [1.0, 1.0]
    assert bool(torch.isnan(s[2:]).all() and torch.isnan(c[2:]).all())
    # quadrants: sin(-x) = -sin(x) and cos(-x) = cos(x) bit for bit (the reduction is odd-symmetric)
    x = torch.linspace(0.01, 1000.0, 5001)
    sp, cp = sincos(x)
    sn, cn = sincos(-x)
    assert _bits_equal(sn, -sp) and _bits_equal(cn, cp)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("call, word", [
    (lambda: hal.sigmoid(torch.ones(2, dtype=torch.int32)), "x"),
    (lambda: hal.silu_mul(torch.ones(2), torch.ones(3)), "silu_mul"),
    (lambda: hal.silu_mul(torch.ones(2), torch.ones(2, dtype=torch.bfloat16)), "dtypes"),
    (lambda: hal.rotary_cos_sin(torch.arange(3).float(), 8), "positions"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), 7), "rotary_dim"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), True), "rotary_dim"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), 8, base=-1.0), "base"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), 8, base="10000"), "base"),
    (lambda: hal.rotary_cos_sin(torch.tensor([2 ** 24]), 8), "positions"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), 8, inv_freq=torch.ones(3)), "inv_freq"),
    (lambda: hal.rotary_cos_sin(torch.arange(3), 8, inv_freq=torch.ones(4, dtype=torch.float64)), "inv_freq"),
    (lambda: hal.rotary_cos_sin(torch.tensor([2 ** 23]), 8, inv_freq=torch.full((4,), 4.0)), "angles"),
    (lambda: hal.rotary_cos_sin(torch.tensor([2 ** 23]), 8, base=0.25), "angles"),
    (lambda: hal.apply_rotary(torch.ones(2, 8), torch.ones(2, 5), torch.ones(2, 5)), "cos.shape[-1]"),
    (lambda: hal.apply_rotary(torch.ones(2, 8), torch.ones(3, 2), torch.ones(3, 2)), "broadcast"),
    (lambda: hal.apply_rotary(torch.ones(2, 8), torch.ones(2, 2), torch.ones(2, 3)), "same shape"),
    (lambda: hal.apply_rotary(torch.ones(2, 8), torch.ones(2, 2), torch.ones(2, 2), interleaved=1), "interleaved"),
    (lambda: hal.apply_rotary(torch.ones(2, 8), torch.ones(2, 2).double(), torch.ones(2, 2).double()), "float64"),
])
def test_bad_input_names_the_argument(call, word):
    with pytest.raises(hal.InputError, match=word.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_wrong_spec_family_is_refused():
    with pytest.raises(hal.SpecError):
        hal.sigmoid(torch.ones(2), spec=hal.spec.DEFAULTS["rotary"])


# ---------------------------------------------------------------- autograd


def test_gradients_float64():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    y = torch.randn(6, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    for fn in (hal.sigmoid, hal.silu, hal.softplus):
        assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradcheck(hal.silu_mul, (x, y))
    q = torch.randn(4, 2, 10, generator=g, dtype=torch.float64).requires_grad_(True)
    ang = torch.randn(4, 1, 3, generator=g, dtype=torch.float64)
    c, s = ang.cos().requires_grad_(True), ang.sin().requires_grad_(True)
    for inter in (False, True):
        assert torch.autograd.gradcheck(lambda q, c, s: hal.apply_rotary(q, c, s, inter), (q, c, s))


def test_float32_backward_matches_torch():
    x = torch.linspace(-30, 30, 601, requires_grad=True)
    for fn, ref in ((hal.sigmoid, torch.sigmoid), (hal.silu, F.silu), (hal.softplus, F.softplus)):
        (gx,) = torch.autograd.grad(fn(x).sum(), x)
        (gr,) = torch.autograd.grad(ref(x).sum(), x)
        assert torch.allclose(gx, gr, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- one definition shared with gdn_gating


def test_gdn_gating_uses_the_elementwise_definitions():
    from hal.conformance import inputs as gen
    from hal.kernels.reference.strict_math import exp
    a = gen.randn("test_elementwise/ga", (7, 4), torch.float32, scale=4.0)
    b = gen.randn("test_elementwise/gb", (7, 4), torch.float32, scale=4.0)
    A_log = gen.randn("test_elementwise/A", (4,), torch.float32)
    dt_bias = gen.randn("test_elementwise/dt", (4,), torch.float32)
    g, beta = hal.gdn_gating(A_log, a, dt_bias, b)
    assert _bits_equal(beta, hal.sigmoid(b))
    assert _bits_equal(g, -(exp(A_log) * hal.softplus(a + dt_bias)))


def test_broadcasts_to_is_torchs_rule():
    """hal.validate.broadcasts_to (apply_rotary's shape check, in plain Python) answers as torch.broadcast_shapes
    does, for shapes that broadcast, that broadcast to a larger shape, that do not, and with empty dims."""
    from hal import validate
    want_shapes = [(8, 16, 32), (2, 3, 4, 5), (0, 4), (1, 4), (3,)]
    cands = [(8, 1, 32), (1, 32), (32,), (16, 32), (8, 16, 32), (2, 16, 32), (1, 8, 16, 32), (3, 1, 5), (4, 5), (1,),
             (0, 4), (1, 4), (0, 1), (2, 4), (3,), (), (1, 1, 1, 1, 1)]
    seen = set()
    for want in want_shapes:
        for shape in cands:
            try:
                torch_says = tuple(torch.broadcast_shapes(shape, want)) == want
            except RuntimeError:
                torch_says = False
            assert validate.broadcasts_to(shape, want) == torch_says, (shape, want)
            seen.add(torch_says)
    assert seen == {True, False}  # both answers were asked for
