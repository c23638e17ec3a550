"""Cold start of the `cpu` backend: numba compile seconds per kernel and dtype, the whole cold conformance
run and the first forward of a patched tiny Llama, each on a cleared cache, then warm (the cache it left).

    python -m benchmarks.cold_start                      # conformance run + patched forward, cold then warm
    python -m benchmarks.cold_start --skip-conformance   # the patched forward only
    python -m benchmarks.cold_start --ops attention      # the conformance run of these suites only
    python -m benchmarks.cold_start --top 40             # more rows of the per-kernel table
    python -m benchmarks.cold_start --report-dir DIR     # keep the conformance runs' JSON reports

Each measurement runs in a fresh process on a scratch copy of this checkout (its tracked and untracked,
not ignored files: no ``__pycache__``) with ``NUMBA_CACHE_DIR`` an empty folder, so every kernel really
compiles: the report counts compiles and cache hits of the package's kernels (a cold run must show 0
hits). The warm run is the same process again with the cache the cold one left. Each figure is given in
wall seconds and in CPU seconds of the child process (``getrusage``: imports included), with the load
average beside it: other jobs on a shared machine stretch CPU seconds too (two to four times at load 2-7
on 2 cores, measured), so compare figures taken at the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- in the child process ------------------------------------------------------------------------------

def _install_compile_recorder():
    """Record each numba compile (dispatcher, argument types, CPU seconds of the compiling thread excluding
    nested compiles: CPU time, which other jobs on a shared machine move less than wall time, but still move)."""
    from numba.core import event

    records, stack = [], []

    class Recorder(event.Listener):
        def on_start(self, ev):
            stack.append([time.thread_time(), 0.0])

        def on_end(self, ev):
            t0, nested = stack.pop()
            total = time.thread_time() - t0
            if stack:
                stack[-1][1] += total
            d = ev.data["dispatcher"]
            records.append({"kernel": f"{d.py_func.__module__}.{d.py_func.__qualname__}",
                            "args": [str(a) for a in ev.data["args"]], "seconds": total - nested})

    event.register("numba:compile", Recorder())
    return records


def _cache_counts():
    """(compiles, cache hits) of every dispatcher of hal.kernels.cpu loaded in this process."""
    from numba.core.registry import CPUDispatcher
    hits = misses = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("hal.kernels.cpu"):
            continue
        for obj in vars(mod).values():
            if isinstance(obj, CPUDispatcher):
                hits += sum(obj._cache_hits.values())
                misses += sum(obj._cache_misses.values())
    return misses, hits


def _child(kind, ops, out):
    records = _install_compile_recorder()
    t0, c0 = time.perf_counter(), time.process_time()
    if kind == "conformance":
        from hal import cli
        argv = ["conformance", "run", "--backend", "cpu", "--quiet", "--json", out + ".report.json"]
        argv += ["--ops", *ops] if ops else []
        status = cli.main(argv)
    else:
        import torch

        from hal.integrations import transformers as lt
        lt.register()  # attn_implementation="lockstep"
        from hal.integrations.transformers.testing import VOCAB, tiny_model
        model = tiny_model("llama")
        ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
        t0, c0 = time.perf_counter(), time.process_time()  # building the model is transformers' work, not ours
        with torch.no_grad(), lt.patch(model):
            model(ids)
        status = 0
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    misses, hits = _cache_counts()
    pathlib.Path(out).write_text(json.dumps({"seconds": seconds, "cpu": cpu, "status": status, "compiles": records,
                                             "dispatcher_compiles": misses, "cache_hits": hits}))


# ---- in the parent process -----------------------------------------------------------------------------

def _scratch_copy(dest: pathlib.Path):
    """The checkout's tracked and untracked, not ignored files (what a fresh clone plus local edits has)."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _measure(kind, ops, scratch, cache, label):
    out = scratch / f"{kind}-{label}.json"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(scratch))
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--child", kind, "--out", str(out)]
                          + (["--ops", *ops] if ops else []), cwd=scratch, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the child's user + system CPU seconds, imports included: other jobs on a shared machine stretch this
    # less than wall time, but they do (hence the load average in the report)
    child_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if proc.returncode not in (0, 1) or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"cold_start: the {kind} child failed (exit {proc.returncode})")
    res = json.loads(out.read_text())
    res.update(wall=wall, child_cpu=child_cpu, load=(load0, os.getloadavg()), stdout=proc.stdout)
    return res


