"""The `cpu` backend (numba) computes the reference backend's bits exactly.

Every bit claim compares raw bits (first_divergence) against the reference, whose NaNs are made
canonical first (the strict policy's one NaN per dtype; the cpu backend writes it at every output).
Negative controls: a double-rounding `a*b + c` chain and a fastmath chain, compiled the same way,
are caught by the same comparison.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hal
from hal.conformance.bits import first_divergence
from hal.spec import MatmulSpec, RMSNormSpec, SoftmaxSpec, TokenLogprobsSpec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# LOCKSTEP_FULL=1 runs 200 examples per randomized test (minutes); CI runs 15.
HYP = settings(max_examples=200 if os.environ.get("LOCKSTEP_FULL") else 15, deadline=None,
               suppress_health_check=[HealthCheck.too_slow])


def canon(t):
    from hal.kernels.cpu.host import canonical_nan
    return canonical_nan(t.clone()) if t.is_floating_point() else t


def same(label, ref, got):
    """Assert bit identity of a cpu result with the reference result (NaNs canonical)."""
    refs = ref if isinstance(ref, tuple) else (ref,)
    gots = got if isinstance(got, tuple) else (got,)
    for i, (r, g) in enumerate(zip(refs, gots)):
        div = first_divergence(f"{label}[{i}]", canon(r), g)
        assert div is None, str(div)


def both(fn, *args, **kw):
    return fn(*args, backend="reference", **kw), fn(*args, backend="cpu", **kw)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------ randomized bit identity

@HYP
@given(m=st.integers(1, 9), k=st.integers(0, 200), n=st.integers(1, 40), dt=st.sampled_from(DTYPES),
       tile=st.sampled_from([1, 7, 64]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_matmul_bits(m, k, n, dt, tile, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, m, k, dtype=dt), randn(g, n, k, dtype=dt)
    b = randn(g, n, dtype=dt) if bias else None
    spec = MatmulSpec(k_tile=tile)
    same("linear", *both(hal.linear, x, w, b, spec=spec))
    same("matmul", *both(hal.matmul, x.reshape(1, m, k), w.t(), spec=spec))


@HYP
@given(rows=st.integers(1, 6), h=st.integers(1, 700), dt=st.sampled_from(DTYPES), tile=st.sampled_from([16, 256]),
       res=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_bits(rows, h, dt, tile, res, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, rows, h, dtype=dt, scale=3.0), randn(g, h, dtype=dt)
    r = randn(g, rows, h, dtype=dt) if res else None
    same("rms_norm", *both(hal.rms_norm, x, w, 1e-6, residual=r, spec=RMSNormSpec(hidden_tile=tile)))


def _special_rows(g, rows, n):
    x = torch.randn(rows, n, generator=g) * 20
    kind = torch.randint(0, 6, (rows,), generator=g)
    for i in range(rows):
        if kind[i] == 1:
            x[i, torch.randint(0, n, (1,), generator=g)] = float("nan")
        elif kind[i] == 2:
            x[i, torch.randint(0, n, (1,), generator=g)] = float("inf")
        elif kind[i] == 3:
            x[i] = float("-inf")
        elif kind[i] == 4:
            x[i, ::2] = float("-inf")
    return x


@HYP
@given(rows=st.integers(1, 6), n=st.integers(1, 900), dt=st.sampled_from(DTYPES),
       tile=st.sampled_from([5, 8, 16, 256]), seed=st.integers(0, 2**16))
def test_softmax_family_bits(rows, n, dt, tile, seed):
    # tiles 8 and 16: groups of eight whole tiles (reduce._tiled_sum_lanes) and a tail; 5: the scalar path
    g = torch.Generator().manual_seed(seed)
    x = _special_rows(g, rows, n).to(dt)
    spec = SoftmaxSpec(tile=tile)
    for fn in (hal.softmax, hal.log_softmax, hal.logsumexp):
        same(fn.__name__, *both(fn, x, spec=spec))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_softmax_long_rows_bits(dt):
    """Rows of the spec's tile (256) long enough for two groups of eight tiles in the vector lanes,
    whole tiles after them and a short last tile, specials included; negative control: the same
    rows summed as one sequential chain (tile 1), and stock torch.softmax, are caught by the same comparison."""
    g = torch.Generator().manual_seed(11)
    x = _special_rows(g, 6, 2 * 8 * 256 + 3 * 256 + 77)
    x[0] = torch.randn(x.shape[1], generator=g)  # a plain row of many comparable terms, for the control
    x = x.to(dt)
    for fn in (hal.softmax, hal.log_softmax, hal.logsumexp):
        same(fn.__name__, *both(fn, x, spec=SoftmaxSpec(tile=256)))
    if dt != torch.float32:
        return  # the control: float32 outputs (a 16-bit output's rounding may hide one sum ulp)
    got = hal.softmax(x[:1], backend="cpu")
    assert first_divergence("one chain", hal.softmax(x[:1], backend="reference", spec=SoftmaxSpec(tile=1)), got)
    assert first_divergence("stock", torch.softmax(x[:1].float(), -1).to(dt), got)


@HYP
@given(n=st.integers(1, 70), h=st.integers(1, 100), v=st.integers(1, 600), dt=st.sampled_from(DTYPES),
       temp=st.sampled_from([1.0, 0.7]), ht=st.sampled_from([8, 64]), vt=st.sampled_from([32, 256]),
       seed=st.integers(0, 2**16))
def test_token_logprobs_bits(n, h, v, dt, temp, ht, vt, seed):
    g = torch.Generator().manual_seed(seed)
    hid, w = randn(g, n, h, dtype=dt), randn(g, v, h, dtype=dt)
    tok = torch.randint(0, v, (n,), generator=g)
    spec = TokenLogprobsSpec(hidden_tile=ht, vocab_tile=vt)
    same("token_logprobs", *both(hal.token_logprobs, hid, w, tok, temperature=temp, spec=spec))


# the gemm's operand choice and panel edges (matmul._gemm): x packed (M <= N) with one and two
# 16-row panels, the weight packed (M > N) with a short last panel, exact multiples, M on both sides
# of the switch to the streaming kernel (_STREAM_ROWS), 3-D x, K not a multiple of the tile or of 8
PACKING_SHAPES = [((4, 37, 5), 7), ((16, 64, 16), 64), ((17, 70, 33), 16), ((1, 9, 21), 64),
                  ((1, 150, 19), 64), ((2, 33, 40), 64), ((40, 65, 20), 64), ((9, 130, 8), 64)]


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_linear_operand_packing_edges(dt):
    g = torch.Generator().manual_seed(5)
    for (m, k, n), tile in PACKING_SHAPES:
        x, w, b = randn(g, m, k, dtype=dt), randn(g, n, k, dtype=dt), randn(g, n, dtype=dt, scale=4.0)
        x[0, k // 2], w[n - 1, 0], w[0, k - 1] = float("nan"), float("inf"), -float("inf")
        x[m - 1, 1] = 0.0
        w[1 % n, 1] = float("inf")  # inf * 0 = NaN in the last row's chain
        spec = MatmulSpec(k_tile=tile)
        for bias in (None, b):
            same(f"linear {m}x{k}x{n}", *both(hal.linear, x, w, bias, spec=spec))
        if m % 2 == 0:
            same(f"linear 3-D {m}x{k}x{n}", *both(hal.linear, x.reshape(2, m // 2, k), w, b, spec=spec))
        same(f"matmul {m}x{k}x{n}", *both(hal.matmul, x, w.t(), spec=spec))


# the decode kernel on the weight as stored (matmul._stream_*, 1 to _STREAM_ROWS rows): each of its row paths
# (1, 2, 3-4 rows with two K tiles at once, 5-8 rows one tile at a time), N under and off its 16-row tasks, K off
# its blocks (32 bf16 / 16 float32 / fp16 steps), tiles ending inside a block or shorter than one (steps one at
# a time), tiles in pairs, a tile left unpaired (odd count, or the next one shorter) and tiles longer than K
STREAM_SHAPES = [((1, 1, 1), 64), ((1, 200, 70), 64), ((1, 256, 48), 64), ((2, 128, 16), 32), ((2, 300, 40), 256),
                 ((3, 33, 31), 7), ((4, 97, 33), 48), ((5, 130, 65), 100), ((8, 81, 32), 16), ((7, 64, 96), 64),
                 ((6, 96, 17), 32)]


def _stream_operands(g, m, k, n, dt):
    """x, w, bias with -0.0, subnormal values and products, NaN and +-inf at chosen places."""
    x, w, b = randn(g, m, k), randn(g, n, k), randn(g, n, scale=4.0)
    sub = torch.finfo(dt).tiny / 4  # a subnormal of the dtype
    x[0, 0], w[0, 0] = -0.0, -0.0
    w[n - 1, k - 1] = sub
    w[(n - 1) // 2] = -0.0  # a row of -0.0 products: the chain from +0.0 stays +0.0
    if k > 2:
        x[0, 1], w[:, 1] = 1e-20, 1e-20  # a subnormal float32 product (16-bit inputs: whatever they hold)
        x[m - 1, 2] = sub
    if k > 4 and n > 2:  # specials in a few columns (and, with two rows or more, in the last row only)
        w[1, 3] = float("nan")
        w[n - 1, 4] = -float("inf")
        if m > 1:
            x[m - 1, 4] = float("inf")  # inf in a row's chain; inf * -0.0 = NaN in the -0.0 row's
    return x.to(dt), w.to(dt), b.to(dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_linear_streaming_bits(dt):
    from hal.kernels.cpu import matmul as km
    g = torch.Generator().manual_seed(12)
    for (m, k, n), tile in STREAM_SHAPES:
        assert m <= km._STREAM_ROWS
        x, w, b = _stream_operands(g, m, k, n, dt)
        spec = MatmulSpec(k_tile=tile)
        for bias in (None, b):
            same(f"linear {m}x{k}x{n} k{tile}", *both(hal.linear, x, w, bias, spec=spec))
        # the kernel's float32 chains before the output rounding (which hides most float32 ulps of a
        # 16-bit result): the float32 reference on the exactly widened inputs
        ref32 = hal.linear(x.float(), w.float(), b.float(), spec=spec, backend="reference")
        same(f"float32 chains {m}x{k}x{n} k{tile}",
             ref32, torch.from_numpy(km.dot_rows_nk(km.raw(x), km.raw(w), tile, km.raw(b.float()))))
    # negative controls, caught by the same comparison of the kernel's float32 output (16-bit inputs are
    # widened exactly, so the float32 reference on the widened inputs is the kernel's own chain): the
    # streaming kernel run at another tile (on each row path), and MKL's float32 product (another order)
    for m in (1, 2, 3, 6):
        x, w, _ = _stream_operands(g, m, 200, 70, dt)
        ref = canon(hal.linear(x.float(), w.float(), backend="reference"))
        got = np.empty((m, 70), np.float32)
        for tile, agrees in ((64, True), (32, False)):
            km._stream_into(km._widened(km.raw(x)), km.raw(w), got, tile, km._NO_BIAS)
            assert (first_divergence(f"{m} rows, tile {tile}", ref, torch.from_numpy(got)) is None) == agrees
    assert first_divergence("mkl", ref, canon(torch.nn.functional.linear(x.float(), w.float()))) is not None


# ------------------------------------------------------------------ invariances (by construction; shown)

def test_linear_row_alone_equals_row_in_batch():
    # one row streams the weight as stored (as 2-8 rows do), a batch of 33 rows runs the gemm with x packed, a
    # batch of 100 rows the gemm with the weight packed: same bits for every row
    g = torch.Generator().manual_seed(1)
    x, w = randn(g, 100, 300), randn(g, 70, 300)
    big, batch = hal.linear(x, w, backend="cpu"), hal.linear(x[:33], w, backend="cpu")
    for i in (0, 5, 32):
        div = first_divergence(f"row {i}", batch[i:i + 1], hal.linear(x[i:i + 1], w, backend="cpu"))
        assert div is None, str(div)
        div = first_divergence(f"row {i} of 100", big[i:i + 1], batch[i:i + 1])
        assert div is None, str(div)
    # negative control: torch's own linear is not batch invariant here
    stock = torch.nn.functional.linear
    assert any(first_divergence("stock", stock(x, w)[i:i + 1], stock(x[i:i + 1], w)) is not None for i in range(33))


def test_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(2)
    x, w = randn(g, 64, 512), randn(g, 256, 512)
    s = randn(g, 16, 3000)
    old = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((hal.linear(x, w, backend="cpu"), hal.log_softmax(s, backend="cpu")))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*outs):
        assert first_divergence("threads", a, b) is None


def _pool_calls(monkeypatch):
    """Every kernel lockstep's pool splits over threads, as (threads, torch's thread count) at the time."""
    from hal.kernels.cpu import pool
    calls, real = [], pool.run

    def recorded(kernel, n_tasks, *args, parallel):
        if parallel and min(pool.threads(), n_tasks) > 1:
            calls.append((min(pool.threads(), n_tasks), torch.get_num_threads()))
        return real(kernel, n_tasks, *args, parallel=parallel)
    monkeypatch.setattr(pool, "run", recorded)
    return calls


def test_engine_calls_give_torchs_threads_to_lockstep(monkeypatch):
    """hal.integrations.vllm.threads: inside, torch on one thread and lockstep's kernels on the threads torch had;
    put back after (an exception too); the bits are those of either count. Control: with torch on one thread and
    no scope, the same call launches no second thread."""
    from hal import kernel_threads
    from hal.integrations.vllm.threads import lockstep_takes_the_cores
    from hal.kernels.cpu import pool
    g = torch.Generator().manual_seed(3)
    x, w = randn(g, 64, 512), randn(g, 256, 512)  # 8M fma steps: parallel
    calls = _pool_calls(monkeypatch)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = hal.linear(x, w, backend="cpu")
        assert calls == []  # the control: one torch thread, one lockstep thread
        torch.set_num_threads(2)
        with lockstep_takes_the_cores():
            assert (torch.get_num_threads(), pool.threads(), kernel_threads.own()) == (1, 2, 2)
            with lockstep_takes_the_cores():  # nested: nothing more to hand over
                assert (torch.get_num_threads(), pool.threads()) == (1, 2)
            inside = hal.linear(x, w, backend="cpu")
        assert calls and all(c == (2, 1) for c in calls), calls
        assert (torch.get_num_threads(), kernel_threads.own()) == (2, None)
        assert first_divergence("engine threads", serial, inside) is None
        with pytest.raises(RuntimeError, match="boom"):
            with lockstep_takes_the_cores():
                raise RuntimeError("boom")
        assert (torch.get_num_threads(), kernel_threads.own()) == (2, None)
        kernel_threads.set_own(3)  # a count of lockstep's own is kept inside, and after
        with lockstep_takes_the_cores():
            assert (torch.get_num_threads(), pool.threads()) == (1, 3)
        assert (torch.get_num_threads(), kernel_threads.own()) == (2, 3)
    finally:
        kernel_threads.set_own(None)
        torch.set_num_threads(old)


def test_install_wraps_only_the_model_calls():
    from hal.integrations.vllm import threads
    from hal.kernels.cpu import pool

    def seen(self):
        return torch.get_num_threads(), pool.threads()

    worker = type("Worker", (), {name: seen for name in threads.MODEL_CALLS + ("load_model",)})
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert worker().execute_model() == (2, 2)  # the control: before install
        threads.install(worker)
        for name in threads.MODEL_CALLS:
            assert getattr(worker(), name)() == (1, 2), name
        assert worker().load_model() == (2, 2)  # weight loading keeps torch's threads
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_pool_thread_count_refuses_bad_values(bad):
    from hal import kernel_threads
    from hal.errors import InputError
    with pytest.raises(InputError, match="thread count"):
        kernel_threads.set_own(bad)
    assert kernel_threads.own() is None


def test_auto_selection_prefers_cpu_and_reference_stays_selectable():
    x = torch.randn(3, 4)
    spec = hal.spec.DEFAULTS["softmax"]
    assert hal.select("softmax", spec, x.dtype, x.device).name == "cpu"
    with hal.use("reference"):
        assert hal.select("softmax", spec, x.dtype, x.device).name == "reference"


def test_without_numba_auto_selection_falls_back(monkeypatch):
    cpu = hal.get_backend("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))
    assert "numba" in cpu.unavailable_reason()
    x = torch.randn(3, 4)
    spec = hal.spec.DEFAULTS["softmax"]
    assert hal.select("softmax", spec, x.dtype, x.device).name == "reference"
    with pytest.raises(hal.UnsupportedError, match="numba"):
        hal.softmax(x, backend="cpu")


def test_flush_to_zero_is_refused():
    x = torch.randn(2, 8)
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(hal.UnsupportedError, match="flush"):
            hal.softmax(x, backend="cpu")
    finally:
        torch.set_flush_denormal(False)
    hal.softmax(x, backend="cpu")  # fine again


def test_subnormals_are_kept():
    tiny = torch.tensor([[2.0 ** -140, 3.0 * 2.0 ** -149, -(2.0 ** -130)]])
    one = torch.ones(1, 1)
    same("subnormal linear", *both(hal.linear, tiny.t().contiguous(), one))
    assert bool((hal.linear(tiny.t().contiguous(), one, backend="cpu") != 0).all())


def test_bf16_fp16_conversion_is_round_to_nearest_even():
    """The host rounds float32 results with torch's .to(): check it against integer RNE on ties,
    subnormals and random patterns (the reference rounds the same way, so this pins the rule)."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, (torch.arange(0, 2**16) << 16) | 0x8000, torch.arange(0, 300)])  # bf16 ties
    x = (bits & 0x7F7FFFFF).to(torch.int32).view(torch.float32)  # finite
    b = x.numpy().view(np.uint32).astype(np.uint64)
    rne = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    assert (x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) == rne).all()
    half = x[(x.abs() < 65504)]
    exact = half.double().numpy().astype(np.float16)  # numpy's float64 -> float16 is RNE
    assert (half.to(torch.float16).view(torch.int16).numpy() == exact.view(np.int16)).all()


