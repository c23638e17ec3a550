"""TorchTitan's Qwen3.5 (Gated DeltaNet hybrid) vs the transformers sampler: the same per-token log-prob bits.

Tiny text Qwen3.5 (one GDN layer, one gated full-attention layer) in float32 and bfloat16, raw bits compared.
Positive: ``generate``'s log-probs == TorchTitan's packed training forward's, before and after a TorchTitan
training step and the weight sync back (``Qwen35StateDictAdapter.to_hf``). Negative controls, asserted here:
stock TorchTitan's Qwen3.5 cannot run on CPU at all (FLA's Triton kernels), so the caught control is a converter
leaving one module stock, named as the first divergence (bf16: a module whose stock double rounding shows
through bf16); the tied-head sync is refused.
"""
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import torchtitan_parity as ex  # noqa: E402
from examples.hf_rollout import make_prompts, sample  # noqa: E402
from hal.conformance.bits import same_bits  # noqa: E402
from hal.integrations import torchtitan as ltt  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
VOCAB = 128


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sampler_and_torchtitan_qwen3_5_agree_before_and_after_a_step(dtype):
    hf = ex.hf_qwen3_5(dtype)
    tt = ex.titan_qwen3_5(hf)
    prompts = make_prompts(3, 0, VOCAB)
    with lt.patch(hf):
        resp, lp_s = sample(hf, "lockstep", prompts, 5, seed=0)
        tt.train()
        lp_t = ex.trainer_logprobs(tt, "lockstep", prompts, resp)
        assert lp_t.dtype == torch.float32 and lp_t.requires_grad
        assert same_bits(lp_t.detach(), lp_s)
        text = {n: p.detach().clone() for n, p in tt.named_parameters() if not n.startswith("vision_encoder.")}
        ex.train_step(tt, lp_t)
        changed = [n for n, p in tt.named_parameters() if n in text and not torch.equal(p, text[n])]
        assert len(changed) == len(text)  # backward reached every text weight (GDN conv, A_log, dt_bias included)
        ltt.sync_to_hf(tt, hf)
        resp2, lp_s2 = sample(hf, "lockstep", prompts, 5, seed=1)
        lp_t2 = ex.trainer_logprobs(tt, "lockstep", prompts, resp2)
        assert same_bits(lp_t2.detach(), lp_s2)
        assert not same_bits(lp_s2, lp_s)


def test_stock_torchtitan_qwen3_5_cannot_run_on_cpu():
    """What the README and docs/integrations.md say: stock TorchTitan's Qwen3.5 runs FLA's Triton conv / gated delta rule (CUDA only)."""
    hf = ex.hf_qwen3_5(torch.float32)
    tt = ex.titan_qwen3_5(hf, lockstep=False)
    tokens, positions, _ = ex.pack([torch.tensor([1, 2, 3])], torch.tensor([[4, 5]]))
    with pytest.raises(Exception) as err, torch.no_grad():
        ltt.forward(tt, tokens, positions)
    assert "lockstep" not in str(err.value)


# the module left stock per dtype: fp32 the GDN's gated norm (stock rounds after the weight, then after the gate);
# bf16 the same norm, which rounds to bf16 twice (visible where one rounding of a float32 norm is not)
LEFT_STOCK = {torch.float32: "layers.0.attn.norm", torch.bfloat16: "layers.0.attn.norm"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_first_divergence_names_the_qwen3_5_module_left_stock(dtype):
    hf = ex.hf_qwen3_5(dtype)
    g = torch.Generator().manual_seed(1)
    tokens, positions, _ = ex.pack(make_prompts(3, 1, VOCAB), torch.randint(1, VOCAB, (3, 40), generator=g))
    with lt.patch(hf):
        assert ltt.first_divergence(ex.titan_qwen3_5(hf), hf, tokens, positions) is None
        name = LEFT_STOCK[dtype]
        leaky = ex.titan_qwen3_5(hf, stock=[name])
        assert type(leaky.get_submodule(name)).__name__ == "RMSNormGated"
        assert ltt.first_divergence(leaky, hf, tokens, positions) == (name, "model.layers.0.linear_attn.norm")


def test_no_transformers_class_inside_the_torchtitan_qwen3_5():
    tt = ex.titan_qwen3_5(ex.hf_qwen3_5(torch.float32))
    mods = [m for _, m in tt.named_modules()]
    assert not [type(m) for m in mods if type(m).__module__.startswith("transformers")]
    names = {type(m).__name__ for m in mods}
    assert {"Qwen35Model", "Qwen35TransformerBlock"} <= names  # TorchTitan's decoder and blocks
    assert {"LockstepGatedDeltaNet", "LockstepGatedDeltaKernel", "LockstepRMSNormGated", "LockstepOffsetRMSNorm",
            "LockstepQwen35Attention", "LockstepMRoPE", "LockstepVarlenAttention", "LockstepFeedForward",
            "LockstepLinear", "TextOnlyVisionEncoder"} <= names


def test_qwen3_5_refusals_name_the_problem_and_change_nothing():
    from hal import UnsupportedError
    hf = ex.hf_qwen3_5(torch.float32)
    tt = ex.titan_qwen3_5(hf)
    # TorchTitan's Qwen3.5 never ties its head; a tiny HF Qwen3.5 may: a sync would lose one of the two heads
    tied = ex.hf_qwen3_5(torch.float32, tied=True)
    before = {k: v.clone() for k, v in tied.state_dict().items()}
    with pytest.raises(UnsupportedError, match="lose one of the two heads"):
        ltt.sync_to_hf(tt, tied)
    assert all(torch.equal(v, tied.state_dict()[k]) for k, v in before.items())
    # images: the vision encoder is kept for its weights only and refuses to run
    with pytest.raises(UnsupportedError, match="vision encoder"):
        tt.vision_encoder(torch.zeros(1, 4, 12), grid_thw=torch.tensor([[1, 2, 2]]))
    # a layer pattern TorchTitan cannot build
    cfg = hf.config.__class__(**{**hf.config.to_dict(), "layer_types": ["full_attention", "linear_attention"]})
    with pytest.raises(UnsupportedError, match="layer_types"):
        ltt.qwen3_5_config_from_hf(cfg)
