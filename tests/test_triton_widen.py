"""bfloat16 subnormal inputs: the strict kernels widen bf16 exactly (tests/scripts/triton_widen_check.py, interpreter),
with the plain cast as the negative control."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from _triton_seq_run import interpreter_ok  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not interpreter_ok(), reason="the Triton interpreter before 3.9 rounds tl.fma twice")
def test_bf16_subnormal_inputs_give_reference_bits_and_the_plain_cast_is_caught():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "triton_widen_check.py")], cwd=ROOT,
                       env=dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plain cast (negative control)" in r.stdout and r.stdout.count("same bits") == 2, r.stdout