# ------------------------------------------------------------------ negative controls

def _variant_dot(kind):
    """The cpu linear kernel's per-output chain, compiled wrongly on purpose."""
    from numba import njit
    from hal.kernels.cpu.strict_math import ZERO

    def chain(x, w, t, out):
        for n in range(w.shape[0]):
            total = ZERO
            for k0 in range(0, x.shape[0], t):
                acc = ZERO
                for k in range(k0, min(k0 + t, x.shape[0])):
                    acc = x[k] * w[n, k] + acc  # double rounding (or reassociated under fastmath)
                total = total + acc
            out[n] = total
    return njit(fastmath=(kind == "fastmath"))(chain)


@pytest.mark.parametrize("kind", ["double_rounding", "fastmath"])
def test_negative_control_wrong_arithmetic_is_caught(kind):
    g = torch.Generator().manual_seed(4)
    x, w = randn(g, 1, 512), randn(g, 64, 512)
    out = np.empty(64, np.float32)
    _variant_dot(kind)(x[0].numpy(), w.numpy(), 64, out)
    ref = hal.linear(x, w, backend="reference")[0]
    assert first_divergence("variant", ref, torch.from_numpy(out)) is not None
    assert first_divergence("cpu", ref, hal.linear(x, w, backend="cpu")[0]) is None


