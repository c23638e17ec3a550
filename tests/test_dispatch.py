"""Backend selection: by device, LOCKSTEP_BACKEND (HAL_BACKEND still read), hal.use (nested, exception-safe,
per thread), fallback, entry points."""
import logging
import sys
import textwrap
import threading

import pytest
import torch

import hal
from hal import dispatch
from hal.backend import Backend
from hal.errors import BackendUnavailable, UnsupportedError
from hal.backends.reference import ReferenceBackend


class Recording(ReferenceBackend):
    """A reference backend that records its calls (used to see which backend served a call)."""

    def __init__(self, name, priority=0):
        self.name, self.priority, self.calls = name, priority, 0

    def matmul(self, a, b, spec):
        self.calls += 1
        return super().matmul(a, b, spec)


class Broken(Backend):
    name = "broken"
    device_types = ("cpu",)
    priority = 50

    def unavailable_reason(self):
        return "needs the frobnicator package (pip install frobnicator)"

    def matmul(self, a, b, spec):  # pragma: no cover - never reached
        raise AssertionError


@pytest.fixture
def temp_backends():
    added = []

    def add(b):
        hal.register_backend(b)
        added.append(b.name)
        return b
    yield add
    for n in added:
        hal.unregister_backend(n)
    dispatch._fallback_logged.clear()


def _mm():
    return hal.matmul(torch.ones(2, 3), torch.ones(3, 2))


def test_auto_selects_cpu_backend_on_cpu_else_reference():
    # the numba `cpu` backend when numba is installed (a default dependency), else the reference
    expected = "reference" if hal.get_backend("cpu").unavailable_reason() else "cpu"
    assert dispatch.select("matmul", hal.spec.DEFAULTS["matmul"], torch.float32, torch.device("cpu")).name == expected


def test_stock_is_never_chosen_automatically():
    assert not hal.get_backend("stock").auto


def test_use_is_nested_and_exception_safe(temp_backends):
    a, b = temp_backends(Recording("rec_a")), temp_backends(Recording("rec_b"))
    with hal.use("rec_a"):
        _mm()
        with hal.use("rec_b"):
            _mm()
            with pytest.raises(RuntimeError):
                with hal.use("rec_a"):
                    raise RuntimeError("boom")
            _mm()
        _mm()
    assert (a.calls, b.calls) == (2, 2)
    assert dispatch.requested_backend()[0] is None


def test_use_is_per_thread(temp_backends):
    a, b = temp_backends(Recording("rec_a")), temp_backends(Recording("rec_b"))
    barrier = threading.Barrier(2)

    def worker(name):
        with hal.use(name):
            barrier.wait()
            for _ in range(5):
                _mm()
            barrier.wait()
    ts = [threading.Thread(target=worker, args=(n,)) for n in ("rec_a", "rec_b")]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert (a.calls, b.calls) == (5, 5)


def test_env_var_and_explicit_argument(temp_backends, monkeypatch):
    a, b = temp_backends(Recording("rec_a")), temp_backends(Recording("rec_b"))
    monkeypatch.setenv("LOCKSTEP_BACKEND", "rec_a")
    _mm()
    hal.matmul(torch.ones(2, 3), torch.ones(3, 2), backend="rec_b")  # argument beats environment
    with hal.use("rec_b"):
        _mm()  # context beats environment
    assert (a.calls, b.calls) == (1, 2)


def test_lockstep_backend_env_var_wins_and_hal_backend_is_still_read(temp_backends, monkeypatch):
    a, b = temp_backends(Recording("rec_a")), temp_backends(Recording("rec_b"))
    monkeypatch.delenv("LOCKSTEP_BACKEND", raising=False)
    monkeypatch.setenv("HAL_BACKEND", "rec_a")  # the older name alone: still read
    _mm()
    assert dispatch.requested_backend() == ("rec_a", "HAL_BACKEND")
    monkeypatch.setenv("LOCKSTEP_BACKEND", "rec_b")  # both set: lockstep's own prefix wins
    _mm()
    assert dispatch.requested_backend() == ("rec_b", "LOCKSTEP_BACKEND") and (a.calls, b.calls) == (1, 1)
    monkeypatch.setenv("LOCKSTEP_BACKEND", "auto")  # auto, by its own variable, is the automatic choice
    assert dispatch.requested_backend() == (None, "auto")


