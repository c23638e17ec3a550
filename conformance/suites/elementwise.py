"""Strict elementwise ops: sigmoid, silu, softplus, silu_mul (SwiGLU).

Each output element depends on its own input only, so the L1 question is sharp: does a value give the
same bits alone, in a long tensor, in the vectorised body or the scalar tail of a loop, in any layout?
On AVX-512 CPUs torch's float32 sigmoid / silu / softplus do not (the vector body and the scalar tail
round differently), which the "position" checks below catch. Every case's first row holds the edge
values (NaN with a payload, +-inf, +-0, subnormals, +-88, +-100, +-1e30, the dtype's max), so the goldens
pin their bits.
"""
from __future__ import annotations

import torch

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks

OPS = ("sigmoid", "silu", "softplus", "silu_mul")
SHAPES = [(1, 1), (7, 129), (1, 4099)]
EPS32 = 2.0 ** -24
#: |x| beyond which exp(-x) overflows float32 (x < -88.72): sigmoid/silu = 1 / inf, x / inf = +-0 there,
#: where the exact values are below UNDERFLOW_GAP in magnitude (|x| e^x at x = -88.72; the spec states it).
OVERFLOW_X = -88.72
UNDERFLOW_GAP = 2.7e-37
#: A NaN with a payload and the sign bit set: the output must still be the canonical NaN.
_PAYLOAD_NAN = {torch.float32: -0x3FFFFF, torch.bfloat16: -0x3F, torch.float16: -0x1FF}


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """The values whose bits the goldens pin, in ``dtype`` (out-of-range ones become +-inf there)."""
    fi = torch.finfo(dtype)
    vals = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 8, -fi.tiny / 8,
            fi.smallest_normal * fi.eps, 88.0, -88.0, 88.75, -88.75, 95.0, -95.0, 100.0, -100.0, 1e30, -1e30,
            fi.max, -fi.max, 1.0, -1.0, 1e-3, -1e-3, 20.0, -20.0, 1e-7, -1e-7]
    t = torch.tensor(vals, dtype=torch.float32).to(dtype)
    payload = torch.tensor([_PAYLOAD_NAN[dtype]], dtype=torch.int32 if dtype == torch.float32 else torch.int16)
    return torch.cat([payload.view(dtype), t])


