"""torch.compile(fullgraph=True) of code calling hal ops gives eager's raw bits (Inductor, static and
dynamic shapes), backward runs through the compiled graph, and a backend or spec chosen when the graph
was traced is never baked in (the graph recompiles or the op reads the choice when it runs)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import hal
from hal.ops_registry import TORCH_OPS

from _torch_op_cases import F32, op_args, public
from hal.conformance.bits import same_bits


class GraphCount:
    """Graphs Dynamo compiles from here on (its own counter), from an empty compile cache."""

    def __init__(self):
        torch._dynamo.reset()
        counters.clear()

    @property
    def frame_count(self) -> int:
        return counters["stats"]["unique_graphs"]


def every_op(cases: dict):
    """Each table op alone, on its own inputs: one graph holding every op."""
    return {name: public(name, args) for name, args in cases.items()}


def _cases(rows):
    return {name: tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op_args(name, F32, rows))
            for name in TORCH_OPS}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_every_op_compiled_fullgraph_gives_eager_bits(dynamic):
    counter = GraphCount()
    compiled = torch.compile(every_op, fullgraph=True, dynamic=dynamic)
    for rows in (5, 7):  # never a fixed size of the cases (cu_seqlens 3, heads 4): duck sizing would tie them
        cases = _cases(rows)
        got, want = compiled(cases), every_op(cases)
        for name in TORCH_OPS:
            assert same_bits(got[name], want[name]), name
    if dynamic:
        assert counter.frame_count == 1  # one graph served both batch sizes


# ---------------------------------------------------------------- a composed chain

H, I, V = 256, 256, 64  # K = 256: stock F.linear's fp32 rows change with the batch here (the control)


def _weights():
    g = torch.Generator().manual_seed(7)
    return dict(norm=torch.randn(H, generator=g) * 0.1 + 1, gate_up=torch.randn(2 * I, H, generator=g) / 16,
                down=torch.randn(H, I, generator=g) / 16, head=torch.randn(V, H, generator=g) / 16)


W = _weights()


def chain(x, tokens, linear=hal.linear):
    h = hal.rms_norm(x, W["norm"])
    gate, up = linear(h, W["gate_up"]).chunk(2, -1)
    y = hal.linear(hal.silu_mul(gate, up), W["down"])
    return hal.token_logprobs(y, W["head"], tokens)


def _batch(n):
    g = torch.Generator().manual_seed(11)
    return torch.randn(37, H, generator=g)[:n], (torch.arange(37) * 5 % V)[:n]


def _compiled_chain(dynamic: bool, stock: bool = False):
    counter = GraphCount()
    fn = functools.partial(chain, linear=F.linear) if stock else chain
    return torch.compile(fn, fullgraph=True, dynamic=dynamic), counter


def _rows_stable(compiled) -> bool:
    """The first rows' bits are the same in a batch of 2 and a batch of 37."""
    x, t = _batch(37)
    return same_bits(compiled(x[:2], t[:2]), compiled(x, t)[:2])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_chain_gives_eager_bits_and_rows_do_not_change_with_the_batch(dynamic):
    compiled, counter = _compiled_chain(dynamic)
    for n in (2, 37):
        x, t = _batch(n)
        assert same_bits(compiled(x, t), chain(x, t))
    assert _rows_stable(compiled)
    assert counter.frame_count == (1 if dynamic else 2)


def test_negative_control_a_stock_linear_in_the_compiled_chain_is_caught_by_the_batch_check():
    compiled, counter = _compiled_chain(True, stock=True)
    assert not _rows_stable(compiled)
    assert counter.frame_count == 1


@pytest.fixture
def fresh_inductor():
    """No Inductor / AOT autograd cache: their keys hold the traced graph, not the ops' registered backwards,
    so a cache warmed by an older lockstep (backward formulas traced inline) would serve that older graph."""
    import torch._inductor.config as inductor_config
    with inductor_config.patch(force_disable_caches=True):
        yield


