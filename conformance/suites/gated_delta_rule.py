"""gated_delta_rule: chunk_gated_delta_rule / fused_recurrent_gated_delta_rule against one spec.

Each case packs three sequences into one varlen call of ``chunk_gated_delta_rule`` (the base
call: "training / full prefill"); outputs are ``o`` (packed) and ``final`` (the FLA float32 state
of each sequence after its last token). seq 0 is long (crosses chunk boundaries), seq 1 short
(decoded token by token), seq 2 medium. Every transform recomputes rows another way and must give
the base bits exactly:

L1  each sequence alone as a batched [1, T] call (packed vs batched); all three as a batched
    [3, Tmin] call of their prefixes; reversed packing order with NaN/inf sequences in between.
L2  seq 0 split in two at every point 1..T-1 ("sweep" cases: T = 140) or at 1, C-1, C, C+1 (2C-1,
    2C, 2C+1 where T allows) and 3 random points; seq 0 cut several times with the two op names
    alternating; seq 1 decoded token by token; seq 0 decoding while seq 2 prefills in the same
    calls (mixed batch); the recurrent op on the whole input (chunk form vs recurrent form);
    continuation from the bare FLA tensor where the spec makes it exact (multiples of C for
    chunked, anywhere for serial).
L3  the autograd (training) forward equals the base call, and seq 1's token-by-token decode.

Negative control: the stock backend runs transformers' Qwen3-Next functions; its chunk form
restarts the chunk grid at every call, so the split checks catch it, and its chunk and recurrent
forms differ, which the recurrent-op and decode checks catch.
"""
from __future__ import annotations

import torch

import hal
from hal.spec import GatedDeltaRuleSpec

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, half_ulp

EPS32 = 2.0 ** -24
SPECS = (GatedDeltaRuleSpec(variant="chunked"), GatedDeltaRuleSpec(variant="serial"))
CHUNK_OP, REC_OP = "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"

# name, (len seq0, seq1, seq2), H, HV, d_k, d_v, L2 norm in kernel, scale (None: d_k^-1/2),
# initial state (None, or the std of a random float32 [N, HV, d_k, d_v]), sweep every split point
CONFIGS = [
    ("sweep_gva_h1v2_d16", (140, 9, 60), 1, 2, 16, 16, True, None, None, True),
    ("gva_h1v2_d64", (100, 11, 70), 1, 2, 64, 64, True, None, None, False),
    ("mha_h1_d128", (100, 9, 50), 1, 1, 128, 128, True, None, None, False),
    ("gva_h2v4_d64_nol2_init", (80, 10, 66), 2, 4, 64, 32, False, 0.2, 0.5, False),
    # NaN in a row's own inputs: seq 0's v at token 70 (one value head), seq 1's q at token 4, seq 2's
    # initial state (one head); every NaN output must be the canonical pattern on every path
    ("nan_gva_h1v2_d16", (90, 9, 30), 1, 2, 16, 16, True, None, 0.5, False),
]


# ------------------------------------------------------------------ helpers


def _lens(case):
    return list(case.p["lens"])


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _seq(inputs, s, a=0, b=None):
    """Tokens [a, b) of sequence s: dict of [1, n, ...] tensors."""
    cu = inputs["cu"].tolist()
    lo = cu[s]
    hi = cu[s + 1] if b is None else cu[s] + b
    return {k: inputs[k][:, lo + a:hi] for k in ("q", "k", "v", "g", "beta")}


def _init(inputs, seqs):
    s0 = inputs.get("s0")
    return None if s0 is None else s0[list(seqs)]


def _call(backend, case, op, parts, init=None, packed=True, out="state"):
    """One call over ``parts`` (list of token dicts); packed with cu_seqlens, or batched (equal lengths)."""
    cat = (lambda k: torch.cat([p[k] for p in parts], 1)) if packed else (lambda k: torch.cat([p[k] for p in parts], 0))
    cu = torch.tensor(_cu([p["q"].shape[1] for p in parts]), dtype=torch.int64, device=parts[0]["q"].device) \
        if packed else None
    fn = getattr(hal, op)
    return fn(cat("q"), cat("k"), cat("v"), cat("g"), cat("beta"), scale=case.p["scale"], initial_state=init,
              output_final_state=out, cu_seqlens=cu, use_qk_l2norm_in_kernel=case.p["l2"], spec=case.spec,
              backend=backend)


def _split_rows(o, lens):
    cu = _cu(lens)
    return [o[0, cu[i]:cu[i + 1]] for i in range(len(lens))]


def _base_rows(base, inputs, s, a=0, b=None):
    cu = inputs["cu"].tolist()
    hi = cu[s + 1] if b is None else cu[s] + b
    return base["o"][cu[s] + a:hi]


