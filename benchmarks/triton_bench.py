"""lockstep's triton backend against stock torch, same device, same run.

    python -m benchmarks.triton_bench --csv bench.csv                 # CUDA (H200: ~2-3 minutes)
    TRITON_INTERPRET=1 python -m benchmarks.triton_bench --device cpu --quick --csv /tmp/b.csv
                                                                      # CPU interpreter smoke test

CUDA timing: CUDA events around each call, warm-up calls first (compilation), median of the
repeats. Each row reports the ratio stock_time / lockstep_time (>= 1: lockstep is faster) and,
for matmul-like rows, the share of the fp32 FMA peak (--fp32-peak, H200 ~67 TFLOP/s) the strict
kernel reaches (strict work runs on fp32 FMA units, never tensor cores). Any failing row is
logged with its error and the run goes on.

Other kernel families add rows through PROVIDERS: a module with ``rows(device, quick) -> list[Row]``
(a missing module is skipped).
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

import hal
from benchmarks.harness import call_seconds, randn, write_csv

#: modules that contribute rows: this one, and e.g. "benchmarks.triton_attn_bench" (attention / GDN)
PROVIDERS = ["benchmarks.triton_bench"]  # attention / GDN rows: benchmarks.triton_attn_bench (its own step)


@dataclass
class Row:
    op: str
    shape: str
    ours: Callable[[], object]
    stock: Callable[[], object]
    flops: float = 0.0  # fp32 FMA work of the strict kernel (2 per fma), 0 when not compute-bound


def rows(device: str, quick: bool) -> list[Row]:
    """Foundation ops: decode GEMV, prefill linear, rms_norm, softmax family, token_logprobs."""
    bf = torch.bfloat16
    tri = dict(backend="triton")
    sto = dict(backend="stock")
    out = []
    if device == "cpu" or quick:  # interpreter smoke test: tiny shapes
        lin = [(1, 64, 32), (3, 130, 20)]
        norms, soft, lm = [(4, 300)], [(4, 300)], [(2, 64, 600)]
    else:
        lin = [(1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096), (4096, 4096, 4096)]
        norms = [(16, 4096), (4096, 4096)]
        soft = [(16, 32768), (1024, 32768), (64, 152064)]
        lm = [(16, 4096, 32000), (16, 4096, 152064), (256, 4096, 152064)]
    for m, k, n in lin:
        x, w = randn((m, k), bf, device, 1), randn((n, k), bf, device, 2, k ** -0.5)
        kind = "decode GEMV" if m <= 16 else "prefill"
        out.append(Row(f"linear ({kind})", f"M{m} K{k} N{n} bf16", lambda x=x, w=w: hal.linear(x, w, **tri),
                       lambda x=x, w=w: hal.linear(x, w, **sto), 2.0 * m * k * n))
    for r, h in norms:
        x, w = randn((r, h), bf, device, 3), randn((h,), bf, device, 4)
        out.append(Row("rms_norm", f"{r}x{h} bf16", lambda x=x, w=w: hal.rms_norm(x, w, **tri),
                       lambda x=x, w=w: hal.rms_norm(x, w, **sto)))
    for r, n in soft:
        x = randn((r, n), bf, device, 5, 4.0)
        out.append(Row("softmax", f"{r}x{n} bf16", lambda x=x: hal.softmax(x, **tri), lambda x=x: hal.softmax(x, **sto)))
        out.append(Row("log_softmax", f"{r}x{n} bf16", lambda x=x: hal.log_softmax(x, **tri),
                       lambda x=x: hal.log_softmax(x, **sto)))
    for nt, h, v in lm:
        hid, w = randn((nt, h), bf, device, 6), randn((v, h), bf, device, 7, 4 * h ** -0.5)
        tok = (torch.arange(nt) * 7919 % v).to(device)
        # strict: the logits are computed twice (max pass, then sum pass) + the token's logit
        out.append(Row("token_logprobs", f"N{nt} H{h} V{v} bf16",
                       lambda hid=hid, w=w, tok=tok: hal.token_logprobs(hid, w, tok, **tri),
                       lambda hid=hid, w=w, tok=tok: hal.token_logprobs(hid, w, tok, **sto), 4.0 * nt * h * v))
    return out


def time_call(fn, device: str, warmup: int, repeats: int, max_seconds: float) -> float:
    """Median seconds per call (CUDA events on cuda, perf_counter on cpu)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < max_seconds):
        times.append(call_seconds(fn, device == "cuda"))
    return statistics.median(times)


def collect(device: str, quick: bool) -> list[Row]:
    found = []
    for name in PROVIDERS:
        try:
            found += importlib.import_module(name).rows(device, quick)
        except ModuleNotFoundError as e:
            if e.name != name:  # the provider exists but something it imports does not
                print(f"rows of {name} failed: {e}", file=sys.stderr)
        except Exception as e:  # a provider that cannot build its rows must not stop the others
            print(f"rows of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny shapes (always on for the CPU interpreter)")
    p.add_argument("--csv", default="bench-results/triton_bench.csv")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=3.0, help="per row and side, after warm-up")
    p.add_argument("--fp32-peak", type=float, default=67e12, help="fp32 FMA peak in FLOP/s (H200: ~67e12)")
    p.add_argument("--only", nargs="*", help="substrings of op names to run")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    why = hal.get_backend("triton").unavailable_reason()
    if why:
        print(f"triton backend not available: {why}", file=sys.stderr)
        return 2
    quick = args.quick or args.device == "cpu"
    warmup, repeats = (1, 2) if args.device == "cpu" else (3, args.repeats)
    results = []
    for row in collect(args.device, quick):
        if args.only and not any(s in row.op for s in args.only):
            continue
        rec = {"op": row.op, "shape": row.shape, "lockstep_s": "", "stock_s": "", "speed_vs_stock": "",
               "fp32_peak_share": "", "status": "ok"}
        try:
            t_ours = time_call(row.ours, args.device, warmup, repeats, args.max_seconds)
            t_stock = time_call(row.stock, args.device, warmup, repeats, args.max_seconds)
            rec.update(lockstep_s=f"{t_ours:.6g}", stock_s=f"{t_stock:.6g}", speed_vs_stock=f"{t_stock / t_ours:.3g}")
            if row.flops and args.device == "cuda":
                rec["fp32_peak_share"] = f"{row.flops / t_ours / args.fp32_peak:.3g}"
            print(f"{row.op:<22} {row.shape:<26} lockstep {t_ours * 1e3:9.3f} ms  stock {t_stock * 1e3:9.3f} ms  "
                  f"speed {t_stock / t_ours:6.3f}x  fp32-peak {rec['fp32_peak_share'] or '-'}", flush=True)
        except Exception as e:
            rec["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
            print(f"{row.op:<22} {row.shape:<26} FAILED {rec['status']}", flush=True)
            traceback.print_exc(file=sys.stderr)
            if args.device == "cuda":
                torch.cuda.synchronize()
        results.append(rec)
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "interpreter": os.environ.get("TRITON_INTERPRET", "0")}
    write_csv(args.csv, [{**r, **env} for r in results], [*results[0].keys(), *env.keys()] if results else env)
    print(f"wrote {args.csv} ({len(results)} rows, {sum(r['status'] != 'ok' for r in results)} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
