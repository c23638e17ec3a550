"""hal.sampling.kept_logprobs reads a row's kept set from one LM-head row per token (hal.token_logprobs'
K-tokens-per-row form): the same bits as the previous definition, which computed one full-vocabulary row
per kept token. Every backend with token_logprobs takes the form (reference, cpu and jax read K tokens from one
row; triton / ascend run their one-token kernel per column, hal.backend.tokens_per_row); the conformance suites'
L1 check ``k-tokens-per-row`` certifies it per backend, and is shown here to catch a shortcut. The timing ratio
is in benchmarks/kept_logprobs_rows.py (never asserted here)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hal
from backends.reference import ReferenceBackend
from hal.conformance.bits import same_bits
from hal.conformance.suites import token_logprobs as tlp_suite
from hal.sampling import Sampling, kept_logprobs, kept_set, renormalise_kept, sampling_scores
from hal.spec import ExactMatmulSpec, TokenLogprobsSpec


def per_kept_token(h, tokens, sampling, lp_one, scores):
    """The previous kept_logprobs, kept here as the reference: one full-vocabulary row per kept token."""
    kept = kept_set(scores, sampling.top_k, sampling.top_p)
    rows, ids = kept.nonzero(as_tuple=True)
    lp_all = lp_one(h[rows], ids, sampling.temperature)
    lp_tok = lp_one(h, tokens, sampling.temperature)
    return renormalise_kept(lp_tok, lp_all, kept.sum(-1).tolist())


def case(n, vocab, hidden, dtype, spread, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=g) * spread).to(dtype)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    return h, w


SETTINGS = [Sampling(0.7, top_k=5), Sampling(1.0, top_p=0.6), Sampling(1.3, top_k=50, top_p=0.9),
            Sampling(0.9, top_p=0.97)]
SHAPES = [(5, 40, 16, 1.0), (3, 1000, 32, 0.3), (2, 32000, 16, 1.0)]  # the last: 32k vocab, top-p sets of 100s-1000s


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype,exact", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_one_row_per_token_same_bits(backend, dtype, exact):
    why = hal.get_backend(backend).unavailable_reason()
    if why:
        pytest.skip(why)
    spec = TokenLogprobsSpec(matmul=ExactMatmulSpec()) if exact else None
    checked = 0
    for n, vocab, hidden, spread in SHAPES:
        if backend == "reference" and vocab > 1000:
            continue  # the readable reference is slow on 32k rows per kept token; cpu covers the large vocabulary
        h, w = case(n, vocab, hidden, dtype, spread, seed=vocab)

        def lp(hh, tt, temp):
            return hal.token_logprobs(hh, w, tt, temp, spec=spec, backend=backend)

        logits = F.linear(h.float(), w.float())
        for s in SETTINGS:
            scores = sampling_scores(logits, s.temperature)
            kept = kept_set(scores, s.top_k, s.top_p)
            g = torch.Generator().manual_seed(checked)
            tokens = torch.multinomial(kept.float(), 1, generator=g).squeeze(-1)  # any kept token
            got = kept_logprobs(None, h, tokens, s, lp, scores=scores)
            want = per_kept_token(h, tokens, s, lp, scores)
            assert same_bits(got, want), (n, vocab, s)
            checked += 1
    assert checked >= 8
    if dtype == torch.float32 or exact:
        return
    # negative control: a plausible shortcut (torch's log_softmax of a float32 logits row) is caught
    h, w = case(32, 1000, 32, dtype, 1.0, seed=5)
    s = SETTINGS[1]
    scores = sampling_scores(F.linear(h.float(), w.float()), s.temperature)
    tokens = scores.argmax(-1)

    def shortcut(hh, tt, temp):
        return torch.log_softmax(F.linear(hh.float(), w.float()) / temp, -1).gather(-1, tt.reshape(hh.shape[0], -1))

    want = per_kept_token(h, tokens, s, lambda hh, tt, temp: hal.token_logprobs(hh, w, tt, temp, backend=backend),
                          scores)
    assert not same_bits(kept_logprobs(None, h, tokens, s, shortcut, scores=scores), want)


def test_k_tokens_per_row_are_each_tokens_bits():
    """hal.token_logprobs(hidden [n, H], tokens [n, K]) == K single-token calls, bit for bit; gradients flow."""
    h, w = case(4, 300, 24, torch.bfloat16, 0.5, seed=1)
    cand = torch.randint(0, 300, (4, 7), generator=torch.Generator().manual_seed(2))
    got = hal.token_logprobs(h, w, cand, 0.8)
    assert got.shape == (4, 7)
    for k in range(7):
        assert same_bits(got[:, k], hal.token_logprobs(h, w, cand[:, k].contiguous(), 0.8))
    # gradients: the K-token form's backward is that of the sum of K single-token calls
    hg = h.float().requires_grad_()
    weights = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    (hal.token_logprobs(hg, w.float(), cand, 0.8) * weights).sum().backward()
    want = torch.autograd.grad(sum((hal.token_logprobs(hh, w.float(), cand[:, k].contiguous(), 0.8) * weights[:, k]).sum()
                                   for k in range(7) for hh in [hg]), hg)[0]
    torch.testing.assert_close(hg.grad, want)  # two summation orders of the same gradient: not a bit check
    with pytest.raises(hal.InputError, match="trailing K"):
        hal.token_logprobs(h, w, cand[:3], 0.8)


def test_k_tokens_through_the_torch_op_and_compile():
    """The torch op (eager through routed(), and torch.compile(fullgraph)) takes the K form: its fake shape is
    tokens' shape, its bits the direct call's."""
    from hal.torch_ops import routed
    h, w = case(3, 200, 24, torch.bfloat16, 0.5, seed=4)
    cand = torch.randint(0, 200, (3, 5), generator=torch.Generator().manual_seed(5))
    want = hal.token_logprobs(h, w, cand, 0.9)
    with routed():
        assert same_bits(hal.token_logprobs(h, w, cand, 0.9), want)
    torch._dynamo.reset()
    got = torch.compile(lambda hh, ww, tt: hal.token_logprobs(hh, ww, tt, 0.9), fullgraph=True)(h, w, cand)
    assert got.shape == (3, 5) and same_bits(got, want)
    # lead dims [2, 3] with K = 4: the same bits as the flattened rows
    h3, c3 = torch.stack([h, h.flip(0)]), torch.stack([cand[:, :4], cand[:, 1:]])
    got3 = hal.token_logprobs(h3, w, c3, 0.9)
    assert got3.shape == (2, 3, 4)
    assert same_bits(got3.reshape(6, 4), hal.token_logprobs(h3.reshape(6, 24), w, c3.reshape(6, 4), 0.9))


class _ShortcutK(ReferenceBackend):
    """Negative control for the conformance check: one-token calls are the reference's, but the K form reads its
    tokens from torch's log_softmax of the reference logits (a plausible shortcut, other bits)."""
    name = "shortcut-k"

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        if tokens.ndim != hidden.ndim:
            return super().token_logprobs(hidden, weight, tokens, temperature, spec)
        from hal.kernels.reference.softmax import lm_logits
        return torch.log_softmax(lm_logits(hidden, weight, temperature, spec), -1).gather(-1, tokens.long())


