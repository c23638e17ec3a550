"""Sampling semantics shared by every sampler and trainer: the kept set and the recorded log-prob.

* :class:`Sampling`: temperature, top-k, top-p, as sampling draws with them;
* :func:`sampling_scores` / :func:`kept_set`: the float32 scores sampling sees and the tokens it may
  draw from (one definition for engine and trainer: lockstep's softmax, an exact top-p mass sum);
* :func:`recorded_logprobs`: THE recorded log-prob of a token from its hidden row -- ``log p`` under
  softmax(logits / temperature), renormalised over the row's kept set when top-k / top-p filter -- over
  plain tensors (LM-head weight, hidden rows, tokens), so an engine without a transformers model records
  what ``lt.token_logprobs`` recomputes; :func:`kept_logprobs` and :func:`renormalise_kept` are its parts;
* :func:`top_logprobs`: a row's N most probable tokens (an engine's ``logprobs=N`` alternatives) in one
  total order, with their recorded log-probs (the same function's bits);
* :func:`head_logits_are_the_logprobs_dot` / :func:`logits_logprobs`: where an engine's LM head already gives the
  float32 logits ``hal.token_logprobs`` reduces, its value from them (the LM head run once per token).

Engine-neutral: imports neither transformers nor vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import validate as v
from .dispatch import call_spec
from .errors import InputError, UnsupportedError
from .ops import linear, log_softmax, softmax, token_logprobs
from .spec import STRICT, MatmulSpec, SoftmaxSpec, TokenLogprobsSpec

__all__ = ["Sampling", "sampling_scores", "kept_set", "kept_scores", "renormalise_kept", "kept_logprobs",
           "recorded_logprobs", "top_logprobs", "head_logits_are_the_logprobs_dot", "logits_logprobs"]


@dataclass(frozen=True)
class Sampling:
    """What sampling draws from: softmax(logits / ``temperature``) over :func:`kept_set` (``top_k``,
    ``top_p``: None = off)."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise InputError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0.0 <= self.top_p <= 1.0):
            raise InputError(f"top_p must be a float in [0, 1] or None, got {self.top_p!r}")

    @property
    def filters(self) -> bool:
        return self.top_k is not None or (self.top_p is not None and self.top_p < 1.0)


_FIXED_ONE = 2 ** 60  # probability 1 in kept_set's fixed point: the mass sums are exact int64 sums


