"""A spec object that is not a registered id gives the same bits compiled (torch.compile(fullgraph=True)) as
eagerly, for every spec family: it crosses the torch op as its id and the kernel rebuilds it (hal.spec.from_id).

Each case's spec is checked to change the bits against the family's default on the same inputs, so the
compiled result equal to the eager one is that spec's computation, not the default's. Before the fix the
compiled call failed with "SpecError: unknown spec id" (the negative control: run this file on b07734e).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

import hal
from hal import spec as S

from _torch_op_cases import op_args
from hal.conformance.bits import same_bits


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gdn_inputs(t=7):
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, t, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(2, t, 4, 8, generator=g)
    return q, k, v, -torch.rand(2, t, 4, generator=g), torch.rand(2, t, 4, generator=g)


def _attention_inputs():
    q, k, v, cu_q, cu_k, max_q, max_k, *_ = (a.detach() if isinstance(a, torch.Tensor) else a
                                           for a in op_args("flash_attn_varlen", rows=9))
    return q, k, v, cu_q, cu_k, max_q, max_k


# family -> (a non-default, unregistered spec object, call(spec, *inputs), inputs)
CASES = {
    "matmul": (S.MatmulSpec(k_tile=4), lambda s, x, w: hal.linear(x, w, spec=s), (_x(3, 16), _x(8, 16, seed=1))),
    "matmul-exact": (S.ExactMatmulSpec(slices=2), lambda s, x, w: hal.linear(x, w, spec=s),
                     (_x(3, 16), _x(8, 16, seed=1))),
    "rms_norm": (S.RMSNormSpec(hidden_tile=4), lambda s, x, w: hal.rms_norm(x, w, 1e-6, spec=s),
                 (_x(3, 64) * torch.logspace(-3, 3, 64), _x(64, seed=1))),  # wide magnitudes: tiling shows
    "softmax": (S.SoftmaxSpec(tile=4), lambda s, x: hal.log_softmax(x, -1, spec=s), (_x(3, 16) * 4,)),
    "token_logprobs": (S.TokenLogprobsSpec(hidden_tile=4, vocab_tile=8),
                       lambda s, h, w, t: hal.token_logprobs(h, w, t, spec=s),
                       (_x(3, 16), _x(32, 16, seed=1), torch.tensor([1, 7, 30]))),
    "token_logprobs-exact": (S.TokenLogprobsSpec(matmul=S.ExactMatmulSpec(slices=2), vocab_tile=8),
                             lambda s, h, w, t: hal.token_logprobs(h, w, t, spec=s),
                             (_x(3, 16), _x(32, 16, seed=1), torch.tensor([1, 7, 30]))),
    "attention": (S.AttentionSpec(kv_block=2, kv_split=4, dot_tile=4),
                  lambda s, q, k, v, cq, ck, mq, mk: hal.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True,
                                                                                spec=s),
                  _attention_inputs()),
    "gated_delta_rule": (S.GatedDeltaRuleSpec(chunk=4, dk_tile=4),
                         lambda s, q, k, v, g, b: hal.chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True,
                                                                             use_qk_l2norm_in_kernel=True, spec=s),
                         _gdn_inputs()),
}


@pytest.mark.parametrize("family", list(CASES))
def test_an_unregistered_spec_object_compiled_gives_its_eager_bits(family):
    spec, call, inputs = CASES[family]
    assert spec.id not in {s.id for s in S.all_specs()}  # the point: not a registered id
    with torch.no_grad():
        eager = call(spec, *inputs)
        default = call(None, *inputs)
        assert not same_bits(eager, default), "the spec must change the bits here, or the test proves nothing"
        torch._dynamo.reset()
        compiled = torch.compile(lambda *xs: call(spec, *xs), fullgraph=True)(*inputs)
        assert same_bits(compiled, eager)
        torch._dynamo.reset()  # its id string too: eagerly and compiled
        by_id = torch.compile(lambda *xs: call(spec.id, *xs), fullgraph=True)(*inputs)
        assert same_bits(by_id, eager) and same_bits(call(spec.id, *inputs), eager)


@pytest.mark.parametrize("spec", [S.ElementwiseSpec(), S.RotarySpec()], ids=["elementwise", "rotary"])
def test_families_with_one_spec_cross_as_an_object_too(spec):
    """elementwise and rotary have one spec each (their only fields are the policy and version, and no CPU
    backend runs their fast policy): a spec object passed explicitly crosses and comes back."""
    x = _x(3, 16)
    with torch.no_grad():
        if spec.family == "elementwise":
            call = lambda s, x: hal.silu(x, spec=s)  # noqa: E731
        else:
            cos, sin = hal.rotary_cos_sin(torch.arange(3), 8)
            call = lambda s, x: hal.apply_rotary(x, cos, sin, spec=s)  # noqa: E731
        torch._dynamo.reset()
        assert same_bits(torch.compile(lambda x: call(spec, x), fullgraph=True)(x), call(spec, x))


def test_every_spec_round_trips_through_its_id():
    ours = [*S.all_specs(), *(spec for spec, _, _ in CASES.values()), S.GatedDeltaRuleSpec(variant="serial", dk_tile=4),
            S.FastMatmulSpec(block_m=32, num_stages=4), S.FastAttentionSpec(block_m=32, kv_block=32, kv_split=128),
            S.AttentionSpec(p_precision="input", kv_split=128)]
    for spec in ours:
        assert S.from_id(spec.id) == spec and type(S.from_id(spec.id)) is type(spec), spec.id
    for bad in ("matmul.strict.k63.v9", "matmul.exact.s9.v2", "softmax.strict.t64.lsm0.v2", "matmul.strict.k064.v2",
                "matmul.strict", "nonsense"):
        assert S.from_id(bad) is None, bad
    with pytest.raises(hal.SpecError, match="unknown spec id 'matmul.strict.k63.v9'"):
        S.resolve("matmul", "matmul.strict.k63.v9")


@dataclasses.dataclass(frozen=True)
class _OtherMatmul(S.OpSpec):
    """A matmul-family spec class of the user's own: no id of hal.spec's classes names it."""
    family: ClassVar[str] = "matmul"
    policies: ClassVar[tuple[str, ...]] = (S.STRICT,)

    def _id_parts(self):
        return ["other"]


def test_a_spec_whose_id_names_no_spec_is_refused_by_name_under_compile():
    x, w = _x(3, 16), _x(8, 16, seed=1)
    for spec in (_OtherMatmul(), S.MatmulSpec(version=1)):
        torch._dynamo.reset()
        with pytest.raises(hal.SpecError, match=rf"linear under torch.compile / torch.export: spec .* id "
                                                rf"'{spec.id}', which names no spec"):
            torch.compile(lambda x: hal.linear(x, w, spec=spec), fullgraph=True, backend="eager")(x)


def test_a_state_made_under_an_unregistered_spec_continues_under_compile():
    """Prefill and continue through compiled graphs under an unregistered spec (named by object, then by the
    state's id): one eager call's bits. Without spec= the call is refused as eagerly (a state continues only
    under its spec), its id resolved while tracing to shape the state out."""
    spec = S.GatedDeltaRuleSpec(chunk=4, dk_tile=4)
    xs = _gdn_inputs(9)
    first, rest = tuple(x[:, :6] for x in xs), tuple(x[:, 6:] for x in xs)

    def rule(*xs, initial_state=None, spec=None):
        return hal.chunk_gated_delta_rule(*xs, initial_state=initial_state, output_final_state="state",
                                          use_qk_l2norm_in_kernel=True, spec=spec)
    with torch.no_grad():
        o_all, st_all = rule(*xs, spec=spec)
        torch._dynamo.reset()
        o1, st = torch.compile(lambda *x: rule(*x, spec=spec), fullgraph=True)(*first)
        o2, st2 = torch.compile(lambda *x: rule(*x, initial_state=st, spec=st.spec_id), fullgraph=True)(*rest)
        assert st2.spec_id == spec.id
        assert same_bits(torch.cat([o1, o2], 1), o_all) and same_bits(st2.final_state, st_all.final_state)
        with pytest.raises(hal.InputError) as eager:
            rule(*rest, initial_state=st)
        with pytest.raises(hal.InputError) as compiled:
            torch.compile(lambda *x: rule(*x, initial_state=st), fullgraph=True)(*rest)
    assert str(compiled.value) == str(eager.value) and "a state continues only under the spec" in str(eager.value)


def test_a_model_patched_with_an_unregistered_matmul_spec_compiles_to_its_eager_bits():
    pytest.importorskip("transformers")
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import VOCAB, tiny_model
    lt.register()
    model = tiny_model("llama")
    kw = dict(input_ids=torch.arange(14).reshape(2, 7) * 5 % VOCAB, use_cache=False)
    with torch.no_grad():
        with lt.patch(model):
            default = model(**kw).logits
        with lt.patch(model, matmul_spec=S.MatmulSpec(k_tile=32)):
            eager = model(**kw).logits
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True)(**kw).logits
    assert not same_bits(eager, default)  # the spec is honoured (the tiny model's hidden size is 64)
    assert same_bits(compiled, eager)


def test_a_model_patched_with_an_exact_matmul_spec_compiles_to_its_eager_bits():
    """The patch prepares (slices) each weight once under an exact spec; while tracing it hands the op the weight
    itself (a prepared weight cannot cross a torch op), which the kernel slices: the same bits. Before, Dynamo
    failed inside the preparation (``tensor.is_inference()``). A weight written between compiled calls is seen."""
    pytest.importorskip("transformers")
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import VOCAB, tiny_model
    lt.register()
    model = tiny_model("llama")
    kw = dict(input_ids=torch.arange(14).reshape(2, 7) * 5 % VOCAB, use_cache=False)
    with torch.no_grad():
        with lt.patch(model):
            strict = model(**kw).logits
        with lt.patch(model, matmul_spec=S.ExactMatmulSpec(slices=3)) as patch:
            eager = model(**kw).logits
            slicings = patch.matmul.slicings
            torch._dynamo.reset()
            compiled_model = torch.compile(model, fullgraph=True)
            compiled = compiled_model(**kw).logits
            assert patch.matmul.slicings == slicings  # tracing prepared nothing
            model.lm_head.weight.mul_(1.5)
            again, want = compiled_model(**kw).logits, model(**kw).logits
    assert not same_bits(eager, strict)  # the exact policy's bits, not the strict default's
    assert same_bits(compiled, eager)
    assert same_bits(again, want) and not same_bits(again, eager)
