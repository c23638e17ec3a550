"""Canonical NaN (strict policy): every NaN a strict op returns is one pattern per dtype, whatever
produced it and whichever path computed it. Compared as raw bits, never with isnan."""
import pytest
import torch

import hal
from hal.conformance.bits import first_divergence, raw_bits
from hal.kernels.reference.strict_math import CANONICAL_NAN_BITS, canonical_nan, sqrt

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAN = float("nan")


def canonical(dtype):
    bits_dtype = torch.int32 if dtype == torch.float32 else torch.int16  # all three patterns are positive
    return torch.tensor(CANONICAL_NAN_BITS[dtype], dtype=bits_dtype).view(dtype)


def assert_canonical_where_nan(t, expect_some=True):
    """Every NaN of ``t`` has the canonical bits of its dtype (and there is at least one NaN)."""
    nan_mask = torch.isnan(t)
    assert bool(nan_mask.any()) or not expect_some, "the case was meant to produce a NaN"
    got = raw_bits(t)[nan_mask]
    want = raw_bits(canonical(t.dtype)).expand_as(got)
    assert bool((got == want).all()), [hex(int(b) & 0xFFFFFFFF) for b in got.unique()]


def test_canonical_patterns_are_the_documented_ones():
    assert raw_bits(canonical(torch.float32)).item() == 0x7FC00000
    assert raw_bits(canonical(torch.bfloat16)).item() & 0xFFFF == 0x7FC0
    assert raw_bits(canonical(torch.float16)).item() & 0xFFFF == 0x7E00


@pytest.mark.parametrize("dtype", DTYPES)
def test_canonical_nan_maps_every_payload_and_sign(dtype):
    int_t = torch.int32 if dtype == torch.float32 else torch.int16
    payloads = [0x7FC00001, -0x00400000, 0x7F800001, -1] if dtype == torch.float32 else [0x7FC1, -0x40, 0x7F81, -1]
    if dtype == torch.float16:
        payloads = [0x7E01, -0x200, 0x7C01, -1]
    x = torch.tensor(payloads + [0, 1], dtype=int_t).view(dtype)
    y = canonical_nan(x)
    assert_canonical_where_nan(y[:4])
    assert first_divergence("non-NaN values untouched", x[4:], y[4:]) is None


def test_issue_repro_split_kv_batch_vs_single_gives_one_nan():
    """issue 7: a NaN query gave 0xffffffff in a batch of 40 and 0x7fc00000 alone."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(40, 10, 1, 8, generator=g), torch.randn(40, 10, 1, 8, generator=g)
    q = torch.randn(40, 1, 2, 8, generator=g)
    q[5, 0, 0, 0] = NAN
    ob = hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, backend="reference")
    o1 = hal.flash_attn_with_kvcache(q[5:6], kc[5:6], vc[5:6], cache_seqlens=10, backend="reference")
    assert first_divergence("batch vs alone", ob[5:6], o1) is None
    assert_canonical_where_nan(o1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_issue_repro_nan_key_prefill_vs_decode(dtype):
    """A NaN in key 20: the 60-token prefill and that query decoded alone give the same (canonical) bits."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(60, 2, 16, generator=g).to(dtype) for _ in range(3))
    k[20, 1, 3] = NAN
    cu = torch.tensor([0, 60], dtype=torch.int32)
    full = hal.flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, causal=True, backend="reference")
    kc, vc = k.unsqueeze(0).clone(), v.unsqueeze(0).clone()
    dec = hal.flash_attn_with_kvcache(q[None, 45:46], kc, vc, cache_seqlens=46, backend="reference")
    assert first_divergence("prefill vs decode", full[45:46], dec[0]) is None
    assert_canonical_where_nan(full[20:])
    assert not bool(torch.isnan(full[:20]).any())  # queries before the NaN key never see it


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_foundation_op_returns_the_canonical_nan(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 70, generator=g).to(dtype)
    x[1, 3] = NAN
    x[2, 5] = float("inf")
    w = torch.randn(9, 70, generator=g).to(dtype)
    kw = dict(backend="reference")
    assert_canonical_where_nan(hal.linear(x, w, **kw))
    assert_canonical_where_nan(hal.matmul(x, w.t().contiguous(), **kw))
    assert_canonical_where_nan(hal.rms_norm(x, torch.ones(70, dtype=dtype), **kw))
    for op in (hal.softmax, hal.log_softmax, hal.logsumexp):
        assert_canonical_where_nan(op(x, **kw))
    lp = hal.token_logprobs(x, w, torch.tensor([0, 1, 2]), **kw)
    assert_canonical_where_nan(lp)


def test_gated_delta_rule_nan_state_gives_canonical_outputs_on_both_paths():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 10, 1, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 10, 2, 8, generator=g)
    gate = -torch.rand(1, 10, 2, generator=g)
    beta = torch.rand(1, 10, 2, generator=g)
    s0 = torch.randn(1, 2, 8, 8, generator=g)
    s0[0, 1, 2, 3] = NAN  # a NaN in the row's own state (head 1)
    for spec in ("gated_delta_rule.strict.chunked.c64.d64.lsm1.v2", "gated_delta_rule.strict.serial.d64.lsm1.v2"):
        o, fin = hal.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=s0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, spec=spec, backend="reference")
        o2, fin2 = hal.fused_recurrent_gated_delta_rule(q, k, v, gate, beta, initial_state=s0,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                        spec=spec, backend="reference")
        assert first_divergence("chunk vs recurrent", o, o2) is None
        assert first_divergence("final", fin, fin2) is None
        assert_canonical_where_nan(o[:, :, 1])
        assert_canonical_where_nan(fin)
        assert not bool(torch.isnan(o[:, :, 0]).any())  # the other head is untouched


def test_stock_nan_bits_are_not_canonical_and_the_comparison_catches_it():
    """Negative control: torch's own softmax of a row holding +inf yields inf - inf = a negative NaN on x86."""
    x = torch.randn(2, 300)
    x[0, 4] = float("inf")
    ref = hal.softmax(x, backend="reference")
    stock = hal.softmax(x, backend="stock")
    assert bool(torch.isnan(stock[0]).all())
    assert first_divergence("stock vs canonical", ref[0], stock[0]) is not None


def test_strict_sqrt_is_correctly_rounded_and_the_check_catches_a_wrong_one():
    """The reference's sqrt: correctly rounded on random float32 patterns (torch's AVX-512 float32 sqrt is
    not). The criterion is exact: r is correct iff the squares of its neighbouring midpoints bracket x."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 0x7F800000, (200_000,), dtype=torch.int32, generator=g).view(torch.float32)

    def wrong(x):  # truncation instead of rounding: the negative control
        r = torch.sqrt(x.double())
        return (r.view(torch.int64) & ~((1 << 29) - 1)).view(torch.float64).to(torch.float32)

    def n_bad(r):
        r64, x64 = r.double(), x.double()
        up = torch.nextafter(r, torch.tensor(float("inf"))).double()
        dn = torch.nextafter(r, torch.tensor(0.0)).double()
        return int((~((((r64 + dn) / 2) ** 2 <= x64) & (x64 <= ((r64 + up) / 2) ** 2))).sum())

    assert n_bad(sqrt(x)) == 0
    assert n_bad(wrong(x)) > 0
