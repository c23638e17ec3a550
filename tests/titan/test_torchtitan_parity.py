"""TorchTitan (trainer) vs transformers (sampler): the same per-token log-prob bits, raw bits compared.

Tiny Qwen3 in float32 and bfloat16. Positive checks: the sampler's ``generate`` log-probs equal TorchTitan's
packed training forward's, before and after a TorchTitan training step and the weight sync back to HF.
Negative controls, asserted here: stock TorchTitan vs stock HF differ; a converter leaving one module stock
is caught and named as the first divergence (each dtype with inputs that module's stock bits change).
"""
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `examples` is not an installed package; run from a checkout
    sys.path.insert(0, str(ROOT))

from examples import torchtitan_parity as ex  # noqa: E402
from examples.hf_rollout import make_prompts, sample  # noqa: E402
from hal.conformance.bits import raw_bits, same_bits  # noqa: E402
from hal.integrations import torchtitan as ltt  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def differing(a, b) -> int:
    return int((raw_bits(a) != raw_bits(b)).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sampler_and_torchtitan_trainer_agree_before_and_after_a_step(dtype):
    hf = ex.hf_qwen3(dtype)
    tt = ex.titan_qwen3(hf)
    prompts = make_prompts(4, 0, ex.VOCAB)
    with lt.patch(hf):
        resp, lp_s = sample(hf, "lockstep", prompts, 6, seed=0)
        tt.train()
        lp_t = ex.trainer_logprobs(tt, "lockstep", prompts, resp)
        assert lp_t.dtype == torch.float32 and lp_t.requires_grad
        assert same_bits(lp_t.detach(), lp_s)
        before = {n: p.detach().clone() for n, p in tt.named_parameters()}
        ex.train_step(tt, lp_t)
        changed = [n for n, p in tt.named_parameters() if not torch.equal(p, before[n])]
        assert len(changed) == len(before)  # the step reached every weight (backward ran through every module)
        ltt.sync_to_hf(tt, hf)
        resp2, lp_s2 = sample(hf, "lockstep", prompts, 6, seed=1)
        lp_t2 = ex.trainer_logprobs(tt, "lockstep", prompts, resp2)
        assert same_bits(lp_t2.detach(), lp_s2)
        assert not same_bits(lp_s2, lp_s)  # new weights, new tokens: not the first round again


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_stock_torchtitan_vs_stock_hf_differ(dtype):
    """Negative control: the same weights in both codebases with their own kernels give other bits."""
    hf = ex.hf_qwen3(dtype, attn="sdpa")
    tt = ex.titan_qwen3(hf, lockstep=False, attn_backend="sdpa")
    prompts = make_prompts(4, 0, ex.VOCAB)
    resp, lp_s = sample(hf, "stock", prompts, 6, seed=0)
    with torch.no_grad():
        lp_t = ex.unpacked_logprobs(tt, "stock", prompts, resp)
    assert differing(lp_s, lp_t) > 0
    assert float((lp_s.double() - lp_t.double()).abs().max()) < (1e-3 if dtype == torch.float32 else 0.5)


def test_stock_torchtitan_cannot_train_packed_on_cpu():
    """What the README and docs/integrations.md say: stock TorchTitan's packed Qwen3 (varlen attention) has no CPU forward: the varlen
    kernel is CUDA-only. (Its other language-model backend, FlexAttention, has no CPU backward.)"""
    hf = ex.hf_qwen3(torch.float32, attn="sdpa")
    tt = ex.titan_qwen3(hf, lockstep=False)
    tokens, positions, _ = ex.pack([torch.tensor([1, 2, 3])], torch.tensor([[4, 5]]))
    with pytest.raises(RuntimeError):
        tt(tokens, positions, tt.get_attention_masks(positions))


# stock module per dtype: fp32 a norm (stock nn.RMSNorm differs in the last bits); bf16 the SwiGLU feed-forward
# (stock rounds silu(w1 x) to bf16 before the product: visible through bf16 rounding where a norm's is not)
LEFT_STOCK = {torch.float32: "layers.1.ffn_norm", torch.bfloat16: "layers.0.feed_forward"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_first_divergence_names_the_module_left_stock(dtype):
    hf = ex.hf_qwen3(dtype)
    tokens, positions, _ = ex.pack(make_prompts(3, 1, ex.VOCAB), torch.randint(1, ex.VOCAB, (3, 5),
                                                                                generator=torch.Generator().manual_seed(1)))
    with lt.patch(hf):
        assert ltt.first_divergence(ex.titan_qwen3(hf), hf, tokens, positions) is None
        name = LEFT_STOCK[dtype]
        leaky = ex.titan_qwen3(hf, stock=[name])
        assert type(leaky.get_submodule(name)).__name__ in ("RMSNorm", "FeedForward")
        assert ltt.first_divergence(leaky, hf, tokens, positions) == (name, ltt._hf_name(name))


def test_no_transformers_class_inside_the_torchtitan_model():
    hf = ex.hf_qwen3(torch.float32)
    tt = ex.titan_qwen3(hf)
    mods = [m for _, m in tt.named_modules()]
    assert not [type(m) for m in mods if type(m).__module__.startswith("transformers")]
    names = {type(m).__name__ for m in mods}
    assert {"Qwen3Model", "Qwen3TransformerBlock", "GQAttention", "FusedQKVLinear"} <= names  # TorchTitan's code
    assert {"LockstepLinear", "LockstepRMSNorm", "LockstepCosSinRoPE", "LockstepVarlenAttention",
            "LockstepFeedForward"} <= names


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_token_logprobs_from_hidden_states_agree(dtype):
    """hal.token_logprobs (float32 LM head, no rounding of the logits to the model dtype) on each side's final
    hidden states: TorchTitan's packed forward without its LM head vs the HF model's packed forward."""
    hf = ex.hf_qwen3(dtype)
    tt = ex.titan_qwen3(hf)
    prompts = make_prompts(3, 2, ex.VOCAB)
    resp = torch.randint(1, ex.VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    tokens, positions, rows = ex.pack(prompts, resp)
    targets = torch.cat(list(resp))
    with lt.patch(hf), torch.no_grad():
        tt._skip_lm_head = True
        h_tt = tt(tokens, positions, tt.get_attention_masks(positions))[0, rows]
        h_hf = hf.model(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state[0, rows]
        assert same_bits(h_tt, h_hf)
        assert same_bits(ltt.token_logprobs(tt, h_tt, targets), lt.token_logprobs(hf, h_hf, targets))


def test_refusals_name_the_problem_and_change_nothing():
    from torchtitan.models.qwen3 import model_registry
    from hal import InputError, UnsupportedError
    hf = ex.hf_qwen3(torch.float32)
    cfg = ltt.qwen3_config_from_hf(hf.config)
    with pytest.raises(InputError, match="layers.9.ffn_norm"):
        ltt.convert(cfg, stock=["layers.9.ffn_norm"])
    # configs the converter does not know (here Qwen3-MoE's router and experts) are refused by path, never
    # half-converted
    spec = model_registry("debugmodel_moe", attn_backend="varlen")
    with pytest.raises(UnsupportedError, match=r"layers\.0\.moe"):
        ltt.convert(spec.model)
    # a weight sync that would lose the LM head (HF ties it, TorchTitan does not)
    tt = ex.titan_qwen3(hf)
    tied = ex.hf_qwen3(torch.float32, tied=True)
    before = {k: v.clone() for k, v in tied.state_dict().items()}
    with pytest.raises(UnsupportedError, match="lose one of the two heads"):
        ltt.sync_to_hf(tt, tied)
    assert all(torch.equal(v, tied.state_dict()[k]) for k, v in before.items())
    # an HF model cast with .to(bf16): its RoPE table is bf16, not the float32 one TorchTitan's side uses
    rounded = ex.hf_qwen3(torch.float32).to(torch.bfloat16)
    with pytest.raises(UnsupportedError, match="inv_freq"):
        ltt.check_rotary_table(rounded)
    with pytest.raises(UnsupportedError, match="inv_freq"):
        ltt.load_from_hf(ex.titan_qwen3(hf), rounded)
    ltt.check_rotary_table(ex.hf_qwen3(torch.bfloat16))
    # attention lockstep does not compute: a window, masks other than TorchTitan's varlen metadata
    from hal.integrations.torchtitan import modules as tm
    with pytest.raises(UnsupportedError, match="window_size"):
        tm.LockstepVarlenAttention.Config(window_size=(4, 0)).build()
    attn = tm.LockstepVarlenAttention.Config().build()
    q = torch.zeros(1, 3, 2, 16)
    with pytest.raises(UnsupportedError, match="VarlenMetadata"):
        attn(q, q, q, attention_masks=torch.ones(3, 3, dtype=torch.bool))


def test_model_registry_applies_the_converter():
    """TorchTitan's own plug-in point: model_registry(flavor, converters=[...]) converts every leaf config."""
    from torchtitan.models.qwen3 import model_registry
    from hal.integrations.torchtitan import modules as tm
    spec = model_registry("debugmodel", attn_backend="varlen", converters=[ltt.LockstepConverter.Config()])
    layer = spec.model.layers[0]
    assert type(spec.model.lm_head) is tm.LockstepLinear.Config and type(spec.model.norm) is tm.LockstepRMSNorm.Config
    assert type(layer.attention.inner_attention) is tm.LockstepVarlenAttention.Config
    assert type(layer.attention.rope) is tm.LockstepCosSinRoPE.Config
    assert type(layer.feed_forward) is tm.LockstepFeedForward.Config
    assert type(layer.attention.qkv_linear.wqkv) is tm.LockstepLinear.Config


def test_importing_the_integration_imports_no_torchtitan():
    import subprocess
    code = "import sys, hal.integrations.torchtitan; assert 'torchtitan' not in sys.modules, 'imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