# ------------------------------------------------------------------ attention

from hal.spec import AttentionSpec  # noqa: E402


# (Hq, Hkv): GQA groups of 1, 2, 3 and 4 query heads (the kernel runs a group's heads in pairs, a lone
# last head alone), MQA with an odd and an even group; head dims and dot tiles that are and are not
# multiples of the kernel's four-dim passes; kv_split wider than the keys (one narrower tile) and not
# a power of two.
ATTN_HEADS = [(1, 1), (4, 2), (3, 1), (6, 2), (8, 2), (4, 1)]
ATTN_TILES = [(16, 32, 64, "fp32"), (64, 256, 64, "fp32"), (16, 64, 8, "input"), (16, 48, 6, "fp32")]


def _specials(g, x, frac=0.05):
    """x with a few NaN / +-inf / huge entries (at random places, same count for every dtype)."""
    x = x.clone()
    flat = x.reshape(-1)
    if flat.numel():
        n = max(1, int(flat.numel() * frac))
        at = torch.randint(0, flat.numel(), (n,), generator=g)
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e4, -3e4])
        flat[at] = vals[torch.randint(0, 5, (n,), generator=g)].to(x.dtype)
    return x


@HYP
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 90)), min_size=1, max_size=3),
       heads=st.sampled_from(ATTN_HEADS), d=st.sampled_from([8, 37, 40, 64]),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (17, 0), (5, 3)]), dt=st.sampled_from(DTYPES),
       tiles=st.sampled_from(ATTN_TILES), special=st.sampled_from([None, "q", "k", "v"]),
       seed=st.integers(0, 2**16))
