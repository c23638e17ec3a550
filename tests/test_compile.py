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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


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


def test_backward_through_the_compiled_chain():
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
    # AOT autograd runs the registered backward formula's aten ops as eager does: the same bits
    assert same_bits(xs[1].grad, xs[0].grad) and same_bits(ws[1].grad, ws[0].grad)
    # Inductor fuses the backward's float32 math (a backward is not a spec: docs/design.md principle 6)
    assert torch.isfinite(xs[2].grad).all() and torch.isfinite(ws[2].grad).all()
    assert xs[2].grad.shape == x.shape and ws[2].grad.shape == w.shape


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


def follows_the_current_backend(compiled) -> bool:
    """Compiled under hal.use("reference"), called under hal.use("stock"): stock's bits, and back."""
    with hal.use("reference"):
        first = compiled(_X)
    with hal.use("stock"):
        later = compiled(_X)
        stock = _linear(_X)
    with hal.use("reference"):
        reference = _linear(_X)
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
