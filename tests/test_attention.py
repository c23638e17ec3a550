"""Attention ops: semantics against the float64 oracle, spec validation, bad inputs (cache untouched),
backward (gradcheck, determinism) and the KV-cache helper."""
import math

import pytest
import torch

import hal
from hal.conformance import inputs as gen
from hal.conformance.bits import same_bits
from hal.errors import InputError, SpecError
from hal.kv_cache import KVCache
from hal.spec import AttentionSpec, DEFAULTS

F64 = torch.float64
SMALL = AttentionSpec(kv_block=16, kv_split=64)


def _qkv(key, n, hq, hkv, d, dtype=torch.float32, nk=None):
    nk = n if nk is None else nk
    return (gen.randn(f"{key}/q", (n, hq, d), dtype, 1.5), gen.randn(f"{key}/k", (nk, hkv, d), dtype),
            gen.randn(f"{key}/v", (nk, hkv, d), dtype))


def _cu(*lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _varlen(q, k, v, cu_q, cu_k=None, **kw):
    cu_k = cu_q if cu_k is None else cu_k
    mq = int((cu_q[1:] - cu_q[:-1]).max())
    mk = int((cu_k[1:] - cu_k[:-1]).max())
    return hal.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)


# ------------------------------------------------------------------ spec


def test_spec_id_describe_and_validation():
    s = DEFAULTS["attention"]
    assert s.id == "attention.strict.b64.s256.d64.pf32.lsm1.v2"
    assert hal.spec.get(s.id) is s and hal.spec.get(SMALL.id) == SMALL
    assert AttentionSpec(p_precision="input").id == "attention.strict.b64.s256.d64.pin.lsm1.v2"
    assert len(s.describe()) >= 8 and any("split order" in line for line in s.describe())
    with pytest.raises(SpecError, match="multiple of kv_block"):
        AttentionSpec(kv_block=64, kv_split=100)
    with pytest.raises(SpecError, match="p_precision"):
        AttentionSpec(p_precision="bf16")
    with pytest.raises(SpecError, match="positive int"):
        AttentionSpec(kv_block=0)
    with pytest.raises(SpecError, match="attention"):
        hal.flash_attn_varlen_func(*_qkv("x", 3, 1, 1, 4), _cu(3), _cu(3), 3, 3, spec=hal.spec.DEFAULTS["matmul"])


def test_tiling_decides_bits():
    """Different block/split sizes give different bits (so split invariance is not trivially true)."""
    q, k, v = _qkv("tiling", 80, 2, 2, 64)
    a, _ = _varlen(q, k, v, _cu(80), causal=True)
    b, _ = _varlen(q, k, v, _cu(80), causal=True, spec=SMALL)
    assert not same_bits(a, b)
    assert torch.allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------ semantics vs oracle


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (9, -1)), (False, (-1, -1)), (False, (6, 4))])
def test_matches_float64_oracle(causal, window):
    q, k, v = _qkv(f"oracle/{causal}/{window}", 60, 4, 2, 40)
    cu = _cu(37, 23)
    out, lse = _varlen(q, k, v, cu, causal=causal, window_size=window, spec=SMALL)
    o64, l64 = _varlen(q.double(), k.double(), v.double(), cu, causal=causal, window_size=window)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (4, 60)
    assert (out.double() - o64).abs().max() < 2e-6
    assert (lse.double() - l64).abs().max() < 2e-6
    # the oracle agrees with torch's own attention (independent semantics check)
    for a, b in ((0, 37), (37, 60)):
        qt, kt, vt = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
        kt, vt = kt.repeat_interleave(2, 0), vt.repeat_interleave(2, 0)
        n = b - a
        i, j = torch.arange(n).reshape(-1, 1), torch.arange(n).reshape(1, -1)
        mask = torch.ones(n, n, dtype=torch.bool)
        if causal:
            mask &= j <= i
        if window[0] >= 0:
            mask &= j >= i - window[0]
        if window[1] >= 0 and not causal:
            mask &= j <= i + window[1]
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        assert torch.allclose(o64[a:b], ref.transpose(0, 1), atol=1e-12)


