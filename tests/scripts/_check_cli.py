"""The shared shape of the interpreter check scripts (``python tests/<x>_check.py CHECK...``): each check
prints "LABEL: ok" / "LABEL: FAIL why" lines through :func:`report`; :func:`main` runs the named checks (all by
default), times each, and exits 1 when any line failed."""
from __future__ import annotations

import sys
import time

FAILED: list[str] = []


def report(label: str, problem) -> None:
    if problem:
        FAILED.append(label)
        print(f"{label}: FAIL {problem}", flush=True)
    else:
        print(f"{label}: ok", flush=True)


def main(checks: dict) -> None:
    for name in sys.argv[1:] or list(checks):
        t0 = time.time()
        checks[name]()
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)
    sys.exit(1 if FAILED else 0)
