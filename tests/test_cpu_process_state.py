"""The cpu backend leaves process-wide numba state alone, and says when numba cannot serve it
(issue 21, items 7 and 9). Each case runs in a fresh interpreter: the state under test is per process.

Item 7: the first cpu-backend call used to switch numba's threading layer to ``workqueue`` for the
whole process; a user's own ``@njit(parallel=True)`` function called from two threads then aborted
the process (SIGABRT, "workqueue threading layer is not threadsafe"). The check: that exact program
survives, and numba's layer is the one it picks without lockstep (measured in a second process).

Item 9: under ``NUMBA_DISABLE_JIT=1`` every cpu op raised a bare NotImplementedError while
``hal info`` called cpu available.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.pop("NUMBA_THREADING_LAYER", None)
    full.pop("NUMBA_DISABLE_JIT", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=_REPO)


_USER_PROGRAM = """
    import threading
    import numba, numpy as np, torch
    from numba import njit, prange
    if {use_lockstep}:
        import hal
        torch.set_num_threads(2)
        hal.softmax(torch.randn(2, 4), backend="cpu")          # the first cpu-backend call
        hal.silu(torch.randn(1 << 16), backend="cpu")           # a parallel driver (prange)

    @njit(parallel=True)
    def total(a):
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(1 << 16)
    total(a)
    def work():
        for _ in range(300):
            assert total(a) == a.shape[0]
    threads = [threading.Thread(target=work) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("layer", numba.threading_layer())
"""


def test_user_parallel_numba_from_two_threads_survives_a_cpu_backend_call():
    alone = _python(_USER_PROGRAM.format(use_lockstep=False))
    assert alone.returncode == 0, alone.stderr[-2000:]
    with_hal = _python(_USER_PROGRAM.format(use_lockstep=True))
    assert with_hal.returncode == 0, f"rc {with_hal.returncode}: {with_hal.stderr[-2000:]}"
    assert with_hal.stdout.split()[-1] == alone.stdout.split()[-1], (with_hal.stdout, alone.stdout)


def test_user_choice_of_threading_layer_is_kept():
    # the cpu backend runs on its own threads (kernels/cpu/pool.py) and never starts numba's layer; the
    # user's own prange function then starts the layer the user chose
    out = _python("""
        import numba, numpy as np, torch, hal
        from numba import njit, prange
        torch.set_num_threads(2)
        hal.silu(torch.randn(1 << 16), backend="cpu")
        try:
            numba.threading_layer()
            print("started")
        except ValueError:
            print("not-started")

        @njit(parallel=True)
        def total(a):
            s = 0.0
            for i in prange(a.shape[0]):
                s += a[i]
            return s

        total(np.ones(1 << 16))
        print(numba.config.THREADING_LAYER, numba.threading_layer())
    """, env={"NUMBA_THREADING_LAYER": "workqueue"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["not-started", "workqueue", "workqueue"]


def test_numba_jit_disabled_makes_cpu_unavailable():
    out = _python("""
        import logging, torch, hal
        from hal.dispatch import select
        cpu = hal.get_backend("cpu")
        print("reason", "NUMBA_DISABLE_JIT" in (cpu.unavailable_reason() or ""))
        x = torch.randn(2, 4)
        print("auto", select("softmax", hal.spec.DEFAULTS["softmax"], x.dtype, x.device).name)
        ref = hal.softmax(x, backend="reference")
        print("auto-bits", bool(hal.softmax(x).view(torch.int32).equal(ref.view(torch.int32))))
        try:
            hal.softmax(x, backend="cpu")
            print("named ran")
        except hal.UnsupportedError as e:
            print("named", "NUMBA_DISABLE_JIT" in str(e))
    """, env={"NUMBA_DISABLE_JIT": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["reason", "True", "auto", "reference", "auto-bits", "True", "named", "True"], \
        out.stdout + out.stderr[-2000:]
    assert "falls back to backend 'reference'" in out.stderr and "NUMBA_DISABLE_JIT" in out.stderr, out.stderr


def test_hal_info_shows_cpu_unavailable_with_jit_disabled():
    out = _python("import sys; from hal.cli import main; sys.exit(main(['info']))", env={"NUMBA_DISABLE_JIT": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("cpu "))
    assert "not available" in line and "NUMBA_DISABLE_JIT" in line, line


_AFFINITY_PROGRAM = """
    import os, threading
    import torch
    import hal
    torch.set_num_threads(2)
    os.sched_setaffinity(0, {{{main}}})          # this thread only, as vLLM-CPU's worker pins its main thread
    release = threading.Event()
    def omp_like():                               # another thread of the process on the other core
        os.sched_setaffinity(0, {{{other}}})
        release.wait()
    t = threading.Thread(target=omp_like); t.start()
    while os.sched_getaffinity(t.native_id) != {{{other}}}:
        pass
    g = torch.Generator().manual_seed(0)
    hal.linear(torch.randn(64, 512, generator=g), torch.randn(256, 512, generator=g), backend="cpu")  # parallel
    worker = next(w for w in threading.enumerate() if w.name == "lockstep-cpu-1")
    print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(worker.native_id)))
    release.set(); t.join()