def _k_check_pairs(backend, case_):
    suite = tlp_suite.SUITE
    inputs = suite.make_inputs(case_)
    with torch.no_grad():
        base = suite.run(backend, case_, inputs)
        check = dict(suite.checks["L1"])["k-tokens-per-row"]
        return [(name, same_bits(a, b)) for name, a, b in check(backend, case_, inputs, base)]


def test_conformance_k_tokens_check_passes_and_catches_a_shortcut():
    cases = [c for c in tlp_suite.SUITE.cases() if c.dtype == torch.float32 and c.p["v"] == 4097]
    assert cases
    ref = hal.get_backend("reference")
    good = _k_check_pairs(ref, cases[0])
    assert len(good) == 7 and all(ok for _, ok in good), good
    bad = _k_check_pairs(_ShortcutK(), cases[0])
    assert bad[0][0].startswith("k-tokens-per-row:column-0") and not all(ok for _, ok in bad), bad


def test_a_one_token_kernel_looped_per_column_is_each_tokens_bits():
    """hal.backend.tokens_per_row (triton / ascend wrappers): the K form from a one-token kernel, column by column."""
    from hal.backend import tokens_per_row
    ref = hal.get_backend("reference")
    spec = hal.spec.resolve("token_logprobs", None)
    h, w = case(4, 300, 24, torch.bfloat16, 0.5, seed=6)
    cand = torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(7))
    calls = []

    def one(hh, ww, tt, temp, sp):
        assert tt.ndim == 1
        calls.append(tt)
        return ref.token_logprobs(hh, ww, tt, temp, sp)

    got = tokens_per_row(one, h, w, cand, 0.8, spec)
    assert len(calls) == 6 and got.shape == (4, 6)
    assert same_bits(got, ref.token_logprobs(h, w, cand, 0.8, spec))
    assert tokens_per_row(one, h, w, cand[:, :0], 0.8, spec).shape == (4, 0)
