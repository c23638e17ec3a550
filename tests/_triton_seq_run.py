"""Triton interpreter subprocesses for the tests: tests/scripts/triton_seq_check.py (or another check script's) checks,
the conformance suite's quick case sets."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_seq_check.py")


def interpreter_ok() -> bool:
    """Community Triton >= 3.9 is installed (older interpreters round tl.fma twice)."""
    try:
        import triton
    except ImportError:
        return False
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


#: module mark (``pytestmark = needs_interpreter``) of the tests that run kernels in the interpreter
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs triton >= 3.9 (not installed, or an "
                                       "interpreter before 3.9, which rounds tl.fma twice)")


def interpreter_env(**extra) -> dict:
    """The environment of a subprocess whose Triton kernels run in the interpreter (TRITON_INTERPRET=1)."""
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **extra)


def run_checks(*names: str, script: str = SCRIPT) -> str:
    """Run the named checks of ``script`` (default tests/scripts/triton_seq_check.py); every result line must say ok."""
    r = subprocess.run([sys.executable, script, *names], cwd=ROOT, env=interpreter_env(), capture_output=True,
                       text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    lines = [ln for ln in r.stdout.splitlines() if ": ok" in ln or ": FAIL" in ln]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert lines and all(": ok" in ln for ln in lines), r.stdout
    return r.stdout


def run_quick_conformance(backend: str, suite: str, tmp_path) -> None:
    """``hal conformance run --quick`` of one conformance suite on ``backend`` (CPU, interpreter): every record must be
    claimed and pass, and every level of the suite must have run cases."""
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "hal.cli", "conformance", "run", "--backend", backend, "--device",
                        "cpu", "--quick", "--quiet", "--ops", suite, "--json", str(out)],
                       cwd=ROOT, env=interpreter_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = json.loads(out.read_text())["records"]
    from hal.conformance import suites
    by_level = {}
    for rec in records:
        assert rec["claimed"] and rec["status"] == "pass", rec  # the backend claims every level of its suites
        by_level[rec["level"]] = by_level.get(rec["level"], 0) + rec["cases"]
    assert set(by_level) == set(suites.get(suite).levels) and all(n > 0 for n in by_level.values()), by_level
