"""Runs tests/triton_seq_check.py (or another check script's) checks in a TRITON_INTERPRET=1 subprocess."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "triton_seq_check.py")


def interpreter_ok() -> bool:
    import triton
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


def run_checks(*names: str, script: str = SCRIPT) -> str:
    """Run the named checks of ``script`` (default tests/triton_seq_check.py); every result line must say ok."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, script, *names], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    lines = [ln for ln in r.stdout.splitlines() if ": ok" in ln or ": FAIL" in ln]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert lines and all(": ok" in ln for ln in lines), r.stdout
    return r.stdout
