"""Start a gloo world of real processes running one worker script (tests/dist/*_worker.py) and collect results."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(worker: Path, world: int, out_dir: Path, deadline: float) -> list[dict]:
    """``world`` processes of ``python worker RANK WORLD PORT OUT_DIR``; each rank's ``OUT_DIR/rank{r}.pt``.

    Raises AssertionError with a rank's output tail if it fails or the world outlives ``deadline`` seconds."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(port), str(out_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=deadline)[0])
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{worker.name}: the {world} gloo workers did not finish within {deadline} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {worker.name} failed (rc {p.returncode}):\n{log[-4000:]}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
