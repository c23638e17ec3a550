"""An unmodified HF model's linears under a chosen matmul spec: ``lt.patch(model, matmul_spec=...)``.

Tiny random models (hal.integrations.transformers.testing, nothing downloaded), cpu backend. Under the exact
policy (``ExactMatmulSpec(slices=4)``) the patch slices each weight once and re-slices it when its bits
changed. Every bit claim compares raw bits, each with a negative control: per-call
slicing through the model is the oracle of the prepared path (and the strict spec differs from it);
the stock model fails batch invariance; a variant that never re-prepares after an optimizer step
gives other bits than a fresh patch (and the ExactWeight guard catches one that skips the check).
"""
import dataclasses
from typing import ClassVar

import pytest
import torch

pytest.importorskip("transformers")

import hal  # noqa: E402
from hal.conformance.bits import assert_same_bits, same_bits  # noqa: E402
from hal.integrations.transformers import matmul as hf_matmul  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402
from hal.kernels.exact.prepared import ExactWeight  # noqa: E402
from hal.spec import ExactMatmulSpec, MatmulSpec, OpSpec, RMSNormSpec, TokenLogprobsSpec  # noqa: E402

EXACT = ExactMatmulSpec(slices=4)
LLAMA_LINEARS = 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the LM head

lt.register()


pytestmark = pytest.mark.usefixtures("one_thread")


def ids(seed=0, shape=(2, 7)):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def logits(m, x, **kw):
    with torch.no_grad():
        return m(input_ids=x, use_cache=False, **kw).logits


def per_call(monkeypatch):
    """The oracle: every linear gets the plain weight, so hal.linear slices it in each call."""
    monkeypatch.setattr(hf_matmul.PatchMatmul, "weight", lambda self, w, key: w)


# ---------------------------------------------------------------- (a) prepared == per call, through the model


def test_qwen3_next_router_experts_prepared_equals_per_call(monkeypatch):
    m, x = tiny_model("qwen3_next"), ids(1)
    linears = sum(isinstance(mod, torch.nn.Linear) for mod in m.modules())
    routers = sum(type(mod).__name__ == "Qwen3NextTopKRouter" for mod in m.modules())
    with lt.patch(m, matmul_spec=EXACT) as p:
        got = logits(m, x)
        n = p.matmul.slicings
        assert n > linears + routers  # + the experts' weights that were routed to
        assert_same_bits(got, logits(m, x), "second forward")
        assert p.matmul.slicings == n  # reused, not re-sliced
    with monkeypatch.context() as mp:
        per_call(mp)
        with lt.patch(m, matmul_spec=EXACT) as p:
            want = logits(m, x)
            assert p.matmul.slicings == 0
    assert_same_bits(want, got, "qwen3_next prepared vs per-call")


def test_llama_prepared_equals_per_call_and_strict_differs(monkeypatch):
    m, x = tiny_model("llama"), ids()
    with lt.patch(m, matmul_spec="matmul.exact.s4.v2") as p:  # the id works as well as the object
        assert p.matmul.spec == EXACT
        got = logits(m, x)
        assert p.matmul.slicings == LLAMA_LINEARS
    with monkeypatch.context() as mp:
        per_call(mp)
        with lt.patch(m, matmul_spec=EXACT):
            want = logits(m, x)
    assert_same_bits(want, got, "llama prepared vs per-call")
    with lt.patch(m):  # negative control: the default strict spec is another computation
        strict = logits(m, x)
    assert not same_bits(strict, got)


# ---------------------------------------------------------------- (b) batch invariance under exact


def _alone_vs_right_padded(m, seqs):
    P = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), P, dtype=torch.long)
    mask = torch.zeros(len(seqs), P, dtype=torch.long)
    for b, s in enumerate(seqs):
        batch[b, :len(s)], mask[b, :len(s)] = s, 1
    padded = logits(m, batch, attention_mask=mask)
    return all(same_bits(logits(m, s[None])[0], padded[b, :len(s)]) for b, s in enumerate(seqs))


def test_batch_invariance_exact_and_stock_caught():
    seqs = [ids(s, (n,)) for s, n in ((3, 6), (4, 3), (5, 8))]
    m = tiny_model("llama")
    with lt.patch(m, matmul_spec=EXACT):
        assert _alone_vs_right_padded(m, seqs)
        rep = lt.verify(m, VOCAB, lengths=(6, 3, 8), decode_steps=2)  # left-padded, packed, decode too
    assert rep.ok, str(rep)
    assert not _alone_vs_right_padded(tiny_model("llama", attn_implementation="sdpa"), seqs)  # stock


