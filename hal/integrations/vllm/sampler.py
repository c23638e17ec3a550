"""vLLM's sampler on lockstep's bits: the tokens come from lockstep's logits and kept set, and the recorded
log-prob is ``hal.sampling.recorded_logprobs`` of the hidden row the LM head saw (what ``lt.token_logprobs``
gives a trainer), never ``log_softmax`` of vLLM's rounded logits. The head's pass keeps that value's own float32
logits (a bf16 / fp16 head's unrounded float32 result beside the logits vLLM samples from): the value comes from
them, the LM head run once per token (layers.py, ``HiddenRows``).

Per row (request) of the step:

* greedy (temperature < vLLM's 1e-5): ``argmax`` of lockstep's logits (the first index among ties);
* sampled: ``scores = logits.float() / temperature``, lockstep's :func:`hal.sampling.kept_set` (top-k, then
  top-p over what top-k kept), a draw from ``softmax`` of the kept scores. A request with its own ``seed``
  draws from its own generator (vLLM keeps one per seeded request), so its tokens do not depend on its
  neighbours; unseeded requests draw from the process's generator in row order: the right distribution,
  but which token a given request gets depends on the other rows of the step (no reproducibility promise).
  vLLM samples every row, also a prefill chunk that does not end its prompt (its token is thrown away); such a
  row's own generator is held aside while the step samples (:func:`discarded_rows_spare_their_generators`), so a
  seeded request's generator advances once per token it keeps, however its prompt was cut.

Recorded (``SamplingParams(logprobs=0)``): ``logprobs_mode="raw_logprobs"`` (vLLM's default) the
temperature-1 full-vocabulary log-prob; ``"processed_logprobs"`` the log-prob under the distribution the row
was sampled from (temperature, then renormalised over the kept set); a greedy row's processed value is its
temperature-1 value. The rank vLLM returns beside it is the number of tokens whose lockstep logit is >= the
token's (itself and its ties counted, as vLLM counts). ``logprobs=N``: the row's N alternatives and their values
under the same distribution, :func:`hal.sampling.top_logprobs` (ordered by lockstep's score -- the logits, or
under processed_logprobs the scores the row was drawn from, -inf outside its kept set --, then the recorded value,
then the token id; a token outside the kept set: -inf). ``prompt_logprobs=N``: :class:`PromptScorer`, the same
function at temperature 1 for each prompt position. Everything a row's recorded bits cannot follow is refused by
name at request admission (plugin.py); what reaches this sampler unrefused raises here rather than be ignored.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...errors import UnsupportedError
from ...sampling import Sampling, kept_set, sampling_scores, top_logprobs
from .layers import HIDDEN

from vllm.v1.outputs import LogprobsTensors, SamplerOutput

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def _refuse_unsupported(md) -> None:
    problems = []
    if md.allowed_token_ids_mask is not None:
        problems.append("allowed_token_ids")
    if md.bad_words_token_ids:
        problems.append("bad_words")
    if not md.no_penalties:
        problems.append("presence / frequency / repetition penalties")
    if md.logprob_token_ids:
        problems.append("logprob_token_ids")
    if md.spec_token_ids and any(md.spec_token_ids):
        problems.append("speculative decoding")
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        problems.append("thinking_token_budget")
    if md.max_num_logprobs is not None and md.max_num_logprobs < 0:
        problems.append(f"logprobs={md.max_num_logprobs} (the full vocabulary)")
    if problems:
        raise UnsupportedError("lockstep's vLLM sampler does not support " + ", ".join(problems))


@contextlib.contextmanager
def discarded_rows_spare_their_generators(runner):
    """Around the model runner's ``sample_tokens``: the rows whose token vLLM will throw away (a prefill chunk
    that does not end its prompt) have their own generators held aside. vLLM draws for those rows and then
    rewinds the generator with ``set_offset`` (a CUDA Philox generator's counter), which a CPU generator does not
    have: stock vLLM-CPU dies on a seeded request prefilled over several steps ("CPU Generator does not use
    offset"). Held aside, the throwaway draw comes from the process's generator and vLLM's rewind finds no
    generator to rewind; a seeded request's own generator advances only for the tokens it keeps. (Rows keep
    their indices for the whole call: the batch is reordered only when the next step's states are updated.)"""
    batch = runner.input_batch
    discarded = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0].tolist()
    held = {i: batch.generators.pop(i) for i in discarded if i in batch.generators}
    try:
        yield
    finally:
        batch.generators.update(held)


def row_sampling(md, i: int, vocab: int) -> Sampling | None:
    """Row ``i``'s :class:`Sampling`, or None for a greedy row."""
    if md.all_greedy or md.temperature is None:
        return None
    t = float(md.temperature[i])
    if t < _SAMPLING_EPS:
        return None
    k = None if md.top_k is None else int(md.top_k[i])
    p = None if md.top_p is None else float(md.top_p[i])
    return Sampling(temperature=t, top_k=None if k is None or k <= 0 or k >= vocab else k,
                    top_p=None if p is None or p >= 1.0 else p)


def lockstep_sample(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
    """Replaces ``vllm.v1.sample.sampler.Sampler.forward``."""
    md = sampling_metadata
    if predict_bonus_token:
        raise UnsupportedError("speculative decoding is not supported by lockstep's vLLM plugin")
    _refuse_unsupported(md)
    mode = logprobs_mode_override or self.logprobs_mode
    if mode not in ("raw_logprobs", "processed_logprobs"):
        raise UnsupportedError(f"logprobs_mode={mode!r} is not supported by lockstep's vLLM plugin "
                               "(raw_logprobs or processed_logprobs)")
    hidden, head, head_logits = HIDDEN.find(logits)
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    plans, greedy = [], []
    for i in range(n):
        s = row_sampling(md, i, vocab)
        if s is None:
            greedy.append(i)
            plans.append((Sampling(), None))
            continue
        scores = sampling_scores(logits[i:i + 1], s.temperature)
        drawn_from = scores
        if s.filters:
            drawn_from = scores.masked_fill(~kept_set(scores, s.top_k, s.top_p), float("-inf"))
        gen = md.generators.get(i)
        tokens[i] = torch.multinomial(torch.softmax(drawn_from, dim=-1), 1, generator=gen)[0, 0]
        plans.append((s, scores))
    if greedy:  # every greedy row's argmax in one call (each row's own: the first index among its ties)
        if len(greedy) == n:
            tokens.copy_(logits.float().argmax(-1))
        else:
            at = torch.tensor(greedy)
            tokens[at] = logits[at].float().argmax(-1)
    logprobs_tensors = None
    if md.max_num_logprobs is not None:
        top = md.max_num_logprobs  # the batch's largest N; vLLM keeps each request's first 1 + N columns
        ids = torch.empty(n, 1 + top, dtype=torch.int64)
        recorded = torch.empty(n, 1 + top, dtype=torch.float32)
        ids[:, 0] = tokens
        # the rows recorded at temperature 1 over the full vocabulary (raw_logprobs, greedy rows) in one call: one
        # pass over the LM head for all of them (each row's values are the bits it has alone: top_logprobs)
        full = [i for i, (_, scores) in enumerate(plans) if mode == "raw_logprobs" or scores is None]
        groups = [(full, Sampling(), None)] if full else []
        alone = set(range(n)).difference(full)  # processed rows: each under its own distribution
        groups += [([i], s, scores) for i, (s, scores) in enumerate(plans) if i in alone]
        for rows, s, scores in groups:
            at = torch.tensor(rows)
            own = None if head_logits is None else head_logits[at]
            recorded[at, 0], ids[at, 1:], recorded[at, 1:] = top_logprobs(
                head, hidden[at], tokens[at], top, s, scores=logits[at].float() if scores is None else scores,
                head_logits=own)
        logprobs_tensors = LogprobsTensors(ids.to(torch.int32), recorded, rank_of(logits, tokens))
    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs_tensors)


def rank_of(logits, tokens):
    """vLLM's rank of each row's token: the number of tokens whose lockstep logit is >= its own (itself and
    its ties included, as vLLM counts)."""
    raw = logits.float()
    return (raw >= raw.gather(1, tokens.reshape(-1, 1).to(torch.int64))).sum(-1)


class PromptScorer:
    """Stands in for the sampler while vLLM's model runner scores prompt positions (``prompt_logprobs``;
    :func:`scoring_prompts`). The runner asks ``compute_logprobs(logits)`` for a full-vocabulary log-softmax,
    then ``gather_logprobs(that, N, next prompt tokens)``; here the logits pass through untouched, and
    ``gather_logprobs`` scores each position from the hidden row its logits came from: the temperature-1
    full-vocabulary value (prompt positions skip the sampling settings, as in vLLM) and its N alternatives,
    :func:`hal.sampling.top_logprobs` as for sampled tokens."""

    @staticmethod
    def compute_logprobs(logits):
        return logits

    @staticmethod
    def gather_logprobs(logits, num_logprobs, token_ids):
        hidden, head, head_logits = HIDDEN.find(logits)
        lp, top_ids, top_lp = top_logprobs(head, hidden, token_ids, num_logprobs, Sampling(), scores=logits.float(),
                                           head_logits=head_logits)
        return LogprobsTensors(torch.cat([token_ids.reshape(-1, 1), top_ids], 1).to(torch.int32),
                               torch.cat([lp.reshape(-1, 1), top_lp], 1), rank_of(logits, token_ids))


@contextlib.contextmanager
def scoring_prompts(runner):
    """Around the model runner's ``_get_prompt_logprobs_dict``: its sampler is :class:`PromptScorer` for the
    call (vLLM's own bookkeeping of chunks, preempted requests and which positions remain is kept)."""
    sampler = runner.sampler
    runner.sampler = PromptScorer()
    try:
        yield
    finally:
        runner.sampler = sampler
