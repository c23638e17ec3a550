"""examples/vllm_rl.py --short (CI's form of the RL loop): vLLM samples, a trainer takes GRPO steps, the weights go
back through reload_weights. lockstep's sampler and trainer log-probs agree bit for bit at every step; stock's
differ at every step; without the weight sync lockstep's differ after the first step (the check sees the weights)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(out, *args):
    env = dict(os.environ, VLLM_CACHE_ROOT=str(out / "vllm_cache"))
    proc = subprocess.run([sys.executable, "-m", "examples.vllm_rl", "--short", "--out", str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / "vllm_rl.json").read_text())


def test_rl_loop_lockstep_exact_stock_not(tmp_path):
    res = run_example(tmp_path)
    assert (tmp_path / "vllm_rl.png").stat().st_size > 0
    for name in ("lockstep", "stock"):
        for cfg, steps in res[name].items():
            assert len(steps) == 3 and all(s["tokens"] > 0 for s in steps), (name, cfg)
            if name == "lockstep":
                assert [s["bits_differ"] for s in steps] == [0, 0, 0], cfg
                assert all(s["k3"] == 0.0 and s["is_min"] == s["is_max"] == 1.0 for s in steps), cfg
            else:
                assert all(s["bits_differ"] > 0 and s["k3"] > 0 for s in steps), (cfg, steps)


def test_without_weight_sync_lockstep_differs(tmp_path):
    """Negative control: the engine keeps its first weights while the trainer steps: bits differ from step 1 on."""
    res = run_example(tmp_path, "--loops", "lockstep", "--no-weight-sync", "--steps", "2")
    steps = res["lockstep"]["qwen3-bfloat16"]
    assert steps[0]["bits_differ"] == 0 and steps[1]["bits_differ"] > 0, steps
