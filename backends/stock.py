"""The stock backend: torch's own ops, ignoring the spec's tiling and math.

It is the conformance suite's negative control. It serves every spec so the suite can run it
through the same checks, claims no level, and is never chosen automatically. The suite must
report where it diverges (batch invariance of ``F.linear`` on CPU, golden bits, ...); tests
assert that it does, which proves the checks can fail.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.backend import Backend
from hal.spec import FAST, STRICT


class StockBackend(Backend):
    name = "stock"
    device_types = ("cpu", "cuda", "npu", "xpu", "mps")
    priority = -100
    auto = False
    policies = (STRICT, FAST)
    description = "torch's own ops (negative control; claims no level)"

    def matmul(self, a, b, spec):
        return torch.matmul(a, b)

    def linear(self, x, weight, bias, spec):
        return F.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual, spec):
        h = x if residual is None else x + residual
        y = F.rms_norm(h, (h.shape[-1],), weight.to(h.dtype), eps)
        return y if residual is None else (y, h)

    def softmax(self, x, spec):
        return torch.softmax(x, -1)

    def log_softmax(self, x, spec):
        return torch.log_softmax(x, -1)

    def logsumexp(self, x, spec):
        return torch.logsumexp(x, -1)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        logits = F.linear(hidden.float(), weight.float()) / temperature
        return torch.log_softmax(logits, -1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)

    # --- attention ---

    # --- gated delta rule ---