def test_attention_varlen_bits(lens, heads, d, causal, window, dt, tiles, special, seed):
    g = torch.Generator().manual_seed(seed)
    lq = [min(a, b) for a, b in lens]  # queries are the last keys of their sequence
    lk = [b for _, b in lens]
    hq, hkv = heads
    q, k, v = randn(g, sum(lq), hq, d, dtype=dt), randn(g, sum(lk), hkv, d, dtype=dt), randn(g, sum(lk), hkv, d, dtype=dt)
    if special == "q":
        q = _specials(g, q)
    elif special == "k":
        k = _specials(g, k)
    elif special == "v":
        v = _specials(g, v)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    kb, ks, dtile, pp = tiles
    spec = AttentionSpec(kv_block=kb, kv_split=ks, dot_tile=dtile, p_precision=pp)
    ref, got = both(hal.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                    window_size=window, return_lse=True, spec=spec)
    same("varlen", ref, got)


@HYP
@given(b=st.integers(1, 3), cached=st.integers(0, 150), sq=st.integers(1, 5), page=st.sampled_from([16, 48]),
       splits=st.integers(0, 4), dt=st.sampled_from(DTYPES), heads=st.sampled_from(ATTN_HEADS),
       seed=st.integers(0, 2**16))
def test_attention_paged_kvcache_bits(b, cached, sq, page, splits, dt, heads, seed):
    g = torch.Generator().manual_seed(seed)
    (hq, hkv), d = heads, 32
    pages_per_seq = -(-(cached + sq) // page)
    n_pages = b * pages_per_seq
    kc, vc = randn(g, n_pages, page, hkv, d, dtype=dt), randn(g, n_pages, page, hkv, d, dtype=dt)
    table = torch.randperm(n_pages, generator=g).to(torch.int32).reshape(b, pages_per_seq)
    q = randn(g, b, sq, hq, d, dtype=dt)
    seqlens = torch.full((b,), cached + sq, dtype=torch.int32)
    outs = [hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True,
                                        num_splits=splits, return_lse=True, backend=name)
            for name in ("reference", "cpu")]
    same("paged", outs[0], outs[1])


