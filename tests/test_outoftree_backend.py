"""An out-of-tree backend (tests/fixtures/outoftree_backend: one op, rms_norm, written from
docs/architecture.md) installed with pip into a throwaway folder, found through the ``lockstep.backends``
entry point by importlib.metadata, selected by name, and certified by the real conformance runner.

Negative control: the same backend with its sum of squares chained in the wrong order fails the same run.
About 30 s on two loaded cores (pip, then the full rms_norm conformance suite; the control runs its quick cases).
"""
from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import hal
from hal import backend_contract, dispatch
from hal.conformance import runner
from hal.errors import UnsupportedError

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "outoftree_backend"
NAME = "outoftree"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The fixture package pip-installed (offline, no dependencies) into a folder of its own."""
    tmp = tmp_path_factory.mktemp("outoftree")
    src = tmp / "src"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    target = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--no-cache-dir",
                        "install", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    return target


@pytest.fixture
def installed(site, monkeypatch):
    """The installed package on sys.path and hal's registry reloaded from the entry points (restored after)."""
    assert importlib.util.find_spec("outoftree_backend") is None, "the fixture must not be importable before"
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(dispatch, "_backends", None)
    monkeypatch.setattr(dispatch, "_load_errors", {})
    monkeypatch.setattr(dispatch, "_chosen", {})
    yield site
    sys.modules.pop("outoftree_backend", None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def test_found_through_the_entry_point(installed):
    eps = [ep for ep in metadata.entry_points(group=dispatch.ENTRY_POINT_GROUP) if ep.name == NAME]
    assert [ep.value for ep in eps] == ["outoftree_backend:OutOfTreeBackend"]
    assert NAME in dispatch.backends() and NAME not in dispatch.load_errors()
    backend = hal.get_backend(NAME)
    # the installed copy, not the source tree, and nothing but the entry point put it in the registry
    assert pathlib.Path(sys.modules[type(backend).__module__].__file__).is_relative_to(installed)
    assert backend.ops() == ["rms_norm"] and backend.suites == frozenset({"rms_norm"})
    assert backend_contract.violations(backend) == []


def test_selected_by_name_gives_the_reference_bits(installed):
    g = torch.Generator().manual_seed(0)
    x, w, r = (torch.randn(shape, generator=g).to(torch.bfloat16) for shape in ((5, 300), (300,), (5, 300)))
    want_y, want_h = hal.rms_norm(x, w, 1e-6, residual=r, backend="reference")
    got_y, got_h = hal.rms_norm(x, w, 1e-6, residual=r, backend=NAME)
    assert torch.equal(_bits(got_y), _bits(want_y)) and torch.equal(_bits(got_h), _bits(want_h))
    spec = hal.spec.DEFAULTS["rms_norm"]
    with hal.use(NAME):
        assert dispatch.select("rms_norm", spec, torch.bfloat16, x.device) is hal.get_backend(NAME)
        assert torch.equal(_bits(hal.rms_norm(x, w)), _bits(hal.rms_norm(x, w, backend="reference")))
    # auto selection never picks it (auto = False): the built-in cpu backend still serves unnamed calls
    assert dispatch.select("rms_norm", spec, torch.bfloat16, x.device).name != NAME


def test_other_ops_are_refused_naming_the_op(installed):
    x = torch.randn(3, 8)
    calls = {"softmax": lambda **kw: hal.softmax(x, -1, **kw),
             "linear": lambda **kw: hal.linear(x, torch.randn(4, 8), **kw),
             "silu": lambda **kw: hal.silu(x, **kw)}
    for op, call in calls.items():
        # named, the backend answers for itself: no other backend (stock or otherwise) serves the call
        with pytest.raises(UnsupportedError, match=f"{NAME}: does not implement {op}"):
            call(backend=NAME)
        with hal.use(NAME), pytest.raises(UnsupportedError, match=f"{NAME}: does not implement {op}"):
            call()


def test_passes_rms_norm_conformance_and_the_wrong_order_does_not(installed):
    records = runner.run([NAME], ["rms_norm"])
    assert records and runner.exit_status(records) == 0
    assert {(r.level, r.status, r.claimed) for r in records} == \
        {(lvl, "pass", True) for lvl in ("L0", "L1", "L3", "L4", "A")}
    assert {r.dtype for r in records} == {"fp32", "bf16", "fp16"}

    base = type(hal.get_backend(NAME))

    class WrongOrder(base):  # the negative control, made from the outside: the chain runs last element first
        name = "outoftree_wrong_order"

        @staticmethod
        def _sum_of_squares(h32, tile):
            return base._sum_of_squares(h32.flip(-1), tile)

    hal.register_backend(WrongOrder())
    try:
        bad = runner.run([WrongOrder.name], ["rms_norm"], quick=True)  # its fp32 case diverges
    finally:
        hal.unregister_backend(WrongOrder.name)
    assert runner.exit_status(bad) == 1
    failed = {r.level for r in bad if r.status == "fail" and r.claimed}
    assert "L4" in failed, [(r.level, r.status) for r in bad]
    l4 = next(r for r in bad if r.level == "L4" and r.status == "fail")
    assert l4.first_divergence and l4.first_divergence["label"].startswith("golden:")
