"""Measure lockstep's exp/log (lsm1) against correctly rounded float32 results.

    python -m benchmarks.ulp [--step N]      (default 7; 1 = every float32, slow and memory hungry)

Walks float32 bit patterns with a stride (step 1 = every float32) over the range softmax uses,
and compares with float64 libm rounded to float32 (accurate to well under an ulp of float32).
"""
from __future__ import annotations

import argparse

import torch

from hal.kernels.reference.strict_math import exp, log


def _ordered(x):
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def measure(fn, ref, lo, hi, step):
    worst, exact, total = 0, 0, 0
    for sign in (1, -1):
        for start in range(0, 2 ** 31, 2 ** 26):
            x = torch.arange(start, min(start + 2 ** 26, 2 ** 31), step, dtype=torch.int64).to(torch.int32).view(torch.float32)
            x = x * sign
            x = x[torch.isfinite(x) & (x > lo) & (x < hi)]
            if not x.numel():
                continue
            r = ref(x.double()).float()
            ok = torch.isfinite(r)
            d = (_ordered(fn(x)) - _ordered(r)).abs()[ok]
            worst = max(worst, int(d.max()) if d.numel() else 0)
            exact += int((d == 0).sum())
            total += d.numel()
    return worst, exact / max(total, 1), total


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--step", type=int, default=7)
    a = p.parse_args(argv)
    for name, fn, ref, lo, hi in (("exp", exp, torch.exp, -103.98, 88.73), ("log", log, torch.log, 0.0, float("inf"))):
        worst, frac, n = measure(fn, ref, lo, hi, a.step)
        print(f"{name}: max error {worst} ulp, {frac * 100:.2f}% correctly rounded, over {n} float32 inputs "
              f"in ({lo}, {hi}) (every {a.step}th bit pattern)")


if __name__ == "__main__":
    main()
