"""hal.jax's gated delta rule (both specs) against the reference bits, and jax.grad of attention,
rotary and the gated delta rule against the torch ops' autograd.

Bits are compared raw (no tolerance); gradients are not part of any spec, so they are compared
with a tolerance and checked deterministic (two runs, same bits). XLA compilation dominates the
run time: a few shapes per spec, compiled once. The conformance suites run through the jax
backend in tests/test_jax_backend.py (quick) and with LOCKSTEP_FULL=1 (every case).

    python -m pytest tests/test_jax_gdn.py -q                  # CI set
    LOCKSTEP_FULL=1 python -m pytest tests/test_jax_gdn.py -q  # + the chunked backend-block check
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

pytest.importorskip("jax", reason="jax is not installed (pip install 'lockstep[jax]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hal  # noqa: E402
import hal.jax as hj  # noqa: E402
from backends.jax import JaxBackend  # noqa: E402
from hal.conformance import inputs as gen  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.jax import gated_delta_rule as jgdn  # noqa: E402
from hal.spec import GatedDeltaRuleSpec  # noqa: E402

CPU = torch.device("cpu")
FULL = os.environ.get("LOCKSTEP_FULL") == "1"  # the block glue is variant-independent: chunked too when full
SPECS = {v: GatedDeltaRuleSpec(variant=v) for v in ("chunked", "serial")}
J = JaxBackend._j  # torch -> jax by the bits


def T(a):  # jax -> torch by the bits
    return JaxBackend._t(a, CPU)


def assert_same_bits(label, want, got):
    d = first_divergence(label, want, got)
    assert d is None, str(d)


# ---------------------------------------------------------------- GDN forward bits

LENS = (70, 9, 30)  # seq 0 crosses the 64-row chunk boundary and ends mid-chunk
H, HV, DK, DV = 1, 2, 16, 8  # GVA: two value heads read one q/k head


def _inputs(dtype=torch.bfloat16, tag="jg"):
    n = sum(LENS)
    return {
        "q": gen.randn(f"{tag}.q", (1, n, H, DK), dtype),
        "k": gen.randn(f"{tag}.k", (1, n, H, DK), dtype),
        "v": gen.randn(f"{tag}.v", (1, n, HV, DV), dtype),
        "g": -gen.rand(f"{tag}.g", (1, n, HV), torch.float32, 0.0, 1.0) ** 2 * 3.0,
        "beta": gen.rand(f"{tag}.b", (1, n, HV), dtype, 0.0, 1.0),
        "s0": gen.randn(f"{tag}.s0", (len(LENS), HV, DK, DV), torch.float32, scale=0.3),
        "cu": torch.tensor([0, 70, 79, 109], dtype=torch.int32),
        # one decode token for each of the three sequences, batched [3, 1]
        "next": {k: gen.randn(f"{tag}.n{k}", (3, 1, *s), dtype) for k, s in
                 (("q", (H, DK)), ("k", (H, DK)), ("v", (HV, DV)))},
    }


def _decode_inputs(x):
    nx = x["next"]
    g = -gen.rand("jg.ng", (3, 1, HV), torch.float32, 0.0, 1.0)
    return nx["q"], nx["k"], nx["v"], g, gen.rand("jg.nb", (3, 1, HV), nx["v"].dtype, 0.0, 1.0)


@functools.lru_cache(maxsize=None)
def _reference_prefill(variant):
    """The reference's packed varlen prefill of _inputs() from its bare initial state (shared by tests)."""
    x = _inputs()
    return hal.chunk_gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")), initial_state=x["s0"],
                                      output_final_state="state", cu_seqlens=x["cu"].long(),
                                      use_qk_l2norm_in_kernel=True, spec=SPECS[variant], backend="reference")