def test_bottom_right_alignment_and_fully_masked_rows():
    """More queries than keys with causal: the first rows see no key -> out 0, lse -inf."""
    q, k, v = _qkv("masked", 7, 2, 1, 8, nk=4)
    out, lse = _varlen(q, k, v, _cu(7), _cu(4), causal=True)
    assert same_bits(out[:3], torch.zeros_like(out[:3])) and bool((lse[:, :3] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, 3:]).all())
    # row 3 is at position 0: it sees key 0 only, so its output is v[0] exactly (p = 1, l = 1)
    assert same_bits(out[3], v[0].repeat_interleave(2, 0))
    o64, l64 = _varlen(q.double(), k.double(), v.double(), _cu(7), _cu(4), causal=True)
    assert same_bits(o64[:3], torch.zeros_like(o64[:3])) and bool((l64[:, :3] == float("-inf")).all())
    # an empty sequence and padding rows past cu_seqlens[-1]
    q2 = torch.cat([q, torch.full((2, 2, 8), float("nan"))])
    out2, lse2 = hal.flash_attn_varlen_func(q2, k, v, _cu(7, 0), _cu(4, 0), 7, 4, causal=True, return_lse=True)
    assert same_bits(out2[:7], out) and same_bits(out2[7:], torch.zeros(2, 2, 8))
    assert bool((lse2[:, 7:] == float("-inf")).all())


def test_gqa_equals_repeated_kv_heads_bit_for_bit():
    q, k, v = _qkv("gqa", 50, 6, 2, 16)
    out, lse = _varlen(q, k, v, _cu(50), causal=True)
    rep, lse_rep = _varlen(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), _cu(50), causal=True)
    assert same_bits(out, rep) and same_bits(lse, lse_rep)


