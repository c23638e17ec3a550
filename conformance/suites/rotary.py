"""Rotary embedding: cos/sin tables from integer positions (rotary_cos_sin) and the rotation (apply_rotary).

"table" cases check that a trainer building the table for a whole packed batch and a sampler building it
per token (or as int32, or in another shape) get the same bits, up to positions near 2**24. "apply" cases
rotate half-split and interleaved pairs, full and partial rotary dims, with edge values in x, and check
that a token's rotation does not depend on the other tokens, the heads layout or a broadcast table.
"""
from __future__ import annotations

import torch

import hal
from hal.kernels.reference import elementwise as ref_ew
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp, rowwise_checks
from .elementwise import edge_values, overflow_to_inf

EPS32 = 2.0 ** -24
LIMIT = 2 ** 24

# table cases: (name, positions kind, R, base, explicit inv_freq)
TABLES = [("t70_r64", "arange70", 64, 10000.0, False),
          ("b3x40_r128_base1e6", "batch3x40", 128, 1e6, False),
          ("large_r128", "large", 128, 10000.0, False),
          ("large_r6_base5e5", "large", 6, 500000.0, False),
          ("invfreq_r96", "stride97", 96, 10000.0, True)]
# apply cases: (tokens, heads, head dim D, rotary dim R, interleaved, positions kind)
APPLIES = [(33, 4, 64, 64, False, "arange"), (33, 4, 64, 64, True, "arange"),
           (17, 2, 80, 32, False, "arange"), (17, 2, 80, 32, True, "arange"),
           (9, 3, 128, 128, False, "large")]


def _positions(case) -> torch.Tensor:
    kind = case.p["pos"]
    if kind == "arange70":
        return torch.arange(70)
    if kind == "arange":
        return torch.arange(case.p["t"]) + 5
    if kind == "batch3x40":  # three sequences at different offsets
        return torch.arange(40)[None, :] + torch.tensor([[0], [1000], [123457]])
    if kind == "stride97":
        return torch.arange(0, 8192, 97)
    special = torch.tensor([0, 1, -1, 2, LIMIT - 1, -(LIMIT - 1), 2 ** 23, 2 ** 23 + 1, 2 ** 20, 131071, 1000003,
                            4095, 4096, 32767, 32768, 65535])
    n = case.p.get("t", 56)
    rnd = gen.randint(case.key("positions"), (max(n - special.numel(), 0),), LIMIT)
    return torch.cat([special, rnd])[:n]


def _table(backend, case, positions, inv_freq=None):
    c, s = hal.rotary_cos_sin(positions, case.p["r"], case.p["base"], inv_freq, spec=case.spec, backend=backend)
    return {"cos": c, "sin": s}


def _call(backend, case, x):
    if case.p["kind"] == "table":
        return _table(backend, case, x["positions"], x.get("inv_freq"))
    out = hal.apply_rotary(x["x"], x["cos"], x["sin"], case.p["interleaved"], spec=case.spec, backend=backend)
    return {"out": out}


# ---------------------------------------------------------------- L1: tables


def _table_only(check):
    def wrapped(backend, case, inputs, base):
        if case.p["kind"] == "table":
            yield from check(backend, case, inputs, base)
    return wrapped


def _apply_only(check):
    def wrapped(backend, case, inputs, base):
        if case.p["kind"] == "apply":
            yield from check(backend, case, inputs, base)
    return wrapped


@_table_only
def _per_position(backend, case, inputs, base):
    """A sampler's table for one token at a time is the trainer's table row for that position."""
    pos = inputs["positions"].reshape(-1)
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in base.items()}
    for i in sorted(set(range(min(24, pos.numel()))) | {pos.numel() - 1}):
        got = _table(backend, case, pos[i:i + 1], inputs.get("inv_freq"))
        for k in flat:
            yield f"position-{int(pos[i])}-alone:{k}", flat[k][i:i + 1], got[k]


@_table_only
def _int32(backend, case, inputs, base):
    got = _table(backend, case, inputs["positions"].to(torch.int32), inputs.get("inv_freq"))
    for k in base:
        yield f"int32-positions:{k}", base[k], got[k]


@_table_only
def _reshaped_and_split(backend, case, inputs, base):
    pos = inputs["positions"]
    flat = pos.reshape(-1)
    got = _table(backend, case, flat.reshape(-1, 1), inputs.get("inv_freq"))
    for k in base:
        yield f"positions-as-column:{k}", base[k].reshape(-1, base[k].shape[-1]), got[k].reshape(-1, got[k].shape[-1])
    cut = flat.numel() // 3
    a, b = (_table(backend, case, p, inputs.get("inv_freq")) for p in (flat[:cut], flat.flip(0)[: flat.numel() - cut]))
    for k in base:
        whole = base[k].reshape(-1, base[k].shape[-1])
        yield f"prefix-then-reversed-rest:{k}", whole, torch.cat([a[k], b[k].flip(0)])


# ---------------------------------------------------------------- L1: rotation


@_apply_only
def _rows(backend, case, inputs, base):
    for name, check in rowwise_checks(_call, ("x", "cos", "sin")):
        for label, e, g in check(backend, case, inputs, base):
            yield f"{name}/{label}", e, g


