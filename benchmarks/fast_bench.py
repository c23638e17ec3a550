"""The fast policy (tensor cores) on a GPU: matmul speed vs cuBLAS, attention prefill vs flash-attn / SDPA,
and matmul batch invariance in raw bits.

    python -m benchmarks.fast_bench --csv fast.csv          # CUDA (H200: < 1 minute)

Speed rows: ``hal.linear(x, w, spec=FastMatmulSpec())`` vs ``F.linear`` (cuBLAS) on bf16, 4096^3 and
decode shapes M = 1..16 (K = N = 4096); ratio = cuBLAS time / fast time (target from issue #8:
>= 0.8 on 4096^3), CUDA events, median (benchmarks/triton_bench.time_call), and the share of the bf16
dense tensor-core peak (--bf16-peak, H200 ~989 TFLOP/s). Bits rows: each of a few rows computed alone
and at several positions of batches of 1..4096 rows must give the same raw bits (L1 on the device), under v2 and
under v3 (whose launch follows the row count: the device's answer to its hypothesis);
cuBLAS runs the same comparison as the negative control (its kernel choice follows M).
Attention rows: causal varlen prefill (4k and 8k tokens, GQA 32/8, D 128) under FastAttentionSpec() vs
flash-attn's flash_attn_varlen_func when importable, else SDPA (target: >= 0.7x flash attention); the
"cublas_s" column then holds the reference kernel's time.
Refuses to run without CUDA (exit 2): the interpreter measures nothing about speed.

    python -m benchmarks.fast_bench --bits-only --csv OUT/fast_bench.csv           # the verification call's rows
    TRITON_INTERPRET=1 python -m benchmarks.fast_bench --bits-only --tiny --csv X  # CPU: the rows' code path

``--bits-only``: the raw-bit rows alone (benchmarks/gpu_verify.sh); ``--tiny`` runs them in the interpreter at K = N
= 64 and batches of 1..40 rows: the code path only (the interpreter's tl.dot is lockstep's stand-in; it answers
nothing about a GPU, and its stock "negative control" may well be batch-invariant on a CPU).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F

import hal
from hal.conformance.bits import first_divergence
from hal.spec import FastAttentionSpec, FastMatmulSpec, FastMatmulV3Spec

from .harness import randn
from .triton_bench import time_call

SPEED_SHAPES = [(4096, 4096, 4096), (1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096), (8192, 4096, 14336)]
BATCHES = (1, 7, 16, 64, 333, 4096)
TINY_BATCHES = (1, 7, 16, 40)


def _speed(spec, repeats, max_seconds, peak):
    out = []
    for m, k, n in SPEED_SHAPES:
        x, w = randn((m, k), torch.bfloat16, "cuda", 1), randn((n, k), torch.bfloat16, "cuda", 2, k ** -0.5)
        t_fast = time_call(lambda: hal.linear(x, w, spec=spec, backend="triton"), "cuda", 3, repeats, max_seconds)
        t_cublas = time_call(lambda: F.linear(x, w), "cuda", 3, repeats, max_seconds)
        share = 2.0 * m * k * n / t_fast / peak
        out.append({"kind": "speed", "shape": f"M{m} K{k} N{n} bf16", "fast_s": f"{t_fast:.6g}",
                    "cublas_s": f"{t_cublas:.6g}", "speed_vs_cublas": f"{t_cublas / t_fast:.3g}",
                    "bf16_peak_share": f"{share:.3g}", "result": ""})
        print(f"linear fast  M{m:<5} K{k} N{n:<6} fast {t_fast * 1e3:8.3f} ms  cuBLAS {t_cublas * 1e3:8.3f} ms  "
              f"speed {t_cublas / t_fast:5.3f}x  bf16-peak {share:.2f}", flush=True)
    return out


def _attention(spec, repeats, max_seconds, peak):
    """Causal prefill (varlen, one sequence) vs flash-attn when importable, else SDPA (flash backend)."""
    try:
        from flash_attn import flash_attn_varlen_func as fa_varlen
        ref_name = "flash-attn"
    except ImportError:
        fa_varlen, ref_name = None, "SDPA"
    out = []
    for n, hq, hkv, d in ((4096, 32, 8, 128), (8192, 32, 8, 128)):
        q = randn((n, hq, d), torch.bfloat16, "cuda", 5)
        k, v = (randn((n, hkv, d), torch.bfloat16, "cuda", s) for s in (6, 7))
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        fast = lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True, spec=spec,  # noqa: E731
                                                  backend="triton")
        if fa_varlen is not None:
            ref = lambda: fa_varlen(q, k, v, cu, cu, n, n, causal=True)  # noqa: E731
        else:
            qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            ref = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)  # noqa: E731
        t_fast = time_call(fast, "cuda", 3, repeats, max_seconds)
        t_ref = time_call(ref, "cuda", 3, repeats, max_seconds)
        share = 2.0 * 2 * n * n * hq * d / 2 / t_fast / peak  # causal: half of QK^T and PV
        out.append({"kind": f"attention prefill vs {ref_name}", "shape": f"N{n} Hq{hq} Hkv{hkv} D{d} causal bf16",
                    "fast_s": f"{t_fast:.6g}", "cublas_s": f"{t_ref:.6g}", "speed_vs_cublas": f"{t_ref / t_fast:.3g}",
                    "bf16_peak_share": f"{share:.3g}", "result": ""})
        print(f"attention prefill N{n} Hq{hq} Hkv{hkv} D{d}  fast {t_fast * 1e3:8.3f} ms  {ref_name} "
              f"{t_ref * 1e3:8.3f} ms  speed {t_ref / t_fast:5.3f}x  bf16-peak {share:.2f}", flush=True)
    return out


def _bits(spec, device="cuda", k=4096, batches=BATCHES):
    """Rows 0..2 of x alone, and inside batches of every size in ``batches`` at two positions: same bits."""
    n = k
    x, w = randn((max(batches), k), torch.bfloat16, device, 3), randn((n, k), torch.bfloat16, device, 4, k ** -0.5)
    probe = x[:3]
    out = []
    control = "cuBLAS (negative control)" if device == "cuda" else "torch CPU F.linear (no control on CPU)"
    specs = [spec, FastMatmulV3Spec()]  # v3: rows alone take its decode launch, batches its larger ones
    fast = [(f"fast {sp.id}", lambda a, sp=sp: hal.linear(a, w, spec=sp, backend="triton")) for sp in specs]
    for name, fn in fast + [(control, lambda a: F.linear(a, w))]:
        alone = fn(probe)
        div = None
        for b in batches:
            for at in sorted({0, max(0, b - 3)}):
                batch = x[:b].clone()
                batch[at:at + 3] = probe[: min(3, b - at)]
                got = fn(batch)[at:at + 3]
                div = div or first_divergence(f"rows-in-batch-{b}-at-{at}", alone[: got.shape[0]], got)
        res = "same bits" if div is None else f"DIFFERS: {div}"
        print(f"batch invariance {name:<40} {res}", flush=True)
        out.append({"kind": "bits", "shape": f"{name}: rows alone vs in batches {batches}", "result": res})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", default="bench-results/fast_bench.csv")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=2.0)
    p.add_argument("--bf16-peak", type=float, default=989e12, help="bf16 dense tensor-core peak (H200 ~989e12)")
    p.add_argument("--bits-only", action="store_true", help="the raw-bit rows alone (no speed rows)")
    p.add_argument("--tiny", action="store_true", help="with --bits-only: the interpreter at tiny sizes (code path)")
    args = p.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.tiny and not (args.bits_only and interpret):
        print("--tiny runs the bits rows (--bits-only) in the interpreter (TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if not args.tiny and (not torch.cuda.is_available() or interpret):
        print("fast_bench needs a CUDA GPU and TRITON_INTERPRET unset (the interpreter measures no speed)",
              file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    spec = FastMatmulSpec()
    where = "the interpreter (code path only: no GPU answer)" if args.tiny else torch.cuda.get_device_name()
    print(f"spec {spec.id} on {where}", flush=True)
    rows = _bits(spec, "cpu", 64, TINY_BATCHES) if args.tiny else _bits(spec)
    if not args.bits_only:
        rows += _speed(spec, args.repeats, args.max_seconds, args.bf16_peak)
        try:
            rows += _attention(FastAttentionSpec(), args.repeats, args.max_seconds, args.bf16_peak)
        except Exception as e:  # the matmul rows stand on their own
            print(f"attention rows failed: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append({"kind": "attention prefill", "result": f"error: {type(e).__name__}: {str(e)[:200]}"})
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    fields = ["kind", "shape", "fast_s", "cublas_s", "speed_vs_cublas", "bf16_peak_share", "result"]
    with open(args.csv, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=fields + ["device", "torch", "triton"])
        wr.writeheader()
        env = {"device": where, "torch": torch.__version__,
               "triton": __import__("triton").__version__}
        for r in rows:
            wr.writerow({**{k: r.get(k, "") for k in fields}, **env})
    print(f"wrote {args.csv} ({len(rows)} rows)")
    bits = {r["shape"].split(": rows")[0]: r["result"] for r in rows if r["kind"] == "bits"}
    fast = [v for k, v in bits.items() if k.startswith("fast ")]
    failed = len(fast) != 2 or any(v != "same bits" for v in fast)  # v2's claim; v3's hypothesis
    if not args.tiny and bits.get("cuBLAS (negative control)") == "same bits":  # the check must be able to fail
        print("FAILED: the negative control (cuBLAS) gave the same bits in every batch: the check caught nothing")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
