"""Speed of the exact matmul policy.

    python -m benchmarks.exact            # CPU: torch._int_mm path vs F.linear and the strict k64 reference
    python -m benchmarks.exact --gpu      # CUDA: Triton int8 kernel vs cuBLAS bf16 (4096^3, M = 1..16)
    python -m benchmarks.exact --logprobs # CPU: token_logprobs with exact logits vs the strict chain vs stock
    python -m benchmarks.exact --prepared # CPU: hal.linear with a prepared weight (hal.exact_weight) vs
                                          #      slicing per call vs F.linear vs strict k64, cpu backend
    python -m benchmarks.exact --int-mm   # CPU: the two torch._int_mm ways to the slice products (one GEMM;
                                          #      a GEMM per diagonal t + u), prepared weight, vs F.linear fp32

Medians of repeated calls, same process, same inputs; ratios are what to compare. The weight's
slices are computed once (as a serving engine would, per weight) unless a row says otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import hal
from hal.kernels.exact import core
from hal.kernels.exact import cpu as exact_cpu
from hal.spec import ExactMatmulSpec, MatmulSpec


def median_time(fn, repeats=5, min_seconds=0.3, sync=lambda: None):
    fn()
    sync()
    times, start = [], time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_rows(k=4096, n=4096, strict_n=64):
    """Yields (shape, path, seconds, ratio vs F.linear fp32)."""
    g = torch.Generator().manual_seed(0)
    for m in (1, 128):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
        xf, wf = x.float(), w.float()
        t_lin = median_time(lambda: F.linear(xf, wf))
        yield (f"{m}x{k}x{n}", "F.linear fp32 (bf16 values)", t_lin, 1.0)
        t_lin16 = median_time(lambda: F.linear(x, w))
        yield (f"{m}x{k}x{n}", "F.linear bf16", t_lin16, t_lin16 / t_lin)
        for s in (3, 4):
            spec = ExactMatmulSpec(slices=s)
            ew = hal.exact_weight(w, spec=spec)
            t = median_time(lambda: exact_cpu.linear(x, ew, None, spec))
            yield (f"{m}x{k}x{n}", f"exact s{s} torch._int_mm", t, t / t_lin)
            t = median_time(lambda: exact_cpu.linear(x, w, None, spec), repeats=3)
            yield (f"{m}x{k}x{n}", f"exact s{s} torch._int_mm, weight sliced per call", t, t / t_lin)
        # the readable references are slow: time them on N = strict_n and scale to N linearly
        ws, scale = w[:strict_n], n / strict_n
        t_ref = median_time(lambda: hal.linear(x, ws, spec=ExactMatmulSpec(slices=3), backend="reference"), 1, 0) * scale
        yield (f"{m}x{k}x{n}", f"exact s3 reference (int64 matmuls; N={strict_n} x{scale:g})", t_ref, t_ref / t_lin)
        t_strict = median_time(lambda: hal.linear(x, ws, spec=MatmulSpec(), backend="reference"), 1, 0) * scale
        yield (f"{m}x{k}x{n}", f"strict k64 reference (N={strict_n} x{scale:g})", t_strict, t_strict / t_lin)


def prepared_rows(k=4096, n=4096):
    """hal.linear on the cpu backend (the user's path: validation, dispatch, compiled slicing of x,
    torch._int_mm products): a weight prepared once vs sliced in every call, against F.linear in the
    same dtype and the strict k64 default; plus the one-off hal.exact_weight time. Yields rows."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
        name = str(dtype).replace("torch.", "")
        prepared = {}
        for s in (3, 4):
            spec = ExactMatmulSpec(slices=s)
            t = median_time(lambda: hal.exact_weight(w, spec=spec, backend="cpu"), 3)
            prepared[s] = hal.exact_weight(w, spec=spec, backend="cpu")
            yield (f"{n}x{k} {name}", f"hal.exact_weight (one-off), s{s}", t, float("nan"))
        for m in (1, 128):
            x = torch.randn(m, k, generator=g).to(dtype)
            shape = f"{m}x{k}x{n} {name}"
            t_lin = median_time(lambda: F.linear(x, w))
            yield (shape, f"F.linear {name}", t_lin, 1.0)
            t = median_time(lambda: hal.linear(x, w, backend="cpu"), 3)
            yield (shape, "strict k64 (cpu backend, default spec)", t, t / t_lin)
            for s in (3, 4):
                spec = ExactMatmulSpec(slices=s)
                t = median_time(lambda: hal.linear(x, prepared[s], spec=spec, backend="cpu"))
                yield (shape, f"exact s{s}, prepared weight", t, t / t_lin)
                t = median_time(lambda: hal.linear(x, w, spec=spec, backend="cpu"), 3)
                yield (shape, f"exact s{s}, weight sliced per call", t, t / t_lin)