def test_attention_negative_controls_are_caught():
    """The same comparison catches SDPA (stock) and a one-split variant of the merge arithmetic."""
    g = torch.Generator().manual_seed(5)
    q, k, v = randn(g, 40, 8, 32), randn(g, 600, 2, 32), randn(g, 600, 2, 32)  # GQA groups of 4
    cu_q, cu_k = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([0, 600], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, 40, 600)
    ref = hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, backend="reference")
    same("cpu", ref, hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, backend="cpu"))
    stock = hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, backend="stock")
    assert first_divergence("stock", ref[0], stock[0]) is not None
    # one split covering every key is a different (legal) spec: its bits must differ from the default's
    one_split = AttentionSpec(kv_split=1024)
    other = hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, spec=one_split, backend="cpu")
    assert first_divergence("split spec", ref[0], other[0]) is not None


def test_concurrent_calls_from_python_threads():
    """Calls from several Python threads at once (the backend serialises its numba launches)."""
    from concurrent.futures import ThreadPoolExecutor
    g = torch.Generator().manual_seed(6)
    xs = [randn(g, 8, 256) for _ in range(8)]
    w = randn(g, 64, 256)
    serial = [hal.linear(x, w, backend="cpu") for x in xs]
    with ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(lambda x: hal.linear(x, w, backend="cpu"), xs))
    for a, b in zip(serial, threaded):
        assert first_divergence("threaded", a, b) is None