@_apply_only
def _per_token(backend, case, inputs, base):
    for t in sorted({0, 1, case.p["t"] // 2, case.p["t"] - 1}):
        one = {k: inputs[k][t:t + 1] for k in ("x", "cos", "sin")}
        yield f"token-{t}-alone", base["out"][t:t + 1], _call(backend, case, one)["out"]


@_apply_only
def _layouts(backend, case, inputs, base):
    """Heads flattened into rows with a materialised table; a [H, T, D] view; a full-size table."""
    x, c, s = inputs["x"], inputs["cos"], inputs["sin"]
    t, h, d = x.shape
    full = lambda u: u.expand(t, h, u.shape[-1]).contiguous()
    got = _call(backend, case, {"x": x.reshape(t * h, d), "cos": full(c).reshape(t * h, -1),
                                "sin": full(s).reshape(t * h, -1)})["out"]
    yield "heads-flattened", base["out"], got.reshape(t, h, d)
    got = _call(backend, case, {"x": x.transpose(0, 1), "cos": c.transpose(0, 1), "sin": s.transpose(0, 1)})["out"]
    yield "heads-first-view", base["out"], got.transpose(0, 1)
    got = _call(backend, case, {"x": x, "cos": full(c), "sin": full(s)})["out"]
    yield "materialised-table", base["out"], got


class RotarySuite(Suite):
    def cases(self):
        spec = DEFAULTS["rotary"]
        out = [Case("rotary", f"table_{name}", torch.float32, spec,
                    (("kind", "table"), ("pos", pos), ("r", r), ("base", base), ("inv_freq", inv)))
               for name, pos, r, base, inv in TABLES]
        for t, h, d, r, inter, pos in APPLIES:
            name = f"apply_{'interleaved' if inter else 'half'}_t{t}_h{h}_d{d}_r{r}" + ("_largepos" if pos == "large" else "")
            out += [Case("rotary", name, dt, spec, (("kind", "apply"), ("t", t), ("h", h), ("d", d), ("r", r),
                                                    ("interleaved", inter), ("pos", pos), ("base", 10000.0)))
                    for dt in DTYPES]
        return out

    def make_inputs(self, case):
        p = case.p
        pos = _positions(case)
        if p["kind"] == "table":
            x = {"positions": pos}
            if p["inv_freq"]:  # e.g. a scaled (Llama-3 / YaRN) table: float32 values in (1e-4, 1]
                x["inv_freq"] = gen.rand(case.key("inv_freq"), (p["r"] // 2,), torch.float32, 1e-4, 1.0)
            return x
        c, s = ref_ew.rotary_cos_sin(pos, p["r"], p["base"], None)
        x = gen.randn(case.key("x"), (p["t"], p["h"], p["d"]), case.dtype, scale=2.0)
        edges = edge_values(case.dtype)
        x.view(-1)[: edges.numel()] = edges  # token 0 carries the edge values
        return {"x": x, "cos": c[:, None, :], "sin": s[:, None, :]}

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels.oracle import elementwise as ora
        p = case.p
        if p["kind"] == "table":
            c, s = ora.rotary_cos_sin(x["positions"], p["r"], p["base"], x.get("inv_freq"))
            return {"cos": c, "sin": s}
        return {"out": overflow_to_inf(ora.apply_rotary(x["x"], x["cos"], x["sin"], p["interleaved"]), case.dtype)}

    def budget(self, case, output, x, exact):
        from hal.kernels.oracle import elementwise as ora
        p = case.p
        if p["kind"] == "table":
            # the angle's float32 error (inv_freq: a division, log, a product and exp, whose argument error
            # scales with log(base); then one product), then lsm1 sin/cos (measured <= 2 ulp of float32)
            angle = ora.rotary_angles(x["positions"], p["r"], p["base"], x.get("inv_freq")).abs()
            c = 2.0 if "inv_freq" in x else 2.0 * (1.0 + abs(torch.tensor(p["base"]).log().item())) + 4.0
            return c * EPS32 * angle + 4 * EPS32
        half = x["cos"].shape[-1]
        xa = x["x"].double().abs()
        x1, x2 = ref_ew.rotary_pairs(xa, half, p["interleaved"])
        ca, sa = x["cos"].double().abs(), x["sin"].double().abs()
        m1, m2 = x1 * ca + x2 * sa, x2 * ca + x1 * sa
        mag = torch.zeros_like(xa)
        if p["interleaved"]:
            mag[..., 0:2 * half:2], mag[..., 1:2 * half:2] = m1, m2
        else:
            mag[..., :half], mag[..., half:2 * half] = m1, m2
        # two products and an fma, each rounded once in float32, then one rounding to x's dtype
        return 3 * EPS32 * mag + half_ulp(exact, case.dtype)


SUITE = RotarySuite(
    name="rotary", ops=("rotary_cos_sin", "apply_rotary"), levels=("L0", "L1", "L3", "L4", "A"),
    checks={
        "L1": [("per-position", _per_position), ("int32-positions", _int32), ("reshaped-and-split", _reshaped_and_split),
               ("rows", _rows), ("per-token", _per_token), ("layouts", _layouts)],
        "L3": autograd_check(_call, ("x", "cos", "sin", "inv_freq")),
    },
    # quick: positions up to 2**24 - 1, a caller's inv_freq, partial rotary (pass-through dims) in both pair
    # layouts, each dtype
    quick=("table_large_r128.fp32", "table_invfreq_r96.fp32", "apply_half_t17_h2_d80_r32.bf16",
           "apply_interleaved_t17_h2_d80_r32.fp16", "apply_half_t9_h3_d128_r128_largepos.fp32"),
)
