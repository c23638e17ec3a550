"""hal.kernels.triton.strict_math == kernels/reference/strict_math.py bit for bit, in the Triton interpreter.

Each check runs tests/scripts/triton_math_check.py in a subprocess with TRITON_INTERPRET=1 (Triton picks
interpreter or compiler when a kernel module is imported, so the mode needs its own process).
Inputs: all 2**16 bfloat16 patterns as float32, 2**16 random float32 patterns, 8192 subnormals,
16384 values in exp's busy range, crafted edge cases (~2 s each).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_math_check.py")


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _interpreter_ok():
    import triton
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


pytestmark = pytest.mark.skipif(not _interpreter_ok(), reason="the Triton interpreter before 3.9 rounds tl.fma twice")


def test_strict_math_matches_reference_bits():
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if " inputs, " in ln}
    for name in ("exp", "log", "log(|x|)", "div", "sqrt", "fma", "sin", "cos", "widen(bf16)", "bf16", "fp16"):
        assert lines[name].endswith(" 0 differ"), lines[name]


@pytest.mark.parametrize("variant", ["log_fused", "tl_exp", "tl_sin"])
def test_negative_controls_are_caught(variant):
    # log with the contraction fp fusion makes, and Triton's own exp: the same comparison must see them
    r = _run("--variant", variant)
    assert r.returncode == 0, r.stdout + r.stderr
    n = int(r.stdout.split(" inputs, ")[1].split()[0])
    assert n > 0
