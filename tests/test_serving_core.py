"""The serving core (hal/serving.py) and the sampling module (hal/sampling.py), with no engine at all.

One hand-built mixed step: request 0 decodes (one new token on 6 cached), request 1 continues its prefill
(a second chunk of 3 tokens on 5 cached), request 2 starts one (4 tokens); each request's blocks are
scattered over the cache out of order, and two padding rows follow. The step's attention over the paged
cache, in the [blocks, block_size, Hkv, D] layout and in vLLM's CPU layout [blocks, Hkv, block_size, 2 * D]
(addressed through views, never copied), must give every request the raw bits of
hal.flash_attn_varlen_func on that request alone with its keys contiguous. Wrong addressing is caught.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import hal
from hal.conformance.bits import same_bits
from hal.errors import InputError, UnsupportedError
from hal.sampling import Sampling, kept_logprobs, kept_set, recorded_logprobs, sampling_scores, top_logprobs
from hal.kernels import layout
from hal.serving import GdnStates, PagedKV, ServingBatch, paged_attention, request_kv, varlen_attention, write_kv

HQ, HKV, D, BS, BLOCKS = 4, 2, 8, 4, 12
SCALE = 0.35
CACHED = [6, 5, 0]    # keys already in the cache per request
NEW = [1, 3, 4]       # this step's queries (= new keys) per request: decode, a later prefill chunk, a first one
TABLE = torch.tensor([[7, 2, -1], [4, 9, 0], [11, -1, -1]])  # non-contiguous blocks, unused entries -1
PAD = 2               # the engine's padding rows after the real queries


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, for checks on parts of a tensor (padding rows all +0.0); whole results: same_bits."""
    return t.contiguous().view(torch.int32)


