"""Gated delta rule: strict arithmetic helpers, both spec variants, state object, errors, autograd."""
import pytest
import torch

import hal
from hal.conformance.bits import same_bits
from hal.errors import InputError
from hal.spec import GatedDeltaRuleSpec
from hal.kernels.oracle.gated_delta_rule import gated_delta_rule as oracle

CHUNKED = GatedDeltaRuleSpec(variant="chunked")
SERIAL = GatedDeltaRuleSpec(variant="serial")
SPECS = [CHUNKED, SERIAL]
F32 = torch.float32


def _inputs(B=1, T=70, H=1, HV=2, dk=8, dv=4, dtype=F32, seed=0, gscale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g).to(dtype)
    k = torch.randn(B, T, H, dk, generator=g).to(dtype)
    v = torch.randn(B, T, HV, dv, generator=g).to(dtype)
    lg = -(torch.rand(B, T, HV, generator=g) * gscale)
    beta = torch.rand(B, T, HV, generator=g).to(dtype)
    return [q, k, v, lg, beta]


def _run(x, spec, op="chunk_gated_delta_rule", **kw):
    kw.setdefault("use_qk_l2norm_in_kernel", True)
    return getattr(hal, op)(*x, spec=spec, **kw)


def _pack(parts):
    """[(q, k, v, g, beta) per sequence, each [1, n, ...]] -> packed tensors and cu_seqlens."""
    cu = [0]
    for p in parts:
        cu.append(cu[-1] + p[0].shape[1])
    return [torch.cat([p[i] for p in parts], 1) for i in range(5)], torch.tensor(cu)


def _sl(x, a, b):
    return [t[:, a:b] for t in x]


# ---------------------------------------------------------------- strict helpers


# ---------------------------------------------------------------- spec ids and accuracy


def test_spec_ids_and_default():
    assert CHUNKED.id == "gated_delta_rule.strict.chunked.c64.d64.lsm1.v2"
    assert SERIAL.id == "gated_delta_rule.strict.serial.d64.lsm1.v2"
    assert hal.spec.DEFAULTS["gated_delta_rule"] == CHUNKED
    assert hal.spec.get(SERIAL.id) == SERIAL
    with pytest.raises(hal.SpecError):
        GatedDeltaRuleSpec(variant="parallel")
    with pytest.raises(hal.SpecError):
        GatedDeltaRuleSpec(variant="serial", chunk=32)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
@pytest.mark.parametrize("l2", [True, False])
def test_accuracy_against_float64_oracle(spec, l2):
    x = _inputs(B=2, T=140, H=1, HV=2, dk=32, dv=16)
    if not l2:
        x[1] = x[1] * 0.1
    o, fin = _run(x, spec, use_qk_l2norm_in_kernel=l2, output_final_state=True)
    oo, ff = oracle(*x, 32 ** -0.5, None, None, l2)
    # float32 accumulation: a few ulps of the largest |o| of the sequence and head
    mag = oo.abs().amax(dim=(1, 3), keepdim=True)
    assert ((o.double() - oo).abs() <= 16 * 2.0 ** -24 * mag).all()
    smag = ff.abs().amax(dim=(2, 3), keepdim=True)
    assert ((fin.double() - ff).abs() <= 16 * 2.0 ** -24 * smag).all()


def test_the_two_variants_are_different_computations():
    x = _inputs(T=100)
    a, _ = _run(x, CHUNKED)
    b, _ = _run(x, SERIAL)
    assert not same_bits(a, b)  # distinct ids because distinct bits
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_both_op_names_compute_the_spec(spec):
    x = _inputs(T=90)
    a, fa = _run(x, spec, output_final_state=True)
    b, fb = _run(x, spec, op="fused_recurrent_gated_delta_rule", output_final_state=True)
    assert same_bits(a, b) and same_bits(fa, fb)


# ---------------------------------------------------------------- split invariance


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
def test_every_split_point_continues_exactly(spec):
    """T = 70 split at every p in 1..69 (two varlen calls, each p its own sequence)."""
    T = 70
    x = _inputs(T=T, HV=1)
    o, fin = _run(x, spec, output_final_state=True)
    pts = list(range(1, T))
    first, cu1 = _pack([_sl(x, 0, p) for p in pts])
    second, cu2 = _pack([_sl(x, p, T) for p in pts])
    o1, st = _run(first, spec, cu_seqlens=cu1, output_final_state="state")
    o2, st2 = _run(second, spec, op="fused_recurrent_gated_delta_rule", cu_seqlens=cu2, initial_state=st,
                   output_final_state=True)
    assert isinstance(st2, hal.GatedDeltaRuleState)
    for i, p in enumerate(pts):
        got = torch.cat([o1[0, cu1[i]:cu1[i + 1]], o2[0, cu2[i]:cu2[i + 1]]])
        assert same_bits(got, o[0]), p
        assert same_bits(st2.final_state[i], fin[0]), p
        assert int(st2.position[i]) == T


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_token_by_token_equals_prefill(spec, dtype):
    x = _inputs(T=70, H=2, HV=4, dtype=dtype)
    o, fin = _run(x, spec, output_final_state=True)
    assert o.dtype == dtype and fin.dtype == F32
    st, outs = None, []
    for t in range(70):
        ot, st = _run(_sl(x, t, t + 1), spec, op="fused_recurrent_gated_delta_rule", initial_state=st,
                      output_final_state="state")
        outs.append(ot)
    assert same_bits(torch.cat(outs, 1), o) and same_bits(st.final_state, fin)


