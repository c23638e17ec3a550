"""softmax, log_softmax and logsumexp along the last axis (one spec family)."""
from __future__ import annotations

import torch

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks

# (rows, n): n = 1, not a multiple of the tile, 4097; "special" adds masked / NaN / inf / huge rows.
SHAPES = [(1, 1), (3, 7), (5, 129), (2, 4097), (4, 256)]
EPS32 = 2.0 ** -24
SPLIT_SHAPE = (2, 8300)


def _call(backend, case, x):
    kw = dict(spec=case.spec, backend=backend)
    return {"softmax": hal.softmax(x["x"], -1, **kw), "log_softmax": hal.log_softmax(x["x"], -1, **kw),
            "logsumexp": hal.logsumexp(x["x"], -1, **kw)}


class SoftmaxSuite(Suite):
    def cases(self):
        out = [Case("softmax", f"r{r}_n{n}", dt, DEFAULTS["softmax"], (("r", r), ("n", n), ("special", False)))
               for r, n in SHAPES for dt in DTYPES]
        out += [Case("softmax", "special_r6_n300", dt, DEFAULTS["softmax"], (("r", 6), ("n", 300), ("special", True)))
                for dt in DTYPES]
        # rows long enough that the triton backend splits each across programs (kernels/triton/softmax.py: few rows
        # of >= 8192 columns; chunk maxima, tile sums per tile chunk, the sums in tile order, outputs per chunk);
        # n off the tile, float32 (a wrong order of the 33 tile sums shows there)
        r, n = SPLIT_SHAPE
        out.append(Case("softmax", f"split_r{r}_n{n}", torch.float32, DEFAULTS["softmax"],
                        (("r", r), ("n", n), ("special", False))))
        return out

    def make_inputs(self, case):
        r, n = case.p["r"], case.p["n"]
        x = gen.randn(case.key("x"), (r, n), case.dtype, scale=4.0)
        if case.p["special"]:
            fi = torch.finfo(case.dtype)
            x[0] = float("-inf")                       # fully masked row
            x[1, ::2] = float("-inf")                  # half masked
            x[2, 7] = float("nan")                     # NaN poisons its row
            x[3, 3] = float("inf")                     # +inf poisons its row
            x[4] = x[4] * 0 + fi.max                   # all equal, huge
            x[5, :5] = -fi.max                         # huge negative entries
        return {"x": x}

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels import oracle
        return {"softmax": oracle.softmax(x["x"]), "log_softmax": oracle.log_softmax(x["x"]),
                "logsumexp": oracle.logsumexp(x["x"])}

    def budget(self, case, output, x, exact):
        # S is a sum of positive terms: relative error <= (tile + n_tiles) eps; exp/log <= 1 ulp each.
        n, t = case.p["n"], case.spec.tile
        c = (t + -(-n // t) + 6) * EPS32
        xs = x["x"].double()
        m = xs.amax(-1, keepdim=True)
        shift = torch.nan_to_num((xs - m).abs(), nan=0.0, posinf=0.0)
        if output == "softmax":
            return (c + shift * EPS32 * 2) * exact.abs() + 2 * half_ulp(exact, case.dtype) + 1e-45
        if output == "log_softmax":
            return c + 2 * shift * EPS32 + 2 * half_ulp(exact, case.dtype)
        return c + 2 * m.squeeze(-1).abs().nan_to_num(0.0, 0.0, 0.0) * EPS32 + 2 * half_ulp(exact, case.dtype)


SUITE = SoftmaxSuite(
    # quick: n = 300 crosses the 256 tile and holds the masked / NaN / inf / huge rows; in float32, where a
    # wrong summation order shows (bf16/fp16 outputs round most of it away: see the negative control); split_r2_n8300:
    # the triton backend's split passes (a row across programs)
    quick=("r3_n7.fp16", "r5_n129.bf16", "special_r6_n300.fp32", "split_r2_n8300.fp32"),
    name="softmax", ops=("softmax", "log_softmax", "logsumexp"), levels=("L0", "L1", "L3", "L4", "A"),
    checks={"L1": rowwise_checks(_call, ("x",)), "L3": autograd_check(_call, ("x",))},
)