def slot(b: int, pos: int, bs: int = BS) -> int:
    return int(TABLE[b, pos // bs]) * bs + pos % bs


def make_step(dtype=torch.float32, bs: int = BS, d: int = D, cached=CACHED, new=NEW):
    g = torch.Generator().manual_seed(0)
    lens = [c + n for c, n in zip(cached, new)]
    keys = [torch.randn(n, HKV, d, generator=g).to(dtype) for n in lens]
    vals = [torch.randn(n, HKV, d, generator=g).to(dtype) for n in lens]
    q = torch.randn(sum(new) + PAD, HQ, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(new)).cumsum(0).to(torch.int32)
    mapping = torch.tensor([slot(b, t, bs) for b in range(3) for t in range(cached[b], lens[b])])
    batch = ServingBatch(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=TABLE,
                         slot_mapping=mapping)
    old = torch.tensor([slot(b, t, bs) for b in range(3) for t in range(cached[b])])
    k_old = torch.cat([keys[b][:cached[b]] for b in range(3)])
    v_old = torch.cat([vals[b][:cached[b]] for b in range(3)])
    k_new = torch.cat([keys[b][cached[b]:] for b in range(3)])
    v_new = torch.cat([vals[b][cached[b]:] for b in range(3)])
    return q, keys, vals, batch, (old, k_old, v_old), (k_new, v_new)


def alone(q, keys, vals, batch):
    """Each request alone: hal.flash_attn_varlen_func on its own queries and contiguous keys."""
    qsl = batch.query_start_loc.tolist()
    out = []
    for b in range(3):
        qb = q[qsl[b]:qsl[b + 1]]
        n_q, n_k = qb.shape[0], keys[b].shape[0]
        out.append(hal.flash_attn_varlen_func(qb, keys[b], vals[b], torch.tensor([0, n_q], dtype=torch.int32),
                                              torch.tensor([0, n_k], dtype=torch.int32), n_q, n_k,
                                              softmax_scale=SCALE, causal=True))
    return torch.cat(out)


def standard_cache(dtype=torch.float32):
    kc = torch.full((BLOCKS, BS, HKV, D), float("nan"), dtype=dtype)  # never-written slots are NaN: a read shows
    vc = torch.full((BLOCKS, BS, HKV, D), float("nan"), dtype=dtype)
    return PagedKV(kc, vc), (kc, vc)


def vllm_cache(dtype=torch.float32):
    kv = torch.full((BLOCKS, HKV, BS, 2 * D), float("nan"), dtype=dtype)
    return PagedKV.from_vllm_cpu(kv, D), kv


def inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view``'s memory lies in ``base``'s storage (a view, not a copy)."""
    start, size = base.untyped_storage().data_ptr(), base.untyped_storage().nbytes()
    return (view.untyped_storage().data_ptr() == start and start <= view.data_ptr() < start + size)


def filled(make, dtype=torch.float32):
    q, keys, vals, batch, (old, k_old, v_old), (k_new, v_new) = make_step(dtype)
    cache, base = make(dtype)
    write_kv(cache, k_old, v_old, old)  # what earlier steps stored
    write_kv(cache, k_new, v_new, batch.slot_mapping)  # this step's new tokens
    return q, keys, vals, batch, cache, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["blocks_bs_h_d", "vllm_cpu"])
def test_mixed_step_equals_each_request_alone(layout, dtype):
    make = standard_cache if layout == "blocks_bs_h_d" else vllm_cache
    q, keys, vals, batch, cache, base = filled(make, dtype)
    out = paged_attention(q, cache, batch, SCALE)
    n = sum(NEW)
    want = alone(q, keys, vals, batch)
    got, want = (out.float(), want.float()) if dtype == torch.bfloat16 else (out, want)
    assert same_bits(got[:n], want)
    assert out.shape == (n + PAD, HQ, D) and not bits(out[n:].float()).any()  # padding rows: +0.0
    assert same_bits(paged_attention(q[:n], cache, batch, SCALE), out[:n])  # no padding rows (vLLM's call)
    # the contiguous-keys form of the same step: the same bits
    assert same_bits(varlen_attention(q, torch.cat(keys), torch.cat(vals), batch, SCALE).float(), out.float())
    if layout == "vllm_cpu":
        assert inside(cache.keys, base) and inside(cache.values, base)  # views into the engine's tensor
        assert not cache.keys.is_contiguous()
        # write_kv landed where vLLM's CPU attention ("vec" ISA) keeps a token: in the memory of its (block, kv
        # head), element d of the key at d * BS + offset, element d of the value at BS * D + offset * D + d
        for b, t in ((0, CACHED[0]), (1, CACHED[1] + 2), (2, 0)):
            blk, off = divmod(slot(b, t), BS)
            for h in range(HKV):
                mem = base[blk, h].reshape(-1)
                assert torch.equal(bits(mem[torch.arange(D) * BS + off].float()), bits(keys[b][t][h].float()))
                assert torch.equal(bits(mem[BS * D + off * D + torch.arange(D)].float()), bits(vals[b][t][h].float()))


def test_both_layouts_give_the_same_bits():
    outs = []
    for make in (standard_cache, vllm_cache):
        q, keys, vals, batch, cache, _ = filled(make)
        outs.append(paged_attention(q, cache, batch, SCALE))
    assert same_bits(outs[0], outs[1])


def test_wrong_addressing_is_caught():
    """Negative controls: the same checks see a wrong block table, keys read in the wrong order, and the vLLM
    layout read as if it were [blocks, block_size, Hkv, D]."""
    n = sum(NEW)
    q, keys, vals, batch, cache, _ = filled(standard_cache)
    want = alone(q, keys, vals, batch)
    assert same_bits(paged_attention(q, cache, batch, SCALE)[:n], want)  # the right addressing passes
    swapped = TABLE.clone()
    swapped[1, [0, 1]] = swapped[1, [1, 0]]  # request 1's first two blocks in the wrong order
    bad = ServingBatch(batch.query_start_loc, batch.seq_lens, swapped, batch.slot_mapping)
    assert not same_bits(paged_attention(q, cache, bad, SCALE)[:n], want)
    reversed_keys = [k.flip(0) for k in keys]  # contiguous keys, newest first
    assert not same_bits(varlen_attention(q, torch.cat(reversed_keys), torch.cat(vals), batch, SCALE)[:n], want)
    q, keys, vals, batch, cache, kv = filled(vllm_cache)
    rows = kv.transpose(1, 2)  # the wrong reading of vLLM's cache: a token's key and value side by side in a row
    wrong = PagedKV(rows[..., :D], rows[..., D:])
    assert not same_bits(paged_attention(q, wrong, batch, SCALE)[:n], want)
    keys_tokens_major = kv.view(BLOCKS, HKV, 2, BS, D)[:, :, 0].transpose(1, 2)  # keys read [BS, D], not [D, BS]
    wrong = PagedKV(keys_tokens_major, cache.values)
    assert not same_bits(paged_attention(q, wrong, batch, SCALE)[:n], want)


def random_bits_cache(make, dtype, seed):
    """A cache whose every slot holds random bits (NaN patterns included): a token read from a wrong slot shows."""
    cache, _ = make(dtype)
    g = torch.Generator().manual_seed(seed)
    raw, half = (torch.int16, 2 ** 15) if dtype.itemsize == 2 else (torch.int32, 2 ** 31)
    for t in (cache.keys, cache.values):
        t.copy_(torch.randint(-half, half, t.shape, generator=g, dtype=torch.int64).to(raw).view(dtype))
    return cache


def padded_round_trip(cache, batch):
    """The old request_kv: each request padded to the longest (layout.gather_kv, whole pages), then packed."""
    lens = batch.seq_lens.to(torch.int64)
    max_len, total = (int(lens.max()), int(lens.sum())) if lens.numel() else (0, 0)
    return [layout.padded_to_varlen(layout.gather_kv(kv, lens, batch.block_table, max_len), batch.key_starts(), total)
            for kv in (cache.keys, cache.values)]


RAGGED = [  # (seq_lens, block table): out-of-order blocks, unused entries -1, empty requests, exact block multiples
    ([6, 0, 9, 1, 8, 0], [[7, 2, -1], [-1, -1, -1], [4, 9, 0], [11, -1, -1], [3, 1, -1], [5, -1, -1]]),
    ([0, 0], [[1, -1, -1], [-1, -1, -1]]),
    ([12], [[10, 6, 8]]),
]


@pytest.mark.parametrize("layout_name", ["blocks_bs_h_d", "vllm_cpu"])
def test_one_gather_is_the_padded_round_trip_bit_for_bit(layout_name):
    """request_kv gathers each request's keys straight into the packed layout (one gather at coordinates the batch
    computes once): the raw bits of the old padded -> packed round trip and of a per-token loop, for ragged
    lengths, empty requests and non-contiguous blocks. Negative control: keys one slot off are caught."""
    make = standard_cache if layout_name == "blocks_bs_h_d" else vllm_cache
    cache = random_bits_cache(make, torch.bfloat16, seed=3)
    for lens, table in RAGGED:
        lens, table = torch.tensor(lens, dtype=torch.int32), torch.tensor(table, dtype=torch.int32)
        batch = ServingBatch(torch.zeros(len(lens) + 1, dtype=torch.int32), lens, table)
        got = request_kv(cache, batch)
        loop = [torch.stack([kv[int(table[b, t // BS]), t % BS] for b in range(len(lens)) for t in range(lens[b])])
                if int(lens.sum()) else kv[:0, 0] for kv in (cache.keys, cache.values)]
        for new, old, by_token in zip(got, padded_round_trip(cache, batch), loop):
            assert new.shape == (int(lens.sum()), HKV, D) and new.is_contiguous()
            assert torch.equal(bits(new.float()), bits(old.float())) and torch.equal(bits(new.float()),
                                                                                   bits(by_token.float()))
    lens, table = torch.tensor(RAGGED[0][0]), torch.tensor(RAGGED[0][1])
    blocks, offsets = layout.paged_token_coords(lens, table, BS)
    old = padded_round_trip(cache, ServingBatch(torch.zeros(len(lens) + 1, dtype=torch.int32), lens, table))[0]
    assert torch.equal(bits(cache.keys[blocks, offsets].float()), bits(old.float()))
    off_by_one = cache.keys[blocks, (offsets + 1) % BS]  # each token read from the slot beside its own
    assert not torch.equal(bits(off_by_one.float()), bits(old.float()))
    one_block_on = cache.keys[(blocks + 1) % BLOCKS, offsets]
    assert not torch.equal(bits(one_block_on.float()), bits(old.float()))


def test_a_batch_derives_its_indices_once_for_every_layer(monkeypatch):
    """One ServingBatch over two layers' caches (vLLM hands every layer of a step the same metadata): the paged
    coordinates are computed once, each layer still reads its own cache, and each cache is still checked."""
    calls = []
    coords = layout.paged_token_coords
    monkeypatch.setattr(layout, "paged_token_coords", lambda *a: calls.append(1) or coords(*a))
    q, keys, vals, batch, cache, _ = filled(vllm_cache)
    other = random_bits_cache(vllm_cache, torch.float32, seed=5)  # another layer's cache
    n = sum(NEW)
    want = alone(q, keys, vals, batch)
    for _ in range(2):
        assert same_bits(paged_attention(q, cache, batch, SCALE)[:n], want)
        for new, old in zip(request_kv(other, batch), padded_round_trip(other, batch)):
            assert torch.equal(bits(new), bits(old))
    assert len(calls) == 1
    small = PagedKV(other.keys[:8], other.values[:8])  # TABLE names block 11: past a cache of 8 blocks
    with pytest.raises(InputError, match="outside the cache's 8 blocks"):
        request_kv(small, batch)
    fresh = ServingBatch(batch.query_start_loc, batch.seq_lens, batch.block_table)  # a new step: computed anew
    request_kv(cache, fresh)
    assert len(calls) == 2


def test_write_kv_skips_padding_slots_among_real_ones():
    """vLLM's PAD_SLOT_ID (-1) rows beside real ones: only the real rows are written, each at its slot."""
    cache, (kc, vc) = standard_cache()
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g)
    before = kc.clone()
    write_kv(cache, k, v, torch.tensor([-1, 13, -1, 2]))
    assert torch.equal(bits(kc[3, 1]), bits(k[1])) and torch.equal(bits(vc[0, 2]), bits(v[3]))
    untouched = torch.ones(BLOCKS, BS, dtype=torch.bool)
    untouched[3, 1] = untouched[0, 2] = False
    assert torch.equal(bits(kc[untouched]), bits(before[untouched]))