def overflow_to_inf(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 value as correct rounding to ``dtype`` sees it: beyond max + half an ulp it is +-inf."""
    fi = torch.finfo(dtype)
    thr = fi.max * (2 - fi.eps / 2) / (2 - fi.eps)
    return torch.where(exact.abs() >= thr, exact.sign() * float("inf"), exact)


def _call(backend, case, x):
    op, kw = case.p["op"], dict(spec=case.spec, backend=backend)
    if op == "silu_mul":
        return {op: hal.silu_mul(x["a"], x["b"], **kw)}
    return {op: getattr(hal, op)(x["x"], **kw)}


def _row_inputs(case):
    return ("a", "b") if case.p["op"] == "silu_mul" else ("x",)


def _map_inputs(case, inputs, fn):
    return dict(inputs, **{k: fn(inputs[k]) for k in _row_inputs(case)})


def _alone(backend, case, inputs, base):
    """The first 40 and the last 20 elements, five at a time as their own tiny tensors: shorter than any
    vector width, so a vectorised library runs them through its scalar path."""
    out = case.p["op"]
    n = base[out].numel()
    flat = _map_inputs(case, inputs, lambda t: t.reshape(-1))
    starts = sorted(set(range(0, min(40, n), 5)) | set(range(max(0, n - 20), n, 5)))
    for i in starts:
        j = min(i + 5, n)
        got = _call(backend, case, _map_inputs(case, flat, lambda t: t[i:j]))[out]
        yield f"elements-{i}-{j - 1}-alone", base[out].reshape(-1)[i:j], got


def _filled(backend, case, inputs, base):
    """A value repeated along a row of 1027 (a vector body, e.g. a 1024-wide block, and a scalar or masked
    tail) gives its own bits at every position."""
    out = case.p["op"]
    n = min(base[out].numel(), 32)
    flat = _map_inputs(case, inputs, lambda t: t.reshape(-1)[:n])
    got = _call(backend, case, _map_inputs(case, flat, lambda t: t.unsqueeze(1).expand(n, 1027).contiguous()))[out]
    yield "value-repeated-1027-times", base[out].reshape(-1)[:n].unsqueeze(1).expand(n, 1027), got


def _layouts(backend, case, inputs, base):
    """[N, 1] column, [1, N] row and a transposed (non-contiguous) view: the bits of the base call."""
    out = case.p["op"]
    shape = base[out].shape
    for label, fwd, back in (("column-[N,1]", lambda t: t.reshape(-1, 1), lambda t: t.reshape(shape)),
                             ("row-[1,N]", lambda t: t.reshape(1, -1), lambda t: t.reshape(shape)),
                             ("transposed-view", lambda t: t.t(), lambda t: t.t())):
        got = _call(backend, case, _map_inputs(case, inputs, fwd))[out]
        yield label, base[out], back(got)


def _rowwise(backend, case, inputs, base):
    for name, check in rowwise_checks(_call, _row_inputs(case)):
        for label, e, g in check(backend, case, inputs, base):
            yield f"{name}/{label}", e, g


class ElementwiseSuite(Suite):
    def cases(self):
        return [Case("elementwise", f"{op}_n{n}_w{w}", dt, DEFAULTS["elementwise"], (("op", op), ("n", n), ("w", w)))
                for op in OPS for n, w in SHAPES for dt in DTYPES]

    def make_inputs(self, case):
        n, w, dt = case.p["n"], case.p["w"], case.dtype
        names = _row_inputs(case)
        out = {}
        for j, name in enumerate(names):
            x = gen.randn(case.key(name), (n * w,), dt, scale=4.0)
            edges = edge_values(dt)
            if name == "b":  # pair every edge value of a with ordinary and edge values of b
                edges = torch.roll(edges, 3)
            k = min(edges.numel(), x.numel())
            x[:k] = edges[:k]
            if x.numel() > 2 * k:  # and again in the scalar tail
                x[-k:] = edges[:k]
            out[name] = x.reshape(n, w)
        return out

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels.oracle import elementwise as ora
        op = case.p["op"]
        exact = ora.silu_mul(x["a"], x["b"]) if op == "silu_mul" else getattr(ora, op)(x["x"])
        return {op: overflow_to_inf(exact, case.dtype)}

    def budget(self, case, output, x, exact):
        dt = case.dtype
        rel = {"sigmoid": 6, "silu": 6, "softplus": 10, "silu_mul": 8}[output] * EPS32
        base = rel * exact.abs() + half_ulp(exact, dt) + half_ulp(exact, torch.float32)
        arg = (x["a"] if output == "silu_mul" else x["x"]).double()
        if output != "softplus":  # the stated overflow of exp(-x): +-0 instead of a value below UNDERFLOW_GAP
            gap = UNDERFLOW_GAP * (x["b"].double().abs() if output == "silu_mul" else 1.0)
            base = base + torch.where(arg < OVERFLOW_X, gap, 0.0)
        return base


SUITE = ElementwiseSuite(
    name="elementwise", ops=OPS, levels=("L0", "L1", "L3", "L4", "A"),
    checks={
        "L1": [("rows", _rowwise), ("alone", _alone), ("filled", _filled), ("layouts", _layouts)],
        "L3": autograd_check(_call, ("x", "a", "b")),
    },
    # quick: each op and dtype once; w = 4099 crosses the Triton kernels' 1024-element blocks into a short tail
    quick=("sigmoid_n7_w129.fp32", "silu_n1_w4099.bf16", "softplus_n1_w4099.fp32", "softplus_n7_w129.fp16",
           "silu_mul_n7_w129.bf16", "silu_mul_n1_w4099.fp16"),
)
