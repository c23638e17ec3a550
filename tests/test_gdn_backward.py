"""The gated delta rule backward (hal/gdn_backward.py): the chunked recompute against the
token-by-token float64 oracle under autograd, determinism in raw bits, and negative controls."""
import pytest
import torch

import hal
from hal import gdn_backward
from hal.conformance.bits import assert_same_bits, same_bits
from hal.errors import InputError
from hal.kernels.oracle.gated_delta_rule import gated_delta_rule as oracle
from hal.spec import GatedDeltaRuleSpec

F32, F64 = torch.float32, torch.float64
NAMES = ("q", "k", "v", "g", "beta", "S0")


def _inputs(B=1, T=70, H=1, HV=2, dk=16, dv=8, dtype=F32, seed=0, kscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=gen)
    k = torch.randn(B, T, H, dk, generator=gen) * kscale
    v = torch.randn(B, T, HV, dv, generator=gen)
    lg = -torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return [x.to(dtype) for x in (q, k, v, lg, beta)]


def _cotangents(o_shape, f_shape):
    gen = torch.Generator().manual_seed(9)
    return torch.randn(o_shape, generator=gen), torch.randn(f_shape, generator=gen)


def _hal_grads(x, S0=None, cu=None, l2=True, op="chunk_gated_delta_rule", nudge=False, **kw):
    """Gradients of sum(o * do) + sum(final * dfinal) through the public op, and the (do, dfinal) used.

    ``S0``: a bare state tensor (differentiated) or a state object (then only o is differentiated:
    dfinal = 0). ``nudge``: raise one element of do by one ulp."""
    leaves = [t.clone().requires_grad_(True) for t in x]
    s0 = S0.clone().requires_grad_(True) if isinstance(S0, torch.Tensor) else S0
    o, fin = getattr(hal, op)(*leaves, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                              cu_seqlens=None if cu is None else torch.tensor(cu), **kw)
    fin = fin if isinstance(fin, torch.Tensor) else None
    do, dfin = _cotangents(o.shape, (o.shape[0], *s0.layout[1:]) if fin is None else fin.shape)
    do = do.to(o.dtype)  # the gradient reaching the op is in o's dtype
    if nudge:
        do.view(-1)[-1] = torch.nextafter(do.view(-1)[-1], torch.tensor(float("inf"), dtype=do.dtype))
    if fin is None:
        dfin = torch.zeros_like(dfin)
        o.backward(do)
    else:
        torch.autograd.backward((o, fin), (do, dfin))
    grads = [t.grad for t in leaves] + ([s0.grad] if isinstance(s0, torch.Tensor) else [])
    return grads, (do, dfin)


def _oracle_grads(x, S0, cu, l2, cot, fn=oracle, scale=None):
    """The same gradients from the float64 token-by-token oracle (or ``fn``) under autograd."""
    ref = [t.double().requires_grad_(True) for t in x]
    s0 = None if S0 is None else S0.double().requires_grad_(True)
    o, fin = fn(*ref, x[0].shape[-1] ** -0.5 if scale is None else scale, s0, cu, l2, F64)
    torch.autograd.backward((o, fin), (cot[0].double(), cot[1].double()))
    return [t.grad for t in ref] + ([] if s0 is None else [s0.grad])


def _max_rel_err(got, want):
    """max |got - want| / max |want| per gradient."""
    return {n: float((a.double() - b).abs().max() / b.abs().max()) for n, a, b in zip(NAMES, got, want)}


def _assert_close(got, want, tol):
    errs = _max_rel_err(got, want)
    assert all(e <= tol for e in errs.values()), errs


# float32 recompute: the measured error is ~2e-7 of the largest gradient; bf16 gradients are rounded to bf16
TOL = {F32: 1e-5, torch.bfloat16: 2 ** -8}

