"""Every Python file CI does not import still compiles: the benchmarks (the device scripts run them on a lent GPU,
where a syntax error costs the device time), the examples and the check scripts under tests/scripts. A stray line
in benchmarks/exact.py once made that module unimportable for a whole session without a test noticing."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted(p for d in ("benchmarks", "examples", "tests/scripts") for p in (ROOT / d).rglob("*.py"))


def test_there_are_files_to_compile():
    assert len(FILES) > 40 and any(p.name == "exact.py" for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles(path):
    compile(path.read_text(encoding="utf-8"), str(path), "exec")


def test_the_defect_it_guards_against_is_caught():
    """Negative control: the defect that went unnoticed (a stray line at column 0 inside an indented block)."""
    with pytest.raises(SyntaxError):
        compile("def rows():\n    for s in (3, 4):\nX\n        yield s\n", "stray.py", "exec")


SHELL_FILES = sorted((ROOT / "benchmarks").glob("*.sh")) + [ROOT / ".ci" / "run"]


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_parse(path):
    import subprocess
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_a_shell_syntax_error_is_caught(tmp_path):
    import subprocess
    bad = tmp_path / "bad.sh"
    bad.write_text("for rel in 5.18; do\n  echo $rel\n")  # no `done`
    assert subprocess.run(["bash", "-n", str(bad)], capture_output=True, timeout=30).returncode != 0
