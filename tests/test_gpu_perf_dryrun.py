"""The GPU run (benchmarks/gpu_perf.py, benchmarks/gpu_check_8min.sh) is never broken when a GPU comes: its CPU dry
run executes every stage's code with CPU stand-ins (issue 40), and the summary's classifier names each symptom."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(folder, name):
    with open(os.path.join(folder, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_shell_script_parses():
    for script in ("gpu_check_8min.sh", "gpu_verify.sh", "gpu_sweep.sh", "gpu_exact.sh", "gpu_rl_step.sh",
                   "check_steps.sh"):
        r = subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    pytest.importorskip("triton")
    out = str(tmp_path_factory.mktemp("gpu_perf"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LOCKSTEP_BACKEND", None)
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_perf", "--device", "cpu", "--tiny", "--out", out,
                        "--budget", "600"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p.stdout


def test_every_stage_wrote_its_rows(dry_run):
    from benchmarks import gpu_perf
    out, stdout = dry_run
    assert not os.path.exists(os.path.join(out, "errors.jsonl")), open(os.path.join(out, "errors.jsonl")).read()
    with open(os.path.join(out, "env.json")) as f:
        env = json.load(f)
    assert env["triton"] and env["torch"] == torch.__version__
    ceilings = {r["name"]: r for r in _rows(out, "ceilings.jsonl")}
    assert set(ceilings) == {"copy_GBps", "bf16_TFLOPs", "fp32_TFLOPs"}
    assert all(r["value"] > 0 for r in ceilings.values())
    # every case of every op family and policy ran through the whole row: timed, bits compared, kernels recorded
    ops = {r["id"]: r for r in _rows(out, "ops.jsonl")}
    want = [c.id for c in gpu_perf.cases(gpu_perf.TINY, "cpu")]
    assert list(ops) == want
    for r in ops.values():
        assert r.get("error") is None and r.get("skipped") is None, r
        assert r["bits"] == "same" and r["ours_s"] > 0 and r["sets"] == 2 and r["bytes"] > 0, r
        assert r["kernels"] and all(isinstance(g, list) for g in r["grids"]), r
        assert r["triton"] == gpu_perf.TRITON
    assert {r["policy"] for r in ops.values()} == {"strict", "fast", "exact"}
    # the decode-tile spec's rows (their bits checks included: decode == its prefill-sized chunk, prefill == decode)
    assert {"attention_decode/fast-m16/B2", "attention_prefill/fast-m16/T24"} <= set(ops)
    assert all(r["ratio"] is not None for r in ops.values())  # transformers is a test dependency: GDN has stock
    kernels = _rows(out, "kernels.jsonl")
    assert {k["id"] for k in kernels} == set(want) and all(k["programs"] >= 1 for k in kernels)
    with open(os.path.join(out, "ops.csv")) as f:
        assert len(f.read().splitlines()) == len(want) + 1
    profiled = _rows(out, "profile.jsonl")
    assert len(profiled) == 2 and all(p["kernels"] and "cpu stand-in" in p["source"] for p in profiled), profiled
    assert os.path.getsize(os.path.join(out, "profile.txt")) > 0
    ncu = _rows(out, "ncu.jsonl")
    assert 1 <= len(ncu) <= 3
    for n in ncu:  # no ncu here: its command is built, its absence logged
        assert n["status"].startswith("skipped: ncu not found"), n
        kernels_regex = n["cmd"].split("--kernel-name regex:^(")[1].split(")$")[0].split("|")
        assert n["kernel"] in kernels_regex and n["id"] in n["cmd"].split("--run-case")[1].split()
        assert n["target_rc"] == 0, n  # the ncu target (the --run-case child, every picked case) runs
    summary = _rows(out, "summary.jsonl")
    assert summary and all(s["symptoms"] for s in summary)
    with open(os.path.join(out, "summary.txt")) as f:
        text = f.read()
    assert "slow rows" in text and f"triton {gpu_perf.TRITON}" in text and text.strip() in stdout


def test_replay_bits_check_catches_a_difference():
    """The row's bits field is not a constant: a replay that differs in one bit is reported."""
    from benchmarks.gpu_perf import _bits
    a = torch.tensor([1.0, -0.0, 3.0], dtype=torch.bfloat16)
    b = a.clone()
    assert _bits("x", a, (b,)) == "same"
    b[1] = 0.0  # +0.0 against -0.0: equal as numbers, different bits
    assert _bits("x", a, b).startswith("DIFFER")