def test_bare_tensor_continuation_is_exact_only_at_chunk_multiples_for_chunked():
    T = 140
    x = _inputs(T=T)
    for spec in SPECS:
        o, _ = _run(x, spec)
        for p in (64, 128, 50, 100):
            o1, f1 = _run(_sl(x, 0, p), spec, output_final_state=True)
            assert isinstance(f1, torch.Tensor) and f1.dtype == F32
            o2, _ = _run(_sl(x, p, T), spec, initial_state=f1)
            same = same_bits(torch.cat([o1, o2], 1), o)
            # documented contract: serial anywhere; chunked at multiples of 64 only
            assert same == (spec.variant == "serial" or p % 64 == 0), (spec.variant, p)


def test_negative_controls_transformers_chunk_is_split_variant_and_differs_from_recurrent():
    T = 140
    x = _inputs(T=T, dk=16, dv=16)
    o, _ = _run(x, CHUNKED, backend="stock")
    o1, st = _run(_sl(x, 0, 50), CHUNKED, backend="stock", output_final_state="state")
    o2, _ = _run(_sl(x, 50, T), CHUNKED, backend="stock", initial_state=st)
    assert not same_bits(torch.cat([o1, o2], 1), o)  # grid restarted at 50
    r, _ = _run(x, CHUNKED, backend="stock", op="fused_recurrent_gated_delta_rule")
    assert not same_bits(r, o)  # chunk form vs recurrent form


def test_packed_varlen_equals_batched_and_is_batch_invariant():
    x = _inputs(B=3, T=75, H=2, HV=4)
    o, fin = _run(x, CHUNKED, output_final_state=True)
    packed = [t.reshape(1, -1, *t.shape[2:]) for t in x]
    op_, fp = _run(packed, CHUNKED, cu_seqlens=torch.tensor([0, 75, 150, 225], dtype=torch.int32),
                   output_final_state=True)
    assert same_bits(op_.reshape(o.shape), o) and same_bits(fp, fin)
    for b in range(3):
        ob, fb = _run([t[b: b + 1] for t in x], CHUNKED, output_final_state=True)
        assert same_bits(ob[0], o[b]) and same_bits(fb[0], fin[b])


def test_nan_and_positive_g_stay_in_their_sequence():
    x = _inputs(B=3, T=70)
    x[3] = x[3].clone()
    x[3][1, 10] = 0.5          # g > 0 is allowed: the state grows
    x[2] = x[2].clone()
    x[2][2, 5, 0] = float("nan")  # a NaN value poisons its own sequence's state (and only that)
    for spec in SPECS:
        o, _ = _run(x, spec)
        assert torch.isfinite(o[:2]).all()
        assert torch.isnan(o[2, 5:, 0]).all() and torch.isfinite(o[2, :5]).all() and torch.isfinite(o[2, :, 1]).all()
        for b in range(3):
            ob, _ = _run([t[b: b + 1] for t in x], spec)
            assert same_bits(ob[0].view(torch.int32), o[b].view(torch.int32))  # NaN payloads included


# ---------------------------------------------------------------- state object


def test_state_object_select_cat_and_empty_call():
    x = _inputs(B=3, T=70)
    _, st = _run(_sl(x, 0, 40), CHUNKED, output_final_state="state")
    assert st.batch_size == 3 and st.layout == (1, 2, 8, 4) and st.position.tolist() == [40, 40, 40]
    again = hal.GatedDeltaRuleState.cat([st.select(0), st.select([1, 2])])
    for a, b in zip(st.parts, again.parts):
        assert same_bits(a, b)
    o_full, _ = _run(_sl(x, 40, 70), CHUNKED, initial_state=st)
    o_re, _ = _run(_sl(x, 40, 70), CHUNKED, initial_state=again)
    assert same_bits(o_full, o_re)
    o0, st0 = _run(_sl(x, 40, 40), CHUNKED, initial_state=st, output_final_state=True)
    assert o0.shape[1] == 0 and st0.position.tolist() == [40, 40, 40]
    assert "GatedDeltaRuleState" in repr(st)


def _snapshot(st):
    return [None if t is None else t.clone() for t in st.parts]


def _same(st, snap):
    return all((a is None and b is None) or same_bits(a, b) for a, b in zip(st.parts, snap))


