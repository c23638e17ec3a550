"""Qwen3-Next's gated-delta-rule layer pieces: the gates and the causal conv1d with its decode state.

gdn_gating is elementwise; gdn_causal_conv1d reduces over K taps and carries the previous K-1
inputs between calls, so a prefill cut anywhere, or token-by-token decode, must give the bits of
the single full call (L2).
"""
from __future__ import annotations

import torch

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks

# (batch, tokens, conv channels, taps, value heads, bias)
SHAPES = [(3, 70, 24, 4, 4, True), (2, 9, 8, 4, 2, False), (2, 12, 8, 4, 2, True)]
NAN_SHAPE = (2, 12, 8, 4, 2, True)  # NaN in x, a and b of sequence 1: outputs must be the canonical NaN
EPS32 = 2.0 ** -24


def _gates(backend, case, x):
    kw = dict(spec=case.spec, backend=backend)
    return hal.gdn_gating(x["A_log"], x["a"], x["dt_bias"], x["b"], **kw)


def _conv(backend, case, x, xs=None, state=None):
    return hal.gdn_causal_conv1d(x["x"] if xs is None else xs, x["weight"], x.get("bias"), conv_state=state,
                                 spec=case.spec, backend=backend)


def _call(backend, case, x):
    g, beta = _gates(backend, case, x)
    y, state = _conv(backend, case, x)
    return {"g": g, "beta": beta, "y": y, "conv_state": state}


def _split_points(t, k):
    return sorted({p for p in (1, 2, k - 1, k, k + 1, t // 2, t - 1) if 0 < p < t})


def _conv_splits(backend, case, inputs, base):
    """Prefill cut at p, continued from the returned conv state: the bits of the full call."""
    t, k = case.p["t"], case.p["k"]
    for p in _split_points(t, k):
        y1, s1 = _conv(backend, case, inputs, inputs["x"][:, :p])
        y2, s2 = _conv(backend, case, inputs, inputs["x"][:, p:], s1)
        yield f"split-at-{p}:y", base["y"], torch.cat([y1, y2], 1)
        yield f"split-at-{p}:conv_state", base["conv_state"], s2


def _conv_decode(backend, case, inputs, base):
    """Token by token from an empty state."""
    state, ys = None, []
    for i in range(case.p["t"]):
        y, state = _conv(backend, case, inputs, inputs["x"][:, i:i + 1], state)
        ys.append(y)
    yield "decode:y", base["y"], torch.cat(ys, 1)
    yield "decode:conv_state", base["conv_state"], state


def _gates_per_token(backend, case, inputs, base):
    """The gates of one decode token are the prefill's gates at that position."""
    for i in sorted({0, case.p["t"] // 2, case.p["t"] - 1}):
        one = dict(inputs, a=inputs["a"][:, i:i + 1], b=inputs["b"][:, i:i + 1])
        g, beta = _gates(backend, case, one)
        yield f"token-{i}:g", base["g"][:, i:i + 1], g
        yield f"token-{i}:beta", base["beta"][:, i:i + 1], beta


def _packed(backend, case, inputs, base):
    """Packed varlen (cu_seqlens) vs batched."""
    bsz, t = inputs["x"].shape[:2]
    cu = torch.arange(0, (bsz + 1) * t, t, device=inputs["x"].device)
    y, state = hal.gdn_causal_conv1d(inputs["x"].reshape(1, bsz * t, -1), inputs["weight"], inputs.get("bias"),
                                     cu_seqlens=cu, spec=case.spec, backend=backend)
    yield "packed:y", base["y"], y.reshape(base["y"].shape)
    yield "packed:conv_state", base["conv_state"], state


class GDNLayerSuite(Suite):
    def cases(self):
        return [Case("gdn_layer", f"b{b}_t{t}_d{d}_k{k}_hv{hv}" + ("_bias" if bias else ""), dt,
                     DEFAULTS["gated_delta_rule"], (("b", b), ("t", t), ("d", d), ("k", k), ("hv", hv), ("bias", bias)))
                for b, t, d, k, hv, bias in SHAPES for dt in DTYPES]

    def make_inputs(self, case):
        p, dt = case.p, case.dtype
        x = {"x": gen.randn(case.key("x"), (p["b"], p["t"], p["d"]), dt, scale=2.0),
             "weight": gen.randn(case.key("w"), (p["d"], p["k"]), dt, scale=0.5),
             # As in the model: A_log and dt_bias are float32 parameters, a and b activations.
             "A_log": gen.randn(case.key("A_log"), (p["hv"],), torch.float32),
             "dt_bias": gen.randn(case.key("dt_bias"), (p["hv"],), torch.float32),
             "a": gen.randn(case.key("a"), (p["b"], p["t"], p["hv"]), dt, scale=3.0),
             "b": gen.randn(case.key("b"), (p["b"], p["t"], p["hv"]), dt, scale=3.0)}
        if p["bias"]:
            x["bias"] = gen.randn(case.key("bias"), (p["d"],), dt)
        if (p["b"], p["t"], p["d"], p["k"], p["hv"], p["bias"]) == NAN_SHAPE:
            x["x"][1, 5, 2] = float("nan")
            x["a"][1, 7, 0] = float("nan")
            x["b"][1, 2, 1] = float("nan")
        return x

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels.oracle import gated_delta_rule as ora
        g, beta = ora.gdn_gating(x["A_log"], x["a"], x["dt_bias"], x["b"])
        y, state = ora.causal_conv1d(x["x"], x["weight"], x.get("bias"))
        return {"g": g, "beta": beta, "y": y, "conv_state": state.double()}

    def budget(self, case, output, x, exact):
        if output == "conv_state":
            return torch.zeros_like(exact)  # a copy of inputs: exact
        if output in ("g", "beta"):  # exp, log, division, a product: a few float32 roundings
            return 16 * EPS32 * exact.abs() + 2 * half_ulp(exact, torch.float32)
        from hal.kernels.oracle import gated_delta_rule as ora
        bias = x.get("bias")
        mag, _ = ora.causal_conv1d(x["x"].abs(), x["weight"].abs(), None if bias is None else bias.abs(),
                                   activation=None)
        # K-term fma chain (+ bias), then silu (|silu'| <= 1.1, exp and a division): rounded once to x's dtype.
        return (case.p["k"] + 2) * 1.1 * EPS32 * mag + 8 * EPS32 * exact.abs() + 2 * half_ulp(exact, case.dtype)


SUITE = GDNLayerSuite(
    # quick: short sequences (conv state carried over splits), with and without bias, every dtype
    quick=("b2_t12_d8_k4_hv2_bias.fp32", "b2_t9_d8_k4_hv2.bf16", "b2_t12_d8_k4_hv2_bias.fp16"),
    name="gdn_layer", ops=("gdn_gating", "gdn_causal_conv1d"), levels=("L0", "L1", "L2", "L3", "L4", "A"),
    checks={
        "L1": rowwise_checks(_call, ("x", "a", "b")) + [("packed-vs-batched", _packed)],
        "L2": [("conv-splits", _conv_splits), ("conv-decode", _conv_decode), ("gates-per-token", _gates_per_token)],
        "L3": autograd_check(_call, ("x", "weight", "bias", "A_log", "a", "dt_bias", "b")),
    },
)
