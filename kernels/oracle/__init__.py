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


def logsumexp(x):
    x = x.to(F64)
    out = torch.logsumexp(x, -1)
    return torch.where(_empty_rows(x).squeeze(-1), float("-inf"), out)


def log_softmax(x):
    x = x.to(F64)
    return torch.where(_empty_rows(x), float("-inf"), torch.log_softmax(x, -1))


def softmax(x):
    x = x.to(F64)
    return torch.where(_empty_rows(x), 0.0, torch.softmax(x, -1))


def token_logprobs(hidden, weight, tokens, temperature=1.0):
    logits = hidden.to(F64) @ weight.to(F64).transpose(0, 1) / temperature
    return log_softmax(logits).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
