"""The HF patch's lifecycle: deep copies, pickling, modules attached after the patch (PEFT LoRA,
resize_token_embeddings, replaced modules), nested patches, and verify's argument checks and decode localiser.

Every bit claim compares raw bits (first_divergence) and has a negative control the same check catches.
"""
import copy
import io
import pickle

import pytest
import torch

pytest.importorskip("transformers")

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402

lt.register()

pytestmark = pytest.mark.usefixtures("one_thread")


def same(a, b, label="x"):
    return first_divergence(label, a, b) is None


def ids(seed=0, shape=(2, 6)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def logits(m, x):
    with torch.no_grad():
        return m(input_ids=x, use_cache=False).logits


def no_instance_forwards(m):
    return all("forward" not in mod.__dict__ and "_lockstep_patch" not in mod.__dict__ for mod in m.modules())


# ---------------------------------------------------------------- deep copy, pickling


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_deepcopy_is_independent_patched_and_revertible(kind):
    x = ids()
    m = tiny_model(kind)
    unpatched = logits(m, x)
    lt.apply(m)
    patched = logits(m, x)
    assert not same(unpatched, patched)  # the patch changes the computation (so "patched" below means something)
    c = copy.deepcopy(m)
    assert same(logits(c, x), patched)  # the copy is patched: lockstep's bits
    with torch.no_grad():  # move the original's weights: the copy must not see it
        for prm in m.parameters():
            prm.mul_(1.5)
    moved = logits(m, x)
    assert not same(moved, patched)  # negative control: the original's logits do move
    assert same(logits(c, x), patched)
    # every lockstep forward of the copy computes on the copy's modules, not the original's
    for mod in c.modules():
        fwd = mod.__dict__.get("forward")
        if hasattr(fwd, "__lockstep__"):
            assert fwd.mod is mod
    lt.revert(c)  # the copy's own patch: a working unpatched model
    assert no_instance_forwards(c)
    assert all(not mod._forward_pre_hooks for mod in c.modules())  # Qwen3-Next's decoder hooks removed too
    assert same(logits(c, x), unpatched)
    assert same(logits(m, x), moved)  # the original is still patched
    lt.revert(m)
    assert no_instance_forwards(m)


def test_pickling_a_patched_model_refused_with_the_way_out():
    m = tiny_model("llama")
    with lt.patch(m):
        with pytest.raises(hal.UnsupportedError, match=r"state_dict\(\).*lt.revert\(model\)"):
            torch.save(m, io.BytesIO())
        with pytest.raises(hal.UnsupportedError, match="cannot be pickled"):
            pickle.dumps(m.model.layers[0])  # a submodule holds lockstep forwards as well
        torch.save(m.state_dict(), io.BytesIO())  # the way named in the error works
    torch.save(m, io.BytesIO())  # reverted: an ordinary model again


def test_revert_function_refuses_what_it_cannot_revert():
    m = tiny_model("llama")
    with pytest.raises(hal.InputError, match="not patched"):
        lt.revert(m)
    with lt.patch(m):
        with pytest.raises(hal.InputError, match="part of a patch"):
            lt.revert(m.model)
        assert "forward" in m.model.norm.__dict__  # nothing reverted


# ---------------------------------------------------------------- modules attached after the patch


def _lora(m):
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # PEFT zero-inits lora_B (the adapters would add exact zeros): make them count
        g = torch.Generator().manual_seed(5)
        for name, prm in pm.named_parameters():
            if "lora_B" in name:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
    return pm


@pytest.mark.parametrize("order", ["peft_after_patch", "peft_before_patch"])
def test_lora_adapters_run_under_the_patch(order):
    pytest.importorskip("peft")
    import torch.nn.functional as F
    m = tiny_model("llama")
    if order == "peft_after_patch":
        p = lt.apply(m)
        pm = _lora(m)
    else:
        pm = _lora(m)
        p = lt.apply(pm)
    x = ids(1)
    a = lt.audit(pm, x)
    assert a.stock_modules == [] and a.aten_ops == {}, str(a)
    lora_mods = {n for n, k in a.lockstep_modules if ".lora_" in n and k == "linear"}
    assert len(lora_mods) == 2 * 3 * 2, sorted(lora_mods)  # A and B, 3 targets, 2 layers
    # one wrapped linear against a hand-built lockstep computation of LoRA, on raw bits
    lay = pm.base_model.model.model.layers[1].mlp.down_proj
    seen = {}
    h = lay.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
    logits(pm, x)
    h.remove()
    A, B, W, s = lay.lora_A["default"].weight, lay.lora_B["default"].weight, lay.base_layer.weight, \
        lay.scaling["default"]
    with torch.no_grad():
        want = hal.linear(seen["x"], W) + hal.linear(hal.linear(seen["x"], A), B) * s
        stock_adapters = hal.linear(seen["x"], W) + F.linear(F.linear(seen["x"], A), B) * s
    assert same(seen["y"], want)
    assert not same(seen["y"], stock_adapters)  # negative control: stock adapters give other bits
    rep = lt.verify(pm, VOCAB, lengths=(5, 3), decode_steps=1)
    assert rep.ok, str(rep)
    p.revert()
    assert no_instance_forwards(pm)
    # negative control: the same audit on the unpatched LoRA model sees the stock adapters
    s = lt.audit(pm, x)
    assert {n for n, _ in s.stock_modules} >= lora_mods and "aten.mm" in s.aten_ops, str(s)


def test_resized_lm_head_is_patched():
    m = tiny_model("llama")
    with lt.patch(m, matmul_spec=hal.spec.ExactMatmulSpec(slices=4)) as p:
        with torch.random.fork_rng(devices=[]):  # the new rows' init draws from the global RNG: fixed here, so the
            torch.manual_seed(0)                 # negative controls below see the same weights in any test order
            m.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
        x = ids(2, (1, 5))
        assert lt.audit(m, x).stock_modules == []
        with torch.no_grad():
            out = m(input_ids=x, use_cache=False, output_hidden_states=True)
            h, head = out.hidden_states[-1], m.lm_head
            want = hal.linear(h, hal.exact_weight(head.weight, spec=p.matmul.spec), spec=p.matmul.spec)
            assert out.logits.shape[-1] == VOCAB + 8
            assert same(out.logits, want)
            assert not same(out.logits, torch.nn.functional.linear(h, head.weight))  # negative control
            # lt.token_logprobs uses the patch's exact spec with the new head
            lp = lt.token_logprobs(m, h[0], x[0])
            assert same(lp, hal.token_logprobs(h[0], hal.exact_weight(head.weight, spec=p.matmul.spec), x[0],
                                               spec=p.matmul.logprobs_spec))
            assert not same(lp, hal.token_logprobs(h[0], head.weight, x[0]))  # negative control: default spec
    assert no_instance_forwards(m)


def test_replaced_module_patched_or_refused_by_name():
    m = tiny_model("llama")
    x = ids(3)
    with lt.patch(m):
        torch.manual_seed(7)
        new = torch.nn.Linear(128, 64, bias=False)
        m.model.layers[0].mlp.down_proj = new  # a known kind: patched on its next forward
        seen = {}
        h = new.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
        logits(m, x)
        h.remove()
        assert same(seen["y"], hal.linear(seen["x"], new.weight))
        assert not same(seen["y"], torch.nn.functional.linear(seen["x"], new.weight))  # negative control

        class Scale(torch.nn.Module):  # an unknown class with weights: refused by name, not run stock
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(64))

            def forward(self, t):
                return t * self.weight

        old = m.model.layers[1].post_attention_layernorm
        m.model.layers[1].post_attention_layernorm = Scale()
        for _ in range(2):  # every forward refuses until the module is removed
            with pytest.raises(hal.UnsupportedError, match=r"model\.layers\.1\.post_attention_layernorm \(Scale\)"):
                logits(m, x)
        m.model.layers[1].post_attention_layernorm = old
        assert lt.audit(m, x).stock_modules == []
    assert no_instance_forwards(m)


