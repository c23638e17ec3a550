"""The conformance suites, by name (what ``hal conformance run --ops`` selects); one module each."""
from __future__ import annotations

import importlib

from hal.backend import OUTSIDE_SUITES

from ..suite import Suite

MODULES = {
    "matmul": "hal.conformance.suites.matmul",
    "matmul_exact": "hal.conformance.suites.matmul_exact",
    "matmul_fast": "hal.conformance.suites.matmul_fast",
    "rms_norm": "hal.conformance.suites.rms_norm",
    "softmax": "hal.conformance.suites.softmax",
    "token_logprobs": "hal.conformance.suites.token_logprobs",
    "token_logprobs_exact": "hal.conformance.suites.token_logprobs_exact",
    "token_logprobs_fast": "hal.conformance.suites.token_logprobs_fast",
    "attention": "hal.conformance.suites.attention",
    "attention_fast": "hal.conformance.suites.attention_fast",
    "gated_delta_rule": "hal.conformance.suites.gated_delta_rule",
    "gated_delta_rule_fast": "hal.conformance.suites.gated_delta_rule_fast",
    "gdn_layer": "hal.conformance.suites.gdn_layer",
    "elementwise": "hal.conformance.suites.elementwise",
    "rotary": "hal.conformance.suites.rotary",
}


def get(name: str) -> Suite:
    if name in OUTSIDE_SUITES:
        return OUTSIDE_SUITES[name]
    if name not in MODULES:
        raise KeyError(f"unknown conformance suite {name!r}; known: {', '.join(names())}")
    return importlib.import_module(MODULES[name]).SUITE


def names() -> list[str]:
    """Lockstep's suites, then those of ops registered from outside (their records' ``conformance``)."""
    return list(MODULES) + [n for n in OUTSIDE_SUITES if n not in MODULES]
