"""float64 oracles: the mathematical value of each op, for the accuracy level A.

Order of operations does not matter here (float64 error is far below any float32 budget), so
these use ordinary torch float64 operations. They also serve float64 calls (gradcheck).
"""
from __future__ import annotations

import torch

F64 = torch.float64


def matmul(a, b):
    return a.to(F64) @ b.to(F64)


def linear(x, weight, bias=None):
    y = x.to(F64) @ weight.to(F64).transpose(0, 1)
    return y if bias is None else y + bias.to(F64)


def rms_norm(x, weight, eps, residual=None):
    h = x if residual is None else (x.to(F64) + residual.to(F64)).to(x.dtype)
    h64 = h.to(F64)
    y = h64 / torch.sqrt((h64 * h64).mean(-1, keepdim=True) + eps) * weight.to(F64)
    return y if residual is None else (y, h)


def _empty_rows(x):
    return (x == float("-inf")).all(-1, keepdim=True)


def _poisoned_rows(x):
    """Rows with a NaN or +inf: the softmax spec defines all their outputs as NaN."""
    return (torch.isnan(x) | (x == float("inf"))).any(-1, keepdim=True)


def _finish(x, out, empty_value, keepdim=True):
    empty, bad = _empty_rows(x), _poisoned_rows(x)
    if not keepdim:
        empty, bad = empty.squeeze(-1), bad.squeeze(-1)
    return torch.where(bad, float("nan"), torch.where(empty, empty_value, out))


def logsumexp(x):
    x = x.to(F64)
    return _finish(x, torch.logsumexp(x, -1), float("-inf"), keepdim=False)


def log_softmax(x):
    x = x.to(F64)
    return _finish(x, torch.log_softmax(x, -1), float("-inf"))


def softmax(x):
    x = x.to(F64)
    return _finish(x, torch.softmax(x, -1), 0.0)


def token_logprobs(hidden, weight, tokens, temperature=1.0):
    logits = hidden.to(F64) @ weight.to(F64).transpose(0, 1) / temperature
    if tokens.ndim == hidden.ndim:  # [N, K]: K tokens of each row
        return log_softmax(logits).gather(-1, tokens.long())
    return log_softmax(logits).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
