"""Time lockstep ops against the stock torch op on the same device in the same run.

    python -m benchmarks.run [--ops foundation attention gated_delta_rule cpu] [--quick] [--csv FILE]
                             [--backend NAME] [--threads 1 2] [--plot [PNG]] [--only linear ...]

Prints a table (median seconds per call, ratio lockstep / stock) and writes a CSV; ``--plot`` also
draws the ratio per op (one bar per thread count) into a PNG. ``--backend`` runs the lockstep side
of the foundation/attention/GDN rows on that backend (default: chosen by device, i.e. `cpu` when
numba is installed); the `cpu` rows always name the cpu backend. Figures are for this machine
only; compare ratios, not seconds.
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
    "cpu": "benchmarks.cpu",
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
    p.add_argument("--ops", nargs="*", default=[m for m in MODULES if m != "cpu"], choices=list(MODULES))
    p.add_argument("--quick", action="store_true", help="small shapes (seconds, not minutes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--csv", default="bench-results/benchmarks.csv")
    p.add_argument("--backend", default="auto", help="backend of the lockstep side (default: by device)")
    p.add_argument("--threads", nargs="*", type=int, default=None, help="thread counts to run at (default: torch's)")
    p.add_argument("--only", nargs="*", default=None, metavar="OP",
                   help="time only the rows whose op name is one of these (e.g. --only linear)")
    p.add_argument("--plot", nargs="?", const="bench-results/ratios.png", default=None,
                   help="also write a PNG chart of the ratios (default path bench-results/ratios.png)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    import hal
    results = []
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)  # the cpu backend runs its kernels on torch's thread count
        for name in args.ops:
            try:
                mod = importlib.import_module(MODULES[name])
            except ModuleNotFoundError as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
            backend = "cpu" if name == "cpu" else args.backend
            ctx = hal.use(backend) if backend != "auto" else _nullcontext()
            with ctx:
                for op, shape, ours, stock in mod.rows(args.quick):
                    if args.only and op not in args.only:
                        continue
                    t_ours = median_time(ours, args.repeats)
                    t_stock = median_time(stock, args.repeats)
                    results.append((op, shape, t_ours, t_stock, t_ours / t_stock, backend, threads))
                    print(f"{op:<28} {shape:<34} {threads}T lockstep {t_ours * 1e3:10.2f} ms   stock "
                          f"{t_stock * 1e3:9.3f} ms   ratio {t_ours / t_stock:9.2f}x", flush=True)
    if args.csv:
        import os
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["op", "shape", "lockstep_s", "stock_s", "ratio", "backend", "torch", "machine", "threads"])
            for r in results:
                wr.writerow([*r[:2], f"{r[2]:.6g}", f"{r[3]:.6g}", f"{r[4]:.3g}", r[5], torch.__version__,
                             platform.machine(), r[6]])
        print(f"wrote {args.csv}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def plot(results, path: str) -> None:
    """Horizontal bars: ratio lockstep / stock per (op, shape), one bar per thread count, log scale."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(f"{r[0]} {r[1]} [{r[5]}]" for r in results))
    threads = sorted({r[6] for r in results})
    ratio = {(f"{r[0]} {r[1]} [{r[5]}]", r[6]): r[4] for r in results}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) * max(1, len(threads)) + 1.5))
    h = 0.8 / len(threads)
    for i, t in enumerate(threads):
        ys = [j + i * h for j in range(len(labels))]
        ax.barh(ys, [ratio.get((lab, t), float("nan")) for lab in labels], height=h, label=f"{t} thread(s)")
    ax.set_yticks([j + h * (len(threads) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("time lockstep / time stock torch (same run; lower is faster)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