def test_bad_inputs_raise_clear_errors_and_leave_the_state_untouched():
    x = _inputs(B=2, T=20, H=1, HV=2)
    _, st = _run(x, CHUNKED, output_final_state="state")
    snap = _snapshot(st)
    q, k, v, g, beta = x
    cases = [
        ("k shape", dict(k=k[..., :4])),
        ("multiple of q/k heads",
         dict(q=q.expand(-1, -1, 2, -1), k=k.expand(-1, -1, 2, -1), v=torch.randn(2, 20, 3, 4))),
        ("g shape", dict(g=g[..., :1])),
        ("beta shape", dict(beta=beta[:, :5])),
        ("v shape", dict(v=v[:, :5])),
        ("dtypes differ", dict(q=q.bfloat16())),
        ("float64", dict(g=g.double())),
    ]
    for msg, repl in cases:
        args = {**dict(q=q, k=k, v=v, g=g, beta=beta), **repl}
        with pytest.raises(InputError, match=msg):
            hal.chunk_gated_delta_rule(**args, initial_state=st, spec=CHUNKED)
    # states from another spec variant, head layout or batch size
    with pytest.raises(InputError, match="spec"):
        _run(x, SERIAL, initial_state=st)
    _, st_other = _run(_inputs(B=2, T=5, H=2, HV=2), CHUNKED, output_final_state="state")
    with pytest.raises(InputError, match="head layout"):
        _run(x, CHUNKED, initial_state=st_other)
    with pytest.raises(InputError, match="sequences"):
        _run(_sl(x, 0, 5), CHUNKED, initial_state=st.select(0))
    with pytest.raises(InputError, match="must be torch.float32"):
        _run(x, CHUNKED, initial_state=torch.zeros(2, 2, 8, 4, dtype=torch.bfloat16))
    with pytest.raises(InputError, match=r"\[N, HV, d_k, d_v\]"):
        _run(x, CHUNKED, initial_state=torch.zeros(2, 2, 4, 8))
    # cu_seqlens: non-increasing, wrong ends, batched input
    packed = [t.reshape(1, -1, *t.shape[2:]) for t in x]
    for cu, msg in (([0, 20, 20, 40], "strictly increasing"), ([0, 25, 20, 40], "strictly increasing"),
                    ([0, 20, 39], "end at"), ([1, 20, 40], "start at 0")):
        with pytest.raises(InputError, match=msg):
            _run(packed, CHUNKED, cu_seqlens=torch.tensor(cu), initial_state=st)
    with pytest.raises(InputError, match="packed"):
        _run(x, CHUNKED, cu_seqlens=torch.tensor([0, 20]))
    with pytest.raises(InputError, match="output_final_state"):
        _run(x, CHUNKED, output_final_state="yes")
    with pytest.raises(InputError, match="scale"):
        _run(x, CHUNKED, scale=-1.0)
    assert _same(st, snap)


# ---------------------------------------------------------------- autograd


def test_gradcheck_float64():
    D = torch.float64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 1, 3, dtype=D, generator=g, requires_grad=True)
    k = torch.randn(1, 6, 1, 3, dtype=D, generator=g, requires_grad=True)
    v = torch.randn(1, 6, 2, 2, dtype=D, generator=g, requires_grad=True)
    lg = (-torch.rand(1, 6, 2, dtype=D, generator=g)).requires_grad_(True)
    beta = torch.rand(1, 6, 2, dtype=D, generator=g, requires_grad=True)
    s0 = torch.randn(2, 2, 3, 2, dtype=D, generator=g, requires_grad=True)
    cu = torch.tensor([0, 4, 6])

    def f(q, k, v, lg, beta, s0):
        return hal.chunk_gated_delta_rule(q, k, v, lg, beta, initial_state=s0, output_final_state=True,
                                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.autograd.gradcheck(f, (q, k, v, lg, beta, s0))


def test_backward_is_deterministic_correct_and_forward_bits_unchanged():
    x = _inputs(T=70, H=1, HV=2)
    o_inf, _ = _run(x, CHUNKED)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in x]
        o, fin = _run(leaves, CHUNKED, output_final_state=True)
        assert same_bits(o.detach(), o_inf)  # training forward == inference forward, bit for bit
        (o.square().sum() + fin.sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert same_bits(a, b)
    ref = [t.double().requires_grad_(True) for t in x]
    oo, ff = oracle(*ref, 8 ** -0.5, None, None, True)
    (oo.square().sum() + ff.sum()).backward()
    for got, want in zip(grads[0], ref):
        assert torch.allclose(got.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_backward_through_a_state_object_continuation():
    x = _inputs(T=70)
    _, st = _run(_sl(x, 0, 37), CHUNKED, output_final_state="state")
    leaves = [t[:, 37:].clone().requires_grad_(True) for t in x]
    o, _ = _run(leaves, CHUNKED, initial_state=st)
    o.sum().backward()
    ref = [t.double().requires_grad_(True) for t in x]
    oo, _ = oracle(*ref, 8 ** -0.5, None, None, True)
    oo[:, 37:].sum().backward()
    for got, want in zip(leaves, ref):
        assert torch.allclose(got.grad.double(), want.grad[:, 37:], rtol=1e-4, atol=1e-5)