def test_refusals_change_nothing():
    q, keys, vals, batch, cache, (kc, vc) = filled(standard_cache)
    before = kc.clone(), vc.clone()
    k1, v1 = keys[0][:1], vals[0][:1]
    with pytest.raises(InputError, match="past the cache"):
        write_kv(cache, torch.cat([k1, k1]), torch.cat([v1, v1]), torch.tensor([3, BLOCKS * BS]))
    with pytest.raises(InputError, match="dtype"):
        write_kv(cache, k1.double(), v1.double(), torch.tensor([3]))
    assert torch.equal(bits(kc), bits(before[0])) and torch.equal(bits(vc), bits(before[1]))
    out_of_cache = TABLE.clone()
    out_of_cache[2, 0] = BLOCKS
    with pytest.raises(InputError, match="outside the cache"):
        paged_attention(q, cache, ServingBatch(batch.query_start_loc, batch.seq_lens, out_of_cache), SCALE)
    with pytest.raises(InputError, match="exceed its block_table"):
        paged_attention(q, cache, ServingBatch(batch.query_start_loc, batch.seq_lens, TABLE[:, :1]), SCALE)
    with pytest.raises(InputError, match="block_table"):
        paged_attention(q, cache, ServingBatch(batch.query_start_loc, batch.seq_lens), SCALE)
    with pytest.raises(InputError, match="vLLM CPU KV cache"):
        PagedKV.from_vllm_cpu(torch.zeros(BLOCKS, HKV, BS, 2 * D), D + 1)
    with pytest.raises(UnsupportedError, match="ISA 'amx'"):
        PagedKV.from_vllm_cpu(torch.zeros(BLOCKS, HKV, BS, 2 * D), D, isa="amx")
    # padding slots (negative, vLLM's PAD_SLOT_ID) are skipped, not written through the -1 wrap-around
    write_kv(cache, torch.cat([k1, k1]), torch.cat([v1, v1]), torch.tensor([-1, -1]))
    assert torch.equal(bits(kc), bits(before[0]))


