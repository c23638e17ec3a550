"""The `cpu` backend's gated delta rule, GDN layer pieces, elementwise and rotary ops == the reference's bits.

Every check compares raw bits (first_divergence; NaNs canonical) of every output and every part of
the returned state. Randomised: shapes, GVA head layouts, dtypes, both GatedDeltaRuleSpec variants
(chunked with small chunks so boundaries are crossed), a prefill split anywhere followed by decode
steps that continue the state, varlen packing, initial states, NaN/inf inputs.
Negative controls: a stock torch float32 recurrence, a double-rounding numba step and the chunk grid
restarted at a call boundary are each caught by the same comparison.
LOCKSTEP_FULL=1 runs 200 examples per randomised test (see test_cpu_backend.py); CI runs 15.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import hal
from hal.conformance.bits import first_divergence
from hal.spec import GatedDeltaRuleSpec
from test_cpu_backend import DTYPES, HYP, both, randn, same

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")

SPECS = [GatedDeltaRuleSpec(variant="serial", dk_tile=8), GatedDeltaRuleSpec(variant="chunked", chunk=8, dk_tile=8),
         GatedDeltaRuleSpec(variant="chunked", chunk=16, dk_tile=64), GatedDeltaRuleSpec()]
HEADS = [(1, 1), (1, 2), (2, 4), (3, 3)]


def same_state(label, ref, got):
    """Bits of every field of two GatedDeltaRuleState objects (None must match None)."""
    assert ref.spec_id == got.spec_id and ref.layout == got.layout
    for name, r, g in zip(type(ref.parts)._fields, ref.parts, got.parts):
        assert (r is None) == (g is None), f"{label}.{name}: one side is None"
        if r is not None:
            same(f"{label}.{name}", r, g)


def _gdn_inputs(g, lens, heads, dk, dv, dt, nan=False):
    h, hv = heads
    tot = sum(lens)
    q, k = randn(g, 1, tot, h, dk, dtype=dt), randn(g, 1, tot, h, dk, dtype=dt)
    v = randn(g, 1, tot, hv, dv, dtype=dt)
    gg = (-torch.rand(1, tot, hv, generator=g) * 0.5).to(dt)
    beta = torch.rand(1, tot, hv, generator=g).to(dt)
    if nan and tot > 1:  # NaN / inf in one token: propagates in its sequence only
        v[0, tot // 2, 0, 0] = float("nan")
        gg[0, 0, -1] = float("-inf")
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return q, k, v, gg, beta, cu


def _gdn_call(args, cu, spec, state, l2, backend, op=hal.chunk_gated_delta_rule):
    q, k, v, gg, beta = args
    return op(q, k, v, gg, beta, initial_state=state, output_final_state="state", cu_seqlens=cu,
              use_qk_l2norm_in_kernel=l2, spec=spec, backend=backend)


def _take(args, cu_full, starts, lens):
    """The tokens starts[i] .. starts[i] + lens[i] of every packed sequence, packed again."""
    idx = torch.cat([torch.arange(cu_full[i] + s, cu_full[i] + s + n) for i, (s, n) in enumerate(zip(starts, lens))])
    return [x[:, idx] for x in args], torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


@HYP
@given(lens=st.lists(st.integers(2, 24), min_size=1, max_size=3), heads=st.sampled_from(HEADS),
       dk=st.sampled_from([4, 12, 20]), dv=st.sampled_from([3, 16, 32]), dt=st.sampled_from(DTYPES),
       spec=st.sampled_from(SPECS), l2=st.booleans(), init=st.booleans(), nan=st.booleans(),
       data=st.data(), seed=st.integers(0, 2**16))
def test_gdn_prefill_split_then_decode_bits(lens, heads, dk, dv, dt, spec, l2, init, nan, data, seed):
    """Prefill split at a random point per sequence, then decode steps: cpu == reference at every call."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + 2 for n in lens]  # room for a split and two decode steps
    q, k, v, gg, beta, cu = _gdn_inputs(g, lens, heads, dk, dv, dt, nan)
    full = [q, k, v, gg, beta]
    cuf = cu.tolist()
    cut = [data.draw(st.integers(1, n - 2)) for n in lens]
    state = None
    if init:
        s0 = torch.randn(len(lens), heads[1], dk, dv, generator=g) * 0.1
        state = (s0, s0)
    else:
        state = (None, None)
    pieces = [([0] * len(lens), cut), (cut, [n - 2 - c for n, c in zip(lens, cut)]),
              ([n - 2 for n in lens], [1] * len(lens)), ([n - 1 for n in lens], [1] * len(lens))]
    for step, (starts, ns) in enumerate(pieces):
        keep = [i for i, n in enumerate(ns) if n > 0]
        if len(keep) < len(ns):  # a zero-length piece: skip the call (every sequence needs >= 1 token)
            continue
        args, cu_p = _take(full, cuf, starts, ns)
        op = hal.fused_recurrent_gated_delta_rule if step >= 2 else hal.chunk_gated_delta_rule
        o_r, st_r = _gdn_call(args, cu_p, spec, state[0], l2, "reference", op)
        o_c, st_c = _gdn_call(args, cu_p, spec, state[1], l2, "cpu", op)
        same(f"o[{step}]", o_r, o_c)
        same_state(f"state[{step}]", st_r, st_c)
        state = (st_r, st_c)