def _expect(label, base, inputs, s, o_rows, final=None):
    yield f"{label}:o", _base_rows(base, inputs, s), o_rows
    if final is not None:
        yield f"{label}:final", base["final"][s], final


def _hostile_like(case, label, x):
    fi = torch.finfo(x.dtype)
    vals = torch.tensor([float("nan"), float("inf"), -fi.max, fi.max, float("-inf"), 0.0], dtype=torch.float32)
    return vals[gen.randint(case.key("hostile", label), tuple(x.shape), len(vals))].to(x.dtype).to(x.device)


def _split_points(case, n):
    if case.p["sweep"]:
        return list(range(1, n))
    c = case.spec.chunk
    named = [1, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1]
    rand = [int(x) + 1 for x in gen.randint(case.key("cuts"), (3,), n - 1)]
    return sorted({p for p in named + rand if 0 < p < n})


# ------------------------------------------------------------------ L1


def _alone(backend, case, inputs, base):
    for s in range(3):
        o, st = _call(backend, case, CHUNK_OP, [_seq(inputs, s)], _init(inputs, [s]), packed=False)
        yield from _expect(f"seq{s}-alone-batched", base, inputs, s, o[0], st.final_state[0])


def _batched_prefixes(backend, case, inputs, base):
    n = min(_lens(case))
    o, _ = _call(backend, case, CHUNK_OP, [_seq(inputs, s, 0, n) for s in range(3)], _init(inputs, range(3)),
                 packed=False)
    for s in range(3):
        yield f"batched-[3,{n}]:seq{s}:o", _base_rows(base, inputs, s, 0, n), o[s]


def _hostile(backend, case, inputs, base):
    """The sequences in reversed order, with NaN/inf/max sequences (and NaN initial states) between them."""
    parts, order, lens = [], [], []
    for s in (2, 1, 0):
        h = {k: _hostile_like(case, f"{k}{s}", v[:, : 7 + 3 * s]) for k, v in _seq(inputs, 0).items()}
        parts += [h, _seq(inputs, s)]
        order += [None, s]
        lens += [7 + 3 * s, _lens(case)[s]]
    init = None
    if inputs.get("s0") is not None:
        nan = torch.full_like(inputs["s0"][:1], float("nan"))
        init = torch.cat([nan if s is None else inputs["s0"][s: s + 1] for s in order])
    o, st = _call(backend, case, CHUNK_OP, parts, init)
    rows = _split_rows(o, lens)
    for i, s in enumerate(order):
        if s is not None:
            yield from _expect(f"reversed-among-hostile-sequences:seq{s}", base, inputs, s, rows[i],
                               st.final_state[i])


# ------------------------------------------------------------------ L2


def _sweep(backend, case, inputs, base):
    """seq 0 in two calls, split at p: every point of its own sequence in one varlen call pair."""
    n = _lens(case)[0]
    points = _split_points(case, n)
    init = _init(inputs, [0] * len(points))
    o1, st = _call(backend, case, CHUNK_OP, [_seq(inputs, 0, 0, p) for p in points], init)
    o2, st2 = _call(backend, case, CHUNK_OP, [_seq(inputs, 0, p, n) for p in points], st)
    first, second = _split_rows(o1, points), _split_rows(o2, [n - p for p in points])
    for i, p in enumerate(points):
        yield from _expect(f"split-at-{p}", base, inputs, 0, torch.cat([first[i], second[i]]), st2.final_state[i])


def _multi_split(backend, case, inputs, base):
    """seq 0 cut at several points (aligned and not), the two op names alternating."""
    n = _lens(case)[0]
    cuts = {int(x) + 1 for x in gen.randint(case.key("multi"), (4,), n - 1)} | {case.spec.chunk}
    bounds = [0, *sorted(x for x in cuts if 0 < x < n), n]
    st, outs = _init(inputs, [0]), []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        o, st = _call(backend, case, (CHUNK_OP, REC_OP)[i % 2], [_seq(inputs, 0, a, b)], st)
        outs.append(o[0])
    yield from _expect(f"cuts-{bounds[1:-1]}", base, inputs, 0, torch.cat(outs), st.final_state[0])


_DECODED: dict = {}


def _decode_tokens(backend, case, inputs, s):
    """Sequence s decoded one token per call. L2 and L3 both need seq 1's decode: computed once per
    (backend, inputs) of a case run."""
    key = (id(inputs), inputs["q"].data_ptr(), str(backend), case.spec.id, case.id, s)
    if key not in _DECODED:
        _DECODED.clear()
        _DECODED[key] = _decode_uncached(backend, case, inputs, s)
    return _DECODED[key]


