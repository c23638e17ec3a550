"""Every strict CPU backend refuses to compute under flush-to-zero / denormals-are-zero, the same way
(hal.fp_env), before anything is computed or stored (issue 21, items 4 and 10).

Negative controls: with the check taken out from the outside (monkeypatch), the reference under FTZ
really produces other bits than without it (so the refusal guards a real divergence); and the
probe's own building blocks flush under FTZ.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hal
from hal import fp_env
from hal.conformance.bits import assert_same_bits, same_bits
from hal.kv_cache import KVCache

BACKENDS = ["reference"] + (["cpu"] if importlib.util.find_spec("numba") else [])


class flushing:
    """torch.set_flush_denormal(True) on this thread for the block (always cleared again)."""

    def __enter__(self):
        assert torch.set_flush_denormal(True), "this CPU cannot set flush-to-zero"
        return self

    def __exit__(self, *exc):
        torch.set_flush_denormal(False)


_SUB = torch.tensor([[2.0 ** -140, -3.0 * 2.0 ** -149, 2.0 ** -127, 1e-39, 2.0 ** -126, 0.0, 0.5, -2.0]])
_FAR = torch.tensor([[0.0, -100.0, -95.0, -90.0, -88.5, 3.0, -101.0, -1.0]])  # exp(-100) is subnormal

#: each op of the issue on inputs (made here, without FTZ) whose results or operands are subnormal
OPS = {
    "linear": lambda b: hal.linear(_SUB[:, :4], torch.tensor([[1.0, 1.0, 0.5, 0.0], [2.0 ** -3] * 4]), backend=b),
    "rms_norm": lambda b: hal.rms_norm(_FAR, torch.full((8,), 2.0 ** -135), 1e-6, backend=b),
    "silu": lambda b: hal.silu(_SUB, backend=b),
    "sigmoid": lambda b: hal.sigmoid(_FAR, backend=b),
    "softmax": lambda b: hal.softmax(_FAR, backend=b),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_flush_to_zero_refused_with_the_fix_and_no_other_backend(backend, op):
    OPS[op](backend)  # runs without FTZ
    with flushing():
        with pytest.raises(hal.UnsupportedError) as e:
            OPS[op](backend)
    msg = str(e.value)
    assert "flush-to-zero / denormals-are-zero" in msg and "torch.set_flush_denormal(False)" in msg
    assert "backend=" not in msg.replace("(requested by backend=)", "")  # recommends no other backend
    OPS[op](backend)  # and runs again once it is cleared


def test_reference_under_ftz_really_flushes_without_the_check(monkeypatch):
    """Negative control: the refusal is needed. The check removed from the outside, the reference
    computes other bits under FTZ for every op of the issue."""
    want = {op: fn("reference") for op, fn in OPS.items()}
    monkeypatch.setattr(fp_env, "flush_reason", lambda *a, **k: None)
    with flushing():
        got = {op: fn("reference") for op, fn in OPS.items()}
    for op in OPS:
        assert not same_bits(want[op], got[op]), f"{op}: no subnormal was flushed"


def test_reference_backend_methods_refuse_too():
    """Callers of the backend's methods (the conformance generator) skip dispatch: the op refuses
    itself, so no golden file is written from flushed bits."""
    ref = hal.get_backend("reference")
    x = torch.randn(2, 8)
    with flushing():
        assert "flush" in ref.unavailable_reason()
        with pytest.raises(hal.UnsupportedError, match="flush-to-zero"):
            ref.softmax(x, hal.spec.DEFAULTS["softmax"])
    assert ref.unavailable_reason() is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_ftz_switched_on_between_calls_is_seen(backend):
    x = torch.randn(3, 5)
    for _ in range(3):
        hal.softmax(x, backend=backend)
        with flushing(), pytest.raises(hal.UnsupportedError):
            hal.softmax(x, backend=backend)


def test_auto_selection_never_runs_a_flushed_cpu_backend():
    want = hal.silu(_SUB, backend="reference")
    with flushing():
        try:
            got = hal.silu(_SUB)  # auto: cpu and reference refuse; only a backend immune to FTZ may serve
        except hal.UnsupportedError as e:
            assert "flush-to-zero" in str(e)
        else:
            assert_same_bits(want, got, "auto under FTZ")


def test_thread_probe_sees_ftz():
    assert not fp_env.thread_flushes()
    with flushing():
        assert fp_env.thread_flushes()
    assert not fp_env.thread_flushes()


_WORKERS = textwrap.dedent("""
    import torch
    torch.set_flush_denormal(True)
    x = torch.full((1 << 17,), 2.0 ** -126)  # torch's pool starts here, its threads take FTZ with them
    torch.set_flush_denormal(False)
    flushed = not bool(((x * 0.5) * 2.0 == x).all())
    import hal
    try:
        hal.softmax(torch.randn(2, 4), backend="reference")
        print("ran", flushed)
    except hal.UnsupportedError as e:
        print("refused", flushed, "intra-op threads" in str(e))
""")


def test_torch_worker_threads_started_under_ftz_are_caught():
    """A pool started under FTZ keeps flushing after this thread clears it (shown in the same
    process: the negative control), and the reference refuses, naming the pool."""
    env = dict(os.environ, OMP_NUM_THREADS="2")  # a pool of two threads (set_num_threads would start it)
    out = subprocess.run([sys.executable, "-c", _WORKERS], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "True", "True"], out.stdout


# ------------------------------------------------------------------ refusals touch no state (item 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_attend_refused_under_ftz_changes_nothing(backend):
    cache = KVCache.paged(2, 16, 1, 8, page_size=4, num_pages=6)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, s, 8, generator=g) for s in (2, 1, 1))
    snap = (cache.k.clone(), cache.v.clone(), cache.block_table.clone(), cache.seqlens.clone(),
            list(cache._free), list(cache._refs), [list(p) for p in cache._pages])
    with flushing(), pytest.raises(hal.UnsupportedError) as e:
        cache.attend(q, k, v, backend=backend)
    now = (cache.k, cache.v, cache.block_table, cache.seqlens)
    for name, a, b in zip(("k", "v", "block_table", "seqlens"), snap, now):
        assert_same_bits(a, b, name)
    assert (list(cache._free), list(cache._refs), [list(p) for p in cache._pages]) == snap[4:]
    assert len(cache._free) == 6
    assert "flush-to-zero" in str(e.value)
    cache.attend(q, k, v, backend=backend)  # and the same call runs once FTZ is off
    assert len(cache._free) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_with_kvcache_refused_under_ftz_appends_nothing(backend):
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(1, 8, 1, 8, generator=g), torch.randn(1, 8, 1, 8, generator=g)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g) for s in (2, 1, 1))
    before = kc.clone(), vc.clone()
    with flushing(), pytest.raises(hal.UnsupportedError) as e:
        hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, backend=backend)
    assert_same_bits(before[0], kc, "k_cache"), assert_same_bits(before[1], vc, "v_cache")
    assert "flush-to-zero" in str(e.value)