def test_backward_through_the_compiled_chain(fresh_inductor):
    x, t = _batch(4)
    w = W["down"].clone().requires_grad_(True)

    def loss(x, w):
        h = hal.rms_norm(x, W["norm"])
        gate, up = hal.linear(h, W["gate_up"]).chunk(2, -1)
        return hal.token_logprobs(hal.linear(hal.silu_mul(gate, up), w), W["head"], t).sum()

    xs = [x.clone().requires_grad_(True) for _ in range(3)]
    ws = [w.detach().clone().requires_grad_(True) for _ in range(3)]
    loss(xs[0], ws[0]).backward()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(xs[1], ws[1]).backward()
    torch.compile(loss, fullgraph=True)(xs[2], ws[2]).backward()
    # every backward is an opaque op running the eager formula: aot_eager and Inductor give eager's bits
    for got_x, got_w in zip(xs[1:], ws[1:]):
        assert same_bits(got_x.grad, xs[0].grad) and same_bits(got_w.grad, ws[0].grad)


# a negative control: rms_norm with its backward as traced torch code (the formula itself, not an op)
@torch.library.custom_op("lockstep_test::rms_norm_traced_backward", mutates_args=())
def _rms_norm_traced_backward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.lockstep.rms_norm(x, weight, eps, None, None)


_rms_norm_traced_backward.register_fake(lambda x, weight, eps: x.new_empty(x.shape))


def _traced_rms_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps, ctx.has_residual = inputs[2], False


def _traced_rms_backward(ctx, g):
    from hal.ops import _RMSNormFn
    return (*_RMSNormFn.backward(ctx, g)[:2], None)


_rms_norm_traced_backward.register_autograd(_traced_rms_backward, setup_context=_traced_rms_setup)


def _small_step(x, w_in, norm, head, tokens, rms_norm=hal.rms_norm):
    """linear -> rms_norm -> silu_mul -> log_softmax and token_logprobs: every grad is an op's."""
    gate, up = rms_norm(hal.linear(x, w_in), norm, 1e-6).chunk(2, -1)
    h = hal.silu_mul(gate, up)
    return hal.log_softmax(h, -1).sum() + hal.token_logprobs(h, head, tokens).sum()


def _small_step_grads(dtype, compiled: bool, rms_norm=hal.rms_norm):
    g = torch.Generator().manual_seed(5)
    leaves = [(torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_(True)
              for shape, scale in (((6, 16), 1.0), ((32, 16), 0.25), ((32,), 0.1), ((8, 16), 0.25))]
    with torch.no_grad():
        leaves[2] += 1
    fn = functools.partial(_small_step, rms_norm=rms_norm)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="inductor")
    fn(*leaves, torch.arange(6) % 8).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_inductor_training_step_grads_are_eagers_bits(dtype, fresh_inductor):
    """Inductor compiles the forward and the backward graph; every backward in it is a lockstep op whose
    kernel runs the eager formula, so each input's and parameter's grad is eager's raw bits."""
    want = _small_step_grads(dtype, compiled=False)
    got = _small_step_grads(dtype, compiled=True)
    assert [same_bits(a, b) for a, b in zip(got, want)] == [True] * len(want)


def test_negative_control_a_traced_backward_formula_under_inductor_is_caught(fresh_inductor):
    """The same step with rms_norm's backward as traced torch code: Inductor fuses it, grads differ."""
    want = _small_step_grads(torch.float32, compiled=False, rms_norm=_rms_norm_traced_backward)
    got = _small_step_grads(torch.float32, compiled=True, rms_norm=_rms_norm_traced_backward)
    assert not all(same_bits(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- attention ops: backward, cache writes


def test_varlen_attention_backward_through_a_compiled_graph_gives_eager_grads():
    """The op's backward is itself a lockstep op (its math reads cu_seqlens on the host): the compiled
    graph's grads are the eager op's bits, under aot_eager and Inductor alike."""
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, window = op_args("flash_attn_varlen", F32, 5)

    def loss(q, k, v):
        out, lse = hal.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, scale, causal, window, return_lse=True)
        return (out * out).sum() + lse.sum()

    leaves = [[t.detach().clone().requires_grad_(True) for t in (q, k, v)] for _ in range(3)]
    loss(*leaves[0]).backward()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves[1]).backward()
    torch.compile(loss, fullgraph=True)(*leaves[2]).backward()
    for got in leaves[1:]:
        assert all(same_bits(a.grad, b.grad) for a, b in zip(got, leaves[0]))


