"""transformers' continuous-batching engine on lockstep: scheduler-invariant bits, engine == trainer.

Quick set (CI): tiny Llama and Qwen3-Next (Gated DeltaNet hybrid) fp32 and bf16, Qwen3.5 fp32. Full matrix
(Llama, Qwen3, Qwen3-Next, Qwen3.5; fp32, bf16):
``LOCKSTEP_ENGINE_FULL=1 python -m pytest -q tests/test_hf_engine.py``.
Every comparison is on raw float32 bits; stock sdpa through the same cases is the caught negative control.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")

import hal.sampling  # noqa: E402
from hal.errors import InputError, UnsupportedError  # noqa: E402
from hal.integrations.transformers import engine as hf_engine  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402
from examples.engine_parity import (EASY, GDN_EASY, GDN_HARD, HARD, HARD_ORDER, NEW, PROMPTS,  # noqa: E402
                                     differing_tokens, run_engine, teacher_forced)
from examples.engine_parity import gen_config as _gen_config  # noqa: E402
from hal.conformance.bits import same_bits

FULL = os.environ.get("LOCKSTEP_ENGINE_FULL") == "1"
CASES = [("llama", torch.float32), ("llama", torch.bfloat16)] + ([("qwen3", torch.float32),
                                                                  ("qwen3", torch.bfloat16)] if FULL else [])


def teacher_hidden(model, prompt, tokens):
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([prompt + tokens])).last_hidden_state[0]
    return hidden[len(prompt) - 1:-1].clone()


def prove_hard_cases(steps):
    """The hard configuration really chunked, mixed and offloaded (scheduler hook): one prompt prefilled over
    three or more steps before its first token, one step with a prefill chunk next to the decode rows of two
    or more requests, an offload, and the decode fast path."""
    prefill_steps, first_token, mixed = {}, set(), False
    for s in steps:
        prefill_rows = [rid for rid, _, _ in s.requests if rid not in s.decoding]
        mixed |= bool(prefill_rows) and len(s.decoding) >= 2
        for rid in prefill_rows:
            if rid not in first_token:
                prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
        first_token |= {rid for rid, _, new in s.requests if new}
    assert max(prefill_steps.values()) >= 3, prefill_steps
    assert mixed, [(s.requests, sorted(s.decoding)) for s in steps]
    assert steps[-1].offloads >= 1, "no request was offloaded"
    assert any(s.decode_fast_path for s in steps), "no step took the decode fast path"


def assert_same_requests(want, got, label):
    """Every request of run ``got`` has ``want``'s tokens and log-prob bits ({i: (tokens, log-probs)})."""
    assert sorted(want) == sorted(got), label
    for i in want:
        assert want[i][0] == got[i][0], f"{label}: request {i} tokens"
        assert same_bits(want[i][1], got[i][1]), f"{label}: request {i} log-prob bits"


def check_engine_invariant_and_equal_to_trainer(model, easy_cb, hard_cb):
    """The easy configuration, the hard one (in another order; hook-proved) and requests arriving while one
    decodes give the same greedy tokens and log-prob bits, equal to the teacher-forced trainer; the model ran
    prompt + generated - 1 positions per request (no second pass). Returns the easy run."""
    easy, easy_steps, count = run_engine(model, PROMPTS, easy_cb)
    hard, steps, _ = run_engine(model, PROMPTS, hard_cb, order=HARD_ORDER)
    prove_hard_cases(steps)
    with pytest.raises(AssertionError):  # the proof can fail: the easy configuration does none of it
        prove_hard_cases(easy_steps)
    arrived = run_arrivals(model, PROMPTS, hard_cb)
    assert count == sum(len(p) + NEW - 1 for p in PROMPTS)
    assert_same_requests(easy, hard, "hard scheduler")
    assert_same_requests(easy, arrived, "arrivals")
    trainer = {i: (easy[i][0], teacher_forced(model, p, easy[i][0])) for i, p in enumerate(PROMPTS)}
    assert_same_requests(easy, trainer, "engine vs trainer")
    return easy


