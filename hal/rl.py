"""RL mismatch toolkit: measure, attribute and correct sampler/trainer log-prob mismatch.

lockstep removes the *engine's* share of the mismatch between the log-probs a sampler recorded
(``q``) and the ones a trainer recomputes (``p``). What remains -- a stale sampler in asynchronous RL,
a stock engine that cannot be changed, a `fast` policy across two GPU models -- still has to be seen
and handled. These are small pure-torch functions; every formula is in its docstring.

Conventions: log-probs are float tensors of one shape, either ``[B, T]`` (batched, with a ``mask``
of the tokens that count, e.g. response tokens) or packed ``[N]`` with ``cu_seqlens`` (``[S+1]``
offsets, as flash-attn's varlen ops). ``log r_t = log p_t - log q_t`` is the per-token log-ratio of
trainer to sampler, ``r_t`` the importance weight of a token sampled from q when p is the target.
Statistics are computed in float64.

Edge cases (docs/rl.md, "Edge cases"): a token whose two log-probs are equal -- including the same
infinity on both sides -- has log r = 0 exactly (no difference, not NaN); a sequence with no counted
token is not a sequence (it counts in no sequence total or ESS); NaN log-probs make the statistics
that read them NaN.

    m = hal.rl.mismatch_metrics(trainer_logprobs, sampler_logprobs, mask=mask)
    w = hal.rl.truncated_is_weights(trainer_logprobs, sampler_logprobs, cap=2.0)
    d = hal.rl.dlc_decompose(logp_now, logp_at_sampler_weights, sampler_logprobs, mask=mask)
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from . import validate as val
from .errors import InputError

__all__ = ["MismatchMetrics", "mismatch_metrics", "kl_estimators", "effective_sample_size", "ratio_histogram",
           "truncated_is_weights", "masked_is_weights", "score_centered_logprobs", "DLCDecomposition",
           "dlc_decompose", "dlc_token_weights", "sequence_ids", "RatioHistogram"]

F64 = torch.float64


# ------------------------------------------------------------------ layout


def _pair(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None):
    for name, t in (("trainer_logprobs", p), ("sampler_logprobs", q)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InputError(f"{name} must be a floating-point tensor of per-token log-probs, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    if p.shape != q.shape:
        raise InputError(f"trainer_logprobs shape {tuple(p.shape)} != sampler_logprobs shape {tuple(q.shape)}")
    if mask is None:
        mask = torch.ones(p.shape, dtype=torch.bool, device=p.device)
    else:
        mask = val.mask01("mask", mask, p.shape)
    return p, q, mask


def _log_ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """log p - log q in float64; 0 where the two are equal, so the same -inf on both sides (a token
    both engines give probability 0) is no difference rather than inf - inf = NaN."""
    p, q = p.to(F64), q.to(F64)
    return torch.where(p == q, 0.0, p - q)


def _counted_sequences(mask: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    """bool [n]: the sequences with at least one counted token (the others are not sequences)."""
    return _per_sequence_sum(mask.to(F64), seq, n) > 0


def sequence_ids(shape, cu_seqlens: torch.Tensor | None, device=None) -> torch.Tensor:
    """int64 sequence index of every token: row index for ``[B, T]``, from ``cu_seqlens`` for packed ``[N]``."""
    if cu_seqlens is None:
        if len(shape) != 2:
            raise InputError(f"log-probs must be [B, T] (or packed [N] with cu_seqlens), got shape {tuple(shape)}")
        return torch.arange(shape[0], device=device).unsqueeze(1).expand(shape)
    if len(shape) != 1:
        raise InputError(f"with cu_seqlens the log-probs must be packed [N], got shape {tuple(shape)}")
    cu = val.offsets("cu_seqlens", cu_seqlens, shape[0])
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1]).to(device)


def _per_sequence_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seq.reshape(-1), x.reshape(-1))


# ------------------------------------------------------------------ metrics


def kl_estimators(trainer_logprobs, sampler_logprobs, mask=None) -> dict[str, float]:
    """Mean over counted tokens of Schulman's estimators of KL(q || p) from tokens sampled from q.

    With log r = log p - log q: k1 = -log r (unbiased, high variance, can be < 0);
    k2 = (log r)^2 / 2 (biased, low variance); k3 = (r - 1) - log r (unbiased, >= 0).
    No counted token: all 0. Equal log-probs (the same -inf included): log r = 0, adding 0 to each.
    log r = +inf (sampler -inf, trainer finite): k1 = -inf, k2 = k3 = +inf (k3's limit, not inf - inf);
    log r = -inf: k1 = k2 = k3 = +inf.
    """
    p, q, mask = _pair(trainer_logprobs, sampler_logprobs, mask)
    lr = _log_ratio(p, q)[mask]
    if lr.numel() == 0:
        return {"k1": 0.0, "k2": 0.0, "k3": 0.0}
    k3 = torch.where(lr == float("inf"), float("inf"), torch.expm1(lr) - lr)
    return {"k1": float((-lr).mean()), "k2": float((lr * lr / 2).mean()), "k3": float(k3.mean())}


def effective_sample_size(log_weights: torch.Tensor) -> float:
    """Kish's ESS of importance weights w = exp(log_weights): (sum w)^2 / sum w^2, in [1, n].

    Computed from log-weights shifted by their max (exact ratio, no overflow). ESS / n is 1 when
    all weights are equal (on-policy) and falls towards 1/n as one weight dominates.
    Edge cases: no weight (n = 0) or every weight 0 (all log-weights -inf): 0.0 (no sample counts);
    k weights of +inf: k (they dominate every finite one: the limit of the ratio); any NaN: NaN.
    """
    lw = log_weights.to(F64).reshape(-1)
    if bool(lw.isnan().any()):
        return float("nan")
    top = lw.max() if lw.numel() else None
    if top is None or top == float("-inf"):
        return 0.0
    if top == float("inf"):
        return float((lw == top).sum())
    w = torch.exp(lw - top)
    return float(w.sum() ** 2 / (w * w).sum())


@dataclass
class MismatchMetrics:
    """Sampler-vs-trainer mismatch of one batch (see :func:`mismatch_metrics`)."""
    tokens: int
    sequences: int                    # sequences with at least one counted token
    max_abs_log_ratio: float
    mean_abs_log_ratio: float
    share_bits_differ: float          # share of counted tokens whose log-prob bits differ at all
    k1: float
    k2: float
    k3: float
    ess_tokens: float                 # ESS of the token weights r_t, over all counted tokens
    ess_sequences: float              # ESS of the sequence weights prod_t r_t
    ess_per_sequence: list            # per row / segment: ESS of its token weights / its token count; None without any

    def to_dict(self):
        """The fields as Python values (floats may be inf or NaN); :meth:`to_json` for strict JSON."""
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        """Strict JSON (RFC 8259, which has no inf or NaN): a non-finite float is written as the string
        "inf", "-inf" or "nan" (``float()`` reads each back), None as null."""
        return json.dumps(_strict_floats(self.to_dict()), indent=indent, allow_nan=False)

    def table(self) -> str:
        rows = [("tokens", self.tokens), ("sequences", self.sequences),
                ("max |log p - log q|", f"{self.max_abs_log_ratio:.3e}"),
                ("mean |log p - log q|", f"{self.mean_abs_log_ratio:.3e}"),
                ("tokens whose bits differ", f"{100 * self.share_bits_differ:.1f} %"),
                ("KL k1 / k2 / k3", f"{self.k1:.3e} / {self.k2:.3e} / {self.k3:.3e}"),
                ("ESS tokens", f"{self.ess_tokens:.2f} of {self.tokens}"),
                ("ESS sequences", f"{self.ess_sequences:.2f} of {self.sequences}")]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _strict_floats(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _strict_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict_floats(v) for v in x]
    return x


def mismatch_metrics(trainer_logprobs, sampler_logprobs, mask=None, cu_seqlens=None) -> MismatchMetrics:
    """Log-ratio statistics, KL estimators and effective sample sizes of one batch.

    ``share_bits_differ`` compares raw bit patterns (so 0.0 means the two engines agree bit for bit
    on every counted token, which lockstep makes possible). Sequence weight: exp(sum_t log r_t)
    over the sequence's counted tokens; per-sequence ESS is normalised by the sequence's token count.
    A row (or ``cu_seqlens`` segment) without a counted token is not a sequence: it is not in
    ``sequences`` nor in ``ess_sequences``, and its ``ess_per_sequence`` entry is None.
    """
    p, q, mask = _pair(trainer_logprobs, sampler_logprobs, mask)
    seq = sequence_ids(p.shape, cu_seqlens, p.device)
    n_seq = (int(seq.max()) + 1 if seq.numel() else 0) if cu_seqlens is None else int(cu_seqlens.numel()) - 1
    counted = _counted_sequences(mask, seq, n_seq)
    lr = _log_ratio(p, q)
    lr_m = lr[mask]
    same_dtype = p.dtype == q.dtype
    if same_dtype:
        from .conformance.bits import raw_bits
        differ = (raw_bits(p) != raw_bits(q)).to(p.device)[mask]
    else:
        differ = torch.ones_like(lr_m, dtype=torch.bool)
    kl = kl_estimators(p, q, mask)
    seq_lr = _per_sequence_sum(torch.where(mask, lr, 0.0), seq, n_seq)
    per_seq = []
    for s in range(n_seq):
        sel = mask & (seq == s)
        cnt = int(sel.sum())
        per_seq.append(effective_sample_size(lr[sel]) / cnt if cnt else None)
    return MismatchMetrics(
        tokens=int(mask.sum()), sequences=int(counted.sum()),
        max_abs_log_ratio=float(lr_m.abs().max()) if lr_m.numel() else 0.0,
        mean_abs_log_ratio=float(lr_m.abs().mean()) if lr_m.numel() else 0.0,
        share_bits_differ=float(differ.to(F64).mean()) if differ.numel() else 0.0,
        k1=kl["k1"], k2=kl["k2"], k3=kl["k3"],
        ess_tokens=effective_sample_size(lr_m), ess_sequences=effective_sample_size(seq_lr[counted]),
        ess_per_sequence=per_seq)


class RatioHistogram(NamedTuple):
    edges: torch.Tensor     # float64 [K + 1]
    counts: torch.Tensor    # int64 [K]: finite ratios in [e_i, e_{i+1})
    nonfinite: int          # ratios that are NaN or +inf (sampler -inf vs trainer finite, or exp overflow)


def ratio_histogram(trainer_logprobs, sampler_logprobs, mask=None, edges=None) -> RatioHistogram:
    """Counts of the probability ratio r_t = exp(log p - log q) over counted tokens, in ``edges`` bins.

    Default edges are symmetric in log space around 1 (1 +- 1e-6 ... 1 +- 0.5, plus 0 and inf), so an
    exact match (r = 1) lands in the central bin [1 - 1e-6, 1 + 1e-6). Equal log-probs (the same -inf
    included) are r = 1. A ratio that is NaN or +inf is in no bin but counted in ``nonfinite``; a
    finite ratio below the first edge counts in the first bin, one at or above the last edge in the
    last. ``counts.sum() + nonfinite`` is the number of counted tokens.
    """
    p, q, mask = _pair(trainer_logprobs, sampler_logprobs, mask)
    if edges is None:
        d = torch.tensor([1e-6, 1e-4, 1e-2, 0.1, 0.5], dtype=F64)
        edges = torch.cat([torch.tensor([0.0], dtype=F64), (1 - d).flip(0), 1 + d, torch.tensor([float("inf")], dtype=F64)])
    edges = torch.as_tensor(edges, dtype=F64)
    r = torch.exp(_log_ratio(p, q))[mask].cpu()
    finite = torch.isfinite(r)
    idx = (torch.bucketize(r[finite], edges, right=True) - 1).clamp(0, edges.numel() - 2)
    return RatioHistogram(edges, torch.bincount(idx, minlength=edges.numel() - 1), int((~finite).sum()))


# ------------------------------------------------------------------ corrections (loss side)


def truncated_is_weights(trainer_logprobs, sampler_logprobs, cap: float = 2.0, mask=None) -> torch.Tensor:
    """Truncated importance sampling (TIS): w_t = min(exp(log p_t - log q_t), C), detached.

    Multiply the per-token policy-gradient loss by w_t (``loss = -(w * A * logp).sum()``): the
    sampler's tokens are reweighted towards the trainer's distribution, and the cap C bounds the
    variance a rare token with a large ratio would add. Masked tokens get weight 0. ``cap``: a
    number > 0 (``inf``: no cap).
    """
    cap = val.real("cap", cap, allow_inf=True)
    if not cap > 0:
        raise InputError(f"cap must be > 0, got {cap!r}")
    p, q, mask = _pair(trainer_logprobs, sampler_logprobs, mask)
    w = torch.exp(_log_ratio(p.detach(), q.detach())).clamp_max(cap)
    return torch.where(mask, w, 0.0).to(p.dtype)


def masked_is_weights(trainer_logprobs, sampler_logprobs, low: float = 0.5, high: float = 2.0, level: str = "token",
                      mask=None, cu_seqlens=None) -> torch.Tensor:
    """Masked importance sampling / trust-region masking: keep the ratio where it is trusted, else drop.

    token level:    w_t = r_t if low <= r_t <= high else 0
    sequence level: w_t = r_t for every token of a sequence whose geometric-mean ratio
                    exp(mean_t log r_t) lies in [low, high], else 0 for the whole sequence
                    (a sequence the sampler generated far off the trainer's policy is dropped whole).
    Detached; masked tokens get 0.
    """
    low, high = val.real("low", low), val.real("high", high, allow_inf=True)
    if not 0 < low <= 1 <= high:
        raise InputError(f"need 0 < low <= 1 <= high, got low={low!r}, high={high!r}")
    if level not in ("token", "sequence"):
        raise InputError(f"level must be 'token' or 'sequence', got {level!r}")
    p, q, mask = _pair(trainer_logprobs, sampler_logprobs, mask)
    lr = _log_ratio(p.detach(), q.detach())
    r = torch.exp(lr)
    if level == "token":
        keep = (r >= low) & (r <= high)
    else:
        seq = sequence_ids(p.shape, cu_seqlens, p.device)
        n = int(seq.max()) + 1 if seq.numel() else 0
        cnt = _per_sequence_sum(mask.to(F64), seq, n).clamp_min(1)
        gmean = torch.exp(_per_sequence_sum(torch.where(mask, lr, 0.0), seq, n) / cnt)
        keep = ((gmean >= low) & (gmean <= high))[seq]
    return torch.where(mask & keep, r, 0.0).to(p.dtype)


def score_centered_logprobs(token_logprobs: torch.Tensor, candidate_logprobs: torch.Tensor,
                            candidate_sampler_probs: torch.Tensor) -> torch.Tensor:
    """Score centering: a surrogate whose gradient is s(y_t) - E_{v~q}[s(v)], s = grad log p.

    ``token_logprobs`` [...]: the trainer's log p(y_t); ``candidate_logprobs`` [..., K]: the trainer's
    log p(v) for the sampler's top-K candidates v (differentiable); ``candidate_sampler_probs``
    [..., K]: the sampler's q(v) for them (renormalised over the K here). Returns
    log p(y_t) - sum_v stopgrad(q(v)) log p(v): a constant bias that two engines accumulate in
    one direction is subtracted from every token's score.
    """
    if candidate_logprobs.shape != candidate_sampler_probs.shape or candidate_logprobs.shape[:-1] != token_logprobs.shape:
        raise InputError(f"candidate_logprobs {tuple(candidate_logprobs.shape)} and candidate_sampler_probs "
                         f"{tuple(candidate_sampler_probs.shape)} must both be token_logprobs.shape + (K,) = "
                         f"{tuple(token_logprobs.shape)} + (K,)")
    qv = candidate_sampler_probs.detach().to(F64)
    total = qv.sum(-1, keepdim=True)
    if bool((total <= 0).any()):
        raise InputError("candidate_sampler_probs must have a positive sum over the K candidates of every token")
    qv = (qv / total).to(candidate_logprobs.dtype)
    return token_logprobs - (qv * candidate_logprobs).sum(-1)


# ------------------------------------------------------------------ DLC


@dataclass
class DLCDecomposition:
    """delta_t = log p_theta - log q split into policy lag and engine mismatch (see :func:`dlc_decompose`)."""
    lag: torch.Tensor                 # l_t = log p_theta - log p_theta_old
    mismatch: torch.Tensor            # e_t = log p_theta_old - log q
    mismatch_centered: torch.Tensor   # e_t - mean of e over counted tokens
    mismatch_mean: float
    max_abs_mismatch: float
    max_abs_lag: float
    ess_lag_sequences: float          # ESS of the sequences' lag weights exp(sum_t l_t)
    sequences: int                    # sequences with at least one counted token
    resync: bool                      # ESS < half the batch: copy the trainer's weights to the sampler


def dlc_decompose(trainer_logprobs, trainer_logprobs_at_sampler_weights, sampler_logprobs, mask=None,
                  cu_seqlens=None, resync_threshold: float = 0.5) -> DLCDecomposition:
    """Discrepancy-lag decomposition of the sampler/trainer error (DLC).

    The trainer is evaluated twice on the sampled tokens: at its current weights theta (log p_theta) and
    at the weights the sampler used, theta_old (log p_theta_old). Then, exactly,
        delta_t = log p_theta - log q = l_t + e_t,   l_t = log p_theta - log p_theta_old  (policy lag),
                                                     e_t = log p_theta_old - log q       (engine mismatch).
    With lockstep on both sides e_t is exactly 0 on every token. The mismatch is reported centred (its
    first-order bias removed); the lag is what importance weights correct (:func:`dlc_token_weights`).
    ``resync`` is True when the ESS of the sequences' lag weights falls under ``resync_threshold`` of
    the batch: the signal to copy the trainer's weights to the sampler. A row (or segment) without a
    counted token is not a sequence (not in ``sequences``, the ESS or the resync test).
    """
    resync_threshold = val.real("resync_threshold", resync_threshold)
    p, p_old, mask = _pair(trainer_logprobs, trainer_logprobs_at_sampler_weights, mask)
    _, q, _ = _pair(p_old, sampler_logprobs, mask)
    seq = sequence_ids(p.shape, cu_seqlens, p.device)
    n = (int(seq.max()) + 1 if seq.numel() else 0) if cu_seqlens is None else int(cu_seqlens.numel()) - 1
    counted = _counted_sequences(mask, seq, n)
    lag = torch.where(mask, _log_ratio(p, p_old), 0.0)
    mis = torch.where(mask, _log_ratio(p_old, q), 0.0)
    cnt = max(int(mask.sum()), 1)
    mean = float(mis.sum() / cnt)
    ess = effective_sample_size(_per_sequence_sum(lag, seq, n)[counted])
    n = int(counted.sum())
    return DLCDecomposition(lag=lag, mismatch=mis, mismatch_centered=torch.where(mask, mis - mean, 0.0),
                            mismatch_mean=mean, max_abs_mismatch=float(mis.abs().max()) if mis.numel() else 0.0,
                            max_abs_lag=float(lag.abs().max()) if lag.numel() else 0.0, ess_lag_sequences=ess,
                            sequences=n, resync=ess < resync_threshold * n)


def dlc_token_weights(lag: torch.Tensor, advantages: torch.Tensor, eps: float = 0.2, dual_clip: float = 3.0,
                      mask=None) -> torch.Tensor:
    """m_t * rho_t: PPO-style clipping of the lag ratio rho_t = exp(l_t), relative to the sampler's weights.

    m_t = 0 where the ratio has left the trust region in the direction the advantage pushes
    (A_t > 0 and rho_t > 1 + eps, or A_t < 0 and rho_t < 1 - eps), else 1; for A_t < 0 the ratio is
    also capped at ``dual_clip`` (dual-clip PPO). ``advantages`` broadcast to ``lag``. Detached.
    """
    eps, dual_clip = val.real("eps", eps), val.real("dual_clip", dual_clip, allow_inf=True)
    if not (eps > 0 and dual_clip > 1):
        raise InputError(f"need eps > 0 and dual_clip > 1, got eps={eps!r}, dual_clip={dual_clip!r}")
    lag = lag.detach().to(F64)
    adv = torch.as_tensor(advantages, dtype=F64, device=lag.device).expand_as(lag)
    rho = torch.exp(lag)
    out_of_region = ((adv > 0) & (rho > 1 + eps)) | ((adv < 0) & (rho < 1 - eps))
    rho = torch.where(adv < 0, rho.clamp_max(dual_clip), rho)
    w = torch.where(out_of_region, 0.0, rho)
    if mask is not None:
        w = torch.where(mask.to(torch.bool), w, 0.0)
    return w
