"""token_logprobs with exact LM-head logits (TokenLogprobsSpec(matmul=ExactMatmulSpec)): L0-L4, A.

The token_logprobs suite's shapes and inputs under the exact spec, plus one case with massive
activations, and L2 = order freedom of the logits' dot, observable through the public op: the
same bits when the hidden axis (H, the dot's K) is permuted at random and when it is padded with
zeros to a random tile, as a tiled or split kernel reorders or pads it. The stock backend and the
strict k64 chain are both caught by the permutation. Kept in its own suite (and golden folder)
so the goldens of the strict token_logprobs specs stay untouched.
"""
from __future__ import annotations

import torch

from hal.spec import ExactMatmulSpec, TokenLogprobsSpec, get

from .. import inputs as gen
from ..suite import DTYPES, Case, autograd_check, rowwise_checks
from .token_logprobs import EPS32, K_TOKENS, SHAPES, TokenLogprobsSuite, run_token_logprobs, hostile_neighbours

SPEC = get(TokenLogprobsSpec(matmul=ExactMatmulSpec(slices=4)).id)  # the registered one
OUTLIERS = (6, 256, 700, 1.0)  # six hidden channels 1000x larger (LLM residual streams)


class TokenLogprobsExactSuite(TokenLogprobsSuite):
    def cases(self):
        return [Case(self.name, f"n{n}_h{h}_v{v}_t{t}" + ("_outliers" if (n, h, v, t) == OUTLIERS else ""), dt,
                     SPEC, (("n", n), ("h", h), ("v", v), ("temperature", t)))
                for n, h, v, t in SHAPES + [OUTLIERS] for dt in DTYPES]

    def make_inputs(self, case):
        x = super().make_inputs(case)
        if case.name.endswith("outliers"):
            ch = gen.randint(case.key("channels"), (6,), case.p["h"]).long()
            x["hidden"][:, ch] = (x["hidden"][:, ch].float() * 1000.0).to(case.dtype)
        return x

    def budget(self, case, output, x, exact):
        # logits: slicing truncates each value by less than its row's unit 2**(E - 7s + 1) (as in
        # the matmul_exact suite), then one rounding to float32 and the division by T; then the
        # log-softmax's roundings as in the token_logprobs suite.
        from hal.kernels.exact.core import row_exponents
        s, temp = case.spec.matmul.slices, case.p["temperature"]
        h, w = x["hidden"].double(), x["weight"].double()
        uh = torch.exp2((row_exponents(x["hidden"]) - 7 * s + 1).double()).unsqueeze(1)
        uw = torch.exp2((row_exponents(x["weight"]) - 7 * s + 1).double()).unsqueeze(0)
        dot = uh * w.abs().sum(1).unsqueeze(0) + h.abs().sum(1, keepdim=True) * uw + h.shape[1] * uh * uw
        mag = h.abs() @ w.abs().t()
        logits_err = ((dot + 2 * EPS32 * (mag + dot)) / temp).amax(-1)
        tv, v = case.spec.vocab_tile, case.p["v"]
        return 2 * logits_err + (tv + -(-v // tv) + 6) * EPS32 * (1 + exact.abs())


def _h_permuted(backend, case, inputs, base):
    h = inputs["hidden"].shape[1]
    for seed in (1, 2):
        perm = torch.randperm(h, generator=torch.Generator().manual_seed(seed)).to(inputs["hidden"].device)
        got = run_token_logprobs(backend, case, dict(inputs, hidden=inputs["hidden"][:, perm],
                                                     weight=inputs["weight"][:, perm]))
        yield f"hidden-permutation-{seed}:logprobs", base["logprobs"], got["logprobs"]


def _h_zero_padded(backend, case, inputs, base):
    h = inputs["hidden"].shape[1]
    tile = int(torch.randint(2, 97, (1,), generator=torch.Generator().manual_seed(h)))
    pad = -h % tile or tile
    hid, w = inputs["hidden"], inputs["weight"]
    got = run_token_logprobs(backend, case, dict(inputs, hidden=torch.cat([hid, hid.new_zeros(hid.shape[0], pad)], 1),
                                    weight=torch.cat([w, w.new_zeros(w.shape[0], pad)], 1)))
    yield f"hidden-zero-padded-to-tile-{tile}:logprobs", base["logprobs"], got["logprobs"]


SUITE = TokenLogprobsExactSuite(
    # quick: H = 70 with NaN/inf rows (bf16), T = 0.7 (fp16), massive activations (fp32)
    quick=("n4_h70_v300_t1.0.bf16", "n5_h96_v515_t0.7.fp16", "n6_h256_v700_t1.0_outliers.fp32"),
    name="token_logprobs_exact", ops=("token_logprobs",), levels=("L0", "L1", "L2", "L3", "L4", "A"),
    checks={"L1": rowwise_checks(run_token_logprobs, ("hidden", "tokens"), hostile=hostile_neighbours) + K_TOKENS,
            "L2": [("hidden-permutation", _h_permuted), ("hidden-zero-padding", _h_zero_padded)],
            "L3": autograd_check(run_token_logprobs, ("hidden", "weight"))},
)