def run_arrivals(model, prompts, cb):
    """Prompt 0 alone first; the others are added once it decodes (requests arriving into a running batch)."""
    import threading
    from hal.integrations.transformers.testing import continuous_batching_config
    steps, decoding = [], threading.Event()

    def hook(step):
        steps.append(step)
        if any(new for rid, _, new in step.requests if rid == "req_0"):
            decoding.set()
    hf_engine.step_hooks(model).append(hook)
    manager = model.init_continuous_batching(_gen_config(), continuous_batching_config(return_logprobs=True, **cb))
    manager.start()
    try:
        manager.add_request(prompts[0], request_id="req_0")
        assert decoding.wait(120), "the first request never decoded"
        for i in range(1, len(prompts)):
            manager.add_request(prompts[i], request_id=f"req_{i}")
        res = {}
        while len(res) < len(prompts):
            o = manager.get_result(timeout=120)
            assert o is not None, "the engine stopped before all requests finished"
            res[int(o.request_id.split("_")[-1])] = (list(o.generated_tokens),
                                                      torch.tensor(o.logprobs, dtype=torch.float32))
    finally:
        manager.stop(block=True)
        hf_engine.step_hooks(model).remove(hook)
    first_decode = next(k for k, s in enumerate(steps) if any(new for rid, _, new in s.requests if rid == "req_0"))
    later = [k for k, s in enumerate(steps) if any(rid != "req_0" for rid, _, _ in s.requests)]
    assert later and min(later) > first_decode  # the others joined a batch already decoding
    return res


@pytest.fixture(scope="module")
def registered():
    lt.register()


@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_engine_scheduler_invariant_and_equal_to_trainer(registered, kind, dtype):
    model = tiny_model(kind, dtype=dtype)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    with lt.patch(model):
        check_engine_invariant_and_equal_to_trainer(model, EASY, HARD)
        assert model.config._attn_implementation == lt.NAME  # the engine's stop() put the name back
    # negative control: stock sdpa, same cases, differs across the scheduler settings or from teacher forcing
    s_easy, _, _ = run_engine(stock, PROMPTS, EASY)
    s_hard, _, _ = run_engine(stock, PROMPTS, HARD, order=HARD_ORDER)
    teacher = {i: (s_easy[i][0], teacher_forced(stock, p, s_easy[i][0])) for i, p in enumerate(PROMPTS)}
    assert differing_tokens(s_easy, s_hard) + differing_tokens(s_easy, teacher) > 0


def tied_head_model():
    """The tiny Llama with its LM head rows equal in groups of 4: every score comes in four tied tokens, so a
    top-p boundary usually falls inside a tied group (lockstep keeps the whole group, transformers part of it)."""
    model = tiny_model("llama")
    with torch.no_grad():
        w = model.lm_head.weight
        w.copy_(w[::4].repeat_interleave(4, 0))
    return model


def transformers_kept_set(scores, top_k=None, top_p=None, min_tokens_to_keep=1):
    """The negative control's kept set: transformers' own TopK / TopP warpers (torch's softmax, a float32 cumsum,
    an unstable sort at ties)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores > float("-inf")


def test_kept_set_rule():
    """hf_engine.kept_set: transformers' top-k / top-p rule (same sets on tie-free rows), ties kept whole,
    min_tokens_to_keep, top_p 0 and 1; transformers splits a tied group at the boundary."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, VOCAB, generator=g) * 2
    for top_k, top_p in ((None, 0.1), (None, 0.5), (None, 0.9), (20, 0.5), (20, 0.9), (20, None), (5, None)):
        got = hf_engine.kept_set(scores, top_k, top_p)
        assert torch.equal(got, transformers_kept_set(scores, top_k, top_p)), (top_k, top_p)
    assert hf_engine.kept_set(scores, None, 0.9).sum(-1).min() > 1  # the settings above really cut
    four = torch.zeros(1, 4)  # four tied tokens, top_p 0.5: lockstep keeps the group, transformers two of them
    assert hf_engine.kept_set(four, None, 0.5).tolist() == [[True] * 4]
    assert transformers_kept_set(four, None, 0.5).sum() == 2
    row = torch.tensor([[3.0, 2.0, 2.0, 0.0]])
    assert hf_engine.kept_set(row, None, 0.0).tolist() == [[True, False, False, False]]  # min_tokens_to_keep=1
    assert hf_engine.kept_set(row, None, 0.0, min_tokens_to_keep=2).tolist() == [[True, True, True, False]]
    assert torch.equal(hf_engine.kept_set(scores, None, 1.0), torch.ones_like(scores, dtype=torch.bool))
    # the top-p mass runs over what top-k kept: tokens top-k dropped never come back
    assert not (hf_engine.kept_set(scores, 3, 0.999) & ~hf_engine.kept_set(scores, 3)).any()
    for bad, match in ((dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(top_p=True), "top_p")):
        with pytest.raises(InputError, match=match):
            hf_engine.kept_set(scores, **bad)