def _k(name, programs, **kw):
    return {"kernel": name, "grid": [programs], "programs": programs, "n_spills": 0, **kw}


def test_classifier_names_each_symptom():
    from benchmarks.gpu_perf import classify
    row = {"frac": 0.05, "ceiling": "copy"}
    assert classify(row, [_k("a", 200, n_spills=12, sass_stack=48)], None, [], 132)[0].startswith("spills: a 12")
    conv = classify(row, [_k("a", 200, sass_shared=392, sass_barriers=144)], None, [], 132)
    assert conv == ["layout conversions: a 392 LDS/STS 144 BAR"]
    assert classify(row, [_k("a", 16)], None, [], 132)[0].startswith("too few programs: a grid [16] = 16 < 132")
    prof = {"first_kernel": "main", "torch_share": 0.0,
            "kernels": [{"name": "combine", "share": 0.7}, {"name": "main", "share": 0.3}]}
    got = classify(row, [_k("main", 500), _k("combine", 500)], prof, [], 132)
    assert got[0].startswith("secondary kernel dominating: combine 70%")
    torch_prof = {"first_kernel": "main", "torch_share": 0.6,
                  "kernels": [{"name": "torch:copy_", "share": 0.6}, {"name": "main", "share": 0.4}]}
    assert classify(row, [_k("main", 500)], torch_prof, [], 132)[0].startswith("secondary kernels dominating: torch")
    # none of those, far from the ceiling: a latency-bound loop; near the ceiling: nothing to name
    assert classify(row, [_k("main", 500)], None, [], 132)[0].startswith("latency-bound loop: 5.0% of the copy")
    assert classify({"frac": 0.8, "ceiling": "copy"}, [_k("main", 500)], None, [], 132)[0].startswith("unclassified")
    ncu = [{"kernel": "main", "metrics": {"DRAM Throughput": "12 %", "Duration": "5 us"}}]
    got = classify(row, [_k("main", 500)], None, ncu, 132)
    assert got == ["ncu main: DRAM Throughput 12 %", got[1]] and got[1].startswith("latency-bound loop")


def test_ncu_csv_parsed():
    from benchmarks.gpu_perf import parse_ncu
    text = ('==PROF== Connected\n"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","_gemv","GPU Speed Of Light Throughput","DRAM Throughput","%","11.0"\n'
            '"1","_gemv","GPU Speed Of Light Throughput","DRAM Throughput","%","61.2"\n'
            '"1","_gemv","Occupancy","Achieved Occupancy","%","40.1"\n'
            '"1","_gemv","Launch Statistics","Shared Memory Configuration Size","Kbyte","8"\n'
            '"2","_max","GPU Speed Of Light Throughput","DRAM Throughput","%","5"\n')
    assert parse_ncu(text) == {"_gemv": {"DRAM Throughput": "61.2 %", "Achieved Occupancy": "40.1 %"},
                               "_max": {"DRAM Throughput": "5 %"}}  # a kernel's last launch (a replay) counts


