"""Every documented refusal under torch.compile(fullgraph=True) reaches the user as lockstep's error class with
lockstep's message (the eager message, where the call is refused eagerly too), and changes nothing.

A refusal met while Dynamo traces used to become Dynamo's own error ("Attempted to call a super() attribute
that is not a function or method" for UnsupportedError, "Observed exception" for the others): hal/errors.py
says why and how each lockstep error now crosses Dynamo. Refusals met when the graph runs (a kernel's
validation) always did; they are in the table too, so that each documented refusal is checked in one place.
"""
from __future__ import annotations

import re

import pytest
import torch

import hal
from hal import errors
from hal.spec import ExactMatmulSpec, SoftmaxSpec, TokenLogprobsSpec

from _torch_op_cases import op_args

EXACT = ExactMatmulSpec(slices=4)


def _prepared():
    x, w, _ = (t.detach() for t in op_args("linear"))
    return x, hal.exact_weight(w, spec=EXACT)


def _rule_inputs(t=5, b=2):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, t, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(b, t, 4, 8, generator=g)
    return q, k, v, -torch.rand(b, t, 4, generator=g), torch.rand(b, t, 4, generator=g)


def _rule(**kw):
    return lambda q, k, v, g, beta: hal.chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def _kvcache(**kw):
    q, kc, vc, k, v, lens, table, scale, causal, window, splits = op_args("flash_attn_with_kvcache")
    return (lambda q, kc, vc, k, v: hal.flash_attn_with_kvcache(q, kc, vc, k, v, lens, table, scale, causal, window,
                                                                splits, **kw)), (q, kc, vc, k, v)


def _case(fn, args, cls, message, eager=True):
    """fn(*args) is refused with ``cls`` and a message matching ``message``; eagerly too unless ``eager`` is False
    (a refusal of compile only: the eager call runs)."""
    return fn, args, cls, message, eager


def _cases():
    x, ew = _prepared()
    xt, wt, bt = (t.detach() for t in op_args("linear"))
    h, lm, tokens, temp = (t.detach() if isinstance(t, torch.Tensor) else t for t in op_args("token_logprobs"))
    lm_exact = hal.exact_weight(lm, spec=EXACT)
    a, b = (t.detach() for t in op_args("matmul"))
    b_exact = hal.exact_weight(b, spec=EXACT, layout="matmul")
    kv_fn, kv_args = _kvcache()
    kv_grad = (kv_args[0].clone().requires_grad_(True), *kv_args[1:])
    kv_soft, _ = _kvcache(softcap=1.0)
    return {
        # ---- met while Dynamo traces (each failed with Dynamo's own error before)
        "exact_weight-linear": _case(lambda x: hal.linear(x, ew, spec=EXACT), (x,), hal.UnsupportedError,
                                     r"linear under torch.compile / torch.export: an argument of type ExactWeight "
                                     r"cannot cross .*hal.exact_weight is refused under compile", eager=False),
        "exact_weight-matmul": _case(lambda a: hal.matmul(a, b_exact, spec=EXACT), (a,), hal.UnsupportedError,
                                     r"matmul under torch.compile .* type ExactWeight", eager=False),
        "exact_weight-token_logprobs": _case(
            lambda h, t: hal.token_logprobs(h, lm_exact, t, temp, spec=TokenLogprobsSpec(matmul=EXACT)), (h, tokens),
            hal.UnsupportedError, r"token_logprobs under torch.compile .* type ExactWeight", eager=False),
        "gdn-state-without-spec": _case(_rule(output_final_state="state"), _rule_inputs(), hal.UnsupportedError,
                                        r"chunk_gated_delta_rule: a state object out under torch.compile / export "
                                        r"needs its spec named", eager=False),
        "gdn-bad-output_final_state": _case(_rule(output_final_state="yes"), _rule_inputs(), hal.InputError,
                                            r"output_final_state"),
        "gdn-bad-initial_state": _case(_rule(initial_state=[1.0]), _rule_inputs(), hal.InputError, r"initial_state"),
        "spec-not-a-spec": _case(lambda x: hal.linear(x, wt, bt, spec=4), (xt,), hal.SpecError,
                                 r"spec must be an OpSpec or a spec id string, got int"),
        "spec-unknown-id": _case(lambda x: hal.linear(x, wt, bt, spec="matmul.strict.k63.v9"), (xt,), hal.SpecError,
                                 r"unknown spec id 'matmul.strict.k63.v9'"),
        "spec-other-family": _case(lambda x: hal.linear(x, wt, bt, spec=SoftmaxSpec()), (xt,), hal.SpecError,
                                   r"is for 'softmax' ops, but this is a 'matmul' op"),
        "kvcache-requires-grad": _case(kv_fn, kv_grad, hal.InputError, r"flash_attn_with_kvcache has no backward pass"),
        "kvcache-softcap": _case(kv_soft, kv_args, hal.InputError, r"softcap=1.0 is not supported"),
        # ---- met when the graph runs (inside the op's kernel)
        "linear-shapes": _case(lambda x: hal.linear(x, wt[:, :5]), (xt,), hal.InputError, r"."),
        "token_logprobs-range": _case(lambda h, t: hal.token_logprobs(h, lm, t + 100, temp), (h, tokens),
                                      hal.InputError, r"tokens must be in \[0, 32\)"),
        "rms_norm-weight": _case(lambda x: hal.rms_norm(x, wt[0, :5]), (xt,), hal.InputError, r"."),
    }