@HYP
@given(b=st.integers(1, 3), t=st.integers(1, 70), heads=st.sampled_from(HEADS), dt=st.sampled_from(DTYPES),
       spec=st.sampled_from(SPECS), l2=st.booleans(), seed=st.integers(0, 2**16))
def test_gdn_batched_bare_state_bits(b, t, heads, dt, spec, l2, seed):
    """Batched layout [B, T, ...], a bare float32 initial state, FLA's final_state tensor; beta=None (= 1)."""
    g = torch.Generator().manual_seed(seed)
    h, hv = heads
    q, k = randn(g, b, t, h, 8, dtype=dt), randn(g, b, t, h, 8, dtype=dt)
    v = randn(g, b, t, hv, 5, dtype=dt)
    gg = (-torch.rand(b, t, hv, generator=g)).to(dt)
    s0 = torch.randn(b, hv, 8, 5, generator=g)
    ref, got = both(hal.fused_recurrent_gated_delta_rule, q, k, v, gg, None, initial_state=s0,
                    output_final_state=True, use_qk_l2norm_in_kernel=l2, spec=spec)
    same("batched", ref, got)


def test_gdn_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(3)
    q, k, v, gg, beta, cu = _gdn_inputs(g, [70, 5, 33], (2, 4), 32, 16, torch.float32)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(hal.chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=cu, output_final_state=True,
                                                   backend="cpu"))
    finally:
        torch.set_num_threads(before)
    same("threads", outs[0], outs[1])


def test_gdn_chunked_split_over_threads_and_one_thread_same_bits(monkeypatch):
    """The chunked kernel's tasks split over 2 threads (pool.run) and run on the calling thread alone: same
    bits as each other and as the reference, final state included. Forcing the split is the only change."""
    from hal.kernels.cpu import gated_delta_rule as kg
    g = torch.Generator().manual_seed(5)
    q, k, v, gg, beta, cu = _gdn_inputs(g, [40, 3, 21], (2, 4), 12, 32, torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for par in (True, False):
            monkeypatch.setattr(kg, "parallel_worth", lambda work, par=par: par)
            outs.append(hal.chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=cu, output_final_state=True,
                                                   backend="cpu"))
    finally:
        torch.set_num_threads(old)
    same("2 threads vs one", outs[0], outs[1])
    same("vs reference", hal.chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=cu, output_final_state=True,
                                                    backend="reference"), outs[0])


# ------------------------------------------------------------------ negative controls (GDN)

