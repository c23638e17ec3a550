"""An engine-level custom logits processor (vLLM's ``LLM(logits_processors=["ban_token_processor:BanToken"])``) that
bans token 3 in every row: stock vLLM applies it; lockstep's plugin refuses it by name at engine start."""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

BANNED = 3


class BanToken(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, BANNED] = float("-inf")
        return logits

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass


FORCED = 5


class ForceToken(BanToken):
    """Every row's logits -inf but token FORCED's: under stock vLLM each greedy token is FORCED, a sign no run can
    show by chance that the processor ran (tests/vllm_engine installs it through vLLM's entry points)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        forced = logits[:, FORCED].clone()
        logits.fill_(float("-inf"))
        logits[:, FORCED] = forced
        return logits
