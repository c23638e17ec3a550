"""RMSNorm, plain and with the fused residual add."""
from __future__ import annotations

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks

SHAPES = [(1, 7), (7, 129), (3, 4097), (16, 256), (4, 300)]
NAN_SHAPE = (4, 300)  # row 1 holds a NaN, row 2 an inf: outputs must be the canonical NaN
EPS32 = 2.0 ** -24
EPS = 1e-6


def _call(backend, case, x):
    if case.p["residual"]:
        y, h = hal.rms_norm(x["x"], x["weight"], EPS, residual=x["residual"], spec=case.spec, backend=backend)
        return {"y": y, "residual": h}
    return {"y": hal.rms_norm(x["x"], x["weight"], EPS, spec=case.spec, backend=backend)}


class RMSNormSuite(Suite):
    def cases(self):
        return [Case("rms_norm", f"n{n}_h{h}" + ("_res" if res else ""), dt, DEFAULTS["rms_norm"],
                     (("n", n), ("h", h), ("residual", res)))
                for n, h in SHAPES for res in (False, True) for dt in DTYPES]

    def make_inputs(self, case):
        n, h = case.p["n"], case.p["h"]
        x = {"x": gen.randn(case.key("x"), (n, h), case.dtype, scale=3.0),
             "weight": gen.randn(case.key("w"), (h,), case.dtype)}
        if case.p["residual"]:
            x["residual"] = gen.randn(case.key("r"), (n, h), case.dtype)
        if (n, h) == NAN_SHAPE:
            x["x"][1, 260] = float("nan")
            x["x"][2, 3] = float("inf")
        return x

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels import oracle
        out = oracle.rms_norm(x["x"], x["weight"], EPS, x.get("residual"))
        if case.p["residual"]:
            return {"y": out[0], "residual": out[1].double()}
        return {"y": out}

    def budget(self, case, output, x, exact):
        if output == "residual":
            return 2 * half_ulp(exact, case.dtype)
        h, t = case.p["h"], case.spec.hidden_tile
        rel = ((t + -(-h // t)) / 2 + 6) * EPS32
        return rel * exact.abs() + 2 * half_ulp(exact, case.dtype)


SUITE = RMSNormSuite(
    # quick: H = 300 crosses the hidden tile, with the residual rounding and NaN/inf rows
    quick=("n1_h7.fp32", "n4_h300_res.bf16"),
    name="rms_norm", ops=("rms_norm",), levels=("L0", "L1", "L3", "L4", "A"),
    checks={
        "L1": rowwise_checks(_call, ("x", "residual")),
        "L3": autograd_check(_call, ("x", "weight", "residual")),
    },
)
