"""gated_delta_rule under the fast policy (FastGatedDeltaRuleSpec, tensor cores): L0, L1, L2, L3, A; never L4.

The gated_delta_rule suite's inputs, calls and checks unchanged (conformance/suites/gated_delta_rule.py) with
the fast spec and bf16 / fp16 inputs: each sequence alone, in batched prefixes and reversed among NaN/inf
sequences (L1); seq 0 cut in two at points that are not multiples of the chunk (1, C-1, C+1, ... and random
ones; every point 1..T-1 in the sweep case), cut several times with the two op names alternating, seq 1 decoded
one token per call, prefill beside decode in one mixed batch with states joined and split, the recurrent op on
the whole input, the bare FLA tensor continued at multiples of C (L2); the autograd (training) forward against
the base call and against the token-by-token decode (L3: the forward's bits; the backward is the strict specs'
float32 torch recompute, not a fast kernel, and is not part of the spec's bits). No goldens: the report shows
"-" for L4. On CPU the kernel runs in the Triton interpreter with the deterministic ``tl.dot`` stand-in
(kernels/triton/interpreter_dot.py). Negative control: the stock backend (transformers' Qwen3-Next functions,
whose chunk form restarts its grid at every call) fails L2.

Accuracy (A) against the float64 token-by-token oracle: the strict suite's per-sequence-and-head magnitude
(max |o| over the sequence's tokens, max |S| of its final state) times ``BUDGET`` = 2^-5, plus half an ulp of
the output dtype. Why 2^-5: every product takes bf16 operands (relative rounding 2^-9 per operand), and a value
is the sum of several such products (o: the state read gamma * S0^T qs plus the in-chunk P U; S: gamma S0 plus
Kd^T U) whose terms can be larger than the result they sum to; the measured worst case over the suite's cases
is given in docs/gated_delta_rule.md (3.3x below the budget: 0.0094 of the magnitude).
"""
from __future__ import annotations

import torch

from hal.spec import FastGatedDeltaRuleSpec, get

from ..suite import Case, half_ulp
from .gated_delta_rule import CONFIGS, SUITE as STRICT_SUITE, GatedDeltaRuleSuite, _magnitudes

FAST_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT = get(FastGatedDeltaRuleSpec().id)
BUDGET = 2.0 ** -5


class GatedDeltaRuleFastSuite(GatedDeltaRuleSuite):
    def cases(self):
        out = []
        for name, lens, h, hv, dk, dv, l2, scale, init, sweep in CONFIGS:
            for dt in FAST_DTYPES:
                out.append(Case("gated_delta_rule_fast", name, dt, DEFAULT,
                                (("lens", lens), ("h", h), ("hv", hv), ("dk", dk), ("dv", dv), ("l2", l2),
                                 ("scale", scale), ("init", init), ("sweep", sweep))))
        return out

    def budget(self, case, output, inputs, exact):
        mag = _magnitudes(case, inputs, output, exact)
        return half_ulp(exact, case.dtype if output == "o" else torch.float32) + BUDGET * mag


SUITE = GatedDeltaRuleFastSuite(
    # quick (the interpreter): crosses the 64-row chunk, GVA, NaN in v / q / an initial state, decode token by token
    quick=("nan_gva_h1v2_d16.bf16",),
    name="gated_delta_rule_fast", ops=STRICT_SUITE.ops, levels=("L0", "L1", "L2", "L3", "A"),
    checks=dict(STRICT_SUITE.checks),
)
