"""lockstep's worker threads for the cpu kernels: each op compiles one serial ``nogil`` kernel over a range
of tasks, ``kernel(*args, lo, hi)``, and :func:`run` calls it on consecutive ranges from several threads
(numba releases the GIL inside it), instead of a numba ``parallel=True`` driver beside a serial one.

Why (issue 24, cold start): numba compiles a callee into every caller again (it links the callee's LLVM
module into the caller's and optimises and generates machine code for the whole), so a task body
behind a prange driver and a serial driver was compiled three times (its own dispatcher, the parfor
gufunc, the serial loop), and a ``parallel=True`` driver adds a parfor pass of its own. One kernel per
op compiles once. Tasks write disjoint outputs and each runs the same code whatever range it falls
in, so neither the thread count nor the split changes a bit.

The threads are started on demand by the thread that first needs them (a thread starts with its
creator's floating-point environment) and are never replaced: :func:`keep_subnormals` probes each one
(hal.fp_env), and the pool's size is the probe's generation. A worker may run on any core of the
process's threads (:func:`_process_cores`), not only on its creator's. numba's own thread pool and
threading layer are never used, so the process's numba settings stay the user's.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading

import numpy as np

from hal import kernel_threads

from .strict_math import _probe_one

#: fma-sized steps below which a kernel runs on the calling thread alone: handing ranges to other
#: threads costs tens of microseconds
PARALLEL_MIN_WORK = 1 << 20

#: ranges per thread: more, smaller ranges even out tasks of unequal size (causal attention's rows)
_RANGES_PER_THREAD = 4

_workers: list[queue.SimpleQueue] = []  # one job queue per worker thread
_grow = threading.Lock()
_TINY = np.float32(2.0 ** -126)


def threads() -> int:
    """The thread count of a parallel call: torch's unless lockstep's kernels were given their own
    (hal.kernel_threads)."""
    return kernel_threads.count()


def parallel_worth(work: int) -> bool:
    """Whether a kernel doing ``work`` independent fma-sized steps should be split over threads (the
    bits never depend on the choice)."""
    return work >= PARALLEL_MIN_WORK and threads() > 1


def size() -> int:
    """Worker threads started so far (the calling thread is not one of them)."""
    return len(_workers)


def _process_cores() -> set[int] | None:
    """The cores any thread of this process may run on (None where the OS does not say). A thread starts
    with its creator's affinity: where an engine pinned its main thread to one core and each of torch's
    OpenMP threads to one more (vLLM-CPU's worker), a worker thread started from the main thread would share
    the main thread's core; it gets the cores the process was given instead."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores: set[int] = set()
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            cores |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return cores or None


def _serve(jobs: queue.SimpleQueue, cores: set[int] | None) -> None:
    if cores:
        try:
            os.sched_setaffinity(0, cores)  # 0: this thread
        except OSError:  # e.g. a core taken from the process meanwhile: keep the inherited cores
            pass
    while True:
        fn, done = jobs.get()
        try:
            fn()
        except BaseException as e:  # handed to the caller, which raises it
            done.put(e)
        else:
            done.put(None)


def _on_threads(n: int, fn) -> None:
    """fn() on the calling thread and on n - 1 worker threads at once; the first error is raised."""
    with _grow:
        cores = _process_cores() if len(_workers) < n - 1 else None
        while len(_workers) < n - 1:
            jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs, cores), name=f"lockstep-cpu-{len(_workers) + 1}",
                             daemon=True).start()
            _workers.append(jobs)
        mine = _workers[:n - 1]
    done = queue.SimpleQueue()
    for jobs in mine:
        jobs.put((fn, done))
    errors = []
    try:
        fn()
    except BaseException as e:
        errors.append(e)
    for _ in mine:  # every worker finishes before the outputs are handed back
        e = done.get()
        if e is not None:
            errors.append(e)
    if errors:
        raise errors[0]


def run(kernel, n_tasks: int, *args, parallel: bool) -> None:
    """``kernel(*args, lo, hi)`` over tasks [0, n_tasks): on the calling thread alone unless ``parallel``,
    else in consecutive ranges taken in turn by :func:`threads` threads."""
    n = min(threads(), n_tasks) if parallel else 1
    if n <= 1:
        kernel(*args, 0, n_tasks)
        return
    step = max(1, -(-n_tasks // (n * _RANGES_PER_THREAD)))
    starts = itertools.count(0, step)  # next() is atomic under the GIL: each range is taken once

    def take_ranges():
        for lo in starts:
            if lo >= n_tasks:
                return
            kernel(*args, lo, min(lo + step, n_tasks))

    _on_threads(n, take_ranges)


def keep_subnormals() -> bool:
    """Whether every worker thread (started now up to :func:`threads`) keeps subnormal floats: one probe
    on each, all at once (so each runs on a thread of its own)."""
    n = max(threads(), size() + 1)
    ok = []
    barrier = threading.Barrier(n)

    def probe():
        barrier.wait()  # every thread holds one probe: no thread takes two
        ok.append(bool(_probe_one(_TINY)))

    _on_threads(n, probe)
    return all(ok)