def test_explicit_unavailable_backend_raises_with_reason(temp_backends):
    temp_backends(Broken())
    with pytest.raises(UnsupportedError, match="frobnicator"):
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), backend="broken")
    with pytest.raises(BackendUnavailable, match="unknown backend 'nope'"):
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), backend="nope")
    with pytest.raises(BackendUnavailable):
        with hal.use("nope"):
            pass


def test_auto_falls_back_and_logs_once(temp_backends, caplog):
    temp_backends(Broken())  # higher priority than cpu and reference, but unavailable
    nxt = "reference" if hal.get_backend("cpu").unavailable_reason() else "cpu"
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        _mm()
        _mm()
    msgs = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(msgs) == 1 and f"backend {nxt!r}" in msgs[0] and "frobnicator" in msgs[0]


def test_no_backend_for_device_lists_every_reason():
    with pytest.raises(UnsupportedError) as e:
        hal.matmul(torch.ones(2, 2, device="meta"), torch.ones(2, 2, device="meta"))
    assert "no registered backend serves device type 'meta'" in str(e.value)


def test_entry_point_backend_is_discovered(tmp_path, monkeypatch):
    pkg = tmp_path / "thirdparty_lockstep_backend.py"
    pkg.write_text(textwrap.dedent("""
        from hal.backends.reference import ReferenceBackend
        class ThirdParty(ReferenceBackend):
            name = "thirdparty"
    """))
    dist = tmp_path / "thirdparty_lockstep_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-lockstep-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[lockstep.backends]\nthirdparty = thirdparty_lockstep_backend:ThirdParty\n"
                                          "badone = thirdparty_lockstep_backend:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "_backends", None)
    monkeypatch.setattr(dispatch, "_load_errors", {})
    assert hal.get_backend("thirdparty").name == "thirdparty"
    assert "badone" in dispatch.load_errors()
    assert torch.equal(hal.matmul(torch.ones(2, 3), torch.ones(3, 2), backend="thirdparty"), torch.full((2, 2), 3.0))


def test_importing_hal_imports_no_optional_dependency():
    import subprocess
    code = "import sys, hal, hal.backends.reference, hal.conformance.runner; print([m for m in ('triton','jax','torch_npu') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


class Flaky(Recording):
    """Available until told otherwise (availability checked on every call, as a backend may lose a device)."""

    def __init__(self, name, priority):
        super().__init__(name, priority)
        self.down = False

    def unavailable_reason(self):
        return "switched off (test)" if self.down else None


def test_remembered_choice_follows_request_registry_and_availability(temp_backends, monkeypatch):
    """select() remembers its answer per call signature; whatever may change between calls must still
    change the answer: hal.use, LOCKSTEP_BACKEND, a newly registered backend, a backend becoming unavailable."""
    top = temp_backends(Flaky("top", priority=1000))
    for _ in range(2):  # the second call is served from the memo
        _mm()
    assert top.calls == 2
    with hal.use("reference"):
        _mm()
    monkeypatch.setenv("LOCKSTEP_BACKEND", "reference")
    _mm()
    monkeypatch.delenv("LOCKSTEP_BACKEND")
    assert top.calls == 2  # neither request reached it
    _mm()
    assert top.calls == 3  # the memo answers for the automatic choice again
    higher = temp_backends(Recording("higher", priority=2000))
    _mm()
    assert (higher.calls, top.calls) == (1, 3)  # registering cleared the memo
    hal.unregister_backend("higher")
    _mm()
    assert top.calls == 4  # remembered again
    top.down = True  # the remembered backend became unavailable: the next choice is searched again
    _mm()
    assert top.calls == 4