def sampling_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``logits / temperature``: the scores sampling and :func:`kept_set` see (engine and trainer alike)."""
    return logits.float() / temperature


def kept_set(scores: torch.Tensor, top_k: int | None = None, top_p: float | None = None,
             min_tokens_to_keep: int = 1) -> torch.Tensor:
    """bool ``[n, V]``: the tokens sampling may draw from in each row of ``scores [n, V]`` (:func:`sampling_scores`).

    The rule, applied in transformers' order (top-k, then top-p over what top-k kept):

    * top-k: the scores >= the row's k-th highest (``k = max(top_k, min_tokens_to_keep)``): ties at the
      k-th score are all kept, as transformers' warper keeps them;
    * top-p: ``p = hal.softmax`` of the row with the tokens top-k dropped set to -inf (lockstep's softmax:
      the same bits whatever the batch). A token is kept when the mass of the tokens strictly more probable
      than it is < ``top_p``: the smallest set of most probable tokens whose mass reaches ``top_p``, plus
      every token tied with its least probable one; the ``min_tokens_to_keep`` most probable are always kept
      (ties with the last of them too), and a token of probability < 2**-60 only through that minimum.
      The mass is summed exactly, in any order and on any device: each ``p`` floored to a multiple of
      2**-60 and added as int64 (the floor changes a row's mass by < V * 2**-60). ``top_p`` >= 1: no top-p.

    transformers' TopPLogitsWarper keeps the tokens whose ascending float32 cumulative sum of torch's softmax
    exceeds ``1 - top_p``: the same rule in exact arithmetic, except that its result depends on the rounding
    of that sum near the boundary, and at a tie across the boundary it keeps whichever of the tied tokens
    its (unstable) sort put last -- lockstep keeps them all.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise InputError(f"kept_set takes float32 scores [n, vocab], got {tuple(scores.shape)} {scores.dtype}")
    Sampling(top_k=top_k, top_p=top_p)  # validates both
    if isinstance(min_tokens_to_keep, bool) or not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise InputError(f"min_tokens_to_keep must be a positive int, got {min_tokens_to_keep!r}")
    vocab = scores.shape[-1]
    kept = torch.ones_like(scores, dtype=torch.bool)
    if top_k is not None:
        k = min(max(top_k, min_tokens_to_keep), vocab)
        kept = scores >= scores.topk(k, dim=-1).values[:, -1:]
    if top_p is None or top_p >= 1.0 or scores.shape[0] == 0:
        return kept
    p = softmax(scores.masked_fill(~kept, float("-inf")), dim=-1)
    q = (p.double() * _FIXED_ONE).floor().to(torch.int64)  # exact: float32 -> float64, a power-of-two scale
    desc = q.sort(dim=-1, descending=True).values
    above = desc.cumsum(-1) - desc  # mass of the tokens sorted before each (int64: exact, order-free)
    limit = math.ceil(top_p * _FIXED_ONE)  # top_p * 2**60 is exact in float64; above < it <=> above < ceil
    n_keep = ((above < limit) & (desc > 0)).sum(-1).clamp(min=min(min_tokens_to_keep, vocab))
    least = desc.gather(1, (n_keep - 1).reshape(-1, 1))  # the least probable kept; its ties are kept too
    return kept & (q >= least)


def kept_scores(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``scores`` (:func:`sampling_scores`) with every token outside its row's :func:`kept_set` at -inf: what a
    sampler draws from (an engine's own draw over their softmax; greedy is the argmax of ``scores``)."""
    if not sampling.filters:
        return scores
    return scores.masked_fill(~kept_set(scores, sampling.top_k, sampling.top_p), float("-inf"))


def renormalise_kept(lp_token: torch.Tensor, lp_kept: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``log p(token)`` renormalised over each row's kept set: ``lp - log(sum_j exp(lp_j))``.

    ``lp_token [n]`` (or ``[n, K]``: K tokens of each row, each renormalised alone) and ``lp_kept
    [sum(counts)]`` (row i's kept tokens' full-vocabulary log-probs, ascending token id, ``counts[i]`` of them)
    are lockstep's float32 bits. The value: the sum runs in
    float64 in that fixed order with Python's math (no vectorised exp whose bits depend on a row's
    position), ``lp - log(sum)`` in float64, rounded once to float32. Gradients flow as those of
    ``lp - logsumexp(lp_kept)`` (a zero-valued term carries them; it changes no bit).
    """
    exact = []
    for row in torch.split(lp_kept.detach(), counts):
        total = 0.0
        for x in row.tolist():
            total += math.exp(x)
        exact.append(math.log(total))
    log_sum = torch.tensor(exact, dtype=torch.float64, device=lp_token.device)
    if lp_token.requires_grad or lp_kept.requires_grad:
        n, width = len(counts), max(counts)
        starts = torch.tensor([0] + counts[:-1], device=lp_kept.device).cumsum(0)
        rows = torch.repeat_interleave(torch.arange(n, device=lp_kept.device), torch.tensor(counts, device=lp_kept.device))
        cols = torch.arange(lp_kept.shape[0], device=lp_kept.device) - starts[rows]
        padded = lp_kept.new_full((n, width), float("-inf"), dtype=torch.float64).index_put((rows, cols),
                                                                                          lp_kept.double())
        lse = torch.logsumexp(padded, -1)
        log_sum = log_sum + (lse - lse.detach())  # + 0.0 exactly: the value stays the float64 sum above
    return (lp_token.double() - log_sum.reshape(-1, *([1] * (lp_token.ndim - 1)))).float()


def kept_logprobs(model, hidden: torch.Tensor, tokens: torch.Tensor, sampling: Sampling, logprobs_fn,
                  scores: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log p of ``tokens`` under softmax(logits / temperature) restricted to :func:`kept_set`.
    ``hidden [..., H]``, ``tokens [...]`` (or ``[..., K]``: K tokens of each row, each value the bits it has
    alone); ``scores`` (the engine's): :func:`sampling_scores` of these rows, else computed here with the
    model's (patched) LM head, the logits the engine sampled from; ``kept``: their :func:`kept_set`, if the
    caller has it. ``logprobs_fn(h [n, H], candidates [n, K], temperature)``: ``hal.token_logprobs``'
    K-tokens-per-row form (each value the bits it has alone), called once: one full-vocabulary row per hidden
    row, whatever the size of the kept set (a top-p set over a flat distribution of a large vocabulary included)."""
    shape = tokens.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    per_row = tokens.shape[-1] if tokens.ndim == hidden.ndim else 1  # K tokens per row, or one
    t = tokens.reshape(-1, per_row).to(torch.int64)
    if scores is None:
        with torch.no_grad():
            scores = sampling_scores(model.get_output_embeddings()(h), sampling.temperature)
    if kept is None:
        kept = kept_set(scores, sampling.top_k, sampling.top_p)
    if t.numel() and not bool(kept.gather(1, t).all()):
        raise InputError(f"a token is outside the kept set of its row (top_k={sampling.top_k}, top_p={sampling.top_p}):"
                         " it cannot have been sampled with these settings")
    counts = kept.sum(-1)
    rows, ids = kept.nonzero(as_tuple=True)  # row-major: ascending token id within a row
    # candidates [n, K + C]: the K tokens, then their row's kept ids (ascending), padded with the row's first token
    width = per_row + (int(counts.max()) if h.shape[0] else 0)
    cand = torch.cat([t, t[:, :1].expand(-1, width - per_row)], 1).contiguous()
    cols = per_row + torch.arange(ids.numel(), device=t.device) - (counts.cumsum(0) - counts)[rows]
    # one flat index into [n, width], not the pair (rows, cols): torch's two-index gather / scatter took 40-60 ms
    # for 14k entries here (its parallel path) where index_select / index_copy_ take microseconds; same values
    flat = rows * width + cols
    cand.view(-1).index_copy_(0, flat, ids)
    lp = logprobs_fn(h, cand, sampling.temperature)
    return renormalise_kept(lp[:, :per_row], lp.reshape(-1).index_select(0, flat), counts.tolist()).reshape(shape)


def head_logits_are_the_logprobs_dot(dtype: torch.dtype, matmul_spec=None, spec=None) -> bool:
    """Whether the LM head ``hal.ops.linear_with_float32(hidden, lm_head_weight, spec=matmul_spec)`` of ``dtype``
    operands gives, bit for bit, the float32 logits ``hal.token_logprobs(..., spec=spec)`` reduces (its second
    tensor: the strict linear's float32 accumulation before the one rounding; for float32 operands
    ``hal.linear``'s own output): float32, bf16 or fp16 operands, both specs strict, and the linear's K tiles the
    token_logprobs spec's hidden tiles (the same fma chains, the same order of partials: the two specs' words).
    The head's rounded logits (``hal.linear``'s bf16 / fp16 output) are never the recorded value's."""
    m, s = call_spec("linear", matmul_spec), call_spec("token_logprobs", spec)
    return (dtype in (torch.float32, torch.bfloat16, torch.float16) and isinstance(m, MatmulSpec) and m.policy == STRICT
            and isinstance(s, TokenLogprobsSpec) and s.policy == STRICT and s.matmul is None
            and m.k_tile == s.hidden_tile)


def logits_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, spec=None,
                    backend=None) -> torch.Tensor:
    """``hal.token_logprobs(hidden, lm_head_weight, tokens, temperature, spec=spec)``'s bits from ``logits [n, V]``,
    the float32 logits its dot gives for those rows (where :func:`head_logits_are_the_logprobs_dot`: the engine's
    own LM head), so the head runs once for the token and its log-prob. ``tokens [n]``, or ``[n, K]`` (K tokens
    per row). The spec's words, op by op: ``logits / temperature`` (correctly rounded; skipped when it is 1), then
    ``hal.log_softmax`` with the spec's vocab tile: ``(x - M) - log(S)``, the token's entry."""
    s = call_spec("token_logprobs", spec)
    if not isinstance(s, TokenLogprobsSpec) or s.policy != STRICT or s.matmul is not None:
        raise UnsupportedError(f"logits_logprobs: token_logprobs spec {s.id} is not the strict float32 chain; "
                               "its logits are not an LM head linear's (call hal.token_logprobs)")
    v.tensor("logits", logits, ndim=2)
    if logits.dtype != torch.float32:
        raise InputError(f"logits_logprobs takes the float32 logits of the log-prob's dot, got {logits.dtype} "
                         "(rounded logits are not the recorded value's)")
    v.integer("tokens", tokens)
    t = tokens.to(torch.int64)
    if t.shape[0] != logits.shape[0] or t.ndim not in (1, 2):
        raise InputError(f"logits_logprobs: tokens must be [n] or [n, K] for logits {tuple(logits.shape)}, "
                         f"got {tuple(tokens.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= logits.shape[1]):
        raise InputError(f"tokens must be in [0, {logits.shape[1]}) (the vocabulary)")
    temperature = v.scalar("temperature", temperature, positive=True, reciprocal=True)
    scores = logits if temperature == 1.0 else sampling_scores(logits, temperature)
    lsm = log_softmax(scores, -1, spec=SoftmaxSpec(tile=s.vocab_tile), backend=backend)
    return lsm.gather(1, t.reshape(t.shape[0], -1)).reshape(t.shape)


def _head_scores(lm_head_weight, hidden, sampling, matmul_spec, backend) -> torch.Tensor:
    """:func:`sampling_scores` of the logits a lockstep LM head computes for ``hidden``'s rows."""
    with torch.no_grad():
        h = hidden.reshape(-1, hidden.shape[-1])
        return sampling_scores(linear(h, lm_head_weight, spec=matmul_spec, backend=backend), sampling.temperature)


def recorded_logprobs(lm_head_weight, hidden: torch.Tensor, tokens: torch.Tensor, sampling: Sampling, *,
                      spec=None, matmul_spec=None, scores: torch.Tensor | None = None,
                      backend=None, kept: torch.Tensor | None = None,
                      head_logits: torch.Tensor | None = None) -> torch.Tensor:
    """THE recorded log-prob: float32 ``log p(tokens | hidden)`` under ``sampling``, from plain tensors.

    ``lm_head_weight [V, H]`` (or its ``hal.exact_weight``), ``hidden [..., H]`` (the rows the LM head
    saw), ``tokens [...]`` (or ``[..., K]``: K tokens of each row, each value the bits it has asked alone). No
    top-k / top-p: ``hal.token_logprobs(hidden, lm_head_weight, tokens, temperature, spec=spec)``. With them:
    that value renormalised over each row's :func:`kept_set` (``kept``, if the caller has it), decided on
    ``scores`` -- the engine's :func:`sampling_scores` of the logits it sampled from, else
    ``hal.linear(hidden, lm_head_weight, spec=matmul_spec)``'s (the logits a lockstep LM head computes).
    ``spec``: the token_logprobs spec whose dot is ``matmul_spec``'s (hal.integrations.transformers.matmul.logprobs_spec).
    ``head_logits``: the float32 logits of ``hidden``'s rows where the engine's LM head gave them
    (:func:`head_logits_are_the_logprobs_dot`): the values come from them (:func:`logits_logprobs`), the same bits
    without a second pass over the LM head.
    """
    def lp(h, t, temperature):
        if head_logits is not None:  # t: one token per row of h, or K (t.ndim == h.ndim)
            rows = t.reshape(head_logits.shape[0], -1) if t.ndim == h.ndim else t.reshape(-1)
            return logits_logprobs(head_logits, rows, temperature, spec=spec, backend=backend).reshape(t.shape)
        return token_logprobs(h, lm_head_weight, t, temperature, spec=spec, backend=backend)

    if not sampling.filters:
        return lp(hidden, tokens, sampling.temperature)
    if scores is None:
        scores = _head_scores(lm_head_weight, hidden, sampling, matmul_spec, backend)
    return kept_logprobs(None, hidden, tokens, sampling, lp, scores=scores, kept=kept)


def top_logprobs(lm_head_weight, hidden: torch.Tensor, tokens: torch.Tensor, count: int, sampling: Sampling, *,
                 spec=None, matmul_spec=None, scores: torch.Tensor | None = None, backend=None,
                 head_logits: torch.Tensor | None = None):
    """``(recorded [n], top_ids [n, count], top_logprobs [n, count])`` for hidden rows ``[n, H]`` and ``tokens [n]``:
    :func:`recorded_logprobs` of each row's token, and the row's ``count`` most probable tokens with theirs
    (one call of it: the same bits each token has asked alone, so a trainer recomputes them for those ids).

    The order is total and decided on lockstep's numbers only: ``scores`` (as in :func:`recorded_logprobs`: the
    :func:`sampling_scores` the row samples from, with the tokens outside its :func:`kept_set` at -inf), then
    the recorded log-prob, both descending, then the token id ascending. Scores first, so that the alternatives
    are the tokens sampling ranks highest whatever the rounding of the logits (bf16 logits tie often); the
    recorded log-prob orders tokens tied on the score, so the returned values descend. A token outside the kept
    set has probability 0 under ``sampling``: log-prob -inf (top-k / top-p keep fewer than ``count``).
    ``head_logits``: as in :func:`recorded_logprobs`.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = tokens.reshape(-1).to(torch.int64)
    n, vocab = h.shape[0], lm_head_weight.shape[0]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= vocab:
        raise InputError(f"top_logprobs: count must be an int in [0, {vocab}] (the vocabulary), got {count!r}")
    if t.shape[0] != n:
        raise InputError(f"top_logprobs takes one token per hidden row: {tuple(tokens.shape)} for {n} rows")
    if scores is None:
        scores = _head_scores(lm_head_weight, h, sampling, matmul_spec, backend)
    kept = kept_set(scores, sampling.top_k, sampling.top_p) if sampling.filters else None
    ranked = scores if kept is None else scores.masked_fill(~kept, float("-inf"))
    if count == 0 or n == 0:
        lp = recorded_logprobs(lm_head_weight, h, t, sampling, spec=spec, scores=scores, backend=backend, kept=kept,
                               head_logits=head_logits)
        return lp, t.new_empty((n, count)), lp.new_empty((n, count))
    # candidates: every token ranked at or above the count-th score (its ties included), ascending id per row
    cand = ranked >= ranked.topk(count, dim=-1).values[:, -1:]
    per_row = cand.sum(-1)
    width = int(per_row.max())
    rows, ids = cand.nonzero(as_tuple=True)
    cols = torch.arange(ids.numel(), device=t.device) - (per_row.cumsum(0) - per_row)[rows]
    flat = rows * width + cols
    cand_ids = t.reshape(-1, 1).repeat(1, width)  # padding: the row's token (scored, then cut below)
    cand_ids.view(-1).index_copy_(0, flat, ids)
    real = torch.zeros(n * width, dtype=torch.bool, device=t.device).index_fill_(0, flat, True).reshape(n, width)
    scored = real if kept is None else real & kept.gather(1, cand_ids)  # outside the kept set: -inf, not asked
    asked = torch.where(scored, cand_ids, t.reshape(-1, 1))
    lp = recorded_logprobs(lm_head_weight, h, torch.cat([t.reshape(-1, 1), asked], 1), sampling, spec=spec,
                           scores=scores, backend=backend, kept=kept, head_logits=head_logits)
    cand_lp = lp[:, 1:].masked_fill(~scored, float("-inf"))
    cand_score = ranked.gather(1, cand_ids).masked_fill(~real, float("-inf"))
    # the total order by stable sorts, least significant key first: the id (ascending already; padding last),
    # the recorded log-prob, the score (padding: -inf, -inf, last among its ties: never before a real candidate)
    order = torch.arange(width, device=t.device).expand(n, width)
    for key in (cand_lp, cand_score):
        order = order.gather(1, key.gather(1, order).sort(dim=1, descending=True, stable=True).indices)
    order = order[:, :count]
    return lp[:, 0], cand_ids.gather(1, order), cand_lp.gather(1, order)
