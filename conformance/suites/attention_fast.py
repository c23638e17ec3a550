"""attention under the fast policy (FastAttentionSpec, tensor cores): L0, L1, L2, L3, A; never L4.

The attention suite's inputs, calls and checks unchanged -- sequences alone / reordered / among NaN
neighbours (L1); chunked prefill at and around block and split boundaries, token-by-token decode,
mixed batches, paged vs contiguous, num_splits 1..8, prefix reuse (L2); the autograd forward (L3) --
with fast specs and bf16/fp16 only. L2 holds because the fast spec keeps the strict structure: key
blocks and splits anchored at key 0, split partials merged in split order, a block a row cannot see
skipped exactly. The decode-tile spec (FAST_ATTENTION_DECODE, 16-row tiles) has its own case: its bits may
differ from the default's, so its L2 rows compare it with its own prefill. No goldens: the report shows "-" for L4. On CPU the kernels run in the Triton
interpreter with the deterministic ``tl.dot`` stand-in (kernels/triton/interpreter_dot.py).
"""
from __future__ import annotations

import dataclasses

import torch

from hal.spec import FAST_ATTENTION_DECODE, AttentionSpec, FastAttentionSpec, get

from ..suite import Case
from .attention import CONFIGS, SUITE as STRICT_SUITE, AttentionSuite

FAST_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT = get(FastAttentionSpec().id)
SMALL = get(FastAttentionSpec(block_m=16, kv_block=16, kv_split=64, num_warps=4).id)  # many blocks and splits

# cases of the fast suite alone (the strict CONFIGS' layout): the decode-tile spec on a GQA group of 4 (its decode
# tiles pack the 4 query heads into the 16 rows) with 530 keys in seq 0, so its chunks, decode steps (506-519) and
# num_splits cross the 512-key split; head dim 32 keeps its 16-row prefill cheap in the interpreter
FAST_CONFIGS = [
    ("decode_tile_gqa_h4kv1_d32", FAST_ATTENTION_DECODE, (530, 12, 40, 10), 4, 1, 32, True, (-1, -1), None),
]


class AttentionFastSuite(AttentionSuite):
    def cases(self):
        out = []
        for name, spec, lens, hq, hkv, d, causal, window, scale in CONFIGS + FAST_CONFIGS:
            if isinstance(spec, AttentionSpec) and spec.p_precision != "fp32":
                continue  # P is always rounded to the input dtype for the tensor-core P.V under fast
            if not isinstance(spec, FastAttentionSpec):  # a strict case: the default fast spec, or the small one
                spec = DEFAULT if spec is None else SMALL
            params = (("lens", lens), ("hq", hq), ("hkv", hkv), ("d", d), ("causal", causal), ("window", window),
                      ("scale", scale))
            out += [Case("attention_fast", name, dt, spec, params) for dt in FAST_DTYPES]
        return out

    def budget(self, case, output, x, exact):
        # The strict bound of the same structure with P rounded to the input dtype and one dot chain over
        # the (padded) head dim, four times over: the matrix unit's in-instruction sums, the vendor exp.
        spec = case.spec
        d_pad = max(16, 1 << (case.p["d"] - 1).bit_length())
        shadow = AttentionSpec(kv_block=spec.kv_block, kv_split=spec.kv_split, dot_tile=d_pad, p_precision="input")
        return 4 * super().budget(dataclasses.replace(case, spec=shadow), output, x, exact)


SUITE = AttentionFastSuite(
    # quick (the interpreter): 90 keys cross the small spec's 16-key blocks and 64-key split, NaN inputs; the small
    # spec again on GQA with a head dim padded 72 -> 128, non-causal (its CONFIGS entry is SMALL: no quick case runs
    # the default spec); the decode-tile spec (530 keys, 4 packed heads) against its own prefill
    quick=("nan_gqa_h2kv1_d32.bf16", "gqa_h4kv2_d72_noncausal.fp16", "decode_tile_gqa_h4kv1_d32.bf16"),
    name="attention_fast", ops=STRICT_SUITE.ops, levels=("L0", "L1", "L2", "L3", "A"),
    checks={k: v for k, v in STRICT_SUITE.checks.items()},
)
