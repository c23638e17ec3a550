"""Op families of the conformance suite, by name (what ``--ops`` selects)."""
from __future__ import annotations

import importlib

from ..family import Family

MODULES = {
    "matmul": "hal.conformance.families.matmul",
    "matmul_exact": "hal.conformance.families.matmul_exact",
    "matmul_fast": "hal.conformance.families.matmul_fast",
    "rms_norm": "hal.conformance.families.rms_norm",
    "softmax": "hal.conformance.families.softmax",
    "token_logprobs": "hal.conformance.families.token_logprobs",
    "token_logprobs_exact": "hal.conformance.families.token_logprobs_exact",
    "attention": "hal.conformance.families.attention",
    "attention_fast": "hal.conformance.families.attention_fast",
    "gated_delta_rule": "hal.conformance.families.gated_delta_rule",
    "gdn_layer": "hal.conformance.families.gdn_layer",
    "elementwise": "hal.conformance.families.elementwise",
    "rotary": "hal.conformance.families.rotary",
}


def get(name: str) -> Family:
    if name not in MODULES:
        raise KeyError(f"unknown op family {name!r}; known: {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name]).FAMILY


def names() -> list[str]:
    return list(MODULES)