# ---------------------------------------------------------------- Gated DeltaNet states


def st(tag):
    """A stand-in state pair (the store keeps whatever the layer hands it)."""
    return (f"conv{tag}", f"rule{tag}")


def test_gdn_states_start_advance_lookup():
    s = GdnStates()
    key = ("req", 7)  # any hashable
    s.start(key)
    assert s.lookup(key, 0, 0) is None  # token 0: a fresh state
    s.advance(key, 0, 0, 5, *st(5))
    s.advance(key, 1, 0, 5, *st("b5"))
    assert s.lookup(key, 0, 5) == st(5) and s.lookup(key, 1, 5) == st("b5")
    s.advance(key, 0, 5, 8, *st(8))
    s.advance(key, 0, 8, 9, *st(9))
    assert s.positions(key, 0) == [8, 9]  # KEEP = 2: the oldest went
    with pytest.raises(UnsupportedError, match="continues at token 5 .* at \\[8, 9\\]"):
        s.lookup(key, 0, 5)
    with pytest.raises(UnsupportedError, match="continues at token 7"):
        s.lookup(key, 0, 7)  # a position no chunk ended at
    s.advance(key, 0, 0, 4, *st("again"))  # a restart from token 0 drops the layer's older states
    assert s.positions(key, 0) == [4] and s.positions(key, 1) == [5]
    with pytest.raises(InputError, match="before start"):
        s.advance("never-started", 0, 0, 3, *st(3))
    with pytest.raises(InputError, match="no chunk"):
        s.advance(key, 0, 4, 4, *st(4))