@pytest.mark.parametrize("variant", ["chunked", "serial"])
def test_gdn_prefill_varlen_then_decode_bits_equal_reference(variant):
    """Packed varlen prefill from a bare initial state, then one decode token per sequence from the
    returned state (the recurrent op name, a batched call): o and states equal the reference's bits."""
    s, x = SPECS[variant], _inputs()
    kw = dict(use_qk_l2norm_in_kernel=True, spec=s)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    ro, rst = _reference_prefill(variant)
    jo, jst = hj.chunk_gated_delta_rule(*map(J, args), initial_state=J(x["s0"]), output_final_state="state",
                                        cu_seqlens=J(x["cu"]), **kw)
    assert isinstance(jst, hj.GatedDeltaRuleState) and (variant == "serial") == (jst.open_k is None)
    assert_same_bits("prefill o", ro, T(jo))
    assert_same_bits("prefill final", rst.final_state, T(jst.final))
    assert_same_bits("prefill S", rst.parts.S, T(jst.S))
    if variant == "chunked":  # the unfinished chunk's rows travel in the state
        for name in ("open_k", "open_v", "open_g", "open_beta"):
            assert_same_bits(name, getattr(rst.parts, name), T(getattr(jst, name)))
    assert np.asarray(jst.position).tolist() == list(LENS)

    dec = _decode_inputs(x)
    ro2, rf2 = hal.fused_recurrent_gated_delta_rule(*dec, initial_state=rst, output_final_state=True,
                                                    backend="reference", **kw)
    jo2, jst2 = hj.fused_recurrent_gated_delta_rule(*map(J, dec), initial_state=jst, output_final_state=True, **kw)
    assert isinstance(jst2, hj.GatedDeltaRuleState)  # True with a state in: a state out, as in the torch API
    assert_same_bits("decode o", ro2, T(jo2))
    assert_same_bits("decode final", rf2.final_state, T(jst2.final))


@pytest.mark.parametrize("variant", ["serial"] + (["chunked"] if FULL else []))
def test_gdn_backend_blocks_many_sequences(variant):
    """The jax backend computes in blocks of 8 sequences x 64 tokens: 11 packed sequences (two groups,
    two longer than a token block) give the reference's bits, states included. Same layout and
    dtype as the quick conformance case, so the compiled block is shared."""
    lens = [3, 1, 70, 2, 5, 9, 4, 66, 1, 7, 12]
    n, s = sum(lens), SPECS[variant]
    x = {name: gen.randn(f"jb.{name}", (1, n, *sh), torch.float32) for name, sh in
         (("q", (1, 16)), ("k", (1, 16)), ("v", (2, 16)))}
    x["g"] = -gen.rand("jb.g", (1, n, 2), torch.float32, 0.0, 1.0)
    x["beta"] = gen.rand("jb.b", (1, n, 2), torch.float32, 0.0, 1.0)
    cu = torch.tensor(np.cumsum([0] + lens))
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    got = {b: hal.chunk_gated_delta_rule(*args, cu_seqlens=cu, output_final_state="state", spec=s,
                                         use_qk_l2norm_in_kernel=True, backend=b) for b in ("reference", "jax")}
    (ro, rst), (jo, jst) = got["reference"], got["jax"]
    assert_same_bits("o", ro, jo)
    assert jst.position.tolist() == lens
    for name in rst.parts._fields[1:]:
        want, have = getattr(rst.parts, name), getattr(jst.parts, name)
        assert (want is None) == (have is None), name
        if want is not None:
            assert_same_bits(name, want, have)


def test_gdn_stock_recurrence_is_caught():
    """Negative control: the plain float32 jnp recurrence (what jax.grad differentiates) gives
    other bits than the spec on the same inputs."""
    s, x = SPECS["chunked"], _inputs()
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    ro, rst = _reference_prefill("chunked")
    rf = rst.final_state
    cu = J(x["cu"])
    lens = cu[1:] - cu[:-1]
    padded = [jgdn.to_padded(J(a)[0], cu, max(LENS))[0] for a in args]
    st, _ = jgdn._start_state(J(x["s0"]), s, 3, (H, HV, DK, DV))
    stock = jax.jit(jgdn._stock_padded, static_argnames=jgdn._STATIC)
    o, _, _, _, _, _, final = stock(*padded, lens, st.position, st.S, *st[2:6], scale=DK ** -0.5, l2=True, spec=s,
                                    fresh=True)
    assert first_divergence("stock o", ro, T(jgdn.to_packed(o, cu, sum(LENS), 0.0)[None])) is not None
    assert first_divergence("stock final", rf, T(final)) is not None


def test_gdn_bad_input_is_refused():
    s, x = SPECS["chunked"], _inputs()
    q, k, v, g, beta = (J(x[n][:, :9]) for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(hal.InputError, match="multiple of H"):  # 3 value heads on 2 q/k heads
        hj.chunk_gated_delta_rule(jnp.repeat(q, 2, 2), jnp.repeat(k, 2, 2), jnp.repeat(v[:, :, :1], 3, 2),
                                  jnp.repeat(g[..., :1], 3, 2), jnp.repeat(beta[..., :1], 3, 2), spec=s)
    with pytest.raises(hal.InputError, match="cu_seqlens"):
        hj.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=jnp.array([0, 5, 4, 9]), spec=s)
    serial_state = jgdn.GatedDeltaRuleState(jnp.zeros((1,), jnp.int32), jnp.zeros((1, HV, DK, DV)), None, None, None, None,
                                 jnp.zeros((1, HV, DK, DV)))
    with pytest.raises(hal.InputError, match="open chunk rows"):
        hj.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=serial_state, spec=s)


