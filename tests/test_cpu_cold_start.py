"""Cold start of the cpu backend (issue 24): one compiled body for all three dtypes where the arithmetic is
the same after widening, one line when a process compiles, and `hal warmup` compiling ahead of time."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("numba")

import hal  # noqa: E402
from hal.kernels.cpu import attention, gated_delta_rule  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NOTICE = "lockstep: compiling the cpu backend's numba kernels"


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def test_attention_compiles_one_body_for_three_dtypes():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for dt in DTYPES:
        q, k, v = (torch.randn(12, h, 16, generator=g).to(dt) for h in (4, 2, 2))
        out = hal.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, backend="cpu")
        ref = hal.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, backend="reference")
        assert torch.equal(_bits(out), _bits(ref)), dt
    # the kernel: one float32 signature, whatever the input dtype (before: one per dtype)
    # (0 where it came from a warm disk cache: a cached kernel does not list its signatures until loaded)
    assert len(attention._attend_tasks.signatures) <= 1


def test_gated_delta_rule_compiles_once_for_three_dtypes():
    g = torch.Generator().manual_seed(1)
    for dt in DTYPES:
        q, k = (torch.randn(1, 9, 2, 16, generator=g).to(dt) for _ in range(2))
        v = torch.randn(1, 9, 2, 16, generator=g).to(dt)
        gate = (-torch.rand(1, 9, 2, generator=g)).to(dt)
        beta = torch.rand(1, 9, 2, generator=g).to(dt)
        for spec in ("gated_delta_rule.strict.chunked.c64.d64.lsm1.v2", "gated_delta_rule.strict.serial.d64.lsm1.v2"):
            out, _ = hal.chunk_gated_delta_rule(q, k, v, gate, beta, spec=spec, backend="cpu")
            ref, _ = hal.chunk_gated_delta_rule(q, k, v, gate, beta, spec=spec, backend="reference")
            assert torch.equal(_bits(out), _bits(ref)), (dt, spec)
    # before: one compile of each per dtype (the tokens reached the kernels raw)
    assert len(gated_delta_rule._chunked.signatures) <= 1  # 0 from a warm cache, as above
    assert len(gated_delta_rule._serial.signatures) <= 1


def _python(code, cache, *args):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


_NORM_CALLS = """
import torch, hal
x = torch.linspace(-2, 2, 24).reshape(3, 8)
hal.rms_norm(x, torch.ones(8), backend="cpu")
hal.rms_norm(x.bfloat16(), torch.ones(8, dtype=torch.bfloat16), backend="cpu")  # compiles again: no second line
"""


def test_first_compile_prints_one_line_then_none_once_cached(tmp_path):
    cold = _python(_NORM_CALLS, tmp_path)
    assert cold.returncode == 0, cold.stderr
    lines = [ln for ln in cold.stderr.splitlines() if ln.startswith(NOTICE)]
    assert len(lines) == 1, cold.stderr
    # the first compile may be the FP-environment probe that runs at selection (hal.fp_env), before the op's
    # kernel: the line names whatever compiled first
    assert str(tmp_path) in lines[0] and "once per machine" in lines[0]
    warm = _python(_NORM_CALLS, tmp_path)  # the cache the first process left: loads, compiles nothing
    assert warm.returncode == 0, warm.stderr
    assert NOTICE not in warm.stderr, warm.stderr


def test_warmup_compiles_ahead_so_the_first_call_compiles_nothing(tmp_path):
    # control: without the warm-up the same first call compiles (and says so)
    control = _python(_NORM_CALLS.split("\nhal.rms_norm(x.bf")[0], tmp_path / "control")
    assert NOTICE in control.stderr, control.stderr
    w = _python(None, tmp_path / "warm", "-m", "hal.cli", "warmup", "--ops", "rms_norm", "--dtypes", "fp32", "bf16")
    assert w.returncode == 0, w.stdout + w.stderr
    assert "2/2" in w.stderr and "[" + "#" * 30 + "]" in w.stderr  # the progress bar, complete
    assert str(tmp_path / "warm") in w.stdout
    after = _python(_NORM_CALLS, tmp_path / "warm")
    assert after.returncode == 0, after.stderr
    assert NOTICE not in after.stderr, after.stderr


def test_warmup_rejects_an_unknown_suite(tmp_path):
    r = _python(None, tmp_path, "-m", "hal.cli", "warmup", "--ops", "no_such_suite")
    assert r.returncode != 0 and "unknown conformance suite no_such_suite" in r.stderr


_POOL_PROGRAM = """
import threading, numba, torch, hal
from hal.kernels.cpu import pool
torch.set_num_threads(2)
x = torch.randn(1 << 16)
assert torch.equal(hal.silu(x, backend="cpu").view(torch.int32), hal.silu(x, backend="reference").view(torch.int32))
print("pool", pool.size(), sorted(t.name for t in threading.enumerate() if t.name.startswith("lockstep-cpu")))
try:
    print("layer", numba.threading_layer())
