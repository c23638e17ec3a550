"""benchmarks/gpu_rl_step.py's dry run (issue 51): the GPU benchmark's code path -- engine sampling, micro-batched
teacher-forced trainer, GRPO-style loss and backward, lockstep then stock -- runs on CPU at tiny shapes."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LOCKSTEP_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_rl_step", "--tiny", "--device", "cpu", "--out",
                           str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_dry_run_of_one_rl_step(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "rl_step.jsonl") as f:
        lock, stock = [json.loads(line) for line in f]
    assert (lock["side"], lock["policy"], stock["side"]) == ("lockstep", "strict", "stock")
    for r in (lock, stock):
        assert r["tokens"] == 4 * 4 and r["micro_batch"] == 2  # 4 prompts of 12 + 4 new, two micro-batches
        assert r["params_with_grad"] == r["params"]  # the backward reached every weight
        assert r["sample_s"] > 0 and r["train_s"] > 0 and r["step_tok_s"] > 0
    assert lock["logprob_bits_differ"] == 0  # the claim: the engine's recorded bits are the trainer's
    assert 0 <= stock["logprob_bits_differ"] <= stock["tokens"]
    assert lock["step_ratio"] > 0 and "lockstep / stock time" in p.stdout


def test_the_bit_count_catches_one_flipped_bit():
    from benchmarks.gpu_rl_step import differing_bits
    a = torch.randn(3, 4)
    b = a.clone()
    assert differing_bits(a, b) == 0
    b.view(torch.int32)[1, 2] ^= 1  # the last mantissa bit of one log-prob
    assert differing_bits(a, b) == 1
    assert differing_bits(torch.zeros(2), -torch.zeros(2)) == 2


def test_a_run_over_budget_says_so_instead_of_shrinking(tmp_path):
    p = _run(tmp_path, "--budget", "0.001")
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "does not fit: the lockstep warm-up step took" in p.stderr
    with open(tmp_path / "rl_step.jsonl") as f:
        (row,) = [json.loads(line) for line in f]
    assert row["error"].startswith("does not fit")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="the CPU refusal, no interpreter")
def test_the_fast_policy_reaches_lt_patch_and_is_refused_by_name_on_cpu():
    """--policy fast (the device script's default on CUDA) hands lt.patch its switch; on this CPU no backend claims
    the fast suites, so lt.patch refuses it by name and leaves the model as it was."""
    from benchmarks.gpu_rl_step import patch_kwargs
    from hal import UnsupportedError
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_model
    assert patch_kwargs("strict") == {} and patch_kwargs("fast") == {"policy": "fast"}
    lt.register()
    model = tiny_model("llama", dtype=torch.bfloat16)
    forward = type(model.model.layers[0].self_attn).forward
    with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu"):
        with lt.patch(model, **patch_kwargs("fast")):
            pass
    assert "forward" not in vars(model.model.layers[0].self_attn)  # no per-instance forward left behind
    assert type(model.model.layers[0].self_attn).forward is forward
