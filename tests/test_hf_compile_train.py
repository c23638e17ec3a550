"""Training a patched HF model under torch.compile(fullgraph=True): forward, HF's loss, backward and an
optimizer step give the eager patched model's bits -- logits, loss, every parameter's gradient and the
parameters after the step (raw bits).

Backend ``aot_eager``: AOT autograd traces the joint forward + backward graph (the lockstep ops and their
registered backwards, ``hf_attention_backward`` included)
and runs its aten ops as eager does. Inductor is not used here: it compiles this step in ~60-140 s on the CI
machine (over this file's budget); its gradients equal eager's too now that every lockstep backward is an
opaque op (tests/test_compile.py checks a composed step under Inductor; a tiny Llama step was checked by hand).

One tiny model per dtype (Llama fp32, Qwen3 bf16), compiled once; the step runs on a left-padded batch, the
optimizer steps, then a packed batch (two sequences in one row, ``position_ids`` resets) runs through the
same graph (no recompile). Negative controls: the stock model compiled the same way, and a patched model
with one stock module swapped back in, both differ from the eager patched step.
"""
from __future__ import annotations

import functools
import types

import pytest
import torch

pytest.importorskip("transformers")

from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402
from hal.conformance.bits import same_bits

lt.register()

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {"llama-fp32": ("llama", torch.float32), "qwen3-bf16": ("qwen3", torch.bfloat16)}
BACKEND = "aot_eager"


def batches():
    """Padded: two rows, the second left-padded by two. Packed: row 0 holds sequences of 3 and 4 tokens."""
    ids = torch.arange(14).reshape(2, 7) * 5 % VOCAB
    positions = torch.arange(7).expand(2, 7)
    padded_mask = torch.ones(2, 7, dtype=torch.long)
    padded_mask[1, :2] = 0
    padded_labels = ids.masked_fill(padded_mask == 0, -100)
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    packed_ids = (ids * 3 + 1) % VOCAB
    return [dict(input_ids=ids, attention_mask=padded_mask, position_ids=positions, labels=padded_labels),
            dict(input_ids=packed_ids, attention_mask=torch.ones(2, 7, dtype=torch.long), position_ids=packed_positions,
                 labels=packed_ids)]


def train(model, forward):
    """Per batch: logits, loss, every parameter's gradient; an AdamW step between the batches; the parameters
    after the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    steps = []
    for i, batch in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        out = forward(**batch, use_cache=False)
        out.loss.backward()
        steps.append({"logits": out.logits.detach(), "loss": out.loss.detach(),
                      **{f"grad {n}": p.grad.clone() for n, p in model.named_parameters()}})
        if i == 0:
            opt.step()
            steps[0].update({f"param {n}": p.detach().clone() for n, p in model.named_parameters()})
    return steps


def divergences(want, got) -> list[str]:
    """What differs (raw bits) between two training runs: 'batch i: name'."""
    return [f"batch {i}: {name}" for i, (w, g) in enumerate(zip(want, got)) for name in w
            if name not in g or not same_bits(w[name], g[name])]


def compiled_run(model):
    torch._dynamo.reset()
    return train(model, torch.compile(model, fullgraph=True, backend=BACKEND))


@functools.cache
def eager_run(kind: str, dtype: torch.dtype):
    model = tiny_model(kind, dtype=dtype).train()
    with lt.patch(model):
        return train(model, model)


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_training_step_gives_the_eager_patched_bits(name):
    kind, dtype = MODELS[name]
    model = tiny_model(kind, dtype=dtype).train()
    with lt.patch(model):
        compiled = compiled_run(model)
    eager = eager_run(kind, dtype)
    assert len(eager[0]) > 2 * 20  # logits, loss, every parameter's grad and value
    assert divergences(eager, compiled) == []


def test_negative_control_the_stock_model_compiled_the_same_way_differs():
    stock = tiny_model("llama", attn_implementation="sdpa").train()  # same weights, stock kernels
    diff = divergences(eager_run("llama", torch.float32), compiled_run(stock))
    assert "batch 0: logits" in diff and any(d.startswith("batch 0: grad") for d in diff)


def test_negative_control_a_stock_module_swapped_into_the_compiled_patched_model_is_caught():
    model = tiny_model("llama").train()
    with lt.patch(model):
        mlp = model.model.layers[1].mlp
        patched, mlp.forward = mlp.forward, types.MethodType(type(mlp).forward, mlp)  # HF's own: stock F.linear
        try:
            diff = divergences(eager_run("llama", torch.float32), compiled_run(model))
        finally:
            mlp.forward = patched
    assert "batch 0: logits" in diff and "batch 0: grad model.layers.1.mlp.down_proj.weight" in diff


def test_training_under_compile_with_a_kv_cache_is_refused_naming_the_feature():
    model = tiny_model("llama").train()
    torch._dynamo.reset()
    batch = batches()[0]
    # Dynamo re-raises the error its trace met wrapped in its own type: the message is lockstep's
    with lt.patch(model), pytest.raises(Exception, match="KV cache .* under torch.compile"):
        torch.compile(model, fullgraph=True, backend=BACKEND)(**batch, use_cache=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_hf_attention_backward_under_compile_gives_the_eager_grads(causal):
    """The op alone, GQA, row 1 left-padded. Bidirectional: every query is its own sequence over the same
    keys, so the key gradients are summed over sequences (index_put accumulate, as eager's)."""
    from hal.integrations.transformers.attention import masked_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    mask = torch.ones(5, 5, dtype=torch.bool).expand(2, 1, 5, 5).clone()
    mask[1, :, :, :2] = False

    def loss(q, k, v):
        out = masked_attention(q, k, v, mask if not causal else mask.tril(), None, None, None, causal, 0.3)
        return (out * out).sum()

    leaves = [[t.clone().requires_grad_(True) for t in (q, k, v)] for _ in range(2)]
    loss(*leaves[0]).backward()
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True, backend=BACKEND)(*leaves[1]).backward()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(leaves[1], leaves[0]))
