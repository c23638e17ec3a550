"""The cpu backend's numba cache is dropped when any source of the package changes (stale bits guard)."""
import pytest

pytest.importorskip("numba")

from hal.kernels import cpu  # noqa: E402


def _fill(folder):
    for name in ("softmax._rows-1.py311.nbi", "softmax._rows-1.py311.1.nbc"):
        (folder / name).write_bytes(b"x")


def test_stale_stamp_drops_cache_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cache_dirs", lambda: [tmp_path])
    _fill(tmp_path)
    (tmp_path / cpu._STAMP).write_text("a different source tree")
    (tmp_path / "unrelated.txt").write_text("kept")
    cpu.drop_stale_cache()
    assert not list(tmp_path.glob("*.nb?"))
    assert (tmp_path / cpu._STAMP).read_text() == cpu._sources_hash()
    assert (tmp_path / "unrelated.txt").read_text() == "kept"


def test_matching_stamp_keeps_cache_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cache_dirs", lambda: [tmp_path])
    (tmp_path / cpu._STAMP).write_text(cpu._sources_hash())
    _fill(tmp_path)
    cpu.drop_stale_cache()
    assert len(list(tmp_path.glob("*.nb?"))) == 2


def test_hash_covers_every_source(tmp_path, monkeypatch):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(cpu, "_HERE", tmp_path)
    before = cpu._sources_hash()
    (tmp_path / "b.py").write_text("x = 2\n")  # a helper file, not the kernel's own
    assert cpu._sources_hash() != before
