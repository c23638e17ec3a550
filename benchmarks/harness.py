"""What the GPU benchmarks share: timing one call (CUDA events or host wall clock), the median over repeats,
seeded random inputs and the csv file of the rows.

CUDA-event timing records an event before and after the call on the current stream and waits for the
device, so a time covers the kernels the call queued (and the launch gaps between them), not the host's
return. The CPU path (Triton interpreter smoke runs) times the host wall clock.
"""
from __future__ import annotations

import csv
import statistics
import time

import torch


def event_seconds(fn) -> float:
    """Seconds of one call of ``fn`` by CUDA events (the device is synchronised after)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def host_seconds(fn) -> float:
    """Seconds of one call of ``fn`` by the host's clock (no synchronisation: on CUDA, the host's share only)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def call_seconds(fn, cuda: bool) -> float:
    """One call's seconds: CUDA events on a GPU, the host clock on CPU."""
    return event_seconds(fn) if cuda else host_seconds(fn)


def median_seconds(fn, reps: int, cuda: bool = True, warmup: int = 1) -> float:
    """Median of ``reps`` timed calls (:func:`call_seconds`) after ``warmup`` untimed ones (compiles, caches)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(call_seconds(fn, cuda) for _ in range(reps))


def randn(shape, dtype, device, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times ``scale``) from a seeded CPU generator: the same inputs on every device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def write_csv(path: str, rows: list[dict], fieldnames=None) -> None:
    """The rows as a csv file with a header (fields: the first row's keys unless given; missing values empty)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames or rows[0]), restval="")
        w.writeheader()
        w.writerows(rows)
