"""Time lockstep ops against the stock torch op on the same device in the same run.

    python -m benchmarks.run [--ops foundation attention gated_delta_rule] [--quick] [--csv FILE]

Prints a table (median seconds per call, ratio lockstep / stock) and writes a CSV.
Figures are for this machine only; compare ratios, not seconds.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import platform
import statistics
import sys
import time

import torch

MODULES = {
    "foundation": "benchmarks.foundation",
    "attention": "benchmarks.attention",
    "gated_delta_rule": "benchmarks.gated_delta_rule",
}


def median_time(fn, repeats: int, min_seconds: float = 0.2) -> float:
    fn()  # warm up
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="*", default=list(MODULES), choices=list(MODULES))
    p.add_argument("--quick", action="store_true", help="small shapes (seconds, not minutes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--csv", default="bench-results/benchmarks.csv")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    results = []
    for name in args.ops:
        try:
            mod = importlib.import_module(MODULES[name])
        except ModuleNotFoundError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        for op, shape, ours, stock in mod.rows(args.quick):
            t_ours = median_time(ours, args.repeats)
            t_stock = median_time(stock, args.repeats)
            results.append((op, shape, t_ours, t_stock, t_ours / t_stock))
            print(f"{op:<28} {shape:<34} lockstep {t_ours * 1e3:10.2f} ms   stock {t_stock * 1e3:9.3f} ms   "
                  f"ratio {t_ours / t_stock:9.1f}x", flush=True)
    if args.csv:
        import os
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["op", "shape", "lockstep_s", "stock_s", "ratio", "backend", "torch", "machine", "threads"])
            for r in results:
                wr.writerow([*r[:2], f"{r[2]:.6g}", f"{r[3]:.6g}", f"{r[4]:.3g}", "reference", torch.__version__,
                             platform.machine(), torch.get_num_threads()])
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
