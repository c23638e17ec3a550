"""matmul / linear under the exact policy (ExactMatmulSpec): L0, L1, L2, L3, L4, A.

L2 here is order freedom, observable through the public op: the same bits when K is permuted at
random (the per-row scale is a maximum and the sum is exact, so the order of K cannot matter),
when K is padded with zeros to a random tile multiple (as a tiled kernel pads), and with the weight
sliced once (hal.exact_weight) instead of per call. The stock backend
(F.linear) is caught by the first two. Random kernel tilings and split-K counts are checked against these
bits in tests/test_exact_matmul.py and tests/test_exact_triton.py.
"""
from __future__ import annotations

import torch

import hal
from hal.spec import ExactMatmulSpec

from .. import inputs as gen
from ..suite import DTYPES, Case, autograd_check, half_ulp, rowwise_checks
from .matmul import MatmulSuite, run_matmul, column_subset, place_nonfinite

SPECS = (ExactMatmulSpec(slices=3), ExactMatmulSpec(slices=4))
# (name, M, K, N, outlier channels): decode row, odd K, K past one int32-safe tile of 64, massive activations
SHAPES = [("m1_k7_n5", 1, 7, 5, 0), ("m7_k129_n33", 7, 129, 33, 0), ("m3_k4097_n6", 3, 4097, 6, 0),
          ("m8_k512_n16_outliers", 8, 512, 16, 6), ("m6_k70_n9_nonfinite", 6, 70, 9, 0)]
EPS32 = 2.0 ** -24


class MatmulExactSuite(MatmulSuite):
    """The matmul suite's calls and oracle, with exact-policy cases, inputs and error bound."""

    def cases(self):
        return [Case("matmul_exact", name, dt, spec, (("m", m), ("k", k), ("n", n), ("outliers", o)))
                for spec in SPECS for name, m, k, n, o in SHAPES for dt in DTYPES]

    def make_inputs(self, case):
        m, k, n, o = case.p["m"], case.p["k"], case.p["n"], case.p["outliers"]
        a = gen.randn(case.key("a"), (m, k), torch.float32)
        if o:  # a few K channels 1000x larger, as in LLM residual streams
            ch = (gen.randint(case.key("channels"), (o,), k)).long()
            a[:, ch] *= 1000.0
        x = {"a": a.to(case.dtype),
             "b": gen.randn(case.key("b"), (k, n), case.dtype, scale=k ** -0.5),
             "bias": gen.randn(case.key("bias"), (n,), case.dtype)}
        if case.name.endswith("nonfinite"):   # the matmul suite's NaN/Inf placement
            place_nonfinite(x)
        return x

    def budget(self, case, output, x, exact):
        # Slicing truncates each value by less than its row's unit u = 2**(E - 7s + 1) (A) or its
        # column's (B): |ab - a'b'| <= |a| ub + ua |b| + ua ub per product; the sum is exact; then one
        # rounding (linear: the dot to float32, one float32 addition, the output rounding).
        from hal.kernels.exact.core import row_exponents
        s = case.spec.slices
        a, b = x["a"].double(), x["b"].double()
        ua = torch.exp2((row_exponents(x["a"]) - 7 * s + 1).double()).unsqueeze(1)
        ub = torch.exp2((row_exponents(x["b"].T) - 7 * s + 1).double()).unsqueeze(0)
        bound = ua * b.abs().sum(0, keepdim=True) + a.abs().sum(1, keepdim=True) * ub + a.shape[1] * ua * ub
        if output == "linear":
            bound = bound + 2 * EPS32 * (exact.abs() + x["bias"].double().abs() + bound)
        return bound + half_ulp(exact, case.dtype) * 2


def _k_permuted(backend, case, inputs, base):
    k = inputs["a"].shape[1]
    for seed in (1, 2):
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(inputs["a"].device)
        got = run_matmul(backend, case, dict(inputs, a=inputs["a"][:, perm], b=inputs["b"][perm]))
        for key in base:
            yield f"k-permutation-{seed}:{key}", base[key], got[key]


def _k_zero_padded(backend, case, inputs, base):
    k = inputs["a"].shape[1]
    tile = int(torch.randint(2, 97, (1,), generator=torch.Generator().manual_seed(k)))
    pad = -k % tile or tile
    a = torch.cat([inputs["a"], inputs["a"].new_zeros(inputs["a"].shape[0], pad)], 1)
    b = torch.cat([inputs["b"], inputs["b"].new_zeros(pad, inputs["b"].shape[1])], 0)
    got = run_matmul(backend, case, dict(inputs, a=a, b=b))
    for key in base:
        yield f"k-zero-padded-to-tile-{tile}:{key}", base[key], got[key]


def _prepared_weight(backend, case, inputs, base):
    """The weight sliced once (hal.exact_weight) gives the bits of the plain weight sliced per call."""
    b = inputs["b"]
    got = {"matmul": hal.matmul(inputs["a"], hal.exact_weight(b, spec=case.spec, layout="matmul"),
                                spec=case.spec, backend=backend),
           "linear": hal.linear(inputs["a"], hal.exact_weight(b.t(), spec=case.spec), inputs["bias"],
                                spec=case.spec, backend=backend)}
    for key in base:
        yield f"prepared-weight:{key}", base[key], got[key]


SUITE = MatmulExactSuite(
    # quick (slow backends: jax compiles per shape, the Triton interpreter): decode row, NaN/Inf, K past 4096
    quick=("m1_k7_n5.fp32", "m6_k70_n9_nonfinite.bf16", "m3_k4097_n6.fp16"),
    name="matmul_exact", ops=("matmul", "linear"), levels=("L0", "L1", "L2", "L3", "L4", "A"),
    checks={
        "L1": rowwise_checks(run_matmul, ("a",)) + [("column-subset", column_subset)],
        "L2": [("k-permutation", _k_permuted), ("k-zero-padding", _k_zero_padded),
               ("prepared-weight", _prepared_weight)],
        "L3": autograd_check(run_matmul, ("a", "b", "bias")),
    },
)