def test_kvcache_writes_made_by_a_compiled_graph_are_eagers():
    args = op_args("flash_attn_with_kvcache", F32, 2)
    q, kc, vc, k, v, lens, table, scale, causal, window, splits = args

    def decode(q, kc, vc, k, v):
        return hal.flash_attn_with_kvcache(q, kc, vc, k, v, lens, table, scale, causal, window, splits)

    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    want = decode(q, *caches[0], k, v)
    got = torch.compile(decode, fullgraph=True)(q, *caches[1], k, v)
    assert same_bits(got, want)
    assert same_bits(caches[1], caches[0]) and not same_bits(caches[1][0], kc)  # written, and as eager wrote
    with pytest.raises(Exception, match="no backward pass"):  # refused as eagerly, not a grad-less output
        torch.compile(decode, fullgraph=True)(q.clone().requires_grad_(True), kc.clone(), vc.clone(), k, v)


# ---------------------------------------------------------------- choices are never baked into a graph

_X = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
_WL = torch.randn(32, H, generator=torch.Generator().manual_seed(4)) / 16


def _linear(x, spec=None, backend=None):
    return hal.linear(x, _WL, spec=spec, backend=backend)


def follows_the_current_backend(compiled, fn=_linear, args=(_X,)) -> bool:
    """Compiled under hal.use("reference"), called under hal.use("stock"): stock's bits, and back."""
    with hal.use("reference"):
        first = compiled(*args)
    with hal.use("stock"):
        later = compiled(*args)
        stock = fn(*args)
    with hal.use("reference"):
        reference = fn(*args)
    assert not same_bits(stock, reference)  # the two choices are told apart by their bits
    return same_bits(first, reference) and same_bits(later, stock)


def test_a_graph_compiled_under_one_backend_follows_hal_use_when_called():
    assert follows_the_current_backend(torch.compile(_linear, fullgraph=True))


def test_negative_control_a_backend_resolved_at_trace_time_is_caught():
    with hal.use("reference"):  # a stand-in that resolves the backend when it is compiled: the design's bug
        baked = torch.compile(functools.partial(_linear, backend=hal.dispatch.requested_backend()[0]),
                              fullgraph=True)
    assert not follows_the_current_backend(baked)


def test_a_spec_change_recompiles_and_gives_that_specs_bits():
    counter = GraphCount()
    compiled = torch.compile(_linear, fullgraph=True)
    exact = "matmul.exact.s4.v2"
    default, other = compiled(_X), compiled(_X, spec=exact)
    assert same_bits(default, _linear(_X)) and same_bits(other, _linear(_X, spec=exact))
    assert not same_bits(default, other)  # the specs are told apart by their bits
    assert counter.frame_count == 2  # the spec id is a guarded constant: a second graph
    assert same_bits(compiled(_X, spec=hal.spec.get(exact)), other)  # an OpSpec object reaches the op as its id


def test_errors_raised_in_a_compiled_graph_are_the_public_ops_messages():
    compiled = torch.compile(lambda h, t: hal.token_logprobs(h, W["head"], t), fullgraph=True)
    x, t = _batch(3)
    with pytest.raises(hal.InputError, match=rf"tokens must be in \[0, {V}\)"):
        compiled(x, t + V)


# ---------------------------------------------------------------- Inductor's glue between lockstep ops


def test_bf16_glue_between_lockstep_ops_is_bitwise_with_emulate_precision_casts():
    """Inductor fuses stock elementwise glue and keeps its bf16 intermediates in float32 unless
    ``emulate_precision_casts`` rounds them as eager does (docs/integrations.md)."""
    import torch._inductor.config as inductor_config
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    w, nw = (torch.randn(64, 64, generator=g) / 8).bfloat16(), torch.randn(64, generator=g).bfloat16()

    def glued(x):
        z = (hal.linear(x, w) * 1.7 + r) * torch.sigmoid(r)  # stock bf16 glue between two lockstep ops
        return hal.rms_norm(z, nw)

    want = glued(x)
    results = {}
    for emulate in (False, True):
        torch._dynamo.reset()
        # config.patch, not monkeypatch: undoing a monkeypatch on torch's config module deletes the option
        with inductor_config.patch(emulate_precision_casts=emulate):
            results[emulate] = same_bits(torch.compile(glued, fullgraph=True)(x), want)
    assert results == {True: True, False: False}  # False: the control, the default config's fused glue differs


# ---------------------------------------------------------------- the gated delta rule ops

