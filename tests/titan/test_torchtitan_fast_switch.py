"""``LockstepConverter.Config(policy="fast")``: TorchTitan's linears, varlen attention and (Qwen3.5) gated delta rule
on the fast specs, the same
switch as ``lt.patch(hf_model, policy="fast")`` (docs/fast_policy.md): the policy reaches the leaves, an unknown one
is refused, a forward on a device where no backend claims the fast specs is refused by name; in the Triton
interpreter the fast TorchTitan trainer and the fast-patched HF sampler give the same logits' bits (negative
control: the strict TorchTitan trainer's differ)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import torchtitan_parity as ex  # noqa: E402
from hal import InputError, UnsupportedError  # noqa: E402
from hal.integrations import torchtitan as ltt  # noqa: E402
from hal.kernels.triton.versions import interpreting  # noqa: E402


def _fast_titan(hf):
    cfg = ltt.LockstepConverter.Config(policy="fast").build().convert(ltt.qwen3_config_from_hf(hf.config))
    assert cfg.lm_head.policy == "fast" and cfg.layers[0].attention.inner_attention.policy == "fast"
    assert cfg.layers[0].attention.qkv_linear.wqkv.policy == "fast"
    return cfg


def test_converter_policy_reaches_the_qwen3_5_gdn_kernel():
    from hal.integrations.torchtitan.qwen35_modules import LockstepGatedDeltaKernel
    hf = ex.hf_qwen3_5(torch.bfloat16)
    for policy in ("fast", "strict"):
        cfg = ltt.LockstepConverter.Config(policy=policy).build().convert(ltt.qwen3_5_config_from_hf(hf.config))
        kernels = [c for c in _configs(cfg) if isinstance(c, LockstepGatedDeltaKernel.Config)]
        assert kernels and all(k.policy == policy for k in kernels)


def _configs(cfg):
    """Every dataclass config inside ``cfg``."""
    import dataclasses
    if isinstance(cfg, list):
        for c in cfg:
            yield from _configs(c)
    elif dataclasses.is_dataclass(cfg):
        yield cfg
        for f in dataclasses.fields(cfg):
            yield from _configs(getattr(cfg, f.name))


def test_converter_policy_reaches_the_leaves_and_is_refused_by_name():
    hf = ex.hf_qwen3(torch.bfloat16)
    _fast_titan(hf)
    with pytest.raises(InputError, match="policy must be one of"):
        ltt.LockstepConverter.Config(policy="turbo").build().convert(ltt.qwen3_config_from_hf(hf.config))
    strict = ltt.LockstepConverter.Config().build().convert(ltt.qwen3_config_from_hf(hf.config))
    assert strict.lm_head.policy == "strict"


@pytest.mark.skipif(interpreting() or torch.cuda.is_available(), reason="the refusal where no backend claims fast")
def test_fast_trainer_forward_refused_on_cpu():
    hf = ex.hf_qwen3(torch.bfloat16)
    tt = ex._build(ltt.qwen3_config_from_hf(hf.config), hf, True, ())  # strict: runs
    cfg = _fast_titan(hf)
    with torch.random.fork_rng(devices=[]):
        model = cfg.build()
    model.to(torch.bfloat16)
    ltt.load_from_hf(model, hf)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    positions = torch.arange(5).unsqueeze(0)
    ltt.forward(tt, tokens, positions)
    with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: no backend that claims 'matmul_fast'"):
        ltt.forward(model, tokens, positions)


def test_fast_trainer_equals_fast_sampler_in_interpreter():
    pytest.importorskip("triton")
    script = ROOT / "tests" / "scripts" / "fast_switch_check.py"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script), "switch-torchtitan", "switch-torchtitan-qwen3_5"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "switch-torchtitan: ok" in r.stdout and "switch-torchtitan-strict-negative-control: ok" in r.stdout
    # the trainer's token_logprobs on the fast spec (the LM head's policy), equal to the fast-patched sampler's
    assert "switch-torchtitan-token-logprobs-spec: ok" in r.stdout and "switch-torchtitan-token-logprobs: ok" in r.stdout
    # Qwen3.5: its GatedDeltaKernel on the fast GDN spec (the conv and gates strict), trainer == sampler
    assert "switch-torchtitan-qwen3_5-runs-fast-specs: ok" in r.stdout and "switch-torchtitan-qwen3_5: ok" in r.stdout
    assert "switch-torchtitan-qwen3_5-strict-negative-control: ok" in r.stdout
