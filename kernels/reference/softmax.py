"""softmax / log_softmax / logsumexp and token log-probs (strict), tiled along the reduced axis."""
from __future__ import annotations

import torch

from hal.spec import SoftmaxSpec, TokenLogprobsSpec
from .reduce import tiled_dot, tiled_sum
from .strict_math import F32, exp, log


def _row_stats(x32: torch.Tensor, t: int):
    """(M, S, shifted) of rows of x32 [..., n]: M = row max, S = canonical sum of exp(x - M).

    A row that is all -inf uses M = 0 for the shift (so exp gives exact zeros, S = 0, log S = -inf)
    and is fixed up by the callers. A NaN or +inf anywhere in a row sets M = NaN, so every output
    of that row is NaN (one rule for every backend, instead of whatever inf - inf does where).
    """
    m = torch.amax(x32, dim=-1, keepdim=True)  # max is exact and order-free
    poisoned = (torch.isnan(x32) | (x32 == float("inf"))).any(dim=-1, keepdim=True)
    m = torch.where(poisoned, float("nan"), m)
    empty = m == float("-inf")
    m_safe = torch.where(empty, 0.0, m)
    shifted = x32 - m_safe
    s = tiled_sum(exp(shifted), t)
    return m_safe.squeeze(-1), s, shifted, empty.squeeze(-1)


def logsumexp(x: torch.Tensor, spec: SoftmaxSpec) -> torch.Tensor:
    m, s, _, empty = _row_stats(x.to(F32), spec.tile)
    out = torch.where(empty, float("-inf"), m + log(s))
    return out.to(x.dtype)


def log_softmax(x: torch.Tensor, spec: SoftmaxSpec) -> torch.Tensor:
    _, s, shifted, empty = _row_stats(x.to(F32), spec.tile)
    out = shifted - log(s).unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), float("-inf"), out)
    return out.to(x.dtype)


def softmax(x: torch.Tensor, spec: SoftmaxSpec) -> torch.Tensor:
    _, s, shifted, empty = _row_stats(x.to(F32), spec.tile)
    out = exp(shifted) / s.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    return out.to(x.dtype)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, spec: TokenLogprobsSpec):
    """float32 logits [N, V] = hidden [N, H] . weight [V, H], divided by the temperature.

    The dot is the strict tiled fma chain, or (``spec.matmul``) the exact policy's order-free dot
    rounded once to float32."""
    if spec.matmul is not None:
        from . import exact_matmul
        logits = exact_matmul.linear(hidden, weight, None, spec.matmul, out_dtype=F32)
    else:
        logits = tiled_dot(hidden.to(F32).unsqueeze(-2), weight.to(F32), spec.hidden_tile)
    if temperature != 1.0:
        logits = logits / torch.tensor(temperature, dtype=F32)
    return logits


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   spec: TokenLogprobsSpec) -> torch.Tensor:
    """float32 log p(tokens[n] | hidden[n]) for hidden [N, H], weight [V, H], tokens [N] int."""
    logits = lm_logits(hidden, weight, temperature, spec)
    _, s, shifted, empty = _row_stats(logits, spec.vocab_tile)
    if tokens.ndim == hidden.ndim:  # [N, K]: K tokens of each row's one log-softmax
        out = shifted.gather(-1, tokens.long()) - log(s).unsqueeze(-1)
        return torch.where(empty.unsqueeze(-1), float("-inf"), out)
    picked = shifted.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    out = picked - log(s)
    return torch.where(empty, float("-inf"), out)
