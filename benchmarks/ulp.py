"""Measure lockstep's exp/log/sin/cos (lsm1) and the strict activations against correctly rounded float32.

    python -m benchmarks.ulp [--step N] [--fn exp log sin cos sigmoid silu softplus]
        (default step 7, functions exp log; 1 = every float32, slow and memory hungry)

Walks float32 bit patterns with a stride (step 1 = every float32) over the range softmax uses,
and compares with float64 libm rounded to float32 (accurate to well under an ulp of float32).
"""
from __future__ import annotations

import argparse

import torch

from hal.kernels.oracle import elementwise as ora
from hal.kernels.reference import elementwise as ew
from hal.kernels.reference.strict_math import cos, exp, log, sin


def _ordered(x):
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def measure(fn, ref, lo, hi, step):
    worst, exact, total = 0, 0, 0
    for sign in (1, -1):
        first = int(torch.tensor(max(lo, 0.0) if sign == 1 else max(-hi, 0.0), dtype=torch.float32).view(torch.int32))
        first -= first % 2 ** 26  # chunks of 2**26 patterns from 0: the same lattice whatever the range
        for start in range(first, 2 ** 31, 2 ** 26):
            x = torch.arange(start, min(start + 2 ** 26, 2 ** 31), step, dtype=torch.int64).to(torch.int32).view(torch.float32)
            if bool((x.abs() >= max(abs(lo), abs(hi))).all()):
                break
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


# name -> (lockstep's function, float64 reference, [(lo, hi), ...] open ranges measured)
FUNCTIONS = {
    "exp": (exp, torch.exp, [(-103.98, 88.73)]),
    "log": (log, torch.log, [(0.0, float("inf"))]),
    "sin": (sin, torch.sin, [(-2.0 ** 20, 2.0 ** 20), (2.0 ** 20, 2.0 ** 24), (-2.0 ** 24, -2.0 ** 20)]),
    "cos": (cos, torch.cos, [(-2.0 ** 20, 2.0 ** 20), (2.0 ** 20, 2.0 ** 24), (-2.0 ** 24, -2.0 ** 20)]),
    # the activations over every finite float32 (their exp overflow below -88.72 is stated in the spec)
    "sigmoid": (ew.sigmoid_f32, ora.sigmoid, [(-88.72, float("inf")), (float("-inf"), -88.72)]),
    "silu": (ew.silu_f32, ora.silu, [(-88.72, float("inf")), (float("-inf"), -88.72)]),
    "softplus": (ew.softplus_f32, ora.softplus, [(float("-inf"), float("inf"))]),
}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--step", type=int, default=7)
    p.add_argument("--fn", nargs="*", default=["exp", "log"], choices=list(FUNCTIONS))
    a = p.parse_args(argv)
    for name in a.fn:
        fn, ref, ranges = FUNCTIONS[name]
        for lo, hi in ranges:
            worst, frac, n = measure(fn, ref, lo, hi, a.step)
            print(f"{name}: max error {worst} ulp, {frac * 100:.2f}% correctly rounded, over {n} float32 inputs "
                  f"in ({lo}, {hi}) (every {a.step}th bit pattern)", flush=True)


if __name__ == "__main__":
    main()