GH, GHV, GD = 2, 4, 16  # q/k heads, value heads, head dim of the GDN cases

def _gdn_weights():
    g = torch.Generator().manual_seed(21)
    return dict(qkv=torch.randn((2 * GH + GHV) * GD, H, generator=g) / 16, ab=torch.randn(2 * GHV, H, generator=g) / 16,
                conv=torch.randn((2 * GH + GHV) * GD, 4, generator=g) / 2, A_log=torch.randn(GHV, generator=g) / 2,
                dt_bias=torch.randn(GHV, generator=g) / 2)


GW = _gdn_weights()


def gdn_layer(x, linear=hal.linear):
    """A Gated DeltaNet layer's lockstep part over x [B, T, H]: projections, conv, gates, the delta rule."""
    b, t, _ = x.shape
    y, _ = hal.gdn_causal_conv1d(linear(x, GW["qkv"]), GW["conv"])
    q, k, v = y.split([GH * GD, GH * GD, GHV * GD], -1)
    a, beta_in = hal.linear(x, GW["ab"]).chunk(2, -1)
    g, beta = hal.gdn_gating(GW["A_log"], a, GW["dt_bias"], beta_in)
    o, _ = hal.chunk_gated_delta_rule(q.reshape(b, t, GH, GD), k.reshape(b, t, GH, GD), v.reshape(b, t, GHV, GD), g,
                                      beta, use_qk_l2norm_in_kernel=True)
    return o


def _gdn_batch(n, t=5):
    return torch.randn(37, t, H, generator=torch.Generator().manual_seed(23))[:n]


def test_compiled_gdn_layer_gives_eager_bits_and_rows_do_not_change_with_the_batch():
    counter = GraphCount()
    compiled = torch.compile(gdn_layer, fullgraph=True, dynamic=True)
    for n in (2, 37):
        assert same_bits(compiled(_gdn_batch(n)), gdn_layer(_gdn_batch(n)))
    assert same_bits(compiled(_gdn_batch(2)), compiled(_gdn_batch(37))[:2])
    assert counter.frame_count == 1  # one graph served both batch sizes


def test_negative_control_a_stock_projection_before_the_gdn_ops_is_caught_by_the_batch_check():
    torch._dynamo.reset()  # every graph of this test from a fresh cache (the recompile limit is per function)
    compiled = torch.compile(functools.partial(gdn_layer, linear=F.linear), fullgraph=True, dynamic=True)
    assert not same_bits(compiled(_gdn_batch(2)), compiled(_gdn_batch(37))[:2])


def _rule_inputs(t, seed=0, b=2):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, GH, GD, generator=g) for _ in range(2))
    v = torch.randn(b, t, GHV, GD, generator=g)
    return q, k, v, -torch.rand(b, t, GHV, generator=g), torch.rand(b, t, GHV, generator=g)


def _rule(q, k, v, g, beta, initial_state=None, output_final_state="state", spec=None):
    return hal.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, spec=spec)


def _split(xs, at):
    return tuple(x[:, :at] for x in xs), tuple(x[:, at:] for x in xs)


@pytest.mark.parametrize("spec", ["chunked", "serial"])
def test_a_state_object_crosses_the_compiled_graph_and_continues_exactly(spec):
    """Prefill 70 tokens, continue 30 then decode 1 from the returned state objects (split mid-chunk):
    the bits of one call over 101 tokens, compiled as eagerly. Under compile the state needs its spec named."""
    spec_id = next(s.id for s in hal.spec.all_specs() if s.family == "gated_delta_rule" and f".{spec}." in s.id)
    xs = _rule_inputs(101)
    torch._dynamo.reset()  # every graph of this test from a fresh cache (the recompile limit is per function)
    compiled = torch.compile(_rule, fullgraph=True)
    whole, st_whole = compiled(*xs, spec=spec_id)
    assert same_bits(whole, _rule(*xs, spec=spec_id)[0])
    first, rest = _split(xs, 70)
    mid, last = _split(rest, 30)
    o1, st = compiled(*first, spec=spec_id)
    assert isinstance(st, hal.GatedDeltaRuleState) and st.spec_id == spec_id and st.position.tolist() == [70, 70]
    o2, st = compiled(*mid, initial_state=st, spec=spec_id)  # (a state continues under the spec that made it)
    o3, st = torch.compile(hal.fused_recurrent_gated_delta_rule, fullgraph=True)(
        *last, initial_state=st, output_final_state=True, use_qk_l2norm_in_kernel=True, spec=spec_id)
    assert same_bits(torch.cat([o1, o2, o3], 1), whole) and same_bits(st.final_state, st_whole.final_state)
    # the spec shapes the state's tensors, so it is never left to the graph's run time (Dynamo wraps the
    # refusal its trace met in its own error, naming the raising line)
    with pytest.raises(Exception, match="state object out under torch.compile / export needs its spec named"):
        compiled(*first)


