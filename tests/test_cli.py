"""The `hal` command line, run as a user runs it."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET



def hal(*args, check=False):
    return subprocess.run([sys.executable, "-m", "hal.cli", *args], capture_output=True, text=True, check=check)


def test_info_lists_backends_and_availability():
    out = hal("info", check=True).stdout
    assert "reference" in out and "stock" in out and "available" in out


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


def test_unknown_backend_and_family_fail_cleanly():
    r = hal("conformance", "run", "--backend", "nosuch", "--ops", "matmul")
    assert r.returncode == 2 and "unknown backend" in r.stderr
    r = hal("conformance", "run", "--ops", "nosuch")
    assert r.returncode != 0 and "unknown op family" in r.stderr