def test_gdn_states_finish_preempt_fork():
    s = GdnStates()
    for key in ("a", "b"):
        s.start(key)
        s.advance(key, 0, 0, 3, *st(key + "3"))
    s.finish("a")
    assert "a" not in s and "b" in s
    with pytest.raises(UnsupportedError, match="'a' continues at token 3"):
        s.lookup("a", 0, 3)
    s.preempt("b")  # the engine recomputes it from token 0
    assert "b" not in s
    s.start("b")
    assert s.lookup("b", 0, 0) is None
    s.advance("b", 0, 0, 3, *st("b3"))
    s.advance("b", 0, 3, 4, *st("b4"))
    s.fork("b", ["b#1", "b#2"])
    assert s.lookup("b#1", 0, 4) == s.lookup("b#2", 0, 4) == s.lookup("b", 0, 4) == st("b4")
    s.advance("b#1", 0, 4, 5, *st("child"))  # a child's step leaves its parent and siblings alone
    assert s.positions("b", 0) == [3, 4] and s.positions("b#2", 0) == [3, 4]
    assert s.positions("b#1", 0) == [4, 5]
    s.start("b#2")  # a restart forgets the forked states
    with pytest.raises(UnsupportedError):
        s.lookup("b#2", 0, 4)


# ---------------------------------------------------------------- the recorded log-prob


def test_recorded_logprobs_from_plain_tensors():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 16, generator=g)
    h = torch.randn(5, 16, generator=g)
    full = Sampling(temperature=0.7)
    logits = hal.linear(h, w)
    tokens = logits.argmax(-1)  # the most probable token is in every kept set
    assert same_bits(recorded_logprobs(w, h, tokens, full), hal.token_logprobs(h, w, tokens, 0.7))
    cut = Sampling(temperature=0.7, top_k=4, top_p=0.6)
    kept = kept_set(sampling_scores(logits, 0.7), 4, 0.6)
    assert bool((kept.sum(-1) < 4).any())  # the settings really cut
    got = recorded_logprobs(w, h, tokens, cut)
    lp = lambda hh, tt, temp: hal.token_logprobs(hh, w, tt, temp)  # noqa: E731
    assert same_bits(got, kept_logprobs(None, h, tokens, cut, lp, scores=sampling_scores(logits, 0.7)))
    # negative control: the full-vocabulary value is another number wherever the kept set cut
    raw = recorded_logprobs(w, h, tokens, full)
    assert not (bits(got) == bits(raw))[kept.sum(-1) < 40].any()
    outside = int((~kept[0]).nonzero()[0])
    with pytest.raises(InputError, match="outside the kept set"):
        recorded_logprobs(w, h[:1], torch.tensor([outside]), cut)