def test_default_scale_and_explicit_scale():
    q, k, v = _qkv("scale", 20, 2, 2, 40)
    a, _ = _varlen(q, k, v, _cu(20), causal=True)
    b, _ = _varlen(q, k, v, _cu(20), causal=True, softmax_scale=1 / math.sqrt(40))
    c, _ = _varlen(q, k, v, _cu(20), causal=True, softmax_scale=0.3)
    assert same_bits(a, b) and not same_bits(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_decode_paged_and_num_splits_same_bits(dtype):
    n, page = 150, 5
    q, k, v = _qkv(f"inv/{dtype}", n, 4, 2, 64, dtype)
    full, full_lse = _varlen(q, k, v, _cu(n), causal=True, spec=SMALL)
    assert full.dtype == dtype and full_lse.dtype == torch.float32
    cache = KVCache.paged(1, n, 2, 64, page, dtype, page_order=list(range(n // page))[::-1])
    cache.write(k[None, :120], v[None, :120])
    for i in range(120, 130):  # decode across the split boundary at 128
        o, lse = cache.attend(q[None, i:i + 1], k[None, i:i + 1], v[None, i:i + 1], return_lse=True, spec=SMALL)
        assert same_bits(o[0, 0], full[i]) and same_bits(lse[0, :, 0], full_lse[:, i])
    for ns in (1, 2, 5):
        c2 = KVCache.contiguous(1, n, 2, 64, dtype)
        c2.write(k[None, :130], v[None, :130])
        o = c2.attend(q[None, 130:], k[None, 130:], v[None, 130:], num_splits=ns, spec=SMALL)
        assert same_bits(o[0], full[130:])


def test_invisible_keys_are_skipped_not_masked():
    """A NaN/inf key at position 40 must not touch the rows that cannot see it (select, not 0 * mask)."""
    q, k, v = _qkv("skip", 70, 2, 1, 16)
    clean, clean_lse = _varlen(q, k, v, _cu(70), causal=True, spec=SMALL)
    k2, v2 = k.clone(), v.clone()
    k2[40], v2[40] = float("nan"), float("inf")
    dirty, dirty_lse = _varlen(q, k2, v2, _cu(70), causal=True, spec=SMALL)
    assert same_bits(dirty[:40], clean[:40]) and same_bits(dirty_lse[:, :40], clean_lse[:, :40])
    assert bool(torch.isnan(dirty[40:]).all())
    # ... and with a window, the rows whose window has moved past key 40 are clean again
    w = dict(causal=True, window_size=(10, -1), spec=SMALL)
    clean_w, _ = _varlen(q, k, v, _cu(70), **w)
    dirty_w, _ = _varlen(q, k2, v2, _cu(70), **w)
    assert same_bits(dirty_w[51:], clean_w[51:]) and bool(torch.isnan(dirty_w[40:51]).all())


def test_reference_uses_no_library_matmul(monkeypatch):
    """The reference must write its reductions out: break the BLAS entry points and it still runs."""
    q, k, v = _qkv("noblas", 30, 2, 1, 16)
    expected, _ = _varlen(q, k, v, _cu(30), causal=True)

    def boom(*a, **kw):
        raise AssertionError("reference attention called a library reduction")
    for name in ("matmul", "bmm", "einsum", "mm", "baddbmm", "softmax", "logsumexp", "cumsum", "sum"):
        monkeypatch.setattr(torch, name, boom)
    monkeypatch.setattr(torch.Tensor, "sum", boom)
    monkeypatch.setattr(torch.Tensor, "__matmul__", boom)
    got, _ = _varlen(q, k, v, _cu(30), causal=True)
    assert same_bits(got, expected)


# ------------------------------------------------------------------ backward


def test_gradcheck_float64():
    q, k, v = _qkv("grad", 8, 2, 1, 3, F64)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    cu = _cu(5, 3)

    def f(q, k, v):
        out, lse = hal.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, window_size=(3, -1),
                                              return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)

    def g(q, k, v):  # non-causal, uneven q/k lengths, and an extra scale
        return hal.flash_attn_varlen_func(q, k, v, _cu(3, 5), cu, 5, 5, causal=False, softmax_scale=0.7)

    assert torch.autograd.gradcheck(g, (q, k, v), eps=1e-6, atol=1e-7)


def test_backward_is_deterministic_and_close_to_float64():
    q, k, v = _qkv("det", 40, 4, 2, 16)
    cu = _cu(25, 15)
    grads = []
    for dtype in (torch.float32, torch.float32, F64):
        ts = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = hal.flash_attn_varlen_func(*ts, cu, cu, 25, 25, causal=True, return_lse=True)
        (out.square().sum() + lse.sum()).backward()
        grads.append([t.grad for t in ts])
    for a, b in zip(grads[0], grads[1]):
        assert same_bits(a, b)
    for a, b in zip(grads[0], grads[2]):
        assert (a.double() - b).abs().max() < 1e-4 * (1 + b.abs().max())


def test_autograd_forward_equals_inference_forward():
    q, k, v = _qkv("l3", 40, 2, 1, 16, torch.bfloat16)
    inf_out, inf_lse = _varlen(q, k, v, _cu(40), causal=True)
    ts = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = _varlen(*ts, _cu(40), causal=True)
    assert out.requires_grad and same_bits(out.detach(), inf_out) and same_bits(lse.detach(), inf_lse)


# ------------------------------------------------------------------ bad inputs


def _cache_setup(paged=True, dtype=torch.float32):
    kc = gen.randn("bad/kc", (6, 4, 2, 8), dtype)
    vc = gen.randn("bad/vc", (6, 4, 2, 8), dtype)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32) if paged else None
    if not paged:
        kc, vc = gen.randn("bad/kc2", (2, 12, 2, 8), dtype), gen.randn("bad/vc2", (2, 12, 2, 8), dtype)
    q = gen.randn("bad/q", (2, 1, 4, 8), dtype)
    k = gen.randn("bad/k", (2, 1, 2, 8), dtype)
    return q, kc, vc, k, k.clone(), table


BAD_KVCACHE = [
    ("heads", lambda q, kc, vc, k, v, t: dict(q=q[:, :, :3]), "multiple of the number of key/value heads"),
    ("block-table-out-of-range", lambda q, kc, vc, k, v, t: dict(block_table=torch.tensor([[0, 1, 2], [9, 4, 5]],
                                                                                          dtype=torch.int32)),
     "out of range"),
    ("block-table-negative", lambda q, kc, vc, k, v, t: dict(block_table=torch.tensor([[0, -1, 2], [3, 4, 5]],
                                                                                      dtype=torch.int32)),
     "out of range"),
    ("cache-too-small", lambda q, kc, vc, k, v, t: dict(cache_seqlens=torch.tensor([12, 3], dtype=torch.int32)),
     "cache too small"),
    ("dtype-mismatch", lambda q, kc, vc, k, v, t: dict(q=q.to(torch.bfloat16)), "dtypes differ"),
    ("k-without-v", lambda q, kc, vc, k, v, t: dict(v=None), "both k and v"),
    ("negative-seqlens", lambda q, kc, vc, k, v, t: dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)),
     ">= 0"),
    ("num-splits", lambda q, kc, vc, k, v, t: dict(num_splits=-2), "num_splits"),
    ("window", lambda q, kc, vc, k, v, t: dict(window_size=(-3, 0)), "window_size"),
    ("shared-write-slot", lambda q, kc, vc, k, v, t: dict(block_table=torch.tensor([[0, 1, 2], [0, 1, 2]],
                                                                                    dtype=torch.int32),
                                                          cache_seqlens=torch.tensor([5, 5], dtype=torch.int32)),
     "same cache slot"),
    ("head-dim", lambda q, kc, vc, k, v, t: dict(k=k[..., :4], v=v[..., :4]), "k and v must be"),
    ("seqlens-float", lambda q, kc, vc, k, v, t: dict(cache_seqlens=torch.tensor([1.0, 2.0])), "int64 or int32"),
    ("rotary", lambda q, kc, vc, k, v, t: dict(rotary_cos=torch.zeros(3)), "not supported"),
    ("device", lambda q, kc, vc, k, v, t: dict(q=q.to("meta")), "different devices"),
]