"""


def test_pool_workers_run_on_the_process_cores_not_the_pinned_creators():
    """A worker thread inherits its creator's affinity: started from a main thread pinned to one core, lockstep's
    second thread would share that core (measured in vLLM-CPU's bound worker: both on core 0, half the speed).
    kernels/cpu/pool.py gives its workers every core of the process's threads. The main thread's own mask is
    printed beside it: the inherited value the check would see without the fix."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to pin the main thread and another thread apart")
    main, other = cores[0], cores[1]
    out = _python(_AFFINITY_PROGRAM.format(main=main, other=other))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == f"[{main}] {sorted([main, other])}", out.stdout


_HASH_PROGRAM = """
    import numba, numpy as np, torch
    from hal import weight_watch
    torch.set_num_threads(2)
    weight_watch.content_hash(torch.randn(2048, 1024).bfloat16())  # >= 1M lanes: the threaded pass
    try:
        layer = numba.threading_layer()
    except ValueError:  # no layer started
        layer = None
    print(torch.get_num_threads(), layer)

    @numba.njit(parallel=True)
    def total(a):
        s = 0.0
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s
    total(np.ones(1 << 20))
    print(torch.get_num_threads(), numba.threading_layer() is not None)
"""


def test_weight_hash_runs_on_lockstep_threads_not_numbas_layer():
    """The weight watch's hash of a large weight (the vLLM plugin stamps every weight at load) runs on lockstep's
    own threads: numba's threading layer never starts and torch keeps its count. (A numba ``parallel=True`` pass
    there set torch's count to one in vLLM-CPU's bound worker, measured: lockstep's kernels then ran on one
    thread.) Control: a ``parallel=True`` pass in the same process does start the layer."""
    out = _python(_HASH_PROGRAM)
    assert out.returncode == 0, out.stderr[-3000:]
    hashed, control = out.stdout.split("\n")[:2]
    assert hashed == "2 None", out.stdout
    assert control.split()[1] == "True", out.stdout


_FORK_PROGRAM = """
    import os, numpy as np, torch
    from hal.kernels.cpu import pool
    torch.set_num_threads(2)
    def kernel(out, work):
        lo, hi = pool.claim(work)
        while lo < hi:
            out[lo:hi] += 1
            lo, hi = pool.claim(work)
    out = np.zeros(64, np.int64)
    pool.run(kernel, 64, out, parallel=True)
    print("parent", pool.size())
    pid = os.fork()
    if pid == 0:  # the child has none of the parent's threads: a worker it still counted would never answer
        size = pool.size()
        pool.run(kernel, 64, out, parallel=True)
        print("child", size, pool.size(), int(out.min()), int(out.max()), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_a_forked_child_starts_its_own_workers():
    """Threads do not survive fork(): a child that kept its parent's worker list would post to threads that do
    not exist and wait forever. The child starts with none (the parent's count printed beside it: the stale
    value) and its parallel call runs every task once on workers of its own."""
    out = _python(_FORK_PROGRAM, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "parent 1" and "child 0 1 2 2" in out.stdout, out.stdout