except ValueError:  # numba: no parallel region has run in this process
    print("layer none")
if USER_PRANGE:
    from numba import njit, prange

    @njit(parallel=True)
    def total(a):
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    total(x.double().numpy())
    print("layer", numba.threading_layer() is not None)
"""


def test_one_kernel_per_op_no_numba_parallel_driver(tmp_path):
    """The cpu kernels are serial ``nogil`` kernels over task ranges that lockstep's own threads run
    (pool.py): a parallel call starts the pool's worker thread and never numba's threading layer
    (a parallel=True driver compiled a task body a second and third time). Control: a prange function
    in the same program does start numba's layer, and the check sees it."""
    from hal.kernels import cpu as kernels
    import inspect

    for name in ("attention", "elementwise", "exact_slice", "gated_delta_rule", "matmul", "gdn_layer",
                 "rms_norm", "softmax", "strict_math", "host"):
        src = inspect.getsource(__import__(f"hal.kernels.cpu.{name}", fromlist=["_"]))
        assert "parallel=True" not in src and "prange" not in src, name
    assert kernels.pool.PARALLEL_MIN_WORK > 0
    out = _python(_POOL_PROGRAM.replace("USER_PRANGE", "False"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pool 1 ['lockstep-cpu-1']" in out.stdout and "layer none" in out.stdout, out.stdout
    control = _python(_POOL_PROGRAM.replace("USER_PRANGE", "True"), tmp_path)
    assert control.returncode == 0, control.stderr[-3000:]
    assert control.stdout.split()[-2:] == ["layer", "True"], control.stdout


def test_pool_splits_tasks_over_threads_with_the_same_bits():
    """pool.run over 2 threads (ranges claimed in turn, each once) and on the calling thread: the same bits
    (RMSNorm rows); a kernel's error, on whichever thread, reaches the caller."""
    import numpy as np

    from hal.kernels.cpu import pool, rms_norm as k
    h = np.linspace(-3, 3, 64 * 40, dtype=np.float32).reshape(64, 40)
    w = np.linspace(0.5, 2, 40, dtype=np.float32)
    par, ser = np.empty_like(h), np.empty_like(h)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool.run(k._rms_tasks, 64, h, w, np.float32(1e-6), 4, par, parallel=True)
        assert pool.size() >= 1
        pool.run(k._rms_tasks, 64, h, w, np.float32(1e-6), 4, ser, parallel=False)
        assert np.array_equal(par.view(np.int32), ser.view(np.int32))
        other = np.empty_like(h)
        pool.run(k._rms_tasks, 64, h, w, np.float32(1e-6), 8, other, parallel=True)  # control: another tile
        assert not np.array_equal(par.view(np.int32), other.view(np.int32))
        ranges = []

        def record(work):  # a Python kernel: the contract of a compiled one
            lo, hi = pool.claim(work)
            while lo < hi:
                ranges.append((lo, hi))
                lo, hi = pool.claim(work)
        pool.run(record, 16, parallel=True)
        assert sorted(ranges) == [(lo, lo + 2) for lo in range(0, 16, 2)]  # every range taken exactly once
        ranges.clear()
        pool.run(record, 16, parallel=False)
        assert ranges == [(0, 16)]  # alone: one range

        def fails(work):
            lo, hi = pool.claim(work)
            while lo < hi:
                if lo == 8:
                    raise RuntimeError("task range failed")
                lo, hi = pool.claim(work)
        with pytest.raises(RuntimeError, match="task range failed"):
            pool.run(fails, 16, parallel=True)
    finally:
        torch.set_num_threads(old)
    # one float32 signature for both (RMSNorm reads 16-bit inputs in place: one more per dtype); 0 where it came
    # from a warm disk cache
    f32 = [s for s in k._rms_tasks.signatures if str(s[0]).startswith("array(float32")]
    assert len(f32) <= 1, k._rms_tasks.signatures


def test_pool_hand_overs_that_block_still_run_every_task(monkeypatch):
    """A worker that watched past its spin blocks (idle) and is woken by the next call; a caller whose worker
    is still busy past its spin blocks and is woken by the worker's end. Both paths, forced with spins of one
    tick: every task runs once, on both threads."""
    import threading
    import time

    from hal.kernels.cpu import pool
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool.run(lambda work: None, 2, parallel=True)  # the worker exists
        monkeypatch.setattr(pool, "CALLER_SPIN_S", 0.0)
        monkeypatch.setattr(pool, "WORKER_SPIN_S", 0.0)
        pool.run(lambda work: None, 2, parallel=True)  # the worker's next watch: one tick
        ran = []

        def slow(work):  # 8 ranges of 2 ms: the caller waits on a worker still sleeping in its range
            lo, hi = pool.claim(work)
            while lo < hi:
                ran.append((lo, threading.current_thread().name))
                time.sleep(2e-3)
                lo, hi = pool.claim(work)
        for _ in range(3):
            deadline = time.monotonic() + 5
            while not pool._workers[0].idle and time.monotonic() < deadline:
                time.sleep(1e-3)
            assert pool._workers[0].idle  # blocked on its queue: the post must wake it
            ran.clear()
            pool.run(slow, 16, parallel=True)
            assert sorted(lo for lo, _ in ran) == list(range(0, 16, 2))
            assert {name for _, name in ran} == {"MainThread", "lockstep-cpu-1"}
    finally:
        torch.set_num_threads(old)


def test_pool_watches_last_as_long_as_asked(monkeypatch):
    """A watch's bound is in cycle-counter ticks from a rate measured once (pool._cycles): a watch for a word that
    never comes returns False no sooner than asked. Control: the rate once mis-measured here (taken while the
    clock's first call was still loading: 33,000 ticks a second) ends the same watch at once -- every hand-over
    then blocked."""
    import time

    import numpy as np

    from hal.kernels.cpu import pool
    words = np.zeros(16, np.int64)

    def watched_seconds():
        t0 = time.perf_counter()
        assert not pool._watch(words, 0, 1, pool._cycles(0.02))
        return time.perf_counter() - t0
    assert 0.01 <= watched_seconds() < 5
    words[0] = 1
    assert pool._watch(words, 0, 1, pool._cycles(0.02))  # the word there: at once
    words[0] = 0
    monkeypatch.setattr(pool, "_ticks_per_s", 33_000.0)
    assert watched_seconds() < 0.01

def test_pool_threads_watch_only_where_each_has_a_core():
    """Waiting threads watch memory (spin) only when the call's threads fit the process's cores: with more threads
    than cores a watching thread would take time from one still working, so each blocks at once (its watch is
    one tick). The same call on as many threads as cores watches (the control)."""
    from hal import kernel_threads
    from hal.kernels.cpu import pool
    cores = len(pool._process_cores() or ())
    if cores < 2:
        pytest.skip("needs two cores for a parallel call that fits them")
    done = []

    def record(work):
        lo, hi = pool.claim(work)
        while lo < hi:
            done.extend(range(lo, hi))
            lo, hi = pool.claim(work)
    try:
        for n, watches in ((cores, True), (cores + 1, False)):
            kernel_threads.set_own(n)
            done.clear()
            pool.run(record, 64, parallel=True)
            assert sorted(done) == list(range(64))
            assert all((w.spin > 1) == watches for w in pool._workers[:n - 1]), (n, [w.spin for w in pool._workers])
    finally:
        kernel_threads.set_own(None)


def test_row_wise_kernels_compile_one_body_for_three_dtypes():
    # softmax, elementwise, rotary and the GDN layer pieces read float32 copies (exact widening):
    # one signature each, where raw 16-bit inputs compiled once per dtype (gating: once per mix of dtypes)
    from hal.kernels.cpu import elementwise, gdn_layer, softmax
    g = torch.Generator().manual_seed(2)
    for dt in DTYPES:
        x = (torch.randn(6, 40, generator=g) * 4).to(dt)
        a, b = torch.randn(5, 4, generator=g).to(dt), torch.randn(5, 4, generator=g).to(dt)
        A_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)  # float32 beside dt
        cx = torch.randn(1, 7, 8, generator=g).to(dt)
        cw = torch.randn(8, 4, generator=g).to(dt)
        calls = [lambda be: hal.softmax(x, backend=be), lambda be: hal.log_softmax(x, backend=be),
                 lambda be: hal.logsumexp(x, backend=be),
                 lambda be: hal.silu(x, backend=be), lambda be: hal.silu_mul(x, x, backend=be),
                 lambda be: hal.gdn_gating(A_log, a, dt_bias, b, backend=be),
                 lambda be: hal.gdn_causal_conv1d(cx, cw, activation="silu", backend=be)]
        for i, call in enumerate(calls):
            got, ref = call("cpu"), call("reference")
            for o, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                assert o.dtype == r.dtype and torch.equal(_bits(o), _bits(r)), (dt, i)
    for fn in (softmax._softmax_tasks, elementwise._map_unary, elementwise._map_silu_mul,
               gdn_layer._gating, gdn_layer._conv):
        assert len(fn.signatures) <= 1, (fn, fn.signatures)  # 0 from a warm cache, as above
