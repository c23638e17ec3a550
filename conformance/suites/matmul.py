"""matmul and linear: one case computes both (linear with the transposed weight and a bias)."""
from __future__ import annotations

import torch

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks

# (M, K, N): awkward sizes on purpose -- 1 row (decode), K not a multiple of the tile, K = 4097.
SHAPES = [(1, 7, 5), (7, 129, 33), (33, 64, 17), (3, 4097, 6), (6, 70, 9)]
NAN_SHAPE = (6, 70, 9)  # rows/columns holding NaN and inf: outputs must be the canonical NaN
# (M, K, N) of the case whose inputs hold the values that flushing or folding backends get wrong
# (see _special): subnormals, -0.0, rows whose products are all -0.0.
SPECIAL_SHAPE = (6, 70, 9)
EPS32 = 2.0 ** -24


def run_matmul(backend, case, x):
    """The case's matmul / linear call (shared with the exact and fast matmul suites)."""
    return {
        "matmul": hal.matmul(x["a"], x["b"], spec=case.spec, backend=backend),
        "linear": hal.linear(x["a"], x["b"].t(), x["bias"], spec=case.spec, backend=backend),
    }


def column_subset(backend, case, inputs, base):
    """Output columns must not depend on the other columns of b (N-invariance)."""
    n = inputs["b"].shape[1]
    cols = torch.tensor(sorted({0, n - 1, n // 2}), dtype=torch.long)
    sub = dict(inputs, b=inputs["b"][:, cols].contiguous(), bias=inputs["bias"][cols].contiguous())
    got = run_matmul(backend, case, sub)
    for k in base:
        yield f"columns-{cols.tolist()}:{k}", base[k][:, cols], got[k]


def _special(x: dict, dtype: torch.dtype) -> dict:
    """Rows and columns that a backend flushing subnormals or folding ``acc + 0.0`` gets wrong.

    row 0: all -0.0 (every product -0.0: the +0.0 chain start makes the sum +0.0);
    row 1: subnormals of the dtype (products and sums subnormal in float32 for fp32/bf16);
    row 2: half -0.0, half subnormal; column 0 of b: subnormals; bias[0] = -0.0, bias[1] subnormal;
    row 3: -0.0 where b's column 1 is positive and +0.0 elsewhere (mixed-sign zero products).
    """
    a, b, bias = x["a"].clone(), x["b"].clone(), x["bias"].clone()
    k = a.shape[1]
    tiny = torch.finfo(dtype).tiny
    steps = (torch.arange(k, dtype=torch.float32) % 7 + 1) * 0.125  # 1/8 .. 7/8 of the smallest normal
    sub = (tiny * steps * torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)).to(dtype)
    a[0] = -0.0
    a[1] = sub
    a[2] = torch.where(torch.arange(k) % 2 == 0, torch.tensor(-0.0), sub.float()).to(dtype)
    a[3] = torch.where(b[:, 1] > 0, -0.0, 0.0).to(dtype)
    b[:, 0] = (sub.float().abs() * 4).to(dtype)
    bias[0] = -0.0
    bias[1] = (tiny * 0.25)
    return {"a": a, "b": b, "bias": bias}


def place_nonfinite(x: dict) -> None:
    """NaN and inf in rows and columns of a [6, 70] a and [70, 9] b (in place): every output NaN is canonical."""
    x["a"][1, 3] = float("nan")       # row 1: NaN
    x["a"][2, 65] = float("inf")      # row 2: +-inf, in the short last K tile
    x["a"][3, 0] = float("inf")       # row 3: inf * 0 = NaN in column 4
    x["b"][0, 4] = 0.0
    x["b"][7, 6] = float("nan")       # column 6: NaN in every row


class MatmulSuite(Suite):
    def cases(self):
        cases = [Case("matmul", f"m{m}_k{k}_n{n}", dt, DEFAULTS["matmul"], (("m", m), ("k", k), ("n", n)))
                 for m, k, n in SHAPES for dt in DTYPES]
        m, k, n = SPECIAL_SHAPE
        cases += [Case("matmul", f"m{m}_k{k}_n{n}_subnormal_negzero", dt, DEFAULTS["matmul"],
                       (("m", m), ("k", k), ("n", n), ("special", True))) for dt in DTYPES]
        return cases

    def make_inputs(self, case):
        m, k, n = case.p["m"], case.p["k"], case.p["n"]
        x = {"a": gen.randn(case.key("a"), (m, k), case.dtype),
             "b": gen.randn(case.key("b"), (k, n), case.dtype, scale=k ** -0.5),
             "bias": gen.randn(case.key("bias"), (n,), case.dtype)}
        if case.p.get("special"):
            return _special(x, case.dtype)
        if (m, k, n) == NAN_SHAPE:
            place_nonfinite(x)
        return x

    def run(self, backend, case, inputs):
        return run_matmul(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels import oracle
        return {"matmul": oracle.matmul(x["a"], x["b"]), "linear": oracle.linear(x["a"], x["b"].t(), x["bias"])}

    def budget(self, case, output, x, exact):
        # fp32 fma chains of length <= tile inside tiles, then n_tiles tile sums: the classic
        # gamma_n bound on sum |a||b|, plus one rounding to the output dtype.
        k, t = case.p["k"], case.spec.k_tile
        mag = x["a"].double().abs() @ x["b"].double().abs()
        if output == "linear":
            mag = mag + x["bias"].double().abs()
        return (t + -(-k // t) + 2) * EPS32 * mag + 2 * half_ulp(exact, case.dtype)


SUITE = MatmulSuite(
    # quick: K = 70 crosses a K-tile boundary into a short last tile and holds NaN/inf; M = 1 is decode
    quick=("m1_k7_n5.fp32", "m6_k70_n9.bf16", "m33_k64_n17.fp16"),
    name="matmul", ops=("matmul", "linear"), levels=("L0", "L1", "L3", "L4", "A"),
    checks={
        "L1": rowwise_checks(run_matmul, ("a",)) + [("column-subset", column_subset)],
        "L3": autograd_check(run_matmul, ("a", "b", "bias")),
    },
)
