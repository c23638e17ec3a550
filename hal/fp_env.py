"""The floating-point environment the strict specs need: gradual underflow, i.e. neither
flush-to-zero (FTZ: a subnormal result becomes 0) nor denormals-are-zero (DAZ: a subnormal operand
reads as 0). One check, shared by every backend whose arithmetic runs on this machine's CPU
(reference, cpu, the Triton interpreter), called before anything is computed or stored.

FTZ and DAZ are per-thread control bits (x86 MXCSR, Arm FPCR) that govern float32 and float64
alike; ``torch.set_flush_denormal(True)`` sets them on the calling thread, and a library built with
fast-math sets them on the thread that loads it. A thread starts with the bits of the thread that
created it, so a worker pool started while they were set keeps flushing after the calling thread
clears them (measured: torch's intra-op threads, started under FTZ, flush half of a two-thread op
afterwards). So there are two probes:

* the calling thread, on every call: one subnormal float64 product and its double, in Python
  (about 0.1 us; a torch op would cost microseconds). Python's float arithmetic runs on the same
  SSE/NEON unit, under the same control bits, as torch's and numba's float32 code;
* each worker pool a backend computes on (:class:`WorkerThreads`): a probe on every worker until
  it passes, then again only when the pool may have new threads (its thread count changed): a
  pool's threads run only the library's own code afterwards, which never sets the bits.
"""
from __future__ import annotations

from typing import Callable

import torch

from .errors import UnsupportedError

# module globals, so the products below are computed at run time, not folded when compiled
_TINY64 = 2.0 ** -1022   # the smallest normal float64: half of it is subnormal
_HALF = 0.5
_TWO = 2.0

_FIX = ("call torch.set_flush_denormal(False) in this thread (a fast-math library sets it again when "
        "it loads: rebuild it without -ffast-math, or call that after loading it)")


def thread_flushes() -> bool:
    """Whether the calling thread flushes subnormals (FTZ) or reads them as zero (DAZ)."""
    sub = _TINY64 * _HALF                      # FTZ: 0
    return not (sub != 0.0 and sub * _TWO == _TINY64)  # DAZ: sub reads as 0


class WorkerThreads:
    """A pool of threads a backend computes on, with a probe that runs on every one of its threads
    and returns True when all of them keep subnormals.

    ``generation`` names the pool's current set of threads (e.g. its thread count): a passed probe
    holds until it changes. ``remedy``: what clears the setting on these threads."""

    def __init__(self, name: str, probe: Callable[[], bool], remedy: str,
                 generation: Callable[[], object] = lambda: None):
        self.name = name
        self.remedy = remedy
        self._probe = probe
        self._generation = generation
        self._passed: object = _NEVER

    def flushes(self) -> bool:
        gen = self._generation()
        if self._passed is not _NEVER and self._passed == gen:
            return False
        if not self._probe():
            return True
        self._passed = gen
        return False


_NEVER = object()

#: torch's elementwise ops split work in chunks of at least this many elements (at::internal::GRAIN_SIZE)
_TORCH_GRAIN = 32768


def _torch_threads_keep_subnormals() -> bool:
    n = torch.get_num_threads()
    if n == 1:
        return True  # ops run on the calling thread, probed on its own
    x = torch.full((_TORCH_GRAIN * n,), 2.0 ** -126, dtype=torch.float32)  # one chunk per thread
    return bool(((x * 0.5) * 2.0 == x).all())  # FTZ flushes x * 0.5; DAZ reads it as 0


TORCH_THREADS = WorkerThreads(
    "torch's intra-op threads", _torch_threads_keep_subnormals,
    "call torch.set_flush_denormal(False) before the process's first parallel torch op, or run torch on one "
    "thread (torch.set_num_threads(1))", torch.get_num_threads)


def flush_reason(backend: str, workers: tuple[WorkerThreads, ...] = (TORCH_THREADS,)) -> str | None:
    """None when the calling thread and ``workers`` keep subnormals, else why ``backend`` refuses."""
    if thread_flushes():
        return (f"backend {backend!r} refuses to compute: this thread flushes subnormal floats to zero "
                "(flush-to-zero / denormals-are-zero is set, e.g. by torch.set_flush_denormal(True) or a "
                "library built with fast-math), and the strict specs keep subnormals (gradual underflow). "
                f"Turn it off: {_FIX}")
    for pool in workers:
        if pool.flushes():
            return (f"backend {backend!r} refuses to compute: {pool.name} flush subnormal floats to zero "
                    "(flush-to-zero / denormals-are-zero was set in the thread that started them, and a "
                    "thread keeps the setting it started with), and the strict specs keep subnormals. "
                    f"torch.set_flush_denormal(False) in this thread does not reach them: {pool.remedy}")
    return None


def check(backend: str, workers: tuple[WorkerThreads, ...] = (TORCH_THREADS,)) -> None:
    """Raise :class:`UnsupportedError` (with :func:`flush_reason`) when subnormals would be flushed."""
    why = flush_reason(backend, workers)
    if why is not None:
        raise UnsupportedError(why)