# ---------------------------------------------------------------- jax.grad


def _close(label, want: torch.Tensor, got, rtol=1e-4, atol=1e-5):
    got = np.asarray(got)
    want = want.detach().numpy()
    assert got.shape == want.shape, (label, got.shape, want.shape)
    assert np.allclose(got, want, rtol=rtol, atol=atol), (label, float(np.abs(got - want).max()))


def _twice_same(fn, *args):
    """Run a jax.grad twice: bitwise the same gradients (deterministic)."""
    a, b = fn(*args), fn(*args)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
    return a


def test_gdn_grad_through_a_state_with_open_rows():
    """Chunked spec, fp32: 10 tokens from a GatedDeltaRuleState holding s0, then 10 more from the returned state
    (its 10 open rows replayed); jax.grad of a loss on both outputs and the final state equals the
    torch op's autograd over the whole 20 tokens. Both calls have one shape: one compilation."""
    s = SPECS["chunked"]
    shapes = {"q": (2, 20, 1, 8), "k": (2, 20, 1, 8), "v": (2, 20, 2, 8), "g": (2, 20, 2), "beta": (2, 20, 2)}
    x = {n: gen.randn(f"gg.{n}", sh, torch.float32) for n, sh in shapes.items()}
    x["g"] = -x["g"].abs()
    x["beta"] = x["beta"].sigmoid()
    s0 = gen.randn("gg.s0", (2, 2, 8, 8), torch.float32, scale=0.3)
    wo, wf = gen.randn("gg.wo", shapes["v"], torch.float32), gen.randn("gg.wf", (2, 2, 8, 8), torch.float32)
    names = ("q", "k", "v", "g", "beta")
    leaves = [x[n].clone().requires_grad_(True) for n in names] + [s0.clone().requires_grad_(True)]
    o, fin = hal.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, spec=s, backend="reference")
    ((o * wo).sum() + (fin * wf).sum()).backward()

    def loss(q, k, v, g, beta, s0):
        kw = dict(use_qk_l2norm_in_kernel=True, spec=s)
        zero = jnp.zeros((2, s.chunk, 2), jnp.float32)
        st = hj.GatedDeltaRuleState(jnp.zeros((2,), jnp.int32), s0, jnp.zeros((2, s.chunk, 1, 8), jnp.float32),
                         jnp.zeros((2, s.chunk, 2, 8), jnp.float32), zero, zero, s0)
        o1, st = hj.chunk_gated_delta_rule(q[:, :10], k[:, :10], v[:, :10], g[:, :10], beta[:, :10],
                                           initial_state=st, output_final_state="state", **kw)
        o2, st = hj.fused_recurrent_gated_delta_rule(q[:, 10:], k[:, 10:], v[:, 10:], g[:, 10:], beta[:, 10:],
                                                     initial_state=st, output_final_state=True, **kw)
        return (jnp.concatenate([o1, o2], 1) * J(wo)).sum() + (st.final * J(wf)).sum()
    grads = _twice_same(jax.grad(loss, argnums=tuple(range(6))), *(J(x[n]) for n in names), J(s0))
    for name, leaf, gr in zip((*names, "s0"), leaves, grads):
        _close(name, leaf.grad, gr)


