"""benchmarks/vllm_throughput.py's floors: the shapes one step runs, the ratios, and the --dry-run path (no vLLM)."""
from __future__ import annotations

import json

from benchmarks import vllm_throughput as vt


def test_step_linears_are_the_models_shapes():
    w = vt.workloads(quick=False)
    prefill = vt.step_linears(vt.CONFIG, "prefill", w["prefill"])
    decode = vt.step_linears(vt.CONFIG, "decode", w["decode"])
    # qkv: (16 + 2 * 4) heads of 64; o: 16 x 64 -> 1024; gate-up: 2 x 2816; down: 2816 -> 1024; the LM head on
    # one row per sequence (8), whatever the prompt length
    assert prefill == [(4096, 1024, 1536, 8), (4096, 1024, 1024, 8), (4096, 1024, 5632, 8), (4096, 2816, 1024, 8),
                       (8, 1024, 32000, 1)]
    assert decode == [(8, 1024, 1536, 8), (8, 1024, 1024, 8), (8, 1024, 5632, 8), (8, 2816, 1024, 8),
                      (8, 1024, 32000, 1)]


def test_floors_are_time_ratios_over_stock_bf16():
    assert vt.floors({"decode": {"stock": 2.0, "float32": 5.0, "lockstep": 7.0}}) == {"decode": (3.5, 2.5)}


def test_dry_run_prints_a_floor_per_row_and_the_load(tmp_path, capsys):
    vt.main(["--dry-run", "--out", str(tmp_path), "--modes", "eager"])
    out = capsys.readouterr().out
    assert "load average (1/5/15 min) at start" in out
    rows = [line for line in out.splitlines() if line.startswith("| eager |")]
    assert [r.split(" | ")[1] for r in rows] == ["prefill", "decode", "top-p"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len(cells) == 7 and cells[-1].endswith("x") and cells[-2].endswith("x")
    saved = json.load(open(tmp_path / "vllm_throughput.json"))
    assert set(saved["linears"]["decode"]) == {"stock", "float32", "lockstep"}
    assert all(t > 0 for wl in saved["linears"].values() for t in wl.values())