def test_recorded_logprobs_is_the_trainers_value():
    """lt.token_logprobs on a patched transformers model is recorded_logprobs of its LM-head weight."""
    pytest.importorskip("transformers")
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_model
    lt.register()
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, model.config.hidden_size, generator=g)
    with lt.patch(model):
        tokens = model.lm_head(h).argmax(-1)
        for settings in (dict(), dict(top_k=5), dict(top_p=0.5), dict(top_k=5, top_p=0.5)):
            want = lt.token_logprobs(model, h, tokens, temperature=0.8, **settings)
            got = recorded_logprobs(model.lm_head.weight, h, tokens, Sampling(0.8, **settings))
            assert same_bits(got, want), settings


def test_recorded_logprobs_k_tokens_per_row():
    """tokens [n, K]: each value the bits of that token asked alone, with and without a kept set."""
    g = torch.Generator().manual_seed(5)
    w, h = torch.randn(40, 16, generator=g).to(torch.bfloat16), torch.randn(4, 16, generator=g).to(torch.bfloat16)
    for s in (Sampling(0.9), Sampling(0.9, top_k=6, top_p=0.8)):
        kept = kept_set(sampling_scores(hal.linear(h, w), 0.9), s.top_k, s.top_p)
        many = torch.stack([r.nonzero()[:, 0][torch.arange(3) % int(r.sum())] for r in kept])  # 3 kept ids per row
        alone = torch.stack([recorded_logprobs(w, h, many[:, j], s) for j in range(3)], 1)
        assert same_bits(recorded_logprobs(w, h, many, s), alone), s
        none = torch.zeros(0, 3, dtype=torch.int64)  # no rows (an engine step without such rows)
        assert recorded_logprobs(w, h[:0], none, s).shape == (0, 3)
        assert [x.shape for x in top_logprobs(w, h[:0], none[:, 0], 3, s)] == [(0,), (0, 3), (0, 3)]


def _top_by_brute_force(w, h, s, count):
    """Row by row over the whole vocabulary: every token's recorded_logprobs alone (-inf outside the kept set),
    ordered by (score desc, recorded log-prob desc, id asc) -- top_logprobs' documented order."""
    scores = sampling_scores(hal.linear(h, w), s.temperature)
    kept = kept_set(scores, s.top_k, s.top_p) if s.filters else torch.ones_like(scores, dtype=torch.bool)
    ranked = scores.masked_fill(~kept, float("-inf"))
    ids, lps = [], []
    for i in range(h.shape[0]):
        every = torch.tensor([recorded_logprobs(w, h[i:i + 1], torch.tensor([v]), s)[0].item() if kept[i, v]
                              else float("-inf") for v in range(w.shape[0])])
        order = sorted(range(w.shape[0]), key=lambda v: (-ranked[i, v].item(), -every[v].item(), v))[:count]
        ids.append(order)
        lps.append(every[order])
    return torch.tensor(ids), torch.stack(lps), scores


