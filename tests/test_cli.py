"""The `hal` command line, run as a user runs it."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from hal.cli import main


def hal(*args, check=False, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "hal.cli", *args], capture_output=True, text=True, check=check,
                          env=None if env is None else {**os.environ, **env}, cwd=cwd)


def test_info_lists_backends_and_availability():
    out = hal("info", check=True).stdout
    assert "reference" in out and "stock" in out and "available" in out
    lines = {w[0]: line for line in out.splitlines() if len(w := line.split()) > 1 and w[1] == "devices"}
    assert "claims L0 L1 L2 L3 L4 A" in lines["reference"] and "claims no level" in lines["stock"]


def test_info_claims_are_asked_per_conformance_suite_and_its_specs():
    """claimed_levels takes a conformance suite's name and one of its specs (not an op's spec family and
    that family's default spec): matmul_fast is claimed under its fast specs, where the backend has them."""
    import hal
    from hal.conformance import runner
    ref, triton = hal.get_backend("reference"), hal.get_backend("triton")
    assert runner.claims(ref, "matmul_exact") == frozenset(hal.LEVELS)
    assert "matmul_fast" not in ref.suites and runner.claims(ref, "matmul_fast") == frozenset()
    assert runner.claims(triton, "matmul_fast") == triton.fast_levels["matmul_fast"] != frozenset()
    assert runner.claims(triton, "attention_fast") == triton.fast_levels["attention_fast"]
    assert runner.claims(triton, "matmul") == frozenset(hal.LEVELS)


def test_spec_show_prints_words_and_unknown_id_fails():
    out = hal("spec", "show", "matmul.strict.k64.v2", check=True).stdout
    assert "tiles of 64" in out and "fma" in out
    bad = hal("spec", "show", "matmul.strict.k65.v2")
    assert bad.returncode == 2 and "unknown spec id" in bad.stderr


