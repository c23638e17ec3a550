"""The shared shape of the interpreter check scripts (``python tests/<x>_check.py CHECK...``): each check
prints "LABEL: ok" / "LABEL: FAIL why" lines (through :func:`report`, or triton_seq_check's ``_same`` / ``_differs``,
which share :data:`FAILED`); :func:`main` runs the named checks (all by default), times each, and exits 1 when any
line failed; :func:`skip_without_interpreter` exits 3, the tests' skip, where the interpreter cannot run them."""
from __future__ import annotations

import contextlib
import sys
import time

FAILED: list[str] = []


def report(label: str, problem) -> None:
    if problem:
        FAILED.append(label)
        print(f"{label}: FAIL {problem}", flush=True)
    else:
        print(f"{label}: ok", flush=True)


def skip_without_interpreter() -> None:
    """Print "SKIP: why" and exit 3 (tests/_triton_seq_run.py skips on it) when the Triton interpreter cannot run
    strict kernels here."""
    from hal.kernels.triton.launch import interpreter_problem
    problem = interpreter_problem()
    if problem:
        print(f"SKIP: {problem}")
        sys.exit(3)


def main(checks: dict, names: list[str] | None = None, *, optional: dict | None = None,
         each=contextlib.nullcontext, tag: str = "") -> None:
    """Run ``names`` (default: the command line's; none: every one of ``checks``; ``optional`` ones only when named),
    each inside ``each()``, print "NAME{tag}: SECONDS" after each, and exit 1 when any line failed."""
    known = {**checks, **(optional or {})}
    for name in (sys.argv[1:] if names is None else names) or list(checks):
        t0 = time.time()
        with each():
            known[name]()
        print(f"{name}{tag}: {time.time() - t0:.1f}s", flush=True)
    sys.exit(1 if FAILED else 0)
