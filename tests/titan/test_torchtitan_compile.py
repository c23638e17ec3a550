"""TorchTitan's per-block torch.compile (``apply_compile``: each transformer block ``fullgraph=True``) on the
lockstep-converted Qwen3 keeps the bits, raw bits compared.

* Inductor: the compiled packed forward's log-probs == the eager converted model's == the HF sampler's, and
  every grad == eager's (lockstep's backwards are opaque ops, which Inductor cannot re-fuse).
* aot_eager (TorchTitan's other compile backend): forward and every grad == eager, bit for bit.
* Negative control: a converted model with one module left stock, compiled: its log-probs differ from the
  sampler's and its grads from the eager lockstep grads.
The same for the converted Qwen3.5 (Gated DeltaNet + gated attention): its GDN ops are torch ops, each block
compiles fullgraph; its vision encoder's parameters get no grads (text only) and are compared as None.
"""
import pathlib
import sys

import pytest
import torch
from torch._inductor import config as inductor_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import torchtitan_parity as ex  # noqa: E402
from examples.hf_rollout import make_prompts, sample  # noqa: E402
from hal.conformance.bits import same_bits  # noqa: E402
from hal.integrations import torchtitan as ltt  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402


def step(model, prompts, resp):
    """Packed training forward + backward: (log-probs, {name: grad})."""
    model.train()
    lp = ex.trainer_logprobs(model, "lockstep", prompts, resp)
    (-(torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape) * lp).mean()).backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters()}


def same_grads(a, b):
    """The names whose grads differ (bits, or one None and not the other): a misnomer kept short."""
    return [n for n in a if (a[n] is None) != (b[n] is None)
            or (a[n] is not None and not same_bits(a[n], b[n]))]


# model -> (HF builder, TorchTitan builder, parameters with grads, the module a control leaves stock)
MODELS = {"qwen3": (ex.hf_qwen3, ex.titan_qwen3, 21, "layers.1.ffn_norm"),
          # Qwen3.5: the vision encoder's parameters get no grads; the control leaves the GDN's gated norm stock
          "qwen3_5": (ex.hf_qwen3_5, ex.titan_qwen3_5, 32, "layers.0.attn.norm")}


@pytest.mark.parametrize("model", list(MODELS))
def test_per_block_compile_keeps_the_bits(model):
    hf_build, titan_build, n_grads, left_stock = MODELS[model]
    torch._dynamo.reset()
    hf = hf_build(torch.float32)
    prompts = make_prompts(3, 0, ex.VOCAB)
    with lt.patch(hf):
        resp, lp_s = sample(hf, "lockstep", prompts, 5, seed=0)
    lp_e, g_e = step(titan_build(hf), prompts, resp)
    assert same_bits(lp_e, lp_s)

    aot = titan_build(hf)
    ltt.compile_blocks(aot, backend="aot_eager")
    lp_a, g_a = step(aot, prompts, resp)
    assert same_bits(lp_a, lp_s)
    assert sum(g is not None for g in g_a.values()) == n_grads and not same_grads(g_e, g_a)

    ind = titan_build(hf)
    ltt.compile_blocks(ind, backend="inductor")
    with inductor_config.patch(force_disable_caches=True):  # a cached graph may predate the backward ops
        lp_i, g_i = step(ind, prompts, resp)
    assert same_bits(lp_i, lp_s) and not same_grads(g_e, g_i)

    # control: one module left stock, compiled: its log-probs and the grads it feeds are caught
    leaky = titan_build(hf, stock=[left_stock])
    ltt.compile_blocks(leaky, backend="aot_eager")
    lp_l, g_l = step(leaky, prompts, resp)
    assert not same_bits(lp_l, lp_s)
    assert same_grads(g_e, g_l)
