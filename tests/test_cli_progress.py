"""`hal conformance run`'s terminal output (issues 22 item 6, 24 item 3): a progress bar on stderr (one line
redrawn on a terminal, a few lines elsewhere) that shows the cpu backend's compiles, per-case lines only with
--verbose, and specs a backend does not implement listed as such, never as divergences (the command itself: tests/test_cli.py)."""
import io

from hal.cli import _Bar, _progress
from hal.conformance import report
from hal.conformance.runner import Record


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run_bar(stream, cases=200, verbose=False, compile_at=None):
    bar = _Bar(stream)
    progress = _progress(bar, verbose)
    for i in range(cases):
        progress(i, cases, f"cpu softmax s case{i} ({i + 1}/{cases})", None)
        if i == compile_at:
            bar.compile_started("softmax._softmax_row", "lockstep: compiling the cpu backend's numba kernels ...")
            bar.compile_started("softmax._softmax_tasks", None)
        progress(i + 1, cases, f"cpu softmax s case{i} ({i + 1}/{cases})", 0.01)
    bar.close("done")
    return stream.getvalue()


def test_not_a_terminal_gets_a_few_lines_and_the_compile_notice_once():
    out = _run_bar(io.StringIO(), compile_at=3)
    lines = out.splitlines()
    assert len(lines) <= 12, out  # 0%, 10%, ..., 100% and the notice: not a line per case
    assert sum("compiling the cpu backend" in ln for ln in lines) == 1, out
    assert "\r" not in out and "200/200" in lines[-1] and "[" + "#" * 30 + "]" in lines[-1]


def test_a_terminal_gets_one_line_redrawn_in_place_naming_the_compile():
    out = _run_bar(_Terminal(), compile_at=3)
    assert out.count("\n") == 2, repr(out[-300:])  # the notice's line and the finished bar: the rest is redrawn
    assert "compiling softmax._softmax_tasks (first run on this machine)" in out
    # the compile is shown while it runs, not after the case that compiled has ended
    assert "compiling" not in out.rsplit("case5", 1)[1]


def test_verbose_adds_a_line_per_case():
    quiet, verbose = _run_bar(io.StringIO(), cases=40), _run_bar(io.StringIO(), cases=40, verbose=True)
    assert len(verbose.splitlines()) >= 40 > len(quiet.splitlines()), (quiet, verbose)
    assert "cpu softmax s case7 (8/40) 0.0s" in verbose


def _rec(status, claimed, level="L0", spec="matmul.fast.v1", detail="policy 'fast' not implemented"):
    return Record("cpu", "matmul_fast", "bf16", spec, level, status, detail, None, claimed)


def test_unclaimed_refusals_are_not_implemented_not_divergences():
    records = [_rec("unsupported", False), _rec("unsupported", False, level="L1"),
               _rec("fail", True, spec="matmul.strict.k64.v2", detail="1/3 cases fail; first: ...")]
    assert report.not_implemented(records) == "[cpu matmul_fast bf16 matmul.fast.v1] policy 'fast' not implemented"
    fails = report.failures(records)
    assert "matmul.strict.k64.v2 L0" in fails and "matmul.fast.v1" not in fails
    # a refused level the backend claims is no "not implemented": it fails the run (Compared nothing)
    assert report.not_implemented([_rec("unsupported", True)]) == ""