def _dtype_of(args):
    for a in args:
        for tag, name in (("float32", "fp32"), ("int16", "bf16"), ("uint16", "fp16")):
            if f"array({tag}," in a:
                return name
    return "-"


def _kernel_table(records, top):
    by = {}
    for r in records:
        key = (r["kernel"].removeprefix("hal.kernels.cpu."), _dtype_of(r["args"]))
        n, s = by.get(key, (0, 0.0))
        by[key] = (n + 1, s + r["seconds"])
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])
    lines = [f"  {'kernel':<48} {'dtype':<5} {'compiles':>8} {'CPU s':>8}"]
    lines += [f"  {k:<48} {d:<5} {n:>8} {s:>8.1f}" for (k, d), (n, s) in rows[:top]]
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"  {'(' + str(len(rest)) + ' more)':<48} {'':<5} {sum(n for _, (n, _) in rest):>8} "
                     f"{sum(s for _, (_, s) in rest):>8.1f}")
    return "\n".join(lines)


def _summary(label, res):
    comp = sum(r["seconds"] for r in res["compiles"])
    (a0, _, _), (a1, _, _) = res["load"]
    status = "" if res["status"] == 0 else f"  EXIT STATUS {res['status']}"
    return (f"{label:<26} {res['seconds']:7.1f} s wall, {res['cpu']:7.1f} s CPU  (whole process {res['wall']:6.1f} s wall, "
            f"{res['child_cpu']:6.1f} s CPU; "
            f"numba compiles {res['dispatcher_compiles']:4d}, {comp:6.1f} CPU s; cache hits {res['cache_hits']:4d}; "
            f"load {a0:.1f} -> {a1:.1f}){status}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=["conformance", "forward"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ops", nargs="*", help="conformance suites (default: all)")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--skip-forward", action="store_true")
    p.add_argument("--top", type=int, default=25, help="rows of the per-kernel compile table")
    p.add_argument("--report-dir", help="keep each conformance run's JSON report here (to compare with another "
                                        "checkout's: the same records, the same bits)")
    a = p.parse_args()
    if a.child:
        return _child(a.child, a.ops, a.out)
    kinds = [k for k, skip in (("conformance", a.skip_conformance), ("forward", a.skip_forward)) if not skip]
    with tempfile.TemporaryDirectory(prefix="lockstep-cold-") as tmp:
        scratch = pathlib.Path(tmp) / "clone"
        _scratch_copy(scratch)
        for kind in kinds:
            cache = pathlib.Path(tmp) / f"numba-cache-{kind}"
            cache.mkdir()
            what = "hal conformance run --backend cpu" + (f" --ops {' '.join(a.ops)}" if a.ops and kind ==
                                                             "conformance" else "")
            if kind == "forward":
                what = "first patched tiny-Llama forward"
            cold = _measure(kind, a.ops, scratch, cache, "cold")
            warm = _measure(kind, a.ops, scratch, cache, "warm")
            if a.report_dir and kind == "conformance":
                pathlib.Path(a.report_dir).mkdir(parents=True, exist_ok=True)
                for label in ("cold", "warm"):
                    shutil.copy(scratch / f"{kind}-{label}.json.report.json",
                                pathlib.Path(a.report_dir) / f"conformance-{label}.json")
            print(f"--- {what}", flush=True)
            print(_summary("cold (cleared cache)", cold))
            print(_summary("warm (the cache it left)", warm))
            print("per kernel and dtype, cold (CPU seconds of numba compiling, nested compiles excluded):")
            print(_kernel_table(cold["compiles"], a.top), flush=True)
            if cold["cache_hits"]:
                print("WARNING: the cold run hit the cache: it did not compile from scratch")
    print(f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