SAMPLED = {"top_k": dict(top_k=20), "top_p": dict(top_p=0.6), "top_k+top_p": dict(top_k=20, top_p=0.6)}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_engine_sampled_equals_trainer(registered, name, monkeypatch):
    """Sampled decoding (temperature 0.7 with top-k, top-p, both) through the hard scheduler configuration: the
    engine samples from lockstep's kept set and records log p renormalised over it; the trainer's
    lt.token_logprobs(..., top_k=, top_p=) gives the same bits (autograd path too); a token outside the kept
    set is refused. Controls: the full-vocabulary value differs, and (top-p) a trainer deciding the kept set
    with transformers' own warpers is caught."""
    settings = SAMPLED[name]
    model = tied_head_model()
    gen = _gen_config(do_sample=True, temperature=0.7, **settings)
    with lt.patch(model):
        torch.manual_seed(1)
        out, steps, _ = run_engine(model, PROMPTS, HARD, gen=gen)
        assert len(steps) > len(PROMPTS) and any(len(s.requests) >= 2 for s in steps)
        cut = 0
        for i, p in enumerate(PROMPTS):
            tokens, lp = out[i]
            assert same_bits(lp, teacher_forced(model, p, tokens, temperature=0.7, **settings)), i
            # the trainer's autograd path: the same bits, and a gradient
            h = teacher_hidden(model, p, tokens).requires_grad_()
            lp_grad = lt.token_logprobs(model, h, torch.tensor(tokens), temperature=0.7, **settings)
            assert same_bits(lp, lp_grad.detach()), i
            lp_grad.sum().backward()
            assert h.grad is not None and bool(h.grad.abs().sum() > 0)
            # the kept sets really cut (top-p cut below top-k's set where both are on); where they cut, the
            # full-vocabulary (raw) value is another number
            scores = hf_engine.sampling_scores(model.lm_head(h.detach()), 0.7)
            kept = hf_engine.kept_set(scores, settings.get("top_k"), settings.get("top_p")).sum(-1)
            wider = hf_engine.kept_set(scores, settings.get("top_k")).sum(-1) if "top_p" in settings else VOCAB
            cut += int((kept < wider).sum())
            raw = teacher_forced(model, p, tokens, temperature=0.7)
            assert not (lp.view(torch.int32) == raw.view(torch.int32))[kept < VOCAB].any(), i
        assert cut > 0
        # refused: a token outside its row's kept set (it cannot have been sampled with these settings)
        h = teacher_hidden(model, PROMPTS[0], out[0][0])[:1]
        outside = int((~hf_engine.kept_set(hf_engine.sampling_scores(model.lm_head(h), 0.7),
                                           settings.get("top_k"), settings.get("top_p"))[0]).nonzero()[0])
        with pytest.raises(InputError, match="outside the kept set"):
            lt.token_logprobs(model, h, torch.tensor([outside]), temperature=0.7, **settings)
        if "top_p" not in settings:
            return
        # negative control: the trainer decides the kept set with transformers' warpers (its boundary splits
        # tied groups): refused or other bits on some request
        monkeypatch.setattr(hal.sampling, "kept_set", transformers_kept_set)  # the kept set's home (hal/sampling.py)
        caught = 0
        for i, p in enumerate(PROMPTS):
            try:
                caught += not same_bits(out[i][1], teacher_forced(model, p, out[i][0], temperature=0.7, **settings))
            except InputError:
                caught += 1
        assert caught > 0


def test_prefix_blocks_invalidated_after_weight_update(registered):
    model = tiny_model("llama")
    fresh = copy.deepcopy(model)
    prompts = [PROMPTS[0], PROMPTS[2]]
    cb = dict(page_size=4, num_blocks=64, max_batch_tokens=64, allow_block_sharing=True)

    def update(m):
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))

    results = {}
    for invalidate in (True, False):
        m = copy.deepcopy(model)
        with lt.patch(m):
            run_engine(m, prompts, cb, persistent=True)  # fills the prefix cache under the old weights
            state = hf_engine.engine_state(m._cached_continuous_batching_manager)
            state.invalidate_on_update = invalidate
            update(m)
            results[invalidate], _, _ = run_engine(m, prompts, cb, persistent=True)
            m.destroy_cached_continuous_batching_manager()
    update(fresh)
    with lt.patch(fresh):
        want, _, _ = run_engine(fresh, prompts, cb)
    for i in range(2):
        assert same_bits(results[True][i][1], want[i][1]), i
    # negative control: without the invalidation the stale shared blocks change the bits
    assert differing_tokens(results[False], want) > 0