# ---------------------------------------------------------------- (c) training: re-prepared after a step


def _step(m, x, lr=0.5):
    loss = m(input_ids=x, use_cache=False).logits.float().square().mean()
    loss.backward()
    torch.optim.SGD(m.parameters(), lr=lr).step()
    m.zero_grad()


def _fresh_logits(trained, x):
    """The updated weights in a fresh model under a fresh patch."""
    m = tiny_model("llama")
    m.load_state_dict(trained.state_dict())
    with lt.patch(m, matmul_spec=EXACT):
        return logits(m, x)


def test_grads_reach_the_weights_as_with_per_call_slicing(monkeypatch):
    x = ids()
    grads = []
    for prepared in (True, False):
        m = tiny_model("llama")
        with monkeypatch.context() as mp:
            if not prepared:
                per_call(mp)
            with lt.patch(m, matmul_spec=EXACT):
                m(input_ids=x, use_cache=False).logits.float().square().mean().backward()
        grads.append({n: q.grad for n, q in m.named_parameters()})
    lin = [n for n in grads[0] if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert len(lin) == LLAMA_LINEARS and all(grads[0][n] is not None and grads[0][n].abs().max() > 0 for n in lin)
    for n in lin:
        assert_same_bits(grads[1][n], grads[0][n], f"grad {n}")


def test_optimizer_step_re_prepares(monkeypatch):
    x = ids()
    m = tiny_model("llama")
    with lt.patch(m, matmul_spec=EXACT) as p:
        stale = logits(m, x)
        _step(m, x)
        assert p.matmul.slicings == LLAMA_LINEARS
        after = logits(m, x)
        assert p.matmul.slicings == 2 * LLAMA_LINEARS  # every weight changed: every weight re-sliced once
        assert_same_bits(after, logits(m, x), "no re-slicing while unchanged")
        assert p.matmul.slicings == 2 * LLAMA_LINEARS
    fresh = _fresh_logits(m, x)
    assert_same_bits(fresh, after, "after the step vs a fresh patch")
    assert not same_bits(stale, after)

    # negative control 1: a variant that keeps the first slices (re-wrapped so no guard sees them) is caught
    def never_again(self, w, key):
        hit = self._prepared.setdefault(key, ((), hal.exact_weight(w, spec=self.spec)))[1]
        return ExactWeight(w, hit.spec, hit.layout, hit.sliced)
    m = tiny_model("llama")
    with monkeypatch.context() as mp:
        mp.setattr(hf_matmul.PatchMatmul, "weight", never_again)
        with lt.patch(m, matmul_spec=EXACT):
            logits(m, x)
            _step(m, x)
            wrong = logits(m, x)
    assert not same_bits(fresh, wrong)
    # negative control 2: reusing the stale ExactWeight itself is refused by its staleness guard
    m = tiny_model("llama")
    with monkeypatch.context() as mp:
        mp.setattr(hf_matmul.PatchMatmul, "weight",
                   lambda self, w, key: self._prepared.setdefault(key, hal.exact_weight(w, spec=self.spec)))
        with lt.patch(m, matmul_spec=EXACT):
            logits(m, x)
            _step(m, x)
            with pytest.raises(hal.InputError, match="weight changed since exact_weight"):
                logits(m, x)


@pytest.mark.parametrize("how", ["load_state_dict", "data_rebind", "data_copy"])
def test_writes_re_prepare(how):
    """``load_state_dict`` (in-place copy), ``w.data = t`` (new storage) and ``w.data.copy_`` (no version bump)
    all re-slice with no clear() (every optimizer and write: tests/test_exact_fresh.py)."""
    x = ids()
    m, donor = tiny_model("llama"), tiny_model("llama", seed=1)
    with lt.patch(m, matmul_spec=EXACT) as p:
        stale = logits(m, x)
        if how == "load_state_dict":
            m.load_state_dict(donor.state_dict())
        else:
            for q, d in zip(m.parameters(), donor.parameters()):
                if how == "data_rebind":
                    q.data = d.detach().clone()
                else:
                    q.data.copy_(d.detach())
        got = logits(m, x)
        assert p.matmul.slicings == 2 * LLAMA_LINEARS
    assert_same_bits(_fresh_logits(m, x), got, how)
    assert not same_bits(stale, got)


def test_revert_restores_the_model_exactly():
    m, x = tiny_model("llama"), ids()
    before_sd = {k: v.clone() for k, v in m.state_dict().items()}
    before_dicts = [set(mod.__dict__) for mod in m.modules()]
    stock_bits = logits(m, x)
    p = lt.apply(m, matmul_spec=EXACT)
    logits(m, x)
    p.revert()
    assert p.matmul.slicings and not p.matmul._prepared  # the slices are dropped
    assert [set(mod.__dict__) for mod in m.modules()] == before_dicts
    for k, v in m.state_dict().items():
        assert_same_bits(before_sd[k], v, k)
    assert_same_bits(stock_bits, logits(m, x), "stock bits after revert")


# ---------------------------------------------------------------- (d) token_logprobs helper


def test_token_logprobs_helper_uses_the_exact_head_spec():
    m, x = tiny_model("llama"), ids()
    tok = ids(7)
    tspec = TokenLogprobsSpec(matmul=EXACT)
    with torch.no_grad():
        with lt.patch(m, matmul_spec=EXACT) as p:
            assert p.matmul.logprobs_spec == tspec
            h = m.model(input_ids=x).last_hidden_state
            logits(m, x)  # prepares the LM head
            n = p.matmul.slicings
            got = lt.token_logprobs(m, h, tok, 0.7)
            assert p.matmul.slicings == n  # the linear's prepared LM head, not a new slicing
        assert_same_bits(hal.token_logprobs(h, m.lm_head.weight, tok, 0.7, spec=tspec), got, "helper vs hal")
        strict = lt.token_logprobs(m, h, tok, 0.7)  # unpatched: the default (strict) spec, as before
        assert_same_bits(hal.token_logprobs(h, m.lm_head.weight, tok, 0.7), strict)
    assert not same_bits(strict, got)  # negative control: the two specs are different computations


def test_matching_logprobs_specs():
    assert hf_matmul.logprobs_spec(hal.spec.DEFAULTS["matmul"]) == hal.spec.DEFAULTS["token_logprobs"]
    assert hf_matmul.logprobs_spec(ExactMatmulSpec(slices=3)).id == "token_logprobs.strict.exact-s3.v256.lsm1.v2"
    assert hf_matmul.logprobs_spec(MatmulSpec(k_tile=32)).id == "token_logprobs.strict.h32.v256.lsm1.v2"
    assert hf_matmul.logprobs_spec(hal.spec.FastMatmulSpec()) == hal.spec.POLICY_SPECS["fast"]["token_logprobs"]


# ---------------------------------------------------------------- (e) bad specs refused before mutation


@pytest.mark.parametrize("bad, err, match", [
    (RMSNormSpec(), hal.SpecError, "matmul_spec: spec rms_norm.* for 'rms_norm' ops"),
    (TokenLogprobsSpec(matmul=EXACT), hal.SpecError, "matmul_spec: spec token_logprobs"),
    ("matmul.exact.s9.v2", hal.SpecError, "matmul_spec: unknown spec id 'matmul.exact.s9.v2'"),
    (4, hal.SpecError, "matmul_spec must be a matmul spec .* got int"),
])
def test_bad_spec_leaves_model_unpatched(bad, err, match):
    m = tiny_model("llama")
    with pytest.raises(err, match=match):
        lt.apply(m, matmul_spec=bad)
    assert all("forward" not in mod.__dict__ for mod in m.modules()) and "_lockstep_patch" not in m.__dict__
    lt.apply(m).revert()  # still patchable


@dataclasses.dataclass(frozen=True)
class _OtherMatmul(OpSpec):
    """A matmul-family spec with no token_logprobs counterpart."""
    family: ClassVar[str] = "matmul"

    def _id_parts(self):
        return ["other"]


def test_spec_without_logprobs_counterpart_refused():
    m = tiny_model("llama")
    with pytest.raises(hal.SpecError, match="matmul_spec matmul.strict.other.v2: no token_logprobs spec"):
        lt.apply(m, matmul_spec=_OtherMatmul())
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_exact_refuses_float64_weights_before_mutation():
    m = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(hal.InputError, match="model.layers.0.self_attn.q_proj.weight: the exact matmul policy"):
        lt.apply(m, matmul_spec=EXACT)
    assert all("forward" not in mod.__dict__ for mod in m.modules())