CASES = {
    # name: (input kwargs, initial state shape or None, cu_seqlens, l2)
    "T150_gqa_l2_state": (dict(B=2, T=150, H=2, HV=4), (2, 4, 16, 8), None, True),
    "T37_short_no_l2": (dict(T=37, kscale=0.1), None, None, False),
    "varlen_3seq_state": (dict(T=200, H=1, HV=2), (3, 2, 16, 8), [0, 70, 75, 200], True),
    "varlen_gqa_no_l2": (dict(T=140, H=2, HV=4, kscale=0.1), None, [0, 64, 65, 140], False),
}


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_the_float64_token_by_token_oracle(case, dtype):
    kw, s_shape, cu, l2 = CASES[case]
    x = _inputs(dtype=dtype, **kw)
    S0 = None if s_shape is None else torch.randn(s_shape, generator=torch.Generator().manual_seed(5))
    got, cot = _hal_grads(x, S0, cu, l2)
    assert all(gr.dtype == t.dtype for gr, t in zip(got, x))
    _assert_close(got, _oracle_grads(x, S0, cu, l2, cot), TOL[dtype])


def test_fused_recurrent_op_has_the_same_backward():
    x = _inputs(B=2, T=100, H=1, HV=2)
    a, _ = _hal_grads(x, op="chunk_gated_delta_rule")
    b, _ = _hal_grads(x, op="fused_recurrent_gated_delta_rule")
    for n, ga, gb in zip(NAMES, a, b):
        assert_same_bits(ga, gb, n)


def test_every_backend_shares_the_backward():
    """The backward is backend-neutral: the reference and cpu backends give the same gradient bits
    (their forwards differ only in speed; the recompute reads the inputs, not the forward's outputs)."""
    x = _inputs(T=100, H=1, HV=2)
    a, _ = _hal_grads(x, backend="reference")
    b, _ = _hal_grads(x, backend="cpu")
    for n, ga, gb in zip(NAMES, a, b):
        assert_same_bits(ga, gb, n)


@pytest.mark.parametrize("spec", ["chunked", "serial"])
def test_continuation_from_a_state_object_with_an_open_chunk(spec):
    s = GatedDeltaRuleSpec(variant=spec)
    x = _inputs(T=190, H=1, HV=2)
    split = 37  # the chunked spec's state carries 37 open rows; the call then crosses two chunk boundaries
    _, st = hal.chunk_gated_delta_rule(*[t[:, :split] for t in x], output_final_state="state",
                                       use_qk_l2norm_in_kernel=True, spec=s)
    got, cot = _hal_grads([t[:, split:] for t in x], st, spec=s)
    ref = [t.double().requires_grad_(True) for t in x]
    o, _ = oracle(*ref, 16 ** -0.5, None, None, True, F64)
    o[:, split:].backward(cot[0].double())
    _assert_close(got, [t.grad[:, split:] for t in ref], TOL[F32])


def test_minus_inf_decay_gives_finite_correct_gradients():
    x = _inputs(T=100)
    x[3][0, 10, 0] = x[3][0, 80, 1] = float("-inf")  # forget everything at two rows
    got, cot = _hal_grads(x)
    want = _oracle_grads(x, None, None, True, cot)
    assert all(torch.isfinite(gr).all() for gr in got[:3] + got[4:])
    finite = [torch.where(torch.isfinite(gr), gr, 0) for gr in got]  # dL/dg at a -inf row: the oracle's value
    _assert_close(finite, [torch.where(torch.isfinite(gr), gr, 0) for gr in want], TOL[F32])
    assert same_bits(torch.isfinite(got[3]), torch.isfinite(want[3]))


def test_gradcheck_float64_chunked_form_across_chunks_and_sequences():
    """torch.autograd.gradcheck of the chunked recompute itself (float64), with two chunks in the
    first sequence, a short second one, GQA, the L2 norm and an initial state."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 75, 1, 3, dtype=F64, generator=gen) for _ in range(2))
    v = torch.randn(1, 75, 2, 2, dtype=F64, generator=gen)
    lg = -torch.rand(1, 75, 2, dtype=F64, generator=gen) * 0.2
    beta = torch.rand(1, 75, 2, dtype=F64, generator=gen)
    s0 = torch.randn(2, 2, 3, 2, dtype=F64, generator=gen)
    ins = [t.requires_grad_(True) for t in (q, k, v, lg, beta, s0)]

    def f(q, k, v, lg, beta, s0):
        return gdn_backward.chunked_gated_delta_rule(q, k, v, lg, beta, 0.5, s0, [0, 70, 75], True, F64)
    assert torch.autograd.gradcheck(f, ins, fast_mode=True)


# ---------------------------------------------------------------- determinism


def test_backward_is_deterministic_in_raw_bits():
    x = _inputs(B=2, T=150, H=2, HV=4)
    S0 = torch.randn(2, 4, 16, 8)
    a, _ = _hal_grads(x, S0)
    b, _ = _hal_grads(x, S0)
    for n, ga, gb in zip(NAMES, a, b):
        assert_same_bits(ga, gb, n)
    # negative control: the comparison sees a one-ulp change of one incoming gradient element
    c, _ = _hal_grads(x, S0, nudge=True)
    assert not all(same_bits(ga, gc) for ga, gc in zip(a, c))


# ---------------------------------------------------------------- negative controls and the fallback


def _shifted_decay(q, k, v, g, beta, *rest):
    """Deliberately wrong: each row decays by the previous row's g (off by one)."""
    return oracle(q, k, v, torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1), beta, *rest)