def _decode_case():
    g = torch.Generator().manual_seed(11)
    q, k, v, gg, beta, _ = _gdn_inputs(g, [40], (1, 2), 64, 32, torch.float32)
    return q, k, v, gg, beta


def test_gdn_negative_control_stock_torch_recurrence_is_caught():
    q, k, v, gg, beta = _decode_case()
    spec = GatedDeltaRuleSpec(variant="serial")
    ref = hal.chunk_gated_delta_rule(q, k, v, gg, beta, spec=spec, backend="reference")[0]
    same("cpu", ref, hal.chunk_gated_delta_rule(q, k, v, gg, beta, spec=spec, backend="cpu")[0])
    from hal.kernels.oracle.gated_delta_rule import recurrence
    stock = recurrence(q, k, v, gg, beta, 64 ** -0.5, dtype=torch.float32)[0]
    assert first_divergence("stock", ref, stock) is not None


def _double_rounding_step(S, k, v, alpha, b):
    """One serial token step with every a*b + c rounded twice (the negative control's kernel)."""
    dk, dv = S.shape
    for c in range(dv):
        S[:, c] = S[:, c] * alpha
    for c in range(dv):
        w = np.float32(0.0)
        for a in range(dk):
            w = k[a] * S[a, c] + w  # double rounding
        u = (v[c] - w) * b
        for a in range(dk):
            S[a, c] = k[a] * u + S[a, c]
    return S


def test_gdn_negative_control_double_rounding_step_is_caught():
    """One serial token step (S' = alpha S; u = beta (v - S'^T k); S = S' + k u^T) with a*b + c rounded
    twice, compiled by numba like the kernel: its state differs from the cpu backend's."""
    g = torch.Generator().manual_seed(12)
    q, k, v = randn(g, 1, 1, 1, 64), randn(g, 1, 1, 1, 64) * 0.1, randn(g, 1, 1, 1, 64)
    gg, beta = torch.full((1, 1, 1), -0.1), torch.full((1, 1, 1), 0.7)
    s0 = torch.randn(1, 1, 64, 64, generator=g)
    spec = GatedDeltaRuleSpec(variant="serial", dk_tile=64)
    args = (q, k, v, gg, beta)
    fin = hal.chunk_gated_delta_rule(*args, initial_state=s0, output_final_state=True, spec=spec, backend="cpu")[1]
    ref = hal.chunk_gated_delta_rule(*args, initial_state=s0, output_final_state=True, spec=spec,
                                     backend="reference")[1]
    same("cpu", ref, fin)
    from numba import njit
    from hal.kernels.reference.strict_math import exp
    alpha = exp(gg.reshape(1)).numpy()[0]
    wrong = njit(cache=True)(_double_rounding_step)(s0[0, 0].numpy().copy(), k.reshape(64).numpy(),
                                                    v.reshape(64).numpy(), alpha, np.float32(0.7))
    assert first_divergence("double rounding", ref[0, 0], torch.from_numpy(wrong)) is not None


def test_gdn_negative_control_restarted_chunk_grid_is_caught():
    """Continuing the chunked spec from a bare tensor at a split off the grid restarts the grid: caught."""
    q, k, v, gg, beta = _decode_case()
    args = (q, k, v, gg, beta)
    one = hal.chunk_gated_delta_rule(*args, backend="cpu")[0]
    same("one-shot", hal.chunk_gated_delta_rule(*args, backend="reference")[0], one)
    first = [x[:, :23] for x in args]
    rest = [x[:, 23:] for x in args]
    o1, st_obj = hal.chunk_gated_delta_rule(*first, output_final_state="state", backend="cpu")
    o2, _ = hal.chunk_gated_delta_rule(*rest, initial_state=st_obj, backend="cpu")
    same("exact split", one, torch.cat([o1, o2], 1))
    o2b, _ = hal.chunk_gated_delta_rule(*rest, initial_state=st_obj.final_state, backend="cpu")
    assert first_divergence("restarted grid", one, torch.cat([o1, o2b], 1)) is not None


