"""matmul / linear under the fast policy (FastMatmulSpec, tensor cores): L0, L1, L3, A; never L4.

Fast bits belong to one GPU model and one Triton version, so there are no goldens and L4 does not
apply (the report shows "-"). L1 is the matmul suite's: a row's bits must not depend on the other
rows (subsets, padding with hostile rows, hostile neighbours) nor on the other columns of B -- the
properties a tile size or split-K chosen from the batch breaks. Matmul has no split of its own, so
no L2. On CPU the kernels run in the Triton interpreter with the deterministic ``tl.dot`` stand-in
of kernels/triton/interpreter_dot.py: the checks test the kernel's structure, a GPU its arithmetic.
"""
from __future__ import annotations

import torch

from hal.spec import FastMatmulSpec, FastMatmulV3Spec, get

from ..suite import Case, autograd_check, half_ulp, rowwise_checks
from .matmul import NAN_SHAPE, EPS32, MatmulSuite, run_matmul, column_subset

FAST_DTYPES = (torch.bfloat16, torch.float16)  # float32 is refused under fast (no silent tf32)
# the default (128x128x64, H100/H200) and a small-tile spec that crosses many tiles at small sizes
# and v3, whose launch follows M from its table: L1's subsets run rows alone (decode entry) against batches of up to
# 130 rows (the 65-256 entry), the very freedom v3 claims (the interpreter follows v3's rule; the GPU answers it)
SPECS = (get(FastMatmulSpec().id), get(FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4,
                                                       num_stages=2).id), get(FastMatmulV3Spec().id))
# (M, K, N): decode row; K not a multiple of any block_k; M past one 64-row tile and past 128; NaN/inf; K = 4097
SHAPES = [(1, 7, 5), (7, 129, 33), (6, 70, 9), (130, 96, 17), (3, 4097, 6)]


class MatmulFastSuite(MatmulSuite):
    """The matmul suite's calls, inputs (NaN/inf placement) and oracle, with fast specs and dtypes."""

    def cases(self):
        return [Case("matmul_fast", f"m{m}_k{k}_n{n}", dt, spec, (("m", m), ("k", k), ("n", n)))
                for spec in SPECS for m, k, n in SHAPES for dt in FAST_DTYPES]

    def budget(self, case, output, x, exact):
        # float32 accumulation of exact bf16/fp16 products, in whatever order the matrix unit uses
        # inside a K tile: a gamma_K bound on sum |a||b| (twice, for hardware that truncates while
        # aligning), plus the bias addition and one rounding to the output dtype.
        k = case.p["k"]
        mag = x["a"].double().abs() @ x["b"].double().abs()
        if output == "linear":
            mag = mag + x["bias"].double().abs()
        return 2 * (k + 2) * EPS32 * mag + 2 * half_ulp(exact, case.dtype)


assert NAN_SHAPE in SHAPES  # make_inputs (the matmul suite's) places NaN and inf in that case

SUITE = MatmulFastSuite(
    # quick (the interpreter): the small-tile spec crosses row tiles (M = 130 > 64... and 128) and K tiles
    # (K = 70, 96 with block_k 32), holds NaN/inf (m6_k70_n9) and covers both dtypes; the default spec
    # runs the same ids (ids do not name the spec).
    quick=("m6_k70_n9.bf16", "m130_k96_n17.fp16", "m1_k7_n5.bf16"),
    name="matmul_fast", ops=("matmul", "linear"), levels=("L0", "L1", "L3", "A"),
    checks={
        "L1": rowwise_checks(run_matmul, ("a",)) + [("column-subset", column_subset)],
        "L3": autograd_check(run_matmul, ("a", "b", "bias")),
    },
)