def _decode_uncached(backend, case, inputs, s):
    n = _lens(case)[s]
    st, outs = _init(inputs, [s]), []
    for t in range(n):
        o, st = _call(backend, case, REC_OP, [_seq(inputs, s, t, t + 1)], st, packed=False)
        outs.append(o[0])
    return torch.cat(outs), st


def _decode(backend, case, inputs, base):
    o, st = _decode_tokens(backend, case, inputs, 1)
    yield from _expect("seq1-decoded-token-by-token", base, inputs, 1, o, st.final_state[0])


def _mixed(backend, case, inputs, base):
    """seq 0 prefilled to a non-aligned point, then decoding one token per call while seq 2
    prefills in chunks of varied sizes in the same varlen calls (states joined with cat, split with select)."""
    n0, n2 = _lens(case)[0], _lens(case)[2]
    p0 = min(case.spec.chunk - 3, n0 - 8)
    o0, st0 = _call(backend, case, CHUNK_OP, [_seq(inputs, 0, 0, p0)], _init(inputs, [0]))
    st2 = _fresh_state(backend, case, inputs, 2)
    outs0, outs2 = [o0[0]], []
    sizes = [13, 1, 29, 5, 64, 100]
    a2, t0, i = 0, p0, 0
    while a2 < n2 and t0 < n0:
        b2 = min(n2, a2 + sizes[i % len(sizes)])
        o, st = _call(backend, case, (REC_OP, CHUNK_OP)[i % 2], [_seq(inputs, 0, t0, t0 + 1), _seq(inputs, 2, a2, b2)],
                      hal.GatedDeltaRuleState.cat([st0, st2]))
        r0, r2 = _split_rows(o, [1, b2 - a2])
        outs0.append(r0)
        outs2.append(r2)
        st0, st2 = st.select(0), st.select(1)
        a2, t0, i = b2, t0 + 1, i + 1
    if a2 < n2:
        o, st2 = _call(backend, case, CHUNK_OP, [_seq(inputs, 2, a2, n2)], st2)
        outs2.append(o[0])
    if t0 < n0:
        o, st0 = _call(backend, case, CHUNK_OP, [_seq(inputs, 0, t0, n0)], st0)
        outs0.append(o[0])
    yield from _expect(f"seq0-prefill-{p0}-then-decode-beside-seq2-prefill", base, inputs, 0, torch.cat(outs0),
                       st0.final_state[0])
    yield from _expect("seq2-prefill-in-chunks-beside-seq0-decode", base, inputs, 2, torch.cat(outs2),
                       st2.final_state[0])


def _fresh_state(backend, case, inputs, s):
    """The state object of sequence s before its first token: a call with no tokens returns it."""
    empty = {k: v[:, :0] for k, v in _seq(inputs, s).items()}
    _, st = _call(backend, case, CHUNK_OP, [empty], _init(inputs, [s]), packed=False)
    return st


def _recurrent_op(backend, case, inputs, base):
    """The recurrent op over the whole packed input: same spec, same bits (chunk form vs recurrent form)."""
    o, fin = _call(backend, case, REC_OP, [_seq(inputs, s) for s in range(3)], _init(inputs, range(3)), out=True)
    yield "recurrent-op-full-input:o", base["o"], o[0]
    yield "recurrent-op-full-input:final", base["final"], fin


def _bare_state(backend, case, inputs, base):
    """FLA contract: continuing from the bare final tensor is exact at multiples of C (chunked), anywhere (serial)."""
    n = _lens(case)[0]
    c = case.spec.chunk
    points = [c - 1] if case.spec.variant == "serial" else [p for p in (c, 2 * c) if p < n]
    for p in points:
        o1, f1 = _call(backend, case, CHUNK_OP, [_seq(inputs, 0, 0, p)], _init(inputs, [0]), out=True)
        o2, f2 = _call(backend, case, REC_OP, [_seq(inputs, 0, p, n)], f1, out=True)
        yield from _expect(f"bare-tensor-split-at-{p}", base, inputs, 0, torch.cat([o1[0], o2[0]]), f2[0])


# ------------------------------------------------------------------ L3


def _training(backend, case, inputs, base):
    train = {k: (v.detach().clone().requires_grad_(True) if k in ("q", "k", "v", "g", "beta", "s0") else v)
             for k, v in inputs.items()}
    with torch.enable_grad():
        o, fin = _call(backend, case, CHUNK_OP, [_seq(train, s) for s in range(3)], _init(train, range(3)), out=True)
    o, fin = o.detach(), fin.detach()
    yield "autograd-forward:o", base["o"], o[0]
    yield "autograd-forward:final", base["final"], fin
    dec, _ = _decode_tokens(backend, case, inputs, 1)
    cu = inputs["cu"].tolist()
    yield "autograd-forward-vs-decode:seq1:o", o[0, cu[1]:cu[2]], dec


