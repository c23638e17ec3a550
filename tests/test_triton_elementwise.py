"""Triton sigmoid / silu / softplus / silu_mul and rotary (tables, rotation) == the reference bit for bit,
in the Triton interpreter (tests/scripts/triton_elementwise_check.py in a TRITON_INTERPRET=1 subprocess).

Edge values in every dtype (NaN payloads, +-inf, +-0, subnormals), a 1024-element block and its tail,
non-contiguous views, positions up to 2**24 - 1, partial rotary, broadcast / bf16 / six-leading-dim tables;
both the CUDA launch and the Ascend variant (persistent grid on 3 fake cores, NPU substitutes).
Negative controls (torch's sigmoid / softplus / cos / sin, an HF-style twice-rounded rotation) must be
caught by the same comparison. ~6-8 s of CPU each. Through the conformance suite:
    TRITON_INTERPRET=1 hal conformance run --backend triton --device cpu --ops elementwise rotary [--quick]
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from _triton_seq_run import interpreter_ok  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ok(), reason="the Triton interpreter before 3.9 rounds tl.fma twice")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("variant", [[], ["--npu"]], ids=["cuda-launch", "ascend-variant"])
def test_elementwise_and_rotary_bits_equal_reference(variant):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "triton_elementwise_check.py"), *variant],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ": ok" in ln or ": FAIL" in ln]
    assert len(lines) >= 30 and all(": ok" in ln for ln in lines), r.stdout
    caught = [ln for ln in lines if ln.startswith("negative:")]
    assert len(caught) == 4 and all("wrong variant caught" in ln for ln in caught), caught
