"""Triton attention backward kernels in the Triton interpreter (CPU), through hal's autograd.

Checks (tests/triton_attn_backward_check.py): varlen with empty sequences, padding rows, Tq < Tk and a
sequence with more queries than keys (rows that see no key), GQA / MQA, causal, causal + sliding window,
a non-causal (left, right) window, an lse gradient, fp32 / bf16 / fp16: gradients within a dtype tolerance
of hal's float64 torch backward (backward bits are not a spec); a second run gives the same raw bits;
exact zeros on padding rows and rows that see no key. Negative control: kernels that drop the dlse term
fail the same closeness check. Default: three cases (CI, ~50 s); LOCKSTEP_FULL=1 adds head dims 24-64.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
SCRIPT = os.path.join(ROOT, "tests", "triton_attn_backward_check.py")


def test_gradients_close_to_float64_deterministic_zero_rows():
    out = run_checks("grads", script=SCRIPT)
    assert "close to float64 oracle: ok" in out and "second run same bits: ok" in out


def test_negative_control_dropped_dlse_is_caught():
    out = run_checks("negative", script=SCRIPT)
    assert "wrong variant caught" in out


def test_gpu_benchmark_fails_cleanly_without_cuda():
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run (benchmarks/gpu_check.sh step attn-train)")
    r = subprocess.run([sys.executable, "-m", "benchmarks.attn_train_bench"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr, (r.returncode, r.stderr[-2000:])