# ------------------------------------------------------------------ drivers and host passes

def test_parallel_and_serial_drivers_same_bits(monkeypatch):
    """Each kernel's tasks split over 2 threads (pool.run, taken for large work at > 1 thread) and run
    on the calling thread alone (small work, or 1 thread): same bits, across task boundaries (rows
    past _R, panels past _PB, columns past a panel, short last tiles), the weight packed or x packed
    (C^T computed). A different k tile, checked the same way, must differ."""
    from hal.kernels.cpu import matmul as km
    g = torch.Generator().manual_seed(7)
    a = randn(g, 70, 130, dtype=torch.bfloat16)
    w = randn(g, 300, 130, dtype=torch.bfloat16)
    a2, w2 = km.raw(a), km.raw(w)
    wt2 = km.raw(w.t())
    assert 300 > km._L * km._PB and 70 % km._R and 300 % km._L  # the boundaries named above are crossed
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, fn, args in (("gemm nk", km._gemm_into, (a2, w2, True)),
                               ("gemm nk, x packed", km._gemm_into, (w2, a2, True)),
                               ("gemm kn", km._gemm_into, (a2, wt2, False)),
                               ("stream", km._stream_into, (km._widened(a2[:3]), w2)),
                               ("stream one row", km._stream_into, (km._widened(a2[:1]), w2)),
                               ("stream six rows", km._stream_into, (km._widened(a2[:6]), w2))):
            xpacked = name.endswith("x packed")  # C^T = W . x^T inside, then transposed
            outs = []
            for par, t in ((True, 64), (False, 64), (False, 32)):
                monkeypatch.setattr(km, "parallel_worth", lambda work, par=par: par)
                rows = {"stream": 3, "stream one row": 1, "stream six rows": 6}.get(name, 70)
                out = np.zeros((rows, 300), np.float32)
                fn(*args, out, t, km._NO_BIAS, *((xpacked,) if name.startswith("gemm") else ()))
                outs.append(torch.from_numpy(out))
            assert first_divergence(name, outs[0], outs[1]) is None
            assert first_divergence(name + " other tile", outs[0], outs[2]) is not None
            if name == "gemm nk":
                plain = outs[0]
            elif xpacked:  # the two orientations of one linear: same bits
                assert first_divergence("x packed vs weight packed", plain, outs[0]) is None
    finally:
        torch.set_num_threads(old)
    same("linear across tasks", *both(hal.linear, a, w))
    same("matmul across tasks", *both(hal.matmul, a, w.t()))