# ------------------------------------------------------------------ the suite


class GatedDeltaRuleSuite(Suite):
    def cases(self):
        out = []
        for name, lens, h, hv, dk, dv, l2, scale, init, sweep in CONFIGS:
            for spec in SPECS:
                for dt in DTYPES:
                    out.append(Case("gated_delta_rule", name, dt, spec,
                                    (("lens", lens), ("h", h), ("hv", hv), ("dk", dk), ("dv", dv), ("l2", l2),
                                     ("scale", scale), ("init", init), ("sweep", sweep))))
        return out

    def make_inputs(self, case):
        p = case.p
        T = sum(p["lens"])
        h, hv, dk, dv, dt = p["h"], p["hv"], p["dk"], p["dv"], case.dtype
        kscale = 1.0 if p["l2"] else 0.5 / dk ** 0.5  # without the in-kernel norm keep |k|^2 well below 2/beta
        x = {
            "q": gen.randn(case.key("q"), (1, T, h, dk), dt),
            "k": gen.randn(case.key("k"), (1, T, h, dk), dt, scale=kscale),
            "v": gen.randn(case.key("v"), (1, T, hv, dv), dt),
            # log-decays in float32 as Qwen3-Next computes them; mostly mild, some strong
            "g": -gen.rand(case.key("g"), (1, T, hv), torch.float32, 0.0, 1.0) ** 2 * 3.0,
            "beta": gen.rand(case.key("beta"), (1, T, hv), dt, 0.0, 1.0),
            "cu": torch.tensor(_cu(p["lens"]), dtype=torch.int64),
        }
        if p["init"]:
            x["s0"] = gen.randn(case.key("s0"), (3, hv, dk, dv), torch.float32, scale=p["init"])
        if case.name.startswith("nan_"):
            cu = x["cu"].tolist()
            x["v"][0, cu[0] + 70, 1, 3] = float("nan")
            x["q"][0, cu[1] + 4, 0, 0] = float("nan")
            x["s0"][2, 0, 1, 2] = float("nan")
        return x

    def run(self, backend, case, inputs):
        o, fin = _call(backend, case, CHUNK_OP, [_seq(inputs, s) for s in range(3)], _init(inputs, range(3)), out=True)
        return {"o": o[0], "final": fin}

    def oracle(self, case, inputs):
        from hal.kernels.oracle.gated_delta_rule import gated_delta_rule
        p = case.p
        scale = float(torch.tensor(p["scale"] if p["scale"] else p["dk"] ** -0.5, dtype=torch.float32))
        o, fin = gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale,
                                  inputs.get("s0"), inputs["cu"].tolist(), p["l2"])
        return {"o": o[0], "final": fin}

    def budget(self, case, output, inputs, exact):
        """Half an ulp of the output dtype, plus float32 accumulation error: BUDGET_ULPS float32 ulps
        of the magnitude the value is summed from (per sequence and head: the largest |o| or |S|)."""
        mag = _magnitudes(case, inputs, output, exact)
        return half_ulp(exact, case.dtype if output == "o" else torch.float32) + BUDGET_ULPS * EPS32 * mag


BUDGET_ULPS = 64


def _magnitudes(case, inputs, output, exact):
    """Per sequence and head, max |value| over its tokens (o) or its state (final), broadcast back."""
    a = exact.abs().nan_to_num(0.0, 0.0, 0.0)  # NaN/inf outputs are checked for their class, not a budget
    if output == "final":
        return a.amax(dim=(-2, -1), keepdim=True)
    cu = inputs["cu"].tolist()
    out = torch.empty_like(a)
    for i in range(len(cu) - 1):
        out[cu[i]:cu[i + 1]] = a[cu[i]:cu[i + 1]].amax(dim=(0, 2), keepdim=True)
    return out


SUITE = GatedDeltaRuleSuite(
    # quick: crosses the 64-row chunk, both specs, NaN inputs; the Triton interpreter's set
    quick=("nan_gva_h1v2_d16.fp32",),
    name="gated_delta_rule", ops=(CHUNK_OP, REC_OP), levels=("L0", "L1", "L2", "L3", "L4", "A"),
    checks={
        "L1": [("alone-batched", _alone), ("batched-prefixes", _batched_prefixes),
               ("reversed-hostile-sequences", _hostile)],
        "L2": [("split-sweep", _sweep), ("multi-split", _multi_split), ("decode", _decode),
               ("mixed-prefill-decode", _mixed), ("recurrent-op", _recurrent_op), ("bare-state", _bare_state)],
        "L3": [("training", _training)],
    },
)