def test_attention_grad_matches_torch_autograd():
    """Varlen, GQA (4 query heads on 2 kv heads), causal with a left window: the stock float32
    backward gives the torch op's gradients."""
    cq = torch.tensor([0, 5, 17, 20], dtype=torch.int32)
    ck = torch.tensor([0, 9, 21, 30], dtype=torch.int32)
    q = gen.randn("ga.q", (20, 4, 16), torch.float32)
    k, v = (gen.randn(f"ga.{n}", (30, 2, 16), torch.float32) for n in "kv")
    w = gen.randn("ga.w", (20, 4, 16), torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = hal.flash_attn_varlen_func(*leaves, cq, ck, 12, 12, causal=True, window_size=(4, -1), backend="reference")
    (o * w).sum().backward()

    def loss(a, b, c):
        return (hj.flash_attn_varlen_func(a, b, c, J(cq), J(ck), 12, 12, causal=True, window_size=(4, -1)) *
                J(w)).sum()
    grads = _twice_same(jax.grad(loss, argnums=(0, 1, 2)), J(q), J(k), J(v))
    for name, leaf, gr in zip("qkv", leaves, grads):
        _close(name, leaf.grad, gr)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_grad_matches_torch_autograd(interleaved):
    x = gen.randn("gr.x", (3, 7, 2, 20), torch.float32)  # rotary on 16 of 20 dims: 4 pass through
    c, s = hal.rotary_cos_sin(torch.arange(7), 16, backend="reference")
    w = gen.randn("gr.w", (3, 7, 2, 20), torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (x, c, s)]
    y = hal.apply_rotary(leaves[0], leaves[1][:, None], leaves[2][:, None], interleaved=interleaved,
                         backend="reference")
    (y * w).sum().backward()

    def loss(a, cc, ss):
        return (hj.apply_rotary(a, cc[:, None], ss[:, None], interleaved) * J(w)).sum()
    grads = _twice_same(jax.grad(loss, argnums=(0, 1, 2)), J(x), J(c), J(s))
    for name, leaf, gr in zip(("x", "cos", "sin"), leaves, grads):
        _close(name, leaf.grad, gr)


def test_rotary_cos_sin_grad_wrt_inv_freq():
    """d/df [sum cos(p f) + 2 sum sin(p f)] = sum_p p (2 cos(p f) - sin(p f)) (float32 stock)."""
    pos = np.arange(7, dtype=np.float64)
    f = np.linspace(0.05, 0.9, 8)
    got = jax.grad(lambda inv: (lambda cs: cs[0].sum() + 2 * cs[1].sum())(
        hj.rotary_cos_sin(jnp.arange(7), 16, inv_freq=inv)))(jnp.asarray(f, jnp.float32))
    want = (pos[:, None] * (2 * np.cos(pos[:, None] * f) - np.sin(pos[:, None] * f))).sum(0)
    assert np.allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_gdn_layer_pieces_grad_match_torch_autograd():
    """gdn_gating and gdn_causal_conv1d (packed varlen, with a conv state and bias)."""
    hv, d, kw = 3, 6, 4
    A_log, dt_bias = (gen.randn(f"gl.{n}", (hv,), torch.float32) for n in ("A", "dt"))
    a, b = (gen.randn(f"gl.{n}", (2, 5, hv), torch.float32, scale=2.0) for n in "ab")
    leaves = [t.clone().requires_grad_(True) for t in (A_log, a, dt_bias, b)]
    g, beta = hal.gdn_gating(*leaves, backend="reference")
    wg, wb = gen.randn("gl.wg", g.shape, torch.float32), gen.randn("gl.wb", beta.shape, torch.float32)
    ((g * wg).sum() + (beta * wb).sum()).backward()

    def gate_loss(*xs):
        gj, bj = hj.gdn_gating(*xs)
        return (gj * J(wg)).sum() + (bj * J(wb)).sum()
    grads = _twice_same(jax.grad(gate_loss, argnums=(0, 1, 2, 3)), *map(J, (A_log, a, dt_bias, b)))
    for name, leaf, gr in zip(("A_log", "a", "dt_bias", "b"), leaves, grads):
        _close(name, leaf.grad, gr)

    cu = [0, 3, 10]
    x = gen.randn("gl.x", (1, 10, d), torch.float32)
    w, bias = gen.randn("gl.w", (d, kw), torch.float32, scale=0.5), gen.randn("gl.bias", (d,), torch.float32)
    st0 = gen.randn("gl.st", (2, kw - 1, d), torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, bias, st0)]
    y, st = hal.gdn_causal_conv1d(*leaves[:3], conv_state=leaves[3], cu_seqlens=torch.tensor(cu), backend="reference")
    wy, ws = gen.randn("gl.wy", y.shape, torch.float32), gen.randn("gl.ws", st.shape, torch.float32)
    ((y * wy).sum() + (st * ws).sum()).backward()

    def conv_loss(xx, ww, bb, ss):
        yj, sj = hj.gdn_causal_conv1d(xx, ww, bb, ss, cu_seqlens=cu)
        return (yj * J(wy)).sum() + (sj * J(ws)).sum()
    grads = _twice_same(jax.grad(conv_loss, argnums=(0, 1, 2, 3)), *map(J, (x, w, bias, st0)))
    for name, leaf, gr in zip(("x", "weight", "bias", "conv_state"), leaves, grads):
        _close(name, leaf.grad, gr)


def test_gdn_state_old_name_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="GatedDeltaRuleState"):
        old = hj.GDNState
    assert old is hj.GatedDeltaRuleState
    with pytest.raises(AttributeError):
        hj.NoSuchName  # noqa: B018