CASES = _cases()


def _raised(fn, args):
    with pytest.raises(hal.HalError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("name", list(CASES))
def test_a_refusal_under_fullgraph_compile_is_lockstep_s_class_and_message(name):
    fn, args, cls, message, eager = CASES[name]
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    if eager:
        want = _raised(fn, args)
        assert type(want) is cls and re.search(message, str(want), re.S), (type(want), str(want))
    else:
        with torch.no_grad():
            fn(*args)  # runs eagerly: a refusal of compile only
    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    except Exception as e:  # noqa: BLE001 - the class is the point of the test
        got = e
    else:
        pytest.fail("the compiled call was not refused")
    assert isinstance(got, cls) and type(got).__name__ == cls.__name__, f"{type(got)}: {got}"
    assert re.search(message, str(got), re.S), str(got)
    if eager:
        assert str(got) == str(want)
    # nothing changed: every tensor argument (the kv cache ones included) keeps its bits
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(p.view(torch.uint8), q.detach().view(torch.uint8)) for p, q in zip(before, after))


def test_without_fullgraph_the_refusal_is_lockstep_s_class_and_message_too():
    fn, args, cls, message, _ = CASES["gdn-bad-output_final_state"]
    want = _raised(fn, args)
    torch._dynamo.reset()
    with pytest.raises(cls) as info:
        torch.compile(fn, backend="eager")(*args)
    assert type(info.value).__name__ == cls.__name__ and str(info.value) == str(want)


def test_a_reasons_list_survives_the_compiled_refusal():
    def refuse(x):
        raise hal.UnsupportedError("nothing serves this", ["backend a: no", "backend b: no"])
    torch._dynamo.reset()
    with pytest.raises(hal.UnsupportedError) as info:
        torch.compile(refuse, fullgraph=True, backend="eager")(torch.ones(1))
    assert info.value.reasons == ["backend a: no", "backend b: no"]
    assert str(info.value) == "nothing serves this\n  - backend a: no\n  - backend b: no"


def test_the_marker_hal_sets_by_hand_is_what_assume_constant_result_sets():
    """hal/errors.py marks its raiser as torch._dynamo.assume_constant_result would (without importing
    torch._dynamo at import time): if torch renames the marker, this fails before any refusal does."""
    def probe():
        pass
    torch._dynamo.assume_constant_result(probe)
    assert probe.__dict__ == {"_dynamo_marked_constant": True}
    assert errors._raise_compile_time._dynamo_marked_constant is True


def test_eager_errors_are_unchanged():
    e = hal.UnsupportedError("no", ["a"])
    assert type(e).__mro__[1:3] == (hal.HalError, RuntimeError) and e.args == ("no\n  - a",) and e.reasons == ["a"]
    assert hal.InputError("bad").args == ("bad",) and isinstance(hal.InputError("bad"), ValueError)
    assert str(hal.SpecError("s")) == "s" and hal.UnsupportedError("x").reasons == []


# ---------------------------------------------------------------- patched HF models (transformers)


def _hf(kind, use_cache=True):
    pytest.importorskip("transformers")
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import VOCAB, tiny_model
    lt.register()
    ids = torch.arange(12).reshape(2, 6) * 5 % VOCAB
    return lt, tiny_model(kind), dict(input_ids=ids, attention_mask=torch.ones(2, 6, dtype=torch.long),
                                      use_cache=use_cache)


HF_CASES = {
    "llama-kv-cache": ("llama", r"a KV cache in a patched forward under torch.compile / torch.export is not supported"),
    "qwen3_next-cached-gdn": ("qwen3_next", r"a cached GatedDeltaNet forward under torch.compile / torch.export is "
                                            r"not supported yet"),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_a_compiled_patched_model_called_with_use_cache_is_refused_with_lockstep_s_class(name):
    kind, message = HF_CASES[name]
    lt, model, kw = _hf(kind)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch._dynamo.reset()
    with lt.patch(model), torch.no_grad():
        model(**kw)  # eagerly a cache is fine
        with pytest.raises(hal.UnsupportedError, match=message) as info:
            torch.compile(model, fullgraph=True, backend="eager")(**kw)
    assert type(info.value).__name__ == "UnsupportedError"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all("forward" not in m.__dict__ for m in model.modules())  # the patch was reverted as usual


def test_training_a_compiled_patched_gdn_model_is_refused_with_lockstep_s_class():
    """hf_gated_delta_net has no backward: its autograd setup refuses inputs that require grad. That check is
    real code Dynamo runs on fake tensors (it used to come back as Dynamo's TorchRuntimeError)."""
    lt, model, kw = _hf("qwen3_next", use_cache=False)
    torch._dynamo.reset()
    with lt.patch(model), pytest.raises(hal.UnsupportedError, match="no backward pass yet") as info:
        torch.compile(model, fullgraph=True, backend="aot_eager")(**kw)
    assert type(info.value).__name__ == "UnsupportedError"
    assert all(p.grad is None for p in model.parameters())