def test_launch_record_reads_sass_of_a_compiled_kernel():
    """The GPU-only part of a kernel record (its SASS counts) on a kernel compiled for sm_90 here: the names the
    summary reads exist, and a kernel with no cubin says why instead of failing the row."""
    pytest.importorskip("triton")
    from benchmarks.gpu_perf import Launches
    from hal.kernels.checks.lint import compile_case, strict_kernels
    case = next(c for c in strict_kernels(False) if c.name.startswith("rms_norm"))
    compiled = compile_case(case, "sm90", aligned=True)
    rec = Launches(sass=True).describe(type("Fn", (), {"__name__": "rms"})(), (3, 1), compiled, 0.0)
    assert rec["kernel"] == "rms" and rec["grid"] == [3, 1] and rec["programs"] == 3
    assert rec["num_warps"] >= 1 and rec["sass_stack"] == 0 and rec["sass_ldg128"] > 0, rec
    assert {"sass_shared", "sass_barriers", "sass_ffma", "sass_ldg_narrow", "sass_instr"} <= rec.keys()
    no_cubin = type("Compiled", (), {"asm": {}})()
    rec = Launches(sass=True).describe(type("Fn", (), {"__name__": "x"})(), "g", no_cubin, 0.0)
    assert rec["sass"].startswith("unavailable: KeyError") and rec["grid"] == "callable" and rec["n_regs"] is None


def test_an_old_path_row_replays_with_its_constants_set(monkeypatch):
    """An old-vs-new row's timed thunk is a replay of the backend calls (launch_path), run after the row's thunk
    has restored the kernel module's constants: the replay must set them again, or both rows time the default
    path (negative control: the bare replay sees the default)."""
    import types

    from benchmarks import gpu_perf
    from hal.backends import triton as tri_backend
    module = types.SimpleNamespace(PATH="new")
    seen = []

    def fake_launch_path(call):
        result = call()
        return (lambda: seen.append(module.PATH)), result
    monkeypatch.setattr(tri_backend, "launch_path", fake_launch_path)
    ours = gpu_perf._with_constants(module, lambda: module.PATH, dict(PATH="old"))
    case = gpu_perf.Case("x/old", "x", "strict", "", build=None)
    path, eager = gpu_perf.launch_path_of(case, ours)
    path()
    assert eager == "old" and seen == ["old"] and module.PATH == "new"
    bare, _ = fake_launch_path(ours)
    bare()
    assert seen == ["old", "new"]  # the replay alone runs the default path


def test_a_selected_path_row_without_its_constants_is_refused():
    """The 2026-12-04 token_logprobs pair set its constant by hand inside the thunk, so its replay timed the default
    path: such a row now fails by name (every tiny row passes the same check in the dry run above)."""
    from benchmarks import gpu_perf
    module = type("M", (), {"PATH": "new"})

    def by_hand():
        saved, module.PATH = module.PATH, "old"
        try:
            return module.PATH
        finally:
            module.PATH = saved
    case = gpu_perf.Case("x/strict/N8/old_path", "x", "strict", "", build=None, via_launch_path=False)
    with pytest.raises(AssertionError, match="x/strict/N8/old_path"):
        gpu_perf.launch_path_of(case, by_hand)
    path, eager = gpu_perf.launch_path_of(case, gpu_perf._with_constants(module, lambda: module.PATH, dict(PATH="old")))
    assert eager == "old" and module.PATH == "new"
    default = gpu_perf.Case("x/strict/N8", "x", "strict", "", build=None, via_launch_path=False)
    assert gpu_perf.launch_path_of(default, by_hand)[1] == "old"
    assert [gpu_perf.runs_a_selected_path(i) for i in ("sweep/strict-linear-M24/t64x32-w4", "linear/strict-old/M2",
                                                       "gdn_chunked/strict/T24/one_dot", "linear/strict/M2")] == \
        [True, True, True, False]


