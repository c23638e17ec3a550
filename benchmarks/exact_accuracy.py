"""Accuracy of the exact matmul policy against float64 (issue 13's table, reproduced and extended).

    python -m benchmarks.exact_accuracy            # 64 x 4096 x 256, ~1 min on 2 cores

Inputs: x [M, K] ~ N(0, 1) with six K-channels 1000x larger (the massive activations of LLM residual
streams; ``--no-outliers`` drops them), weight [N, K] ~ N(0, 1/K). Reported: median and max relative
error of the *unrounded* dot (the float64 round-to-odd value before the output rounding, i.e. the
accumulation error alone) against the float64 product of the same inputs, for the per-row policy
with s = 2, 3, 4 slices, for a per-K-block scale prototype (block 128; the block dots are exact, the
blocks are added in float64, whose error ~1e-16 is far below the figures measured), and for the
float32 ``F.linear`` of the same inputs. The triangular column keeps only the slice products with
t + u <= s - 1 (10 of the 16 at s = 4), the rest of the computation unchanged: a prototype of a
cheaper s = 4 (docs/exact_matmul.md says why it is not registered).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hal.kernels.exact import core
from hal.kernels.exact.cpu import products_int_mm


def make_inputs(m, k, n, dtype, outliers, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    if outliers:
        ch = torch.randperm(k, generator=g)[:6]
        x[:, ch] *= 1000.0
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * k ** -0.5
    return x.to(dtype), w.to(dtype)


def per_row(x, w, s):
    return core.dot_f64_odd(x, w, s, products_int_mm)[0]


def triangular_products(da, dw):
    """The slice products with t + u <= s - 1 only (the others zero): what the triangular variant keeps."""
    p = products_int_mm(da, dw)
    s = da.shape[0]
    keep = torch.tensor([[t + u <= s - 1 for u in range(s)] for t in range(s)])
    return p * keep[:, :, None, None]


def triangular(x, w, s):
    return core.dot_f64_odd(x, w, s, triangular_products)[0]


def per_block(x, w, s, block):
    """Prototype of an MX-style variant: one scale per row per K-block."""
    total = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], block):
        total = total + core.dot_f64_odd(x[:, k0:k0 + block], w[:, k0:k0 + block], s, products_int_mm)[0]
    return total


def rel(got, exact):
    r = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-300)).flatten()
    return r.median().item(), r.max().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="64x4096x256", help="MxKxN")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--no-outliers", action="store_true")
    args = ap.parse_args(argv)
    m, k, n = map(int, args.shape.split("x"))
    torch.set_num_threads(1)
    print(f"M x K x N = {m} x {k} x {n}, outliers: {not args.no_outliers}; median / max relative error "
          "of the dot vs float64")
    print("| inputs | " + " | ".join([f"s = {s}" for s in (2, 3, 4)]
                                     + [f"s = {s}, K-block {args.block}" for s in (2, 3)]
                                     + ["s = 4 triangular (t + u <= 3)"]) + " | fp32 `F.linear` |")
    print("|---" * 8 + "|")
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        x, w = make_inputs(m, k, n, dt, not args.no_outliers)
        exact = x.double() @ w.double().T
        cells = [rel(per_row(x, w, s), exact) for s in (2, 3, 4)]
        cells += [rel(per_block(x, w, s, args.block), exact) for s in (2, 3)]
        cells.append(rel(triangular(x, w, 4), exact))
        cells.append(rel(F.linear(x.float(), w.float()), exact))
        print(f"| {name} | " + " | ".join(f"{a:.1e} / {b:.1e}" for a, b in cells) + " |")


if __name__ == "__main__":
    main()
