"""A patched tiny HF Llama under FSDP2 (``fully_shard``, 2 real gloo processes) keeps lockstep's bits.

Each rank runs its own rows of one batch (data parallel); the single-process reference runs the whole
batch in one call, as a sampler would. Checked bit for bit (raw bits, conformance/bits.py):

* fp32: FSDP2 forward logits == single-process logits of the same rows;
* forward, backward, AdamW step: the parameters after the step == a single-process model taking the
  same step with the two ranks' rows as two accumulated micro-batches (FSDP2's gradient
  reduce-scatter on gloo is ``g0 / 2 + g1 / 2``: one float addition of two operands, which the
  accumulation reproduces), and the logits after the step == that model's;
* ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)``: FSDP2 forward logits
  == the bf16 single-process sampler's (the checkpoint loaded in bf16, patched); with the default
  ``cast_forward_inputs=True`` they differ (FSDP2 rounds the float32 rotary tables passed to each
  decoder layer to bf16), shown by the test; a sampler made with
  ``model.to(torch.bfloat16)`` differs (it rounds the rotary ``inv_freq`` buffer to bf16; FSDP2 keeps
  buffers float32) and the test shows that too.

Negative controls (same file), on a short batch (one 2-token row per rank, both rows in the single
process): the check above (a rank's row vs the single-process patched model's) catches stock transformers
and a patched model with one ``down_proj`` left stock under FSDP2; the patched model agrees there too. They
are compared with lockstep's bits, not with the same stock model on the full batch: whether stock
``F.linear`` changes its bits with the row count depends on the CPU (an AVX-512 MKL does not on these
shapes), while lockstep's down_proj (K = 128) adds two 64-long fma chains, which a BLAS's one chain over K
(AVX-512) or its vector lanes (AVX2, SSE) do not reproduce.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from hal.conformance.bits import first_divergence  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "dist"))
import fsdp2_worker as W  # noqa: E402
from launch import run_world  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # the workers' thread count: backward is stock math
WORLD = 2
DEADLINE_S = 300


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(Path(W.__file__), WORLD, tmp_path_factory.mktemp("fsdp2"), DEADLINE_S)


def _rows(full: torch.Tensor, rank: int) -> torch.Tensor:
    return full[rank * W.ROWS:(rank + 1) * W.ROWS]


def _divergences(label, full, ranks, key):
    return [first_divergence(f"{label} rank {r}", _rows(full, r), res[key]) for r, res in enumerate(ranks)]


@pytest.fixture(scope="module")
def sampler():
    """The single-process patched fp32 model and its logits on the whole batch."""
    model = W.build(patched=True)
    with torch.no_grad():
        return model, model(input_ids=W.batch(WORLD)).logits


def test_fsdp2_forward_gives_single_process_bits(ranks, sampler):
    d = _divergences("FSDP2 fp32 vs single process", sampler[1], ranks, "logits")
    assert d == [None] * WORLD, [str(x) for x in d]


def test_fsdp2_step_gives_the_accumulated_single_process_step(ranks):
    ids = W.batch(WORLD)
    model = W.build(patched=True)
    opt = W.optimizer(model.parameters())
    for r in range(WORLD):  # the ranks' rows as micro-batches: grads g0, then g0 + g1 ...
        model(input_ids=_rows(ids, r), labels=_rows(ids, r)).loss.backward()
    for p in model.parameters():  # ... and FSDP2's average; a division by 2 is exact (no subnormal grads here)
        p.grad.div_(WORLD)
    opt.step()
    want = {k: v.detach() for k, v in model.state_dict().items() if k in ranks[0]["params_after_step"]}
    assert want.keys() == ranks[0]["params_after_step"].keys() and want
    for r, res in enumerate(ranks):
        bad = [k for k, v in want.items() if first_divergence(k, v, res["params_after_step"][k]) is not None]
        assert not bad, f"rank {r}: parameters after the step differ from the single-process step: {bad}"
    with torch.no_grad():
        after = model(input_ids=ids).logits
    d = _divergences("FSDP2 after the step vs single process", after, ranks, "logits_after_step")
    assert d == [None] * WORLD, [str(x) for x in d]
    assert first_divergence("the step changed the logits", _rows(after, 0), ranks[0]["logits"]) is not None


def _bf16_sampler(tmp_path, cast: str):
    """The single-process bf16 sampler. ``cast="load"``: loaded as a sampler loads a checkpoint
    (``from_pretrained(dtype=bfloat16)``: the rotary ``inv_freq`` buffer stays float32, as FSDP2's mixed
    precision keeps it); ``cast="to"``: ``model.to(bfloat16)``, which also rounds ``inv_freq`` to bf16."""
    import transformers as tf
    from hal.integrations import transformers as lt
    if cast == "load":
        W.build(patched=False).save_pretrained(tmp_path)
        model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="lockstep")
    else:
        model = W.build(patched=True)
        lt.revert(model)
        model = model.to(torch.bfloat16)
    lt.apply(model)
    with torch.no_grad():
        return model(input_ids=W.batch(WORLD)).logits


def test_fsdp2_bf16_mixed_precision_gives_the_bf16_sampler_bits(ranks, tmp_path):
    """With ``cast_forward_inputs=False`` the bf16 FSDP2 forward is the bf16 sampler's. FSDP2's default casts the
    float32 cos/sin tables the decoder layers receive to bf16, and the logits differ from position 1 on (position 0
    has angle 0: cos 1, sin 0 in any precision) -- shown here, documented in docs/integrations.md."""
    want = _bf16_sampler(tmp_path, "load")
    assert want.dtype == ranks[0]["logits_bf16_nocast"].dtype == torch.bfloat16
    d = _divergences("FSDP2 bf16 params (cast_forward_inputs=False) vs bf16 sampler", want, ranks, "logits_bf16_nocast")
    assert d == [None] * WORLD, [str(x) for x in d]
    d = _divergences("FSDP2 bf16 params (default policy) vs bf16 sampler", want, ranks, "logits_bf16")
    assert all(x is not None and x.index[1] > 0 for x in d), [str(x) for x in d]
    # the pitfall docs/integrations.md names: a sampler made with model.to(bf16) has a bf16 rotary table
    d = _divergences("FSDP2 bf16 params vs model.to(bf16)", _bf16_sampler(tmp_path, "to"), ranks, "logits_bf16_nocast")
    assert all(x is not None and x.index[1] > 0 for x in d), [str(x) for x in d]


@pytest.mark.parametrize("key,stock_modules", [("patched", ()), ("stock", None),
                                               ("one_stock", ("model.layers.0.mlp.down_proj",))])
def test_short_batch_and_its_negative_controls(ranks, key, stock_modules):
    """One 2-token row per rank vs both rows in the single-process patched model: the patched FSDP2 model agrees;
    the same comparison catches stock transformers, and a patched model with one stock linear, under FSDP2."""
    with torch.no_grad():
        full = W.build(patched=True)(input_ids=W.control_batch(WORLD)).logits
    d = [first_divergence(f"{key} FSDP2 vs single process rank {r}", full[r:r + 1], res[f"short_{key}"])
         for r, res in enumerate(ranks)]
    if key == "patched":
        assert d == [None] * WORLD, [str(x) for x in d]
    else:
        assert any(x is not None for x in d), "the negative control was not caught"