def test_ncu_leaves_out_rows_too_slow_to_replay(tmp_path):
    """A row over NCU_MAX_ROW_US is not profiled on a GPU (ncu replays each launch per counter pass: one 118 ms
    launch used the whole stage on the H200); the CPU dry run, with interpreter times, takes every row."""
    from benchmarks.gpu_perf import NCU_MAX_ROW_US, Out, worst_kernels
    out = Out(str(tmp_path))
    out.row("ops.jsonl", {"id": "slow", "ratio": 0.01, "ours_s": 2 * NCU_MAX_ROW_US * 1e-6, "kernels": ["big"]})
    out.row("ops.jsonl", {"id": "quick", "ratio": 0.5, "ours_s": 20e-6, "kernels": ["small"]})
    assert worst_kernels(out, max_row_us=NCU_MAX_ROW_US) == [("quick", "small")]
    assert worst_kernels(out) == [("slow", "big"), ("quick", "small")]


# ---------------------------------------------------------------- the device plan (issue 49)

def _bash(script, *args, env=None, timeout=60):
    env = {**os.environ, **(env or {}), "PYTHON": sys.executable}
    return subprocess.run(["bash", os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plan_check_refuses_a_plan_over_its_call(tmp_path):
    """The scripts' stage limits (a side-by-side group counts its largest) plus the reserve must fit the call."""
    body = (f'OUT={tmp_path}; source {ROOT}/benchmarks/check_steps.sh; '
            'plan_check 100 10 "a:50 b:60" "{c}"; echo rc=$?; limit b')
    over = subprocess.run(["bash", "-c", body.replace("{c}", "c:31")], capture_output=True, text=True)
    assert "PLAN OVER BUDGET: stage limits + 10s reserve = 101s > the 100s call" in over.stdout and "rc=1" in over.stdout
    fits = subprocess.run(["bash", "-c", body.replace("{c}", "c:30")], capture_output=True, text=True)
    assert "plan ok" in fits.stdout and "rc=0" in fits.stdout and fits.stdout.strip().endswith("60")


@pytest.mark.parametrize("script, call", [("gpu_verify.sh", 150), ("gpu_check_8min.sh", 450), ("gpu_sweep.sh", 240)])
def test_each_call_plan_fits_and_unreached_stages_say_not_run(tmp_path, script, call):
    """Every stage skipped (STEPS names none): the plan is still checked first; the verification call's verdict
    says "not run" for each stage and fails (an unreached stage is never "ok")."""
    r = _bash(script, "--dry-run", str(tmp_path), env={"STEPS": "none"})
    log_text = (tmp_path / "log.txt").read_text()
    assert "plan ok" in log_text and f"<= the {call}s call" in log_text, log_text
    if script == "gpu_verify.sh":
        assert r.returncode == 1 and "verification: FAILED" in r.stdout
        verdict = (tmp_path / "verdict.txt").read_text().splitlines()
        assert len(verdict) == 8 and all(v.endswith(": not run") for v in verdict), verdict


def test_summary_names_planned_rows_never_measured(tmp_path):
    """A row the shell's timeout cut off (planned, never written to ops.jsonl) prints "not run", not a figure."""
    import types

    from benchmarks import gpu_perf
    out = gpu_perf.Out(str(tmp_path))
    out.row("planned.jsonl", {"id": "linear/fast/M1", "op": "linear", "policy": "fast"})
    out.row("planned.jsonl", {"id": "linear/fast/M8", "op": "linear", "policy": "fast"})
    out.row("ops.jsonl", {"id": "linear/fast/M1", "skipped": "not run (stage budget spent)"})
    gpu_perf.stage_summary(types.SimpleNamespace(shapes=gpu_perf.TINY), out, 0.0)
    text = (tmp_path / "summary.txt").read_text()
    assert "linear/fast/M1" in text and "linear/fast/M8" in text and "not run (its stage ended before it)" in text
    assert "same" not in text.split("slow rows")[0].split("\n", 2)[2]


def test_bits_sweep_rows_not_reached_say_not_run():
    """A sweep whose budget is spent reports each row "not run" and fails (the control was not caught)."""
    pytest.importorskip("triton")
    from benchmarks import fast_bits_sweep as sweep
    rows, caught = sweep.run(sweep.TINY_SIZES, "cpu", deadline=0.0, out_path=None, say=lambda s: None)
    assert not caught and rows and all(r["result"].startswith("not run") for r in rows)
    assert len(rows) == len(sweep.DTYPES) * len(sweep.CLASSES) * (len(sweep.FACTORS) + len(sweep.table_launches()) + 1)


@pytest.fixture(scope="module")
def verify_dry_run(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu_verify")
    r = _bash("gpu_verify.sh", "--dry-run", str(out), env={"PYTHONPATH": ROOT}, timeout=600)
    return out, r


def test_verification_call_dry_run(verify_dry_run):
    """gpu_verify.sh --dry-run on CPU: every stage's code runs (matmul_fast's quick set for real, attention_fast and
    the triton matmul_exact set as --plan), the bits sweep at tiny sizes (saying it answers nothing about a GPU), and
    fast_bench's bits rows; the verdict is every stage ok."""
    out, r = verify_dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert (out / "verdict.txt").read_text().splitlines() == [f"{s}: ok" for s in (
        "verify-env", "conf-matmul-fast", "conf-attention-fast", "conf-matmul-exact", "conf-gdn-fast", "conf-tlp-fast",
        "bits-sweep", "fast-bench-bits")]
    conf = (out / "conformance_matmul_fast.txt").read_text()
    assert "cases compared per suite and claimed level" in conf and "triton     matmul_fast            L0 " in conf
    recs = json.loads((out / "conformance_matmul_fast.json").read_text())["records"]
    assert recs and all(rec["status"] == "pass" for rec in recs if rec["claimed"])
    assert "plan: triton attention_fast:" in (out / "conformance_attention_fast.txt").read_text()
    assert "plan: triton matmul_exact:" in (out / "conformance_matmul_exact.txt").read_text()
    assert "plan: triton gated_delta_rule_fast:" in (out / "conformance_gdn_fast.txt").read_text()
    assert "plan: triton token_logprobs_fast:" in (out / "conformance_tlp_fast.txt").read_text()
    from benchmarks import fast_bits_sweep as sweep
    rows = _rows(str(out), "bits_sweep.jsonl")
    assert len(rows) == len(sweep.DTYPES) * len(sweep.CLASSES) * (len(sweep.FACTORS) + len(sweep.table_launches()) + 1)
    assert all(r["where"] == sweep.INTERPRETER_NOTE and "elements" in r for r in rows)
    assert all(r["result"].startswith("caught") for r in rows if r["launch"] == sweep.CONTROL)
    # the comparison can fail: the interpreter's stand-in chains per K tile, so BLOCK_K changes its bits
    assert all(r["differing"] > 0 for r in rows if r["launch"] == "BLOCK_K 32")
    # v3's table under v3's rule: the same bits as the reference launch (what the device rows check on the GPU)
    assert all(r["result"] == "same" for r in rows if r["launch"].startswith("v3 table"))
    assert "say nothing about which launch choices change bits on a GPU" in (out / "bits_sweep.txt").read_text()
    bench = (out / "fast_bench.csv").read_text()
    assert "fast matmul.fast.m128.n128.k64.w8.s3.v2: rows alone vs in batches" in bench
    assert "fast matmul.fast.wgmma.k16.t1.v3: rows alone vs in batches" in bench and "same bits" in bench

def test_a_fast_attention_path_row_fails_unless_its_bits_equal_the_default():
    """attention_prefill/fast/T*/general and /per_split (and decode's /general) time a kept-selectable path of
    fast_attention.py only after its out / lse bits equal the default path's: a path whose bits differ fails the row
    by name (negative control: a check whose lse moves by one ulp on the general path); equal bits pass and the row's
    thunk carries the path's constants."""
    from benchmarks import gpu_perf
    from hal.kernels.triton import fast_attention
    out = torch.arange(6, dtype=torch.float32)

    def check(tensors, shift):  # (out, lse) as the row's call would give them, lse one ulp off on the general path
        lse = out.clone()
        if not fast_attention.FAST_BLOCK_PATH and shift:
            lse = torch.nextafter(lse, torch.full_like(lse, float("inf")))
        return out, lse
    for shift in (True, False):
        new = gpu_perf.Case("attention_prefill/fast/T24", "attention_prefill", "fast", "T24",
                            build=lambda seed: ((lambda: fast_attention.FAST_BLOCK_PATH), None, []))
        row = gpu_perf._fast_attention_path(new, "general", lambda tensors: check(tensors, shift))
        assert row.id == "attention_prefill/fast/T24/general"
        if shift:
            with pytest.raises(AssertionError, match="attention_prefill/fast/T24/general"):
                row.build(0)
        else:
            ours, _, _ = row.build(0)
            assert ours.constants[1] == {"FAST_BLOCK_PATH": False} and ours() is False
    assert fast_attention.FAST_BLOCK_PATH is True


def test_a_decode_tile_row_fails_unless_its_decode_equals_its_prefill(monkeypatch):
    """attention_decode/fast-m16/B* and attention_prefill/fast-m16/T* (the decode-tile spec) check each input set's
    raw bits before timing: the decode == the last row of a prefill-sized chunk ending at it, the prefill's last row
    == that row decoded. Stand-in ops (every row's out and lse its own q's: rows are independent) with the lse of the
    multi-row call one ulp off fail the row by name (the negative control); equal bits pass, the spec passed down."""
    import hal
    from benchmarks import gpu_perf
    from hal.spec import FAST_ATTENTION_DECODE
    seen = set()

    def rows_own(q, many_rows, shift):  # (out, lse [heads, rows]) of rows [rows, heads, d]
        lse = q.float().sum(-1).transpose(0, 1)
        return q.clone(), (torch.nextafter(lse, torch.full_like(lse, float("inf"))) if many_rows and shift else lse)

    def kvcache(shift):
        def call(q, kc, vc, cache_seqlens, block_table=None, return_lse=False, spec=None, **kw):
            seen.add(spec)
            outs = [rows_own(qb, q.shape[1] > 1, shift) for qb in q]
            out, lse = torch.stack([o for o, _ in outs]), torch.stack([lv for _, lv in outs])
            return (out, lse) if return_lse else out
        return call

    def varlen(shift):
        def call(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=False, spec=None, **kw):
            seen.add(spec)
            out, lse = rows_own(q, True, shift)
            return (out, lse) if return_lse else out
        return call

    q = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 1, 4, 8).bfloat16()
    decode = gpu_perf.Case("attention_decode/fast/B2", "attention_decode", "fast", "B2",
                           build=lambda seed: (None, None, [q, None, None, None, torch.tensor([5, 5])]))
    qp = torch.arange(24 * 4 * 8, dtype=torch.float32).reshape(24, 4, 8).bfloat16()
    prefill = gpu_perf.Case("attention_prefill/fast/T24", "attention_prefill", "fast", "T24",
                            build=lambda seed: (None, None, [qp, qp[:, :2], qp[:, :2]]))
    for prefill_row, base, make in ((False, decode, gpu_perf._decode_tile_decode),
                                    (True, prefill, gpu_perf._decode_tile_prefill)):
        row = make(base, {})
        assert row.id == base.id.replace("/fast/", "/fast-m16/") and row.policy == "fast"
        for shift in (True, False):
            monkeypatch.setattr(hal, "flash_attn_with_kvcache", kvcache(shift and not prefill_row))
            monkeypatch.setattr(hal, "flash_attn_varlen_func", varlen(shift and prefill_row))
            if shift:
                with pytest.raises(AssertionError, match=re.escape(row.id)):
                    row.build(0)
            else:
                ours, _, _ = row.build(0)
                assert hasattr(ours, "constants")  # a selected-path row: its replay runs under the same call
    assert seen == {FAST_ATTENTION_DECODE}
