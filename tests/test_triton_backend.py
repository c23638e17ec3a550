"""The triton backend's registration and availability rules (no kernel runs here; fast)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import hal
from hal.spec import DEFAULTS

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_importing_hal_does_not_import_triton():
    code = ("import sys, hal; b = hal.get_backend('triton'); b.unavailable_reason(); b.ops(); "
            "print('triton' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PATH": "", "PYTHONPATH": ".", "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_registered_and_claims_its_suites():
    b = hal.get_backend("triton")
    assert b.device_types == ("cuda",)
    for suite in ("matmul", "rms_norm", "softmax", "token_logprobs", "attention", "gated_delta_rule", "elementwise",
                  "rotary"):  # each suite under its spec family's default spec
        assert b.claimed_levels(suite, DEFAULTS[suite]) == frozenset(hal.LEVELS)
    assert b.claimed_levels("gdn_layer", DEFAULTS["gated_delta_rule"]) == frozenset(hal.LEVELS)


def test_never_chosen_automatically_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chosen = hal.select("matmul", DEFAULTS["matmul"], torch.float32, torch.device("cpu"))
    assert chosen.name != "triton"  # main now has a cpu backend: whichever backend it is, not triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_unavailable_reason_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = hal.get_backend("triton").unavailable_reason()
    if HAS_TRITON:
        assert "no CUDA device" in why and "TRITON_INTERPRET=1" in why
    else:
        assert "not installed" in why
    with pytest.raises(hal.UnsupportedError, match="triton"):
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), backend="triton")


def test_tiles_that_size_kernel_lanes_must_be_powers_of_two():
    """A kernel tile's lanes are one tl.arange (a power of two): other sizes get a clear refusal, not a compile
    error; tiles that only bound a loop (softmax, rms_norm, vocab, head-dim tiles) run any length."""
    import torch
    from hal.backends.triton import TritonBackend
    from hal.spec import AttentionSpec, GatedDeltaRuleSpec, SoftmaxSpec, TokenLogprobsSpec
    be, cuda = TritonBackend(), torch.device("cuda")
    refused = {"flash_attn_varlen_func": AttentionSpec(kv_block=48, kv_split=240),
               "chunk_gated_delta_rule": GatedDeltaRuleSpec(chunk=48)}
    for op, spec in refused.items():
        why = " ".join(be.supports(op, spec, torch.float32, cuda))
        assert "must be a power of two" in why and "48" in why, (op, why)
    for op, spec in {"flash_attn_varlen_func": AttentionSpec(), "softmax": SoftmaxSpec(tile=20),
                     "token_logprobs": TokenLogprobsSpec(vocab_tile=100)}.items():
        assert not any("power of two" in r for r in be.supports(op, spec, torch.float32, cuda)), op