@pytest.mark.parametrize("name,change,message", BAD_KVCACHE, ids=[b[0] for b in BAD_KVCACHE])
def test_bad_kvcache_inputs_raise_and_leave_cache_untouched(name, change, message):
    q, kc, vc, k, v, table = _cache_setup()
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=torch.tensor([5, 3], dtype=torch.int32),
                block_table=table)
    args.update(change(q, kc, vc, k, v, table))
    before = (kc.clone(), vc.clone())
    with pytest.raises(InputError, match=message):
        hal.flash_attn_with_kvcache(**args)
    assert same_bits(kc, before[0]) and same_bits(vc, before[1])


def test_bad_contiguous_cache_inputs():
    q, kc, vc, k, v, _ = _cache_setup(paged=False)
    before = kc.clone()
    with pytest.raises(InputError, match="cache too small"):
        hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=12)
    with pytest.raises(InputError, match="batch"):
        hal.flash_attn_with_kvcache(q[:1], kc, vc, k[:1], v[:1], cache_seqlens=2)
    with pytest.raises(InputError, match="no backward"):
        hal.flash_attn_with_kvcache(q.clone().requires_grad_(True), kc, vc, k, v, cache_seqlens=2)
    assert same_bits(kc, before)
    # a valid call appends in place (as flash-attn does)
    hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=2)
    assert same_bits(kc[:, 2], k[:, 0]) and same_bits(kc[:, :2], before[:, :2])


BAD_VARLEN = [
    ("heads", dict(k_heads=3), "multiple of the number of key/value heads"),
    ("cu-decreasing", dict(cu_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "non-decreasing"),
    ("cu-not-zero", dict(cu_q=torch.tensor([1, 4, 10], dtype=torch.int32)), r"\[0\] must be 0"),
    ("cu-too-long", dict(cu_q=torch.tensor([0, 4, 11], dtype=torch.int32)), "exceeds"),
    ("cu-float", dict(cu_q=torch.tensor([0.0, 4.0, 10.0])), "int64 or int32"),
    ("cu-batch-mismatch", dict(cu_k=torch.tensor([0, 10], dtype=torch.int32)), "sequences"),
    ("max-seqlen-small", dict(max_q=3), "max_seqlen_q"),
    ("dtype", dict(q_dtype=torch.float16), "dtypes differ"),
    ("dropout", dict(dropout_p=0.1), "not supported"),
    ("scale", dict(softmax_scale=float("nan")), "softmax_scale"),
]


@pytest.mark.parametrize("name,kw,message", BAD_VARLEN, ids=[b[0] for b in BAD_VARLEN])
def test_bad_varlen_inputs(name, kw, message):
    kw = dict(kw)
    q, k, v = _qkv("badvar", 10, 4, kw.pop("k_heads", 2), 8)
    q = q.to(kw.pop("q_dtype", torch.float32))
    cu_q = kw.pop("cu_q", _cu(4, 6))
    cu_k = kw.pop("cu_k", _cu(4, 6))
    max_q = kw.pop("max_q", 6)
    with pytest.raises(InputError, match=message):
        hal.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 6, causal=True, **kw)