def test_engine_refusals(registered):
    from hal.integrations.transformers.testing import continuous_batching_config
    model = tiny_model("llama")
    with lt.patch(model):
        # processors other than temperature / top-k / top-p, whether the engine keeps them (min_p) or would drop
        # them and sample without (repetition penalty), refused by name before anything runs
        for gen, match in ((_gen_config(do_sample=True, min_p=0.1), "MinPLogitsWarper"),
                           (_gen_config(repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor .* drop it")):
            with pytest.raises(UnsupportedError, match=match):
                model.generate_batch([PROMPTS[1]], generation_config=gen, progress_bar=False,
                                     continuous_batching_config=continuous_batching_config(**EASY))
        manager = model.init_continuous_batching(_gen_config(), continuous_batching_config(**EASY))
        with pytest.raises(UnsupportedError, match=r"per-request sampling settings \['temperature'\]"):
            manager.add_request(PROMPTS[1], temperature=0.5)
        assert manager.input_queue.empty()  # nothing was queued
    gdn = tiny_model("qwen3_next")
    with lt.patch(gdn):
        for bad, match in ((dict(EASY, allow_block_sharing=True), "block sharing .* Gated DeltaNet"),
                           (dict(EASY, use_async_batching=True), "asynchronous batching .* Gated DeltaNet")):
            with pytest.raises(UnsupportedError, match=match):
                gdn.generate_batch([PROMPTS[1]], generation_config=_gen_config(),
                                   continuous_batching_config=continuous_batching_config(**bad), progress_bar=False)


def test_paged_adapter_matches_contiguous_keys():
    """The serving-engine form (block table + slot mapping, as vLLM hands it) gives the bits of contiguous keys."""
    g = torch.Generator().manual_seed(0)
    lens, new = [5, 9], [2, 1]
    H, D, page = 2, 8, 4
    q = torch.randn(sum(new), 4, D, generator=g)
    keys = [torch.randn(n, H, D, generator=g) for n in lens]
    vals = [torch.randn(n, H, D, generator=g) for n in lens]
    pages = torch.tensor([[5, 0, -1], [2, 7, 1]])
    kc, vc = torch.zeros(8, page, H, D), torch.zeros(8, page, H, D)
    slot = lambda b, t: int(pages[b, t // page]) * page + t % page  # noqa: E731
    for b, n in enumerate(lens):  # the old tokens already cached
        for t in range(n - new[b]):
            kc.view(-1, H, D)[slot(b, t)], vc.view(-1, H, D)[slot(b, t)] = keys[b][t], vals[b][t]
    mapping = torch.tensor([slot(b, t) for b, n in enumerate(lens) for t in range(n - new[b], n)])
    batch = hf_engine.EngineBatch(torch.tensor([0, 2, 3]), torch.tensor(lens), pages, mapping)
    k_new = torch.cat([keys[b][-new[b]:] for b in range(2)])
    v_new = torch.cat([vals[b][-new[b]:] for b in range(2)])
    gk, gv = hf_engine.gather_paged(kc, vc, k_new, v_new, batch)
    assert torch.equal(gk, torch.cat(keys)) and torch.equal(gv, torch.cat(vals))
    got = hf_engine.engine_attention(q, gk, gv, batch, 0.3)
    want = hf_engine.engine_attention(q, torch.cat(keys), torch.cat(vals), batch, 0.3)
    assert same_bits(got, want)
    # each request alone gives its rows' bits (neighbours change nothing)
    alone = hf_engine.engine_attention(q[2:], keys[1], vals[1],
                                       hf_engine.EngineBatch(torch.tensor([0, 1]), torch.tensor([9])), 0.3)
    assert same_bits(got[2:], alone)


GDN_CASES = [("qwen3_next", torch.float32), ("qwen3_next", torch.bfloat16), ("qwen3_5", torch.float32)] + (
    [("qwen3_5", torch.bfloat16)] if FULL else [])


@pytest.mark.parametrize("kind,dtype", GDN_CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in GDN_CASES])
def test_gdn_engine_scheduler_invariant_and_equal_to_trainer(registered, kind, dtype, monkeypatch):
    """Gated DeltaNet hybrids in the engine: each request's GDN state kept by lockstep beside the paged cache."""
    model = tiny_model(kind, dtype=dtype)
    with lt.patch(model):
        easy = check_engine_invariant_and_equal_to_trainer(model, GDN_EASY, GDN_HARD)
        # finished requests' states are dropped: a kept manager's second run holds none of the first's
        run_engine(model, PROMPTS[:2], GDN_EASY, persistent=True)
        cache = model._cached_continuous_batching_manager.batch_processor.cache
        first = set(hf_engine.gdn_engine_states(cache).states)
        run_engine(model, PROMPTS[2:], GDN_EASY, persistent=True)
        assert first and not first & set(hf_engine.gdn_engine_states(cache).states)
        model.destroy_cached_continuous_batching_manager()
        # negative control: states keyed by batch row instead of by request (rows change under chunking,
        # mixed steps and offloading) -- the same checks catch it
        monkeypatch.setattr(hf_engine.GdnEngineStates, "key", lambda self, row, request_id: row)
        orig_init = hf_engine.GdnEngineStates.__init__

        def init_unchecked(self):
            orig_init(self)
            self.check_positions = False
        monkeypatch.setattr(hf_engine.GdnEngineStates, "__init__", init_unchecked)
        by_row, _, _ = run_engine(model, PROMPTS, GDN_HARD, order=HARD_ORDER)
    assert differing_tokens(easy, by_row) > 0


def _forked_samples(model):
    """Two prompts, three samples each (the engine forks the children from the parent's cache): {request id:
    its output}, children included (read from the manager: transformers 5.17's generate_batch returns the
    parents' outputs only)."""
    from hal.integrations.transformers.testing import continuous_batching_config
    gen = _gen_config(do_sample=True, temperature=0.7, top_k=20, num_return_sequences=3)
    torch.manual_seed(1)
    manager = model.init_continuous_batching(gen, continuous_batching_config(return_logprobs=True, **GDN_HARD))
    manager.start()
    try:
        manager.add_requests(PROMPTS[:2])
        out = {}
        while len(out) < 6:
            o = manager.get_result(timeout=120)
            assert o is not None, f"the engine stopped with {sorted(out)} finished"
            if o.is_finished():
                out[o.request_id] = o
    finally:
        manager.stop(block=True)
    return out


def test_gdn_engine_forked_samples_equal_trainer(registered, monkeypatch):
    """Parallel sampling (GRPO's n samples per prompt): each forked child continues its parent's GDN state."""
    model = tiny_model("qwen3_next")
    with lt.patch(model):
        out = _forked_samples(model)
        assert len(out) == 6 and all(o.error is None for o in out.values())
        for i, p in enumerate(PROMPTS[:2]):
            samples = [out[f"req_{i}"]] + [out[f"req_{i}__child#{c}"] for c in range(2)]
            assert len({tuple(o.generated_tokens) for o in samples}) == 3  # three distinct samples
            for o in samples:
                lp = torch.tensor(o.logprobs, dtype=torch.float32)
                assert same_bits(lp, teacher_forced(model, p, list(o.generated_tokens), temperature=0.7, top_k=20))
        # negative control: children not given their parent's state are caught (refused, no bits recorded)
        monkeypatch.setattr(hf_engine.GdnEngineStates, "fork", lambda self, parent, children: None)
        out = _forked_samples(model)
        # (transformers 5.25 may fork a child before its parent's prefill: that child prefills on its own, so it may
        # finish, with the trainer's bits; every other child is refused, none delivers other bits)
        children = {rid: o for rid, o in out.items() if "__child#" in rid}
        refused = [o for o in children.values() if o.error is not None]
        assert refused and all("Gated DeltaNet" in str(o.error) and not o.logprobs for o in refused)
        for rid, o in children.items():
            if o.error is None:
                p = PROMPTS[int(rid.split("_")[1])]
                assert same_bits(torch.tensor(o.logprobs, dtype=torch.float32),
                                 teacher_forced(model, p, list(o.generated_tokens), temperature=0.7, top_k=20)), rid