def test_negative_control_continuing_from_the_bare_final_tensor_mid_chunk_is_caught():
    xs = _rule_inputs(101)
    torch._dynamo.reset()  # every graph of this test from a fresh cache (the recompile limit is per function)
    compiled = torch.compile(_rule, fullgraph=True)
    whole, _ = compiled(*xs, output_final_state=False)
    first, rest = _split(xs, 70)
    o1, fin = compiled(*first, output_final_state=True)  # FLA's tensor: the state at 70, no open chunk rows
    o2, _ = compiled(*rest, initial_state=fin, output_final_state=False)
    assert isinstance(fin, torch.Tensor) and not same_bits(torch.cat([o1, o2], 1), whole)


def test_backward_through_the_compiled_gdn_ops_gives_eager_grads():
    """The four ops' backwards are lockstep ops too (the rule's reads cu_seqlens on the host): the compiled
    graph's grads are eager's bits under aot_eager and Inductor."""
    torch._dynamo.reset()  # every graph of this test from a fresh cache (the recompile limit is per function)
    x = _gdn_batch(1, 9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    weights = [GW[name] for name in ("qkv", "conv", "A_log", "dt_bias")]

    def loss(x, w_qkv, w_conv, A_log, dt_bias, S0):
        y, state = hal.gdn_causal_conv1d(hal.linear(x, w_qkv), w_conv, cu_seqlens=cu)
        q, k, v = y.split([GH * GD, GH * GD, GHV * GD], -1)
        a, b = hal.linear(x, GW["ab"]).chunk(2, -1)
        g, beta = hal.gdn_gating(A_log, a, dt_bias, b)
        o, fin = hal.chunk_gated_delta_rule(q.reshape(1, 9, GH, GD), k.reshape(1, 9, GH, GD),
                                            v.reshape(1, 9, GHV, GD), g, beta, initial_state=S0,
                                            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return (o * 0.5).sum() + fin.sum() + state.sum()

    S0 = torch.randn(2, GHV, GD, GD, generator=torch.Generator().manual_seed(5)) * 0.1
    leaves = [[t.detach().clone().requires_grad_(True) for t in (x, *weights, S0)] for _ in range(3)]
    loss(*leaves[0]).backward()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves[1]).backward()
    torch.compile(loss, fullgraph=True)(*leaves[2]).backward()
    for got in leaves[1:]:
        assert all(same_bits(a.grad, b.grad) for a, b in zip(got, leaves[0]))
    assert all(bool(t.grad.abs().sum() > 0) for t in leaves[0])  # every input got a gradient


def _rule_out(q, k, v, g, beta, spec=None, backend=None):
    return hal.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, spec=spec, backend=backend)[0]


def test_a_compiled_gdn_graph_follows_hal_use_and_recompiles_on_a_spec_change():
    xs = _rule_inputs(5)
    counter = GraphCount()
    compiled = torch.compile(_rule_out, fullgraph=True, backend="aot_eager")  # the guard is Dynamo's
    assert follows_the_current_backend(compiled, _rule_out, xs)
    serial = "gated_delta_rule.strict.serial.d64.lsm1.v2"
    default, other = compiled(*xs), compiled(*xs, spec=serial)
    assert same_bits(default, _rule_out(*xs)) and same_bits(other, _rule_out(*xs, spec=serial))
    assert not same_bits(default, other)  # the two specs are told apart by their bits
    assert counter.frame_count == 2  # the spec id is a guarded constant: a second graph
    with hal.use("reference"):  # negative control: a backend resolved when the graph is traced is caught
        baked = torch.compile(functools.partial(_rule_out, backend=hal.dispatch.requested_backend()[0]),
                              fullgraph=True, backend="aot_eager")
    assert not follows_the_current_backend(baked, _rule_out, xs)