def test_module_of_another_patch_attached_refused():
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    with lt.patch(a), lt.patch(b):
        mine, theirs = a.model.layers[0].mlp, b.model.layers[0].mlp
        with pytest.raises(hal.InputError, match=r"'mlp' \(LlamaMLP\).*already patched by another"):
            a.model.layers[0].mlp = theirs
        assert a.model.layers[0].mlp is mine and "forward" in theirs.__dict__  # refused before the assignment
        assert theirs.__dict__["forward"].patch is b.__dict__["_lockstep_patch"]
        assert lt.audit(a, ids()).stock_modules == []


# ---------------------------------------------------------------- nested patches


def test_nested_and_overlapping_patches_refused_before_mutation():
    x = ids(4)
    m = tiny_model("llama")
    unpatched = logits(m, x)
    p1 = lt.apply(m.model)
    with pytest.raises(hal.InputError, match="already patched"):
        lt.apply(m)
    assert "forward" not in m.lm_head.__dict__ and "generate" not in m.__dict__  # the refused patch changed nothing
    p1.revert()
    assert no_instance_forwards(m) and same(logits(m, x), unpatched)
    p = lt.apply(m)
    with pytest.raises(hal.InputError, match="already patched"):
        lt.apply(m.model.layers[0])
    p.revert()
    assert no_instance_forwards(m) and same(logits(m, x), unpatched)


# ---------------------------------------------------------------- verify: arguments, decode localiser


@pytest.mark.parametrize("vocab_size", [10 ** 6, VOCAB + 1, 0, -3, True, 2.5, "128"])
def test_verify_bad_vocab_size_is_an_input_error_before_any_work(vocab_size):
    m = tiny_model("llama")
    calls = []
    m.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(hal.InputError, match="vocab_size"):
        lt.verify(m, vocab_size)
    assert calls == []


def test_verify_decode_localises_a_batch_dependent_divergence():
    """A divergence only in batched decode (the batch size changes the bits) is named by module."""
    m = tiny_model("llama")
    target = m.model.layers[1].mlp

    def batch_dependent(_m, args, out):  # one element moved when several sequences decode together
        if out.shape[0] > 1 and out.shape[1] == 1:
            out = out.clone()
            out[0, 0, 0] += 0.01
        return out

    with lt.patch(m):
        h = target.register_forward_hook(batch_dependent)
        rep = lt.verify(m, VOCAB, lengths=(5, 4), decode_steps=2)
        h.remove()
        clean = lt.verify(m, VOCAB, lengths=(5, 4), decode_steps=2)
    assert clean.ok, str(clean)  # negative control: without the deliberate bug every check passes
    dec = rep.checks[-1]
    assert [c.ok for c in rep.checks] == [True, True, True, False], str(rep)
    assert dec.first_module is not None and dec.first_module["module"] == "model.layers.1.mlp", str(rep)