# ------------------------------------------------------------------ KV cache helper


def test_kv_cache_paged_prefix_sharing_copy_on_write():
    k = gen.randn("kvc/k", (1, 23, 2, 4))
    v = gen.randn("kvc/v", (1, 23, 2, 4))
    cache = KVCache.paged(2, 40, 2, 4, page_size=5, num_pages=12, page_order=[7, 3, 11, 0, 5, 1, 2, 4, 6, 8, 9, 10])
    cache.write(k, v, rows=[0])
    assert cache.block_table[0, :5].tolist() == [7, 3, 11, 0, 5] and int(cache.seqlens[0]) == 23
    assert same_bits(cache.keys(0), k[0]) and same_bits(cache.values(0), v[0])
    cache.share_prefix(0, 1, 12)  # 2 full pages shared, the third (partial) shared until written
    assert cache.block_table[1, :3].tolist() == [7, 3, 11]
    k2 = gen.randn("kvc/k2", (1, 4, 2, 4))
    cache.write(k2, k2, rows=[1])
    assert cache.block_table[1, :2].tolist() == [7, 3] and int(cache.block_table[1, 2]) not in (7, 3, 11)
    assert same_bits(cache.keys(0), k[0])  # the owner's page was not overwritten
    assert same_bits(cache.keys(1), torch.cat([k[0, :12], k2[0]]))
    free_before = len(cache._free)
    cache.free(1)
    assert len(cache._free) == free_before + 2  # its own pages come back; the shared ones stay with row 0
    with pytest.raises(InputError, match="capacity"):
        cache.write(gen.randn("kvc/big", (1, 41, 2, 4)), gen.randn("kvc/big", (1, 41, 2, 4)), rows=[1])
    with pytest.raises(InputError, match="permutation"):
        KVCache.paged(1, 10, 1, 4, 5, page_order=[0, 0])


def test_kv_cache_contiguous_subset_rows():
    cache = KVCache.contiguous(3, 16, 1, 8)
    q, k, v = _qkv("kvc/sub", 6, 2, 1, 8)
    full, _ = _varlen(q, k, v, _cu(6), causal=True)
    cache.attend(q[None, :4], k[None, :4], v[None, :4], rows=[2])
    o = cache.attend(q[None, 4:], k[None, 4:], v[None, 4:], rows=[2])
    assert same_bits(o[0], full[4:]) and cache.seqlens.tolist() == [0, 0, 6]
    assert same_bits(cache.keys(2), k) and int(cache.k[:2].abs().sum()) == 0


def test_varlen_padded_layout_moves_uniform_fast_path():
    """When every sequence is max_len long from row 0 (a single sequence, or equal lengths), packed
    and padded layouts are the same memory and the moves are views. They must equal the general
    gather / scatter, written out here by slices; a batch with a trailing row of no sequence (the
    general path) is checked the same way, as is an empty sequence."""
    from hal.attention import padded_to_varlen, varlen_to_padded
    g = torch.Generator().manual_seed(3)
    for lens, total in (([7], 7), ([5, 5, 5], 15), ([5, 5], 11), ([4, 0, 4], 8), ([3, 6], 9)):
        x = torch.randn(total, 2, 3, generator=g)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        max_len = max(lens)
        xp, got_lens = varlen_to_padded(x, cu, max_len)
        assert got_lens.tolist() == lens and tuple(xp.shape) == (len(lens), max_len, 2, 3)
        for b, n in enumerate(lens):
            assert same_bits(xp[b, :n], x[int(cu[b]):int(cu[b]) + n])
        back = padded_to_varlen(xp * 2, cu, total, fill=-1.0)
        want = torch.full_like(x, -1.0)
        for b, n in enumerate(lens):
            want[int(cu[b]):int(cu[b]) + n] = x[int(cu[b]):int(cu[b]) + n] * 2
        assert same_bits(back, want)