def test_top_logprobs_is_the_documented_order_with_the_recorded_bits():
    """hal.sampling.top_logprobs (vLLM's logprobs=N alternatives) against a brute force over the vocabulary, fp32
    and bf16 (bf16 logits tie: the recorded log-prob breaks those ties, and the tests see such ties), temperature,
    top-k (fewer kept tokens than asked: -inf), top-p. Negative control: stock's choice, the top-N of log_softmax of
    the bf16 logits, returns other bits."""
    g = torch.Generator().manual_seed(6)
    ties = 0
    for dtype in (torch.float32, torch.bfloat16):
        w = (0.3 * torch.randn(160, 32, generator=g)).to(dtype)
        h = torch.randn(6, 32, generator=g).to(dtype)
        for s in (Sampling(), Sampling(0.7), Sampling(0.8, top_k=3), Sampling(1.3, top_p=0.5)):
            want_ids, want_lp, scores = _top_by_brute_force(w, h, s, 6)
            tokens = want_ids[:, 0]
            rec, ids, lp = top_logprobs(w, h, tokens, 6, s)
            assert torch.equal(ids, want_ids), (dtype, s)
            assert same_bits(lp, want_lp) and same_bits(rec, recorded_logprobs(w, h, tokens, s)), (dtype, s)
            assert bool((lp[:, :-1] >= lp[:, 1:]).all())  # the values descend
            if s.top_k == 3:
                assert bool(torch.isinf(lp[:, 3:]).all()) and bool(torch.isfinite(lp[:, :3]).all())
            ties += int((scores.gather(1, ids)[:, :-1] == scores.gather(1, ids)[:, 1:]).sum())
        stock = hal.linear(h, w).log_softmax(-1, dtype=torch.float32).topk(6, -1).values
        if dtype == torch.bfloat16:
            assert not same_bits(top_logprobs(w, h, tokens, 6, Sampling())[2], stock)
    assert ties >= 2, ties  # bf16 score ties inside the top 6: the log-prob tie-break was exercised
    with pytest.raises(InputError, match="count"):
        top_logprobs(w, h, tokens, 161, Sampling())


def test_vllm_cpu_views_read_what_vllms_own_writer_stored():
    """vLLM's CPU attention fills its cache with its own op (cpu_attn_reshape_and_cache); PagedKV.from_vllm_cpu
    reads every token back, and the step's attention over it equals each request alone. Needs vLLM (CPU)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # a namespace "vllm" (no origin) is not vLLM
        if os.environ.get("LOCKSTEP_VLLM_TESTS") == "1":
            pytest.fail("LOCKSTEP_VLLM_TESTS=1 but vLLM is not importable")
        pytest.skip("needs vLLM's CPU build: runs in CI's vLLM environment (.ci/run)")
    from vllm import _custom_ops as vllm_ops
    bs, d = 32, 32  # vLLM's CPU attention takes block sizes that are multiples of 32, head sizes from 32
    cached, new = [40, 37, 0], [1, 30, 20]  # 2, 3 and 1 blocks of TABLE: a decode, a later chunk, a first one
    for dtype, isa in ((torch.float32, "vec"), (torch.bfloat16, "vec16")):
        q, keys, vals, batch, (old, k_old, v_old), (k_new, v_new) = make_step(dtype, bs, d, cached, new)
        kv = torch.zeros(BLOCKS, HKV, bs, 2 * d, dtype=dtype)
        k_half, v_half = kv.view(BLOCKS, HKV, 2 * bs, d).chunk(2, dim=2)  # how vLLM's backend hands it over
        for slots, k, v in ((old, k_old, v_old), (batch.slot_mapping, k_new, v_new)):
            vllm_ops.cpu_attn_reshape_and_cache(k, v, k_half, v_half, slots, isa, k_scale=1.0, v_scale=1.0,
                                                kv_cache_dtype="auto")
        cache = PagedKV.from_vllm_cpu(kv, d, isa)
        for b in range(3):
            for t in range(keys[b].shape[0]):
                blk, off = divmod(slot(b, t, bs), bs)
                assert torch.equal(bits(cache.keys[blk, off].float()), bits(keys[b][t].float())), (isa, b, t)
                assert torch.equal(bits(cache.values[blk, off].float()), bits(vals[b][t].float())), (isa, b, t)
        n = sum(new)
        assert same_bits(paged_attention(q, cache, batch, SCALE)[:n].float(), alone(q, keys, vals, batch).float())