def test_conformance_run_writes_json_and_junit(tmp_path):
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    r = hal("conformance", "run", "--backend", "reference", "--ops", "softmax", "--dtypes", "fp16",
            "--json", str(j), "--junit", str(x), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(j.read_text())["records"]
    assert {r["level"] for r in recs} == {"L0", "L1", "L3", "L4", "A"}
    assert all(set(rec) >= {"backend", "op", "dtype", "spec_id", "level", "status", "detail", "first_divergence"}
               for rec in recs)
    assert all(rec["status"] == "pass" for rec in recs)
    suite = ET.parse(x).getroot()
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(recs)


def test_stock_run_prints_first_divergence_and_exits_zero():
    r = hal("conformance", "run", "--backend", "stock", "--ops", "matmul", "--dtypes", "fp32", "--quiet")
    assert r.returncode == 0
    assert "FAIL*" in r.stdout and "first divergence at index" in r.stdout and "bits 0x" in r.stdout


def test_unknown_backend_and_suite_fail_cleanly():
    r = hal("conformance", "run", "--backend", "nosuch", "--ops", "matmul")
    assert r.returncode == 2 and "unknown backend" in r.stderr
    assert "conformance suites" in hal("conformance", "run", "--help", check=True).stdout
    r = hal("conformance", "run", "--ops", "nosuch")
    assert r.returncode == 2 and "hal: unknown conformance suite nosuch" in r.stderr and "Traceback" not in r.stderr


# ---- a claimed level that compared nothing fails the run (issue 21 item 11)

def test_claimed_levels_that_compared_nothing_fail_the_run(tmp_path):
    # the cpu backend claims every level of softmax, but serves only the cpu device: on 'meta' it
    # refuses every case, so nothing was compared and the run must not say OK
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    r = hal("conformance", "run", "--backend", "cpu", "--device", "meta", "--ops", "softmax", "--quiet",
            "--json", str(j), "--junit", str(x))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "OK" not in r.stdout and "compared nothing" in r.stdout
    assert "cpu softmax fp32 softmax" in r.stdout and "serves devices ['cpu'], not 'meta'" in r.stdout
    recs = json.loads(j.read_text())["records"]
    assert recs and all(rec["status"] == "unsupported" and rec["claimed"] for rec in recs)
    suite = ET.parse(x).getroot()
    assert int(suite.get("failures")) == len(recs) and suite.get("skipped") == "0"


def test_unclaimed_unsupported_levels_do_not_fail_the_run(tmp_path):
    # the reference backend implements no fast policy: it claims nothing there, and its refusal is no failure
    j = tmp_path / "r.json"
    r = hal("conformance", "run", "--backend", "reference", "--ops", "matmul_fast", "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(j.read_text())["records"]
    assert recs and all(rec["status"] == "unsupported" and not rec["claimed"] for rec in recs)
    assert "Compared nothing" not in r.stdout
    # listed as not implemented, never as divergences (issue 22 item 6)
    assert "First divergences" not in r.stdout and "Not implemented by the backend" in r.stdout
    assert "[reference matmul_fast bf16 " in r.stdout
    # the progress output (stderr, not a terminal here): a few lines ending in the full bar, no line per case
    assert 1 <= len(r.stderr.splitlines()) <= 12 and "[" + "#" * 30 + "]" in r.stderr, r.stderr


def test_require_claims_fails_a_suite_the_backend_claims_nothing_of(capsys):
    """The device's verification call (benchmarks/gpu_verify.sh) passes --require-claims: the run above (reference on
    matmul_fast: every case refused, nothing claimed) says OK without it, and fails with it, naming the suite."""
    argv = ["conformance", "run", "--backend", "reference", "--ops", "matmul_fast", "--quick", "--quiet"]
    assert main(argv) == 0
    assert main(argv + ["--require-claims"]) == 1
    out = capsys.readouterr().out
    assert "reference matmul_fast: the backend claims no level of this suite here" in out
    assert "reference  matmul_fast            L0 -  L1 -" in out  # the cases table: nothing claimed


def test_plan_names_what_a_run_would_prove(capsys):
    """--plan runs nothing: per backend and suite the cases, the claims and the device's refusals; --require-claims
    fails a suite that would prove nothing (the reference backend has no fast policy)."""
    argv = ["conformance", "run", "--backend", "reference", "--ops", "matmul_exact", "matmul_fast", "--quick", "--plan"]
    assert main(argv) == 0
    assert main(argv + ["--require-claims"]) == 1
    out = capsys.readouterr().out
    assert "plan: reference matmul_fast: 9 cases; claims nothing; refused here: reference: implements policies" in out
    assert "plan: reference matmul_exact: 6 cases; claims L0 L1 L2 L3 L4 A; served here" in out
    assert "FAILED (--require-claims): would prove nothing: reference matmul_fast\n" in out and "Compared" not in out
    assert main(["conformance", "run", "--backend", "reference", "--ops", "matmul_exact", "--quick", "--plan",
                 "--require-claims"]) == 0


def test_cases_table_and_zero_case_claims():
    """The report counts the cases compared per (backend, suite, claimed level); a claimed level whose cases were
    all refused counts 0 and --require-claims names it, a claimed level with cases passes."""
    from hal.conformance import report
    from hal.conformance.runner import Record

    def rec(level, status, claimed, cases, op="matmul_fast", dtype="bf16"):
        return Record("triton", op, dtype, "s", level, status, "", None, claimed, cases)
    records = [rec("L0", "pass", True, 3), rec("L0", "pass", True, 2, dtype="fp16"), rec("L1", "unsupported", True, 0),
               rec("L2", "unsupported", False, 0), rec("L0", "pass", False, 4, op="matmul_exact")]
    assert report.cases_compared(records) == {("triton", "matmul_fast", "L0"): 5, ("triton", "matmul_fast", "L1"): 0}
    assert report.unproven_suites(records, ["triton"], ["matmul_fast", "matmul_exact"]) == [
        "triton matmul_fast L1: claimed, 0 cases compared",
        "triton matmul_exact: the backend claims no level of this suite here (wrong backend or device?)"]
    assert report.unproven_suites(records[:2], ["triton"], ["matmul_fast"]) == []
    assert "triton     matmul_fast            L0 5  L1 0  L2 -" in report.cases_table(records)


# ---- validate before work: `hal: ...` and exit 2, nothing run, no traceback (issue 21 item 14)

def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "", out  # nothing ran: no table, no metrics
    assert err.startswith("hal: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("argv, needles", [
    (["--device", "garbage"], ["--device 'garbage' is not a device torch knows"]),
    (["--ops"], ["--ops is given without a conformance suite"]),
    (["--ops", "bogus"], ["unknown conformance suite bogus"]),
    (["--dtypes"], ["--dtypes is given without a dtype"]),
    (["--backend", "bogus"], ["unknown backend"]),
])
def test_conformance_run_refuses_bad_arguments_before_running(capsys, argv, needles):
    # cpu on 'meta' refuses every case: a run that got past the checks would end at once (exit 1, not 2)
    _refused(capsys, ["conformance", "run", "--quiet", "--quick", "--backend", "cpu", "--device", "meta", *argv],
             *needles)


def test_conformance_run_checks_its_outputs_before_running(capsys, tmp_path):
    base = ["conformance", "run", "--backend", "reference", "--ops", "softmax", "--dtypes", "fp32", "--quick",
            "--quiet"]
    _refused(capsys, base + ["--json", str(tmp_path / "missing" / "r.json")], "--json", "does not exist")
    _refused(capsys, base + ["--junit", str(tmp_path / "missing" / "r.xml")], "--junit", "does not exist")
    _refused(capsys, base + ["--json", str(tmp_path)], "is a folder")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _refused(capsys, base + ["--json", str(tmp_path / "r.json"), "--junit", str(blocker / "r.xml")],
             "--junit", "does not exist")
    assert not (tmp_path / "r.json").exists()  # the --json file it opened first is removed again


def test_empty_golden_dir_is_refused(tmp_path):
    # subprocesses: the golden folder is read at import; cwd tmp_path, where an empty value would point
    run = ["conformance", "run", "--backend", "reference", "--ops", "softmax", "--dtypes", "fp32", "--quick", "--quiet"]
    for args, value, needle in ((run, "", "LOCKSTEP_GOLDEN_DIR is set but empty"),
                                (["conformance", "generate", "--ops", "softmax"], "", "LOCKSTEP_GOLDEN_DIR is set but empty"),
                                (run, "/nonexistent/golden", "LOCKSTEP_GOLDEN_DIR=/nonexistent/golden: no such folder")):
        r = hal(*args, env={"LOCKSTEP_GOLDEN_DIR": value}, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "" and needle in r.stderr, (args, value, r.stdout, r.stderr)
    assert list(tmp_path.iterdir()) == []  # nothing written where the empty value points


P = np.array([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
Q = np.array([[-1.0, -2.5, -0.25], [-0.1, -2.0, -1.0]])


def test_rl_report_refuses_unreadable_arrays(capsys, tmp_path):
    f = tmp_path / "lp.npz"
    np.savez(f, trainer=np.array([1.0, "a"], dtype=object), sampler=Q)
    _refused(capsys, ["rl", "report", str(f)], "cannot read array 'trainer'", "no object arrays")
    np.savez(f, trainer=P, sampler=Q, mask=np.array([["1", "1", "1"], ["1", "1", "0"]]))
    _refused(capsys, ["rl", "report", str(f)], "array 'mask' has dtype <U1")
    np.savez(f, trainer=P.ravel(), sampler=Q.ravel(), cu_seqlens=np.array([0.0, 2.9, 6.0]))
    _refused(capsys, ["rl", "report", str(f)], "cu_seqlens must be an integer tensor")
    np.savez(f, trainer=P, sampler=Q)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _refused(capsys, ["rl", "report", str(f)], "cannot read")


def test_rl_report_checks_json_output_before_the_work(capsys, tmp_path):
    f = tmp_path / "lp.npz"
    np.savez(f, trainer=P, sampler=Q)
    _refused(capsys, ["rl", "report", str(f), "--json", str(tmp_path / "missing" / "m.json")],
             "--json", "does not exist")
    _refused(capsys, ["rl", "report", str(f), "--json", str(tmp_path)], "is a folder")


def test_rl_report_reads_big_endian_arrays_and_writes_strict_json(capsys, tmp_path):
    f, out = tmp_path / "lp.npz", tmp_path / "m.json"
    np.savez(f, trainer=P.astype(">f8"), sampler=Q.astype(">f8"))
    assert main(["rl", "report", str(f), "--json", str(out)]) == 0
    big = json.loads(out.read_text())
    np.savez(f, trainer=P, sampler=Q)
    assert main(["rl", "report", str(f), "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == big and big["tokens"] == 6
    # sampler -inf vs trainer finite: k3 = inf, written as the string "inf" (strict JSON has no Infinity)
    np.savez(f, trainer=P, sampler=np.where(P == -9.0, -np.inf, Q))
    assert main(["rl", "report", str(f), "--json", str(out)]) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    m = json.loads(text, parse_constant=lambda c: pytest.fail(c))
    assert m["k3"] == "inf" and m["max_abs_log_ratio"] == "inf"


def test_rl_report_bad_input_is_a_message_not_a_traceback(tmp_path):
    f = tmp_path / "lp.npz"
    np.savez(f, trainer=P.ravel(), sampler=Q.ravel(), cu_seqlens=np.array([0.0, 2.9, 6.0]))
    r = hal("rl", "report", str(f))
    assert r.returncode == 2 and r.stderr.startswith("hal: ") and "Traceback" not in r.stderr, r.stderr


def test_rl_report_refuses_a_dtype_torch_cannot_hold_and_names_a_0d_array_s_shape(capsys, tmp_path):
    """float128 (np.longdouble) used to end in torch.from_numpy's TypeError (a traceback, exit 1); a 0-d array
    was reported as shape (1,) (np.ascontiguousarray makes it 1-d). Each is refused before any work, exit 2."""
    f = tmp_path / "lp.npz"
    np.savez(f, trainer=P.astype(np.longdouble), sampler=Q)
    _refused(capsys, ["rl", "report", str(f)], f"array 'trainer' has dtype {np.dtype(np.longdouble)}, which torch "
                                               "cannot hold")
    np.savez(f, trainer=np.float64(-1.0), sampler=np.float64(-2.0))
    _refused(capsys, ["rl", "report", str(f)], "got shape ()")
    np.savez(f, trainer=P.ravel(), sampler=Q.ravel(), cu_seqlens=np.array(6, dtype=np.int64))  # 0-d offsets
    assert "from 0 to 6, got 6" in _refused(capsys, ["rl", "report", str(f)], "cu_seqlens must be")
    np.savez(f, trainer=P.astype(np.longdouble), sampler=Q.astype(np.longdouble))
    r = hal("rl", "report", str(f))  # as a user runs it: a message and exit 2, not a traceback and exit 1
    assert r.returncode == 2 and r.stderr.startswith("hal: ") and "Traceback" not in r.stderr, r.stderr
