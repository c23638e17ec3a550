"""What the floating-point environment check (hal.fp_env) costs per call, against the ways it could
be done and against a small stock op in the same run.

    python -m benchmarks.fp_env

Rows (median of 7 repeats of 20,000 calls, microseconds per call):
* thread probe: hal.fp_env.thread_flushes (Python float64, the per-call part of the check);
* check, reference: flush_reason for the reference (thread probe + torch's pool, cached);
* check, cpu: the cpu backend's reason (+ numba's pool, cached);
* torch probe: the same probe as a float32 torch op on the calling thread (the alternative);
* numba probe: the compiled float32 probe (the old check's per-call part);
* stock: torch.softmax on 2x8 float32 (for scale).
"""
from __future__ import annotations

import statistics
import timeit

import torch

from hal import fp_env


def _us(fn, n=20000, repeat=7) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6


def main() -> None:
    tiny = torch.tensor([2.0 ** -126])
    rows = [("thread probe", fp_env.thread_flushes),
            ("check, reference", lambda: fp_env.flush_reason("reference")),
            ("torch probe", lambda: bool(((tiny * 0.5) * 2.0 == tiny).all()))]
    try:
        import numpy as np
        from hal.backends import cpu
        from hal.kernels.cpu import strict_math as sm
        t32 = np.float32(2.0 ** -126)
        rows += [("check, cpu", cpu._fp_reason), ("numba probe", lambda: sm._probe_one(t32))]
    except ImportError:
        pass
    x = torch.randn(2, 8)
    rows.append(("stock softmax 2x8", lambda: torch.softmax(x, -1)))
    for name, fn in rows:
        print(f"{name:<20} {_us(fn):8.3f} us")


if __name__ == "__main__":
    main()