def _no_restart(q, k, v, g, beta, scale, S0, cu, l2, dtype):
    """Deliberately wrong: the packed sequences run as one (no restart at each sequence start)."""
    o, _ = gdn_backward.chunked_gated_delta_rule(q, k, v, g, beta, scale, S0[:1], None, l2, dtype)
    _, fin = gdn_backward.chunked_gated_delta_rule(q, k, v, g, beta, scale, S0, cu, l2, dtype)
    return o, fin


@pytest.mark.parametrize("wrong", [_shifted_decay, _no_restart], ids=["decay_off_by_one", "no_sequence_restart"])
def test_negative_control_wrong_variants_fail_the_check(wrong):
    kw, s_shape, cu, l2 = CASES["varlen_3seq_state"]
    x = _inputs(**kw)
    S0 = torch.randn(s_shape, generator=torch.Generator().manual_seed(5))
    got, cot = _hal_grads(x, S0, cu, l2)
    bad = _oracle_grads(x, S0, cu, l2, cot, fn=wrong)
    assert max(_max_rel_err(got, bad).values()) > 100 * TOL[F32]


def test_recurrent_fallback_agrees_and_bad_setting_is_an_input_error(monkeypatch):
    x = _inputs(T=100)
    a, _ = _hal_grads(x)
    monkeypatch.setenv("LOCKSTEP_GDN_BACKWARD", "recurrent")
    b, cot = _hal_grads(x)
    _assert_close(b, _oracle_grads(x, None, None, True, cot), TOL[F32])
    _assert_close(a, [t.double() for t in b], TOL[F32])
    monkeypatch.setenv("LOCKSTEP_GDN_BACKWARD", "chunky")
    leaves = [t.clone().requires_grad_(True) for t in x]
    o, _ = hal.chunk_gated_delta_rule(*leaves)
    with pytest.raises(InputError, match="LOCKSTEP_GDN_BACKWARD"):
        o.sum().backward()


# ops that torch documents as nondeterministic on CUDA (forward or backward), by their autograd node
CUDA_NONDETERMINISTIC = ("Cumsum", "IndexSelect", "Gather", "Scatter", "IndexAdd", "IndexPut", "Index",
                         "RepeatInterleave", "Put")


def _graph_ops(roots):
    seen, todo, names = set(), [r.grad_fn for r in roots], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__.removesuffix("Backward0").removesuffix("Backward1"))
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_the_recompute_graph_has_no_op_that_is_nondeterministic_on_cuda():
    """The CUDA half of the determinism claim, checked on CPU: no node of the differentiated graph
    is one of torch's documented nondeterministic CUDA ops (a changed torch.cumsum would show)."""
    x = [t.requires_grad_(True) for t in _inputs(T=140, H=1, HV=2)]
    S0 = torch.randn(2, 2, 16, 8, requires_grad=True)
    o, fin = gdn_backward.chunked_gated_delta_rule(*x, 0.25, S0, [0, 70, 140], True, F32)
    ops = _graph_ops([o, fin])
    assert {"Bmm", "Exp", "Stack", "Diagonal"} <= ops  # the walk reaches the whole graph
    assert not ops & set(CUDA_NONDETERMINISTIC), ops & set(CUDA_NONDETERMINISTIC)
    # negative control: the same walk sees a cumsum and an index_select
    bad = _graph_ops([x[3].cumsum(-1), x[0].index_select(1, torch.tensor([0, 2]))])
    assert {"Cumsum", "IndexSelect"} <= bad
