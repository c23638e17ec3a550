"""hal.integrations.transformers on tiny HF models (random weights, nothing downloaded), and hal.aten_mode.

Every bit claim compares raw bits (first_divergence) and has a negative control: the same check on
the unpatched model (stock kernels) fails, or a deliberately perturbed run is caught.
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402
from hal.integrations.transformers.verify import cache_kwargs  # noqa: E402

KINDS = ["llama", "qwen3", "qwen3_next"]
LENGTHS = {"llama": (6, 3, 8), "qwen3": (6, 3, 8), "qwen3_next": (6, 3, 8)}

lt.register()


pytestmark = pytest.mark.usefixtures("one_thread")


def same(a, b, label="x"):
    return first_divergence(label, a, b) is None


def stock(kind):
    return tiny_model(kind, attn_implementation="sdpa")


def prompts(kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS[kind]]


# ---------------------------------------------------------------- verify: padding, packing, decode


@pytest.mark.parametrize("kind", KINDS)
def test_verify_patched_bit_identical_and_stock_caught(kind):
    m = tiny_model(kind)
    with lt.patch(m):
        rep = lt.verify(m, VOCAB, lengths=LENGTHS[kind], decode_steps=2)
    assert rep.ok, str(rep)
    assert [c.name.split(" (")[0] for c in rep.checks] == [
        "alone == right-padded batch", "alone == left-padded batch", "alone == packed row",
        "teacher-forced == incremental decode"]
    # negative control: the same checks on the stock model fail and are localised to a module
    rs = lt.verify(stock(kind), VOCAB, lengths=LENGTHS[kind], decode_steps=2)
    failed = [c for c in rs.checks if not c.ok]
    assert len(failed) >= 2, str(rs)
    assert all(c.first_module is not None and c.first_module["ulp"] is not None for c in failed), str(rs)


def test_packed_with_cache_and_cu_seq_lens_isolated():
    """Packing via position_ids with use_cache=True (stock lets sequences see each other) and via cu_seq_lens."""
    m = tiny_model("llama")
    seqs = prompts("llama")
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    with lt.patch(m), torch.no_grad():
        alone = torch.cat([m(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        cached = m(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
        flash = m(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=8, max_length_k=8).logits[0]
    assert same(alone, cached) and same(alone, flash)
    s = stock("llama")
    with torch.no_grad():
        alone_s = torch.cat([s(input_ids=q[None], use_cache=False).logits[0] for q in seqs])
        cached_s = s(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
    # stock sdpa with a cache ignores position_ids packing: later sequences attend to earlier ones
    assert float((alone_s - cached_s).abs().max()) > 1e-3


# ---------------------------------------------------------------- generate (sampler) vs teacher forcing


def _generate(m, seqs, new=3, **generate_kwargs):
    """Greedy generation of ``new`` tokens from left-padded ``seqs``: (tokens [n, new], logits [n, new, V])."""
    n, P = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(n, P, dtype=torch.long)
    mask = torch.zeros(n, P, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, P - len(s):], mask[b, P - len(s):] = s, 1
    out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                     output_logits=True, return_dict_in_generate=True, pad_token_id=0, **generate_kwargs)
    return out.sequences[:, P:], torch.stack(out.logits, 1).float()


def _generate_checks(m, kind):
    """(batched == alone, decode log-probs == teacher-forced log-probs) for a left-padded batch."""
    seqs = prompts(kind, seed=2)
    toks, steps = _generate(m, seqs)
    alone_ok, tf_ok = True, True
    for b, s in enumerate(seqs):
        t1, st1 = _generate(m, [s])
        alone_ok &= same(toks[b:b + 1], t1) and same(steps[b:b + 1], st1)
        full = torch.cat([s, toks[b]])[None]
        with torch.no_grad():
            logits = m(input_ids=full, use_cache=False).logits.float()[0, len(s) - 1:-1]
        tgt = toks[b]
        lp_decode = hal.log_softmax(steps[b], -1).gather(-1, tgt[:, None])
        lp_teacher = hal.log_softmax(logits, -1).gather(-1, tgt[:, None])
        tf_ok &= same(lp_decode, lp_teacher)
    return alone_ok, tf_ok


@pytest.mark.parametrize("kind", KINDS)
def test_generate_left_padded_equals_alone_and_teacher_forced(kind):
    m = tiny_model(kind)
    with lt.patch(m):
        alone_ok, tf_ok = _generate_checks(m, kind)
    assert alone_ok and tf_ok
    alone_s, tf_s = _generate_checks(stock(kind), kind)
    assert not (alone_s and tf_s), "negative control: stock generate should differ somewhere"


def test_token_logprobs_helper_decode_equals_teacher_forced():
    from transformers import DynamicCache
    s = prompts("llama")[2]
    p = 5

    def run(m):
        with torch.no_grad():
            full = m.model(input_ids=s[None], use_cache=False).last_hidden_state[0]
            lp_full = lt.token_logprobs(m, full[p - 1:-1], s[p:])
            cache = DynamicCache(config=m.config)
            h = m.model(input_ids=s[None, :p], use_cache=True, **cache_kwargs(m.model, cache)).last_hidden_state[0, -1:]
            lps = [lt.token_logprobs(m, h, s[p:p + 1])]
            for t in range(p, len(s) - 1):
                h = m.model(input_ids=s[None, t:t + 1], use_cache=True, **cache_kwargs(m.model, cache)).last_hidden_state[0, -1:]
                lps.append(lt.token_logprobs(m, h, s[t + 1:t + 2]))
        return same(lp_full, torch.cat(lps))

    m = tiny_model("llama")
    with lt.patch(m):
        assert run(m)
    assert not run(stock("llama"))


# ---------------------------------------------------------------- training step


def _train_step(m, seqs):
    m.train()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    logits = m(input_ids=ids, position_ids=pos, use_cache=False).logits.float()[0]
    keep = torch.cat([torch.arange(len(s) - 1) + sum(len(q) for q in seqs[:b]) for b, s in enumerate(seqs)])
    tgt = torch.cat([s[1:] for s in seqs])
    lp = hal.log_softmax(logits[keep], -1).gather(-1, tgt[:, None])[:, 0]
    (-lp.mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    m.eval()
    return lp.detach(), grads, {n: p.detach().clone() for n, p in m.named_parameters()}


def _diverging(a: dict, b: dict):
    return [n for n in a if first_divergence(n, a[n], b[n]) is not None]


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_deterministic_and_train_forward_equals_sampler(kind):
    seqs = prompts(kind)
    base = tiny_model(kind)
    m1, m2, m3 = base, copy.deepcopy(base), copy.deepcopy(base)
    with torch.no_grad():  # the deliberately wrong run: one weight moved by one ulp
        w = m3.lm_head.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
    runs = []
    for m in (m1, m2, m3):
        with lt.patch(m):
            if m is m1:  # sampler-side log-probs (no grad, each sequence alone) before the step
                with torch.no_grad():
                    lp_alone = torch.cat([
                        hal.log_softmax(m(input_ids=s[None], use_cache=False).logits.float()[0, :-1], -1)
                        .gather(-1, s[1:, None])[:, 0] for s in seqs])
            runs.append(_train_step(m, seqs))
    (lp1, g1, p1), (lp2, g2, p2), (_, g3, p3) = runs
    assert len(g1) == len(list(base.parameters()))
    assert not _diverging(g1, g2) and not _diverging(p1, p2)
    assert _diverging(g1, g3) and _diverging(p1, p3)  # negative control: the comparison sees one ulp
    assert same(lp_alone, lp1)  # the trainer's packed forward (autograd on) = the sampler's bits


# ---------------------------------------------------------------- patch handle, refusals, audit


def test_revert_restores_stock_bits_and_forwards():
    m = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        before = m(ids).logits
        p = lt.apply(m)
        assert m.model.layers[0].mlp.down_proj.__dict__.get("forward") is not None
        patched = m(ids).logits
        p.revert()
        after = m(ids).logits
    assert same(before, after)
    assert not same(before, patched)  # the patch did change the computation
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    assert "generate" not in m.__dict__


def test_refusals_before_mutation():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                      sliding_window=4, max_window_layers=0)
    with pytest.raises(hal.UnsupportedError, match="sliding"):
        lt.apply(Qwen3ForCausalLM(cfg))

    m = tiny_model("llama")

    class MyNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            return x * self.weight

    m.model.extra_norm = MyNorm()
    with pytest.raises(hal.UnsupportedError, match="extra_norm"):
        lt.apply(m)
    assert all("forward" not in mod.__dict__ for mod in m.modules())  # nothing was touched
    with lt.patch(m, unknown="ignore"):
        with pytest.raises(hal.UnsupportedError, match="beam search"):
            m.generate(input_ids=torch.ones(1, 3, dtype=torch.long), num_beams=2, max_new_tokens=2)
        with pytest.raises(hal.InputError, match="already patched"):
            lt.apply(m)


def test_version_check(monkeypatch):
    import transformers
    assert lt.check_version() == transformers.__version__
    monkeypatch.setattr(transformers, "__version__", "5.31.0")
    with pytest.raises(hal.UnsupportedError, match="5.31.0"):
        lt.check_version()
    monkeypatch.setenv("LOCKSTEP_HF_ANY_VERSION", "1")
    assert lt.check_version() == "5.31.0"


def test_attention_mask_with_holes_refused():
    from hal.integrations.transformers.attention import plan
    vis = torch.tensor([[[True, False, True]]])
    with pytest.raises(hal.UnsupportedError, match="contiguous"):
        plan(vis)


def test_audit_lists_stock_modules_and_ops():
    ids = torch.randint(0, VOCAB, (1, 6))
    m = tiny_model("qwen3_next")
    with lt.patch(m):
        a = lt.audit(m, ids)
    assert a.stock_modules == [] and a.aten_ops == {}, str(a)
    assert {k for _, k in a.lockstep_modules} >= {"linear", "norm1p", "norm_gated", "attention", "gdn", "moe"}
    s = lt.audit(stock("qwen3_next"), ids)
    assert any("Linear" in c for _, c in s.stock_modules) and "aten.mm" in s.aten_ops, str(s)


# ---------------------------------------------------------------- hal.aten_mode


def test_aten_mode_linear_batch_invariant_inside_stock_outside():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(40, 64)

    def first_row(M):
        with torch.no_grad():
            return lin(x[:M])[:1]

    out_stock = {M: first_row(M) for M in (1, 7, 40)}
    assert not same(out_stock[1], out_stock[7])  # negative control: stock gemv vs gemm differ
    with hal.aten_mode():
        inside = {M: first_row(M) for M in (1, 7, 40)}
        with torch.no_grad():
            ref = hal.linear(x[:1], lin.weight, lin.bias)
        y = lin(x[:5].clone().requires_grad_())
        y.sum().backward()  # autograd still works (the backward's matmuls go through hal too)
    assert same(inside[1], inside[7]) and same(inside[1], inside[40]) and same(ref, inside[1])
    assert same(out_stock[40], first_row(40))  # outside again: stock bits
    assert not same(inside[1], out_stock[1]) or not same(inside[7], out_stock[7])


def test_moe_router_ties_take_lower_expert_index():
    """Equal router probabilities: the top-k are the lowest expert indices, in order, whatever the batch."""
    from hal.integrations.transformers import modules as hf_modules
    m = tiny_model("qwen3_next")
    router = m.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight.zero_()  # every expert gets the same probability
        _, w, idx = hf_modules.router(router, torch.randn(5, 64))
    assert idx.tolist() == [[0, 1]] * 5
    assert same(w, torch.full((5, 2), 0.5))


def test_bfloat16_verify():
    m = tiny_model("llama", dtype=torch.bfloat16)
    with lt.patch(m):
        rep = lt.verify(m, VOCAB, lengths=(4, 3), decode_steps=1)
    assert rep.ok, str(rep)


def test_static_cache_decode_equals_teacher_forced():
    """StaticCache (keys padded to the cache length) decode logits = teacher-forced logits; stock differs."""
    seqs = prompts("llama", seed=3)[:2]

    def check(m):
        toks, steps = _generate(m, seqs, cache_implementation="static")
        ok = True
        for b, s in enumerate(seqs):
            with torch.no_grad():
                full = m(input_ids=torch.cat([s, toks[b]])[None], use_cache=False).logits.float()[0]
            ok &= same(steps[b], full[len(s) - 1:-1])
        return ok

    m = tiny_model("llama")
    with lt.patch(m):
        assert check(m)
    assert not check(stock("llama"))


@pytest.mark.parametrize("kind,attn", [("qwen2", "sdpa"), ("mistral", "eager")])
def test_qwen2_mistral_and_any_attn_implementation(kind, attn):
    """Qwen2 (q/k/v biases) and Mistral use the same adapters; a patched attention module calls
    lockstep attention itself and reads sdpa's bool masks / eager's additive masks."""
    m = tiny_model(kind, attn_implementation=attn)
    with lt.patch(m):
        rep = lt.verify(m, VOCAB, lengths=(4, 3), decode_steps=1)
    assert rep.ok, str(rep)
    assert not lt.verify(tiny_model(kind, attn_implementation=attn), VOCAB, lengths=(4, 3), decode_steps=1).ok


def test_aten_mode_softmax_and_elementwise_are_hals_inside_only():
    torch.manual_seed(0)
    x = torch.randn(37, 50) * 4
    ops = dict(softmax=(lambda t: torch.softmax(t, -1), hal.softmax),
               log_softmax=(lambda t: torch.log_softmax(t, -1), hal.log_softmax),
               sigmoid=(torch.sigmoid, hal.sigmoid), silu=(torch.nn.functional.silu, hal.silu),
               softplus=(torch.nn.functional.softplus, hal.softplus))
    with hal.aten_mode():
        inside = {k: f(x) for k, (f, _) in ops.items()}
        mean_1, mean_all = x[:1].mean(-1), x.mean(-1)[:1]
    outside = {k: f(x) for k, (f, _) in ops.items()}
    for k, (_, ref) in ops.items():
        assert same(ref(x), inside[k], k)
        assert not same(ref(x), outside[k], k)  # negative control: torch's own kernels give other bits here
    assert same(mean_1, mean_all)


def test_example_hf_parity_small(tmp_path):
    """examples/hf_parity.py: sampler vs packed-trainer log-probs, lockstep equal bits, stock not; PNG written."""
    import argparse
    import pathlib
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from examples import hf_parity as ex
    args = argparse.Namespace(prompts=3, new_tokens=3, seed=0)
    lock, stock_r = ex.run("llama", "lockstep", args), ex.run("llama", "stock", args)
    assert lock["tokens"] == 9 and lock["share_differing"] == 0.0 and lock["k3"] == 0.0
    assert stock_r["share_differing"] > 0.0
    png = ex.plot([lock, stock_r], "llama", str(tmp_path))
    assert pathlib.Path(png).stat().st_size > 1000
