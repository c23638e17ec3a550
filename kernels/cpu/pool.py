"""lockstep's worker threads for the cpu kernels: each op compiles one serial ``nogil`` kernel over the tasks
of a call, ``kernel(*args, work)``, which takes ranges of tasks from ``work`` (:func:`claim`) until none is
left, and :func:`run` calls it on several threads at once (numba releases the GIL inside it), instead of a
numba ``parallel=True`` driver beside a serial one.

Why one kernel (issue 24, cold start): numba compiles a callee into every caller again (it links the
callee's LLVM module into the caller's and optimises and generates machine code for the whole), so a task
body behind a prange driver and a serial driver was compiled three times (its own dispatcher, the parfor
gufunc, the serial loop), and a ``parallel=True`` driver adds a parfor pass of its own. One kernel per op
compiles once. Tasks write disjoint outputs and each runs the same code whatever range it falls in, so
neither the thread count nor the split changes a bit.

Why ranges are claimed inside the kernel, and why threads wait by watching memory (issue 52): every
hand-over between Python threads goes through the GIL, and a thread that blocks -- on a queue, or on the GIL
while another thread holds it -- costs tens of microseconds to wake (a parallel call cost ~46 us with
queue hand-overs and ranges taken in Python, about a decode step's small linear). So a worker watches its
control words while idle (:func:`_watch_for_job`, GIL released), takes the GIL only once the caller is
inside its own kernel (it has claimed a range: the GIL is free), runs the kernel, and reports its end from
native code after giving the GIL back; a job whose tasks are all claimed before the worker starts is ended
without touching Python. Waits are bounded (:data:`WORKER_SPIN_S`, :data:`CALLER_SPIN_S`), then block, so
an idle lockstep thread never holds a core long from torch's threads beside it; a call on more threads
than the process has cores blocks at once (a watching thread would take a core from one still working).

The threads are started on demand by the thread that first needs them (a thread starts with its
creator's floating-point environment) and are never replaced in a process (a forked child starts with
none): :func:`keep_subnormals` probes each one (hal.fp_env), and the pool's size is the probe's
generation. A worker may run on any core of the process's threads (:func:`_process_cores`), not only on
its creator's. numba's own thread pool and threading layer are never used, so the process's numba
settings stay the user's.
"""
from __future__ import annotations

import os
import platform
import queue
import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from hal import kernel_threads

from .strict_math import _probe_one

#: fma-sized steps below which a kernel runs on the calling thread alone: handing ranges to other
#: threads costs microseconds
PARALLEL_MIN_WORK = 1 << 20

#: ranges per thread: more, smaller ranges even out tasks of unequal size (causal attention's rows)
_RANGES_PER_THREAD = 4

#: how long an idle worker watches for its next job, and a caller for its workers' ends, before blocking
WORKER_SPIN_S = 200e-6
CALLER_SPIN_S = 2e-3

_TINY = np.float32(2.0 ** -126)

# ---------------------------------------------------------------- atomics and the clock, in native code

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _is_int64_array(a, i):
    return isinstance(a, types.Array) and a.dtype == types.int64 and isinstance(i, types.Integer)


@intrinsic
def _load_acquire(typingctx, a, i):
    """a[i] (int64, unchecked) read atomically (acquire): a loop of these reads memory on every pass, and
    what was written before the matching release store is visible after it."""
    if not _is_int64_array(a, i):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)
    return types.int64(a, i), codegen


@intrinsic
def _store_release(typingctx, a, i, v):
    """a[i] = v (int64, unchecked), atomically (release)."""
    if not (_is_int64_array(a, i) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(value, builder.gep(data, [args[1]]), "release", 8)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@intrinsic
def _fetch_add(typingctx, a, i, v):
    """a[i] += v atomically (int64, unchecked); a[i] before."""
    if not (_is_int64_array(a, i) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), value, "monotonic")
    return types.int64(a, i, v), codegen