def interleaved_best(fns, rounds=4):
    """Best time of each of ``fns``, run in turn ``rounds`` times: a shared, loaded machine slows whichever path
    runs during a spike, so alternating the paths and keeping each one's best compares them fairly."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def int_mm_rows(rows=(1, 8, 32, 64, 128, 256, 512), sizes=(1024, 2048, 4096), s_values=(3, 4)):
    """The cpu backend's exact linear with a prepared weight (bf16), its slice products by each torch._int_mm way
    (kernels/exact/cpu.py: ``products_int_mm``, all pairs in one GEMM; ``diagonals_int_mm``, one GEMM per
    diagonal), against F.linear in float32 (MKL) on the same values. Compiled slicing of x, combine and the
    rounding included: the whole call. The two ways are timed in turn (``interleaved_best``); "(cpu backend)"
    marks the one kernels/cpu/exact_slice.diagonal_gemms_pay picks. The ratio column is each path against
    F.linear fp32 (its median). Yields rows."""
    from hal.kernels.cpu.exact_slice import diagonal_gemms_pay, slice_rows
    g = torch.Generator().manual_seed(0)
    for kn in sizes:
        w = (torch.randn(kn, kn, generator=g) * kn ** -0.5).bfloat16()
        wf = w.float()
        sliced = {s: slice_rows(w, s) for s in s_values}
        for m in rows:
            x = torch.randn(m, kn, generator=g).bfloat16()
            xf = x.float()
            shape = f"{m}x{kn}x{kn}"
            t_lin = median_time(lambda: F.linear(xf, wf))
            yield (shape, "F.linear fp32 (bf16 values)", t_lin, 1.0)
            for s in s_values:
                ways = (("one GEMM", exact_cpu.products_int_mm), ("diagonal GEMMs", exact_cpu.diagonals_int_mm))
                times = interleaved_best([lambda p=p: core.exact_linear(x, w, None, s, p, sliced[s], slicer=slice_rows)
                                          for _, p in ways])
                for (name, _), t in zip(ways, times):
                    chosen = diagonal_gemms_pay(m, kn) == (name == "diagonal GEMMs")
                    yield (shape, f"exact s{s} {name}{' (cpu backend)' if chosen else ''}", t, t / t_lin)


def logprob_rows(n=64, h=1024, v=8192):
    """token_logprobs on CPU (bf16 inputs): stock torch, the cpu backend's strict k64 chain (numba), the
    cpu backend's exact s4 logits (torch._int_mm; the weight is sliced inside every call)."""
    from hal.spec import TokenLogprobsSpec
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(n, h, generator=g).bfloat16()
    w = (torch.randn(v, h, generator=g) * 4 * h ** -0.5).bfloat16()
    tok = torch.randint(0, v, (n,), generator=g)
    shape = f"N={n} H={h} V={v}"
    t_stock = median_time(lambda: hal.token_logprobs(hid, w, tok, backend="stock"), 3)
    yield (shape, "token_logprobs stock (F.linear fp32 + log_softmax)", t_stock, 1.0)
    t = median_time(lambda: hal.token_logprobs(hid, w, tok, backend="cpu"), 3)
    yield (shape, "token_logprobs strict h64 (cpu backend)", t, t / t_stock)
    exact = TokenLogprobsSpec(matmul=ExactMatmulSpec(slices=4))
    t = median_time(lambda: hal.token_logprobs(hid, w, tok, spec=exact, backend="cpu"), 3)
    yield (shape, "token_logprobs exact s4 (cpu backend, weight sliced per call)", t, t / t_stock)
    ew = hal.exact_weight(w, spec=exact, backend="cpu")
    t = median_time(lambda: hal.token_logprobs(hid, ew, tok, spec=exact, backend="cpu"), 3)
    yield (shape, "token_logprobs exact s4 (cpu backend, LM head prepared once)", t, t / t_stock)
    t = median_time(lambda: hal.exact_weight(w, spec=exact, backend="cpu"), 3)
    yield (shape, "  hal.exact_weight of the LM head (one-off, s4)", t, t / t_stock)