def test_attention_parallel_and_serial_drivers_same_bits(monkeypatch):
    """Attention's tasks ((sequence, query row, kv head)) split over 2 threads (pool.run) and run on the
    calling thread alone: same bits as each other and as the reference (GQA groups of 4 and of 3,
    varlen with an empty sequence). Forcing the split is the only change."""
    from hal.kernels.cpu import attention as ka
    g = torch.Generator().manual_seed(8)
    cu = torch.tensor([0, 70, 70, 130], dtype=torch.int32)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for hq, hkv in ((8, 2), (3, 1)):
            q, k, v = randn(g, 130, hq, 40), randn(g, 130, hkv, 40), randn(g, 130, hkv, 40)
            args = (q, k, v, cu, cu, 70, 70)
            outs = []
            for par in (True, False):
                monkeypatch.setattr(ka, "parallel_worth", lambda work, par=par: par)
                outs.append(hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, backend="cpu"))
            same(f"attention H{hq}/{hkv} 2 threads vs one", outs[0], outs[1])
            same(f"attention H{hq}/{hkv} vs reference",
                 hal.flash_attn_varlen_func(*args, causal=True, return_lse=True, backend="reference"), outs[0])
    finally:
        torch.set_num_threads(old)


def test_elementwise_serial_and_prange_drivers_same_bits():
    """Elementwise maps run on one thread up to _SERIAL_MAX elements and split over threads above:
    a large input's leading elements equal the same elements computed alone, and the reference
    (specials included). Stock torch silu, checked the same way, must differ."""
    from hal.kernels.cpu import elementwise as ke
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(11)
    x = randn(g, ke._SERIAL_MAX + 4099, scale=8.0)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    for op in (hal.silu, hal.sigmoid, hal.softplus):
        big = op(x, backend="cpu")
        same(f"{op.__name__} prange vs serial", op(x[:1000], backend="cpu"), big[:1000])
        same(f"{op.__name__} prange vs reference", op(x, backend="reference"), big)
    same("silu_mul prange vs reference", *both(hal.silu_mul, x, x.flip(0)))
    assert first_divergence("stock silu", canon(F.silu(x)), hal.silu(x, backend="cpu")) is not None


@pytest.mark.parametrize("dt", DTYPES)
def test_host_canonical_nan_matches_reference(dt):
    """The compiled in-place NaN pass against the reference's torch.where on random bit patterns
    (every NaN payload and sign, infinities, ordinary values)."""
    from hal.kernels.cpu.host import canonical_nan
    from hal.kernels.reference.strict_math import canonical_nan as ref_canon
    g = torch.Generator().manual_seed(8)
    if dt == torch.float32:
        bits = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
        x = torch.cat([bits, torch.tensor([0x7F800000, -0x800000, 0x7FC00000], dtype=torch.int32)]).view(dt)
    else:
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dt)  # every pattern
    want = ref_canon(x.clone())
    got = canonical_nan(x.clone())
    assert first_divergence("canonical_nan", want, got) is None
    assert bool(torch.isnan(x).any())  # the case set holds NaNs: the pass had work to do
    assert first_divergence("untouched", want, x) is not None  # negative control: raw NaN payloads differ