# ------------------------------------------------------------------ GDN layer pieces

@HYP
@given(shape=st.sampled_from([(5, 4), (2, 3, 8), (1, 16)]), dt=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_gdn_gating_bits(shape, dt, seed):
    g = torch.Generator().manual_seed(seed)
    hv = shape[-1]
    a, b = randn(g, *shape, dtype=dt, scale=8.0), randn(g, *shape, dtype=dt, scale=8.0)
    a.view(-1)[0] = float("inf")
    b.view(-1)[-1] = float("nan")
    A_log, dt_bias = randn(g, hv, dtype=dt), randn(g, hv, dtype=dt)
    same("gating", *both(hal.gdn_gating, A_log, a, dt_bias, b))


@HYP
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), d=st.integers(1, 9), kw=st.integers(1, 5),
       bias=st.booleans(), act=st.sampled_from(["silu", None]), dt=st.sampled_from(DTYPES),
       packed=st.booleans(), seed=st.integers(0, 2**16))
def test_gdn_conv1d_bits_and_split(lens, d, kw, bias, act, dt, packed, seed):
    """Varlen or batched, with a conv state; then one decode token continuing each sequence's state."""
    g = torch.Generator().manual_seed(seed)
    if not packed:
        lens = [lens[0]] * len(lens)
    n = len(lens)
    w = randn(g, d, kw, dtype=dt)
    bb = randn(g, d, dtype=dt) if bias else None
    st0 = randn(g, n, kw - 1, d, dtype=dt)
    if packed:
        x, cu = randn(g, 1, sum(lens), d, dtype=dt), torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    else:
        x, cu = randn(g, n, lens[0], d, dtype=dt), None
    x.view(-1)[0] = float("nan")
    ref, got = both(hal.gdn_causal_conv1d, x, w, bb, st0, act, cu)
    same("conv", ref, got)
    x1 = randn(g, n, 1, d, dtype=dt)
    same("conv decode", *both(hal.gdn_causal_conv1d, x1, w, bb, got[1], act))


# ------------------------------------------------------------------ elementwise and rotary

def _specials(g, n, dt):
    x = torch.randn(n, generator=g) * 30
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 88.7, -103.9, 17.0, -17.0]
    x[: len(vals)] = torch.tensor(vals)
    x = x.to(dt)
    if dt == torch.float32:  # a NaN with a payload: the output NaN is canonical anyway
        x.view(torch.int32)[len(vals)] = 0x7FA00001
    return x


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", ["sigmoid", "silu", "softplus", "silu_mul"])
def test_elementwise_bits(op, dt):
    g = torch.Generator().manual_seed(7)
    x = _specials(g, 9000, dt).reshape(3, 3000)
    if op == "silu_mul":
        y = _specials(g, 9000, dt).reshape(3, 3000).flip(-1)
        same(op, *both(hal.silu_mul, x, y))
    else:
        same(op, *both(getattr(hal, op), x))


@HYP
@given(lead=st.sampled_from([(7,), (2, 5), (1, 3, 2)]), rdim=st.sampled_from([2, 8, 64]),
       extra=st.sampled_from([0, 6]), interleaved=st.booleans(), dt=st.sampled_from(DTYPES),
       own_freq=st.booleans(), seed=st.integers(0, 2**16))
def test_rotary_bits(lead, rdim, extra, interleaved, dt, own_freq, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-(2 ** 24) + 1, 2 ** 24, lead, generator=g)
    pos.view(-1)[0] = 0
    freq = torch.rand(rdim // 2, generator=g) if own_freq else None
    ref, got = both(hal.rotary_cos_sin, pos, rdim, 500000.0, freq)
    same("cos_sin", ref, got)
    x = randn(g, *lead, 3, rdim + extra, dtype=dt, scale=4.0)
    cos, sin = (t.unsqueeze(-2).to(dt) for t in got)  # broadcast over the head axis
    same("apply_rotary", *both(hal.apply_rotary, x, cos, sin, interleaved))