def gpu_rows(s_values=(3, 4)):
    """CUDA rows: cuBLAS bf16 vs the exact Triton kernel (best of a few tile configs), plus a bit check.

    Not yet run on a GPU (no device in the session that wrote it): expect to adjust tile configs."""
    from hal.kernels.exact import triton_matmul as tx
    from hal.kernels.reference import exact_matmul as ref
    from hal.conformance.bits import first_divergence
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    out = []
    # bits: the GPU kernel (any config) gives the CPU reference's bits
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4096, generator=g).bfloat16()
    x[:, :6] *= 1000
    w = (torch.randn(256, 4096, generator=g) * 4096 ** -0.5).bfloat16()
    for s in s_values:
        spec = ExactMatmulSpec(slices=s)
        want = ref.linear(x, w, None, spec)
        for block, split in (((64, 64, 64), 1), ((16, 128, 128), 7), ((128, 64, 32), 3)):
            got = tx.exact_linear_triton(x.to(dev), w.to(dev), None, spec, block, split).cpu()
            d = first_divergence(f"s{s} {block} split {split}", want, got)
            out.append(("bits 64x4096x256 bf16", f"exact s{s} triton {block} split {split} vs CPU reference",
                        0.0, "identical" if d is None else str(d)))
    configs = {"big": [((128, 128, 64), 1, 8, 3), ((128, 128, 128), 1, 8, 3), ((128, 256, 64), 1, 8, 3),
                       ((64, 128, 128), 1, 4, 3)],
               "decode": [((16, 64, 128), 4, 4, 3), ((16, 128, 128), 2, 4, 3), ((16, 64, 256), 8, 4, 3),
                          ((16, 32, 128), 1, 2, 3)]}
    for m, k, n in [(4096, 4096, 4096)] + [(mm, 4096, 4096) for mm in (1, 2, 4, 8, 16)]:
        x = torch.randn(m, k, device=dev).bfloat16()
        w = (torch.randn(n, k, device=dev) * k ** -0.5).bfloat16()
        shape = f"{m}x{k}x{n}"
        t_cublas = median_time(lambda: F.linear(x, w), sync=sync)
        out.append((shape, "cuBLAS bf16 F.linear", t_cublas, 1.0))
        for s in s_values:
            spec = ExactMatmulSpec(slices=s)
            ew = hal.exact_weight(w, spec=spec, backend="triton")  # the triton backend's slicing kernel
            wd = ew.sliced
            da = core.slice_rows(x, s).digits
            best = None
            for block, split, warps, stages in configs["big" if m > 16 else "decode"]:
                try:
                    def kern():
                        tx.limbs(da, wd.digits, block, split, num_warps=warps, num_stages=stages)
                    t = median_time(kern, sync=sync)
                except Exception as e:  # a config that does not compile / fit here
                    out.append((shape, f"exact s{s} triton {block} split {split}", float("nan"), f"failed: {e}"[:120]))
                    continue
                if best is None or t < best[0]:
                    best = (t, block, split, warps, stages)
            t, block, split, warps, stages = best
            out.append((shape, f"exact s{s} triton kernel only {block} split {split} w{warps}", t, t / t_cublas))
            t_all = median_time(lambda: tx.exact_linear_triton(x, ew, None, spec, block, split,
                                                               num_warps=warps, num_stages=stages), sync=sync)
            out.append((shape, f"exact s{s} triton end to end (slice x, kernel, round)", t_all, t_all / t_cublas))
            t_glue = median_time(lambda: tx.exact_linear_triton(x, ew, None, spec, block, split, glue="torch",
                                                                num_warps=warps, num_stages=stages), sync=sync)
            out.append((shape, f"exact s{s} triton end to end, earlier torch glue", t_glue, t_glue / t_cublas))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--logprobs", action="store_true", help="token_logprobs rows (CPU) instead of linear")
    ap.add_argument("--prepared", action="store_true", help="hal.linear rows (cpu backend): prepared weight vs "
                    "sliced per call vs F.linear vs strict k64, fp32 and bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads for every path (0: torch's default)")
    ap.add_argument("--int-mm", action="store_true", help="the cpu backend's two torch._int_mm ways to the slice "
                    "products vs F.linear fp32, 1-512 rows, K = N = 1024-4096")
    ap.add_argument("--rows", type=int, nargs="*", help="--int-mm: these row counts instead")
    ap.add_argument("--sizes", type=int, nargs="*", help="--int-mm: these K = N instead")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = (gpu_rows() if args.gpu else logprob_rows() if args.logprobs else prepared_rows() if args.prepared
            else int_mm_rows(**{name: tuple(v) for name, v in (("rows", args.rows), ("sizes", args.sizes)) if v})
            if args.int_mm else cpu_rows())
    base = ("cuBLAS bf16" if args.gpu else "stock" if args.logprobs else "F.linear, same dtype" if args.prepared
            else "F.linear fp32")
    import os
    print(f"load average {os.getloadavg()} on {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    print(f"| shape | path | ms | vs {base} |")
    print("|---|---|---|---|")
    for shape, path, t, ratio in rows:
        r = ("" if ratio != ratio else f"{ratio:.2f}x") if isinstance(ratio, float) else ratio
        print(f"| {shape} | {path} | {t * 1e3:.3f} | {r} |", flush=True)
    print(f"load average {os.getloadavg()} at the end")


if __name__ == "__main__":
    main()