@intrinsic
def _pause_and_clock(typingctx):
    """A spin-wait hint to the core (x86's ``pause``), then the cycle counter."""
    def codegen(context, builder, sig, args):
        mod = builder.module
        if _X86:
            builder.call(cgutils.get_or_insert_function(mod, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"),
                         [])
        clock = cgutils.get_or_insert_function(mod, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        return builder.call(clock, [])
    return types.int64(), codegen


# ---------------------------------------------------------------- the contract of a kernel: claim ranges

_NEXT, _TASKS, _STEP = 0, 8, 9  # a call's work words: the next unclaimed task (a cache line of its own), count, range


@njit(inline="always", cache=True)
def claim(work):
    """The next range [lo, hi) of the call's tasks for this thread (empty, lo >= hi, when none is left).
    A kernel runs ``lo, hi = claim(work)`` then ``while lo < hi: <tasks lo .. hi>; lo, hi = claim(work)``."""
    step = work[_STEP]
    lo = _fetch_add(work, _NEXT, step)
    return lo, min(lo + step, work[_TASKS])


def _work_words(n_tasks: int, step: int, words: np.ndarray | None = None) -> np.ndarray:
    words = np.zeros(16, np.int64) if words is None else words
    words[_TASKS], words[_STEP] = n_tasks, step
    _publish(words, _NEXT, 0)
    return words


# ---------------------------------------------------------------- workers

_POSTED, _KIND, _FINISHED = 0, 1, 8  # a worker's control words: its last job's number and kind; the last it ended
_KERNEL, _CALL = 0, 1  # a job's kind: a kernel claiming from the pool's work words, or a Python call


@njit(cache=True)  # holds the GIL: ordered with the caller's Python writes before it
def _publish(a, i, v):
    _store_release(a, i, v)


@njit(nogil=True, cache=True)
def _clock():
    return _pause_and_clock()


@njit(nogil=True, cache=True)
def _watch(a, i, want, ticks):
    """Spin (GIL released) until a[i] == want, at most ``ticks`` cycles; whether it came."""
    t0 = _pause_and_clock()
    while _load_acquire(a, i) != want:
        if _pause_and_clock() - t0 > ticks:
            return False
    return True


@njit(nogil=True, cache=True)
def _watch_for_job(ctl, work, finished, ticks):
    """A worker's idle time, GIL released: report job ``finished`` ended, then watch for the next. A kernel
    job whose tasks are all claimed already is ended here; one whose caller has not claimed yet (so holds
    the GIL, or soon will) is waited on, up to ``ticks``. Returns (the last job ended, a job to run in
    Python, or ``finished`` where none came within ``ticks``)."""
    _store_release(ctl, _FINISHED, finished)
    t0 = _pause_and_clock()
    while True:
        posted = _load_acquire(ctl, _POSTED)
        if posted != finished:
            if ctl[_KIND] != _KERNEL:
                return finished, posted
            claimed = _load_acquire(work, _NEXT)
            if claimed >= work[_TASKS]:  # nothing left for this thread
                finished = posted
                _store_release(ctl, _FINISHED, finished)
                t0 = _pause_and_clock()
                continue
            if claimed > 0 or _pause_and_clock() - t0 > ticks:
                return finished, posted
        elif _pause_and_clock() - t0 > ticks:
            return finished, finished


_ticks_per_s = 0.0


def _cycles(seconds: float) -> int:
    """``seconds`` in cycle-counter ticks (the counter's rate measured once, over 2 ms)."""
    global _ticks_per_s
    if not _ticks_per_s:
        _clock()  # compiled or loaded from the cache before the clock starts
        t0, c0 = time.perf_counter(), _clock()
        while time.perf_counter() - t0 < 2e-3:
            pass
        _ticks_per_s = (_clock() - c0) / (time.perf_counter() - t0)
    return max(1, int(seconds * _ticks_per_s))


class _Worker:
    """One worker thread. Jobs are handed over by number (``ctl``); every other field is read and written
    under the GIL, so a side that blocks is always woken: each sets its flag and re-checks under the GIL,
    and the other looks at the flag under the GIL after its own write."""

    def __init__(self, name: str, cores: set[int] | None):
        self.ctl = np.zeros(16, np.int64)
        self.job = None
        self.error: BaseException | None = None
        self.jobs_posted = 0
        self.idle = False  # blocked on ``wake``
        self.caller_waiting = False  # the caller blocked on ``ended``
        self.wake: queue.SimpleQueue = queue.SimpleQueue()
        self.ended: queue.SimpleQueue = queue.SimpleQueue()
        self.spin = 1  # ticks of watching after the job, set by each post
        threading.Thread(target=self._serve, args=(cores,), name=name, daemon=True).start()

    def post(self, job, kind: int, spin: int) -> None:
        self.job, self.error, self.spin = job, None, spin
        self.jobs_posted += 1
        self.ctl[_KIND] = kind
        _publish(self.ctl, _POSTED, self.jobs_posted)
        if self.idle:
            self.idle = False
            self.wake.put(None)

    def wait(self, spin: int) -> BaseException | None:
        """The error of the job last posted, once it has ended (None if it ran through)."""
        n = self.jobs_posted
        if not _watch(self.ctl, _FINISHED, n, spin):
            while self.ctl[_FINISHED] != n:
                self.caller_waiting = True
                self.ended.get()
        return self.error

    def _serve(self, cores) -> None:
        if cores:
            try:
                os.sched_setaffinity(0, cores)  # 0: this thread
            except OSError:  # e.g. a core taken from the process meanwhile: keep the inherited cores
                pass
        finished = 0
        while True:
            finished, job = _watch_for_job(self.ctl, _work, finished, self.spin)
            if self.caller_waiting:  # it blocked: it sees the end now
                self.caller_waiting = False
                self.ended.put(None)
            if job == finished:  # none came
                self.idle = True  # before the look: a post after the look sees the flag, and wakes this thread
                if self.ctl[_POSTED] == finished:
                    self.wake.get()
                self.idle = False
                continue
            try:
                if self.ctl[_KIND] == _KERNEL:
                    kernel, args = self.job
                    kernel(*args, _work)
                else:
                    self.job()
            except BaseException as e:  # handed to the caller, which raises it
                self.error = e
            self.job = None
            finished = job  # reported by the next _watch_for_job, after this thread gives the GIL back


_workers: list[_Worker] = []
_work = np.zeros(16, np.int64)  # the running parallel call's work words
_calls = threading.Lock()  # one parallel call at a time holds the workers and _work
_local = threading.local()  # each thread's work words for the calls it runs alone
_core_count: int | None = None  # the process's cores when the last worker was started


def _forget_workers_after_fork() -> None:  # a forked child has none of its parent's threads
    global _calls
    _workers.clear()
    _calls = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers_after_fork)


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


def _on_threads(n: int, job, kind: int, here) -> None:
    """``job`` on n - 1 worker threads and ``here()`` on the calling thread at once (the caller holds
    ``_calls``); the first error is raised once every thread is done."""
    global _core_count
    if len(_workers) < n - 1:
        cores = _process_cores()
        _core_count = len(cores) if cores else None
        while len(_workers) < n - 1:
            _workers.append(_Worker(f"lockstep-cpu-{len(_workers) + 1}", cores))
    mine = _workers[:n - 1]
    # more threads than cores: a watching thread would take time from one still working
    watch = _core_count is None or n <= _core_count
    spin = _cycles(CALLER_SPIN_S) if watch else 1
    for w in mine:
        w.post(job, kind, _cycles(WORKER_SPIN_S) if watch else 1)
    errors = []
    try:
        here()
    except BaseException as e:
        errors.append(e)
    for w in mine:  # every worker finishes before the outputs are handed back
        e = w.wait(spin)
        if e is not None:
            errors.append(e)
    if errors:
        raise errors[0]


def run(kernel, n_tasks: int, *args, parallel: bool) -> None:
    """``kernel(*args, work)`` over tasks [0, n_tasks): on the calling thread alone (one range) unless
    ``parallel``, else on :func:`threads` threads at once, each claiming ranges until none is left."""
    n = min(threads(), n_tasks) if parallel else 1
    if n <= 1:
        words = getattr(_local, "work", None)
        _local.work = words = _work_words(n_tasks, max(1, n_tasks), words)
        kernel(*args, words)
        return
    with _calls:
        _work_words(n_tasks, max(1, -(-n_tasks // (n * _RANGES_PER_THREAD))), _work)
        _on_threads(n, (kernel, args), _KERNEL, lambda: kernel(*args, _work))


def keep_subnormals() -> bool:
    """Whether every worker thread (started now up to :func:`threads`) keeps subnormal floats: one probe
    on each, all at once (so each runs on a thread of its own)."""
    n = max(threads(), size() + 1)
    ok = []
    barrier = threading.Barrier(n)

    def probe():
        barrier.wait()  # every thread holds one probe: no thread takes two
        ok.append(bool(_probe_one(_TINY)))

    with _calls:
        _on_threads(n, probe, _CALL, probe)
    return all(ok)
