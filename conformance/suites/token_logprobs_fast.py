"""token_logprobs with fast LM-head logits (TokenLogprobsSpec(matmul=FastMatmulSpec / FastMatmulV3Spec)): L0, L1, L3,
A; never L4.

The logits are the fast matmul's tensor-core dot (bf16 / fp16 inputs, its float32 accumulator kept as the logit), the
log-softmax is the strict one. Fast bits belong to one GPU model and one Triton version, as in the matmul_fast suite:
no goldens, no L4 (the report shows "-"). L1 is the token_logprobs suite's (a row's log-prob must not depend on the
other rows, their number, padding or hostile neighbours; K tokens per row == each asked alone): what a launch chosen
from the batch breaks. No L2: the fast dot has a fixed K order (the exact suite's permutation freedom does not hold).
On CPU the kernels run in the Triton interpreter with the deterministic ``tl.dot`` stand-in of
kernels/triton/interpreter_dot.py: the checks test the kernels' structure, a GPU their arithmetic.
"""
from __future__ import annotations

from hal.spec import POLICY_SPECS, FAST, FastMatmulSpec, FastMatmulV3Spec, TokenLogprobsSpec

from ..suite import Case, autograd_check, rowwise_checks
from .matmul_fast import FAST_DTYPES
from .token_logprobs import EPS32, K_TOKENS, SHAPES, TokenLogprobsSuite, hostile_neighbours, run_token_logprobs

#: (case-name suffix, spec): the fast switch's spec (matmul.fast 128x128x64), the small-tile matmul's (K tiles of 32:
#: H = 70 / 96 cross them) and v3's (its launch follows the rows: L1's subsets run other launches than the batch)
SPECS = (("", POLICY_SPECS[FAST]["token_logprobs"]),
         ("_small", TokenLogprobsSpec(matmul=FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4,
                                                            num_stages=2))),
         ("_v3", TokenLogprobsSpec(matmul=FastMatmulV3Spec())))


class TokenLogprobsFastSuite(TokenLogprobsSuite):
    def cases(self):
        return [Case(self.name, f"n{n}_h{h}_v{v}_t{t}{tag}", dt, spec,
                     (("n", n), ("h", h), ("v", v), ("temperature", t)))
                for tag, spec in SPECS for n, h, v, t in SHAPES for dt in FAST_DTYPES]

    def budget(self, case, output, x, exact):
        # logits: float32 accumulation of exact bf16/fp16 products in whatever order the matrix unit uses inside a
        # K tile (matmul_fast's gamma_K bound on sum |h||w|, twice), no output rounding, then the division by T;
        # then the log-softmax's roundings as in the token_logprobs suite.
        h, v, temp = case.p["h"], case.p["v"], case.p["temperature"]
        mag = (x["hidden"].double().abs() @ x["weight"].double().abs().t()).amax(-1) / temp
        logits_err = (2 * (h + 2) + 1) * EPS32 * mag
        tv = case.spec.vocab_tile
        return 2 * logits_err + (tv + -(-v // tv) + 6) * EPS32 * (1 + exact.abs())


SUITE = TokenLogprobsFastSuite(
    # quick (the interpreter, ~30 s): the switch's spec with NaN/inf rows (n4_h70_v300), the small spec across K tiles
    # of 32 at T = 0.7 (fp16), v3; V = 300 / 515 cross the vocab tile
    quick=("n4_h70_v300_t1.0.bf16", "n5_h96_v515_t0.7_small.fp16", "n4_h70_v300_t1.0_v3.bf16"),
    name="token_logprobs_fast", ops=("token_logprobs",), levels=("L0", "L1", "L3", "A"),
    checks={"L1": rowwise_checks(run_token_logprobs, ("hidden", "tokens"), hostile=hostile_neighbours) + K_TOKENS,
            "L3": autograd_check(run_token_logprobs, ("hidden", "weight"))},
)
