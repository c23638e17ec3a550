"""The recorded log-prob from the LM head's own float32 logits (hal.sampling.logits_logprobs): the bits of
hal.token_logprobs, so an engine whose head gives those logits runs it once per token (the vLLM sampler). A float32
head's logits are hal.linear's output; a bf16 / fp16 head's are the float32 result hal.ops.linear_with_float32 keeps
beside the rounded logits."""
from __future__ import annotations

import pytest
import torch

import hal
from hal.conformance.bits import same_bits
from hal.sampling import (Sampling, head_logits_are_the_logprobs_dot, logits_logprobs, recorded_logprobs,
                          top_logprobs)
from hal.ops import linear_with_float32
from hal.spec import MatmulSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 96, generator=g).to(dtype)
    w = torch.randn(700, 96, generator=g).to(dtype)
    h[3, 7], h[4, 2] = float("inf"), float("nan")  # a poisoned row each way: NaN everywhere in it
    return h, w, torch.randint(0, 700, (6,), generator=g), torch.randint(0, 700, (6, 9), generator=g)


def _head(h, w):
    """The float32 logits an engine's LM head keeps (float32: hal.linear's output itself)."""
    return hal.linear(h, w) if h.dtype == torch.float32 else linear_with_float32(h, w)[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_head_logits_give_token_logprobs_bits(temperature, dtype):
    h, w, tok, k = _case(dtype)
    assert head_logits_are_the_logprobs_dot(dtype)
    logits = _head(h, w)  # what the engine's LM head computed
    assert same_bits(logits_logprobs(logits, tok, temperature), hal.token_logprobs(h, w, tok, temperature))
    assert same_bits(logits_logprobs(logits, k, temperature), hal.token_logprobs(h, w, k, temperature))


@pytest.mark.parametrize("dtype", DTYPES)
def test_recorded_and_top_logprobs_from_head_logits_equal_the_recomputed(dtype):
    h, w, tok, _ = _case(dtype)
    h, tok = h[:3], tok[:3]  # finite rows: a kept set to renormalise over
    logits = _head(h, w)
    for s in (Sampling(), Sampling(temperature=0.8, top_k=40, top_p=0.9)):
        scores = logits / s.temperature
        tok = scores.argmax(-1)  # in every kept set
        assert same_bits(recorded_logprobs(w, h, tok, s, scores=scores, head_logits=logits),
                         recorded_logprobs(w, h, tok, s, scores=scores))
        for a, b in zip(top_logprobs(w, h, tok, 5, s, scores=scores, head_logits=logits),
                        top_logprobs(w, h, tok, 5, s, scores=scores)):
            assert same_bits(a, b)


def test_rounded_head_logits_are_not_the_recorded_values_negative_control():
    """A bf16 head's rounded logits (hal.linear's output) are not token_logprobs' float32 logits: the function
    refuses them, and widened their log-softmax differs; the float32 result kept beside them gives the bits."""
    h, w, tok, _ = _case(torch.bfloat16)
    logits, logits32 = linear_with_float32(h, w)
    assert same_bits(logits, hal.linear(h, w))
    with pytest.raises(hal.InputError, match="float32"):
        logits_logprobs(logits, tok)
    assert not same_bits(logits_logprobs(logits.float(), tok), hal.token_logprobs(h, w, tok))
    assert same_bits(logits_logprobs(logits32, tok), hal.token_logprobs(h, w, tok))
    # another K tiling of the linear is another chain: not the log-prob's dot
    for dtype in DTYPES:
        assert not head_logits_are_the_logprobs_dot(dtype, matmul_spec=MatmulSpec(k_tile=32))
    assert not head_logits_are_the_logprobs_dot(torch.float64)


def test_bad_tokens_refused():
    logits = torch.zeros(2, 10)
    with pytest.raises(hal.InputError, match="tokens"):
        logits_logprobs(logits, torch.tensor([0, 10]))
    with pytest.raises(hal.InputError, match="tokens"):
        logits_logprobs(logits, torch.tensor([0, 1, 2]))
