"""The bits sweep (issue 49): which launch choices change an output of a bf16 / fp16 tensor-core dot on this GPU.

    python -m benchmarks.fast_bits_sweep --out OUT                      # CUDA (a stage of benchmarks/gpu_verify.sh)
    TRITON_INTERPRET=1 python -m benchmarks.fast_bits_sweep --tiny --out OUT   # CPU: the code path, tiny sizes

Then every launch of FastMatmulV3Spec's table (hal/spec.py FAST_MATMUL_V3_TABLE) against the reference launch: v3
claims they give the same bits (in the interpreter its stand-in follows v3's k16 rule for these rows).

One factor at a time from the reference launch (the v2 spec's: 128 x 128 x 64, 8 warps, 3 stages, one program
per tile, pointer loads): BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, a persistent grid, TMA loads and the
instruction family (BLOCK_M 32 takes Triton to ``mma.sync`` on sm_90: ``wgmma`` needs 64-row warp groups), every
launch compiled in parallel before any runs. Each row compares the kernel's **float32 accumulator** (the fast
matmul kernel with a float32 ``OUT_DTYPE``: the accumulator stored before any output rounding, which a bf16 output
would mostly hide) with the reference launch's, in raw bits, over >= 1M elements (1024 x 1024 outputs), on five
input classes, and reports how many elements differ:

* ``random``: normal values (B scaled by K^-1/2);
* ``cancellation``: A = [x, -x, t], B = [y; y; u] along K: the partial sums grow and cancel to a small t.u;
* ``mixed-exponents``: A's K columns scaled by powers of two spread over the dtype's range;
* ``k-not-multiple``: random, K = 4136 (not a multiple of 16, so of no BLOCK_K: a short last K tile);
* ``subnormals``: a quarter of A's values subnormal in the input dtype, the rest small normals, so products and
  partial sums sit near float32's subnormal range (bf16) or use subnormal inputs (fp16);
* ``negative-zero``: B > 0, every fourth row of A -0.0 (each product -0.0: IEEE's sum is -0.0, a chain from +0.0
  gives +0.0; ``negative_zero_outputs`` counts what the launch gave), every fourth +-0.0 mixed, the rest random.

Negative control: split-K over two programs (the reference launch on each half of K, the halves added in float32)
must differ from the reference on every input class and dtype, or the sweep FAILS (exit 1): a class on which it
is not caught could not show an order change either. A launch that errors (e.g. no TMA in this Triton) reports
the error; a row the budget did not reach prints "not run", never "same".

On CPU (the interpreter, ``--tiny``) every row's code runs at tiny sizes, but ``tl.dot`` there is lockstep's
stand-in (kernels/triton/interpreter_dot.py: a chain per K tile, then added), not a tensor core: its answer says
what the stand-in does, **nothing about a GPU**; the output says so. Rows go to OUT/bits_sweep.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

#: the launches of the sweep, one factor changed from the reference (the v2 default spec's launch) each
FACTORS = (("reference", {}), ("BLOCK_M 64", dict(block_m=64)), ("BLOCK_M 32 (mma.sync)", dict(block_m=32)),
           ("BLOCK_N 64", dict(block_n=64)), ("BLOCK_K 32", dict(block_k=32)), ("BLOCK_K 128", dict(block_k=128)),
           ("num_warps 4", dict(num_warps=4)), ("num_stages 2", dict(num_stages=2)),
           ("num_stages 4", dict(num_stages=4)), ("persistent grid", dict(persistent=True)),
           ("TMA loads", dict(tma=True)))
CLASSES = ("random", "cancellation", "mixed-exponents", "k-not-multiple", "subnormals", "negative-zero")
DTYPES = (torch.bfloat16, torch.float16)
CONTROL = "negative control: split-K over two programs"
INTERPRETER_NOTE = ("interpreter stand-in for tl.dot (a chain per K tile; per k16 step for the v3 rows): these rows "
                    "exercise the code path; they "
                    "say nothing about which launch choices change bits on a GPU")


@dataclass(frozen=True)
class Sizes:
    m: int
    n: int
    k: int
    k_odd: int


GPU_SIZES = Sizes(m=1024, n=1024, k=4096, k_odd=4136)
TINY_SIZES = Sizes(m=70, n=40, k=256, k_odd=200)  # >= 4 K tiles: a split-K sum differs from the chain


def reference_launch():
    from hal.kernels.triton.fast_matmul import launch_of_spec
    from hal.spec import FastMatmulSpec
    return launch_of_spec(FastMatmulSpec())


def launches() -> list[tuple[str, object]]:
    ref = reference_launch()
    return [(name, replace(ref, **change)) for name, change in FACTORS]


def table_launches() -> list[tuple[str, object]]:
    """FastMatmulV3Spec's launches, each a row against the reference launch (v3's claim: none changes a bit)."""
    from hal.kernels.triton.fast_matmul import table_launches as table
    return [(f"v3 table: {name}", lt) for name, lt in table()]


def make_inputs(cls: str, sizes: Sizes, dtype, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [M, K], weight [N, K]) of one input class, made in float32 on the host (seeded), then cast."""
    g = torch.Generator().manual_seed(seed * 101 + CLASSES.index(cls))
    m, n = sizes.m, sizes.n
    k = sizes.k_odd if cls == "k-not-multiple" else sizes.k
    a = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    if cls == "cancellation":
        third = k // 3
        x, y = a[:, :third], w[:, :third]
        tail = k - 2 * third
        a = torch.cat([x, -x, a[:, :tail] * 2.0 ** -8], 1)
        w = torch.cat([y, y, w[:, :tail]], 1)
    elif cls == "mixed-exponents":
        spread = 20 if dtype == torch.bfloat16 else 6  # fp16: inputs stay in its range
        a = a * torch.exp2(torch.randint(-spread, spread + 1, (1, k), generator=g).float())
    elif cls == "subnormals":
        tiny = torch.finfo(dtype).tiny  # the smallest normal: values below it are subnormal
        sub = torch.rand(m, k, generator=g) < 0.25
        if dtype == torch.bfloat16:  # products near float32's subnormals: partial sums keep rounding there
            a = torch.where(sub, torch.rand(m, k, generator=g) * tiny, a * tiny * 16)
        else:  # fp16 subnormal inputs; products are float32 normals
            a = torch.where(sub, torch.rand(m, k, generator=g) * tiny, a)
    elif cls == "negative-zero":
        w = w.abs()  # every product of a -0.0 row is -0.0: IEEE's sum is -0.0, a chain from +0.0 gives +0.0
        a[::4] = -0.0
        a[2::4] = torch.where(torch.rand(a[2::4].shape, generator=g) < 0.5, -0.0, 0.0)
    return a.to(dtype).to(device), w.to(dtype).to(device)


def accumulator(a, w, lt, k_step=None) -> torch.Tensor:
    """The fast matmul kernel's float32 accumulator of a @ w.T under launch ``lt`` (``k_step``: the interpreter
    stand-in's rule, v2's per K tile or v3's per k16 step; nothing on a GPU)."""
    from hal.kernels.triton import fast_matmul as fm
    return fm.run_launch(a, w.t(), None, lt, torch.float32, k_step=k_step)


def split_k_accumulator(a, w, lt) -> torch.Tensor:
    """The negative control: the reference launch on each half of K (split at a K-tile boundary), then added."""
    k = a.shape[1]
    h = max(1, -(-k // lt.block_k) // 2) * lt.block_k
    first = accumulator(a[:, :h].contiguous(), w[:, :h].contiguous(), lt)
    second = accumulator(a[:, h:].contiguous(), w[:, h:].contiguous(), lt)
    return first + second


def differing(expected: torch.Tensor, got: torch.Tensor) -> int:
    from hal.conformance.bits import raw_bits
    return int((raw_bits(expected) != raw_bits(got)).sum())


def instruction_family(compiled) -> str:
    """What the launch's PTX runs its dot on: wgmma, mma.sync, or neither (a compiled kernel from warmup)."""
    ptx = (getattr(compiled, "asm", None) or {}).get("ptx", "")
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "no tensor-core instruction" if ptx else "unknown (no PTX)"


def compile_all(todo, sizes: Sizes, device, say, dtype) -> dict:
    """{(launch label, dtype, K): compiled kernel or error text}: every launch of one dtype compiled before any of
    its rows runs (bf16 first: if the budget ends during fp16's compiles, bf16's rows are in), in parallel where this
    Triton has AsyncCompileMode (else one after the other, said)."""
    from concurrent.futures import ThreadPoolExecutor

    from hal.kernels.triton import fast_matmul as fm
    keys = [(lt, dtype, k) for _, lt in todo for k in sorted({sizes.k, sizes.k_odd})]
    t0 = time.perf_counter()

    def warm(lt, dtype, k):
        a = torch.zeros(sizes.m, k, dtype=dtype, device=device)
        w = torch.zeros(sizes.n, k, dtype=dtype, device=device)
        return fm.run_launch(a, w.t(), None, lt, torch.float32, warmup=True)
    got = {}
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None
    if AsyncCompileMode is not None:
        futures = {}
        with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool, AsyncCompileMode(pool,
                                                                                                ignore_errors=True):
            for lt, dtype, k in keys:
                try:
                    futures[(lt.label, dtype, k)] = warm(lt, dtype, k)
                except Exception as e:  # a launch this Triton cannot build (e.g. TMA): its rows say so
                    got[(lt.label, dtype, k)] = f"{type(e).__name__}: {e}"[:300]
        for key, fut in futures.items():
            try:
                got[key] = fut.result() if hasattr(fut, "result") else fut
            except Exception as e:
                got[key] = f"{type(e).__name__}: {e}"[:300]
        how = "in parallel (AsyncCompileMode)"
    else:
        for lt, dtype, k in keys:
            try:
                got[(lt.label, dtype, k)] = warm(lt, dtype, k)
            except Exception as e:
                got[(lt.label, dtype, k)] = f"{type(e).__name__}: {e}"[:300]
        how = "one after the other (this Triton has no AsyncCompileMode)"
    say(f"compiled {len(keys)} launches x K for {dtype} {how} in {time.perf_counter() - t0:.1f} s")
    return got


def run(sizes: Sizes, device: str, deadline: float, out_path: str | None, say=print) -> tuple[list[dict], bool]:
    """(rows, negative control caught on every class and dtype). Rows not reached before ``deadline``: "not run"."""
    cuda = device.startswith("cuda")
    todo, table = launches(), table_launches()
    compiled = {}
    rows = []

    def emit(row):
        row = {"where": "gpu" if cuda else INTERPRETER_NOTE, **row}
        rows.append(row)
        if out_path:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    caught_everywhere = True
    for dtype in DTYPES:
        dname = str(dtype).replace("torch.", "")
        if cuda and time.monotonic() < deadline:
            try:
                compiled.update(compile_all(todo + table, sizes, device, say, dtype))
            except Exception as e:  # the rows then compile at their first call (and say "family unknown")
                say(f"compiling {dname}'s launches ahead failed ({type(e).__name__}: {e}); each compiles at its "
                    "first run")
        for cls in CLASSES:
            if time.monotonic() > deadline:
                for name, lt in todo + table + [(CONTROL, None)]:
                    emit({"launch": name, "label": getattr(lt, "label", ""), "dtype": dname, "class": cls,
                          "result": "not run (budget spent)"})
                caught_everywhere = False  # an unreached class is not a caught one
                continue
            a, w = make_inputs(cls, sizes, dtype, device)
            ref_lt = todo[0][1]
            try:
                ref = accumulator(a, w, ref_lt)
            except Exception as e:
                emit({"launch": "reference", "label": ref_lt.label, "dtype": dname, "class": cls,
                      "result": f"error: {type(e).__name__}: {e}"[:300]})
                caught_everywhere = False
                continue
            base = {"dtype": dname, "class": cls, "elements": ref.numel(), "K": a.shape[1]}
            # v3's rows: the interpreter's stand-in follows v3's k16 rule for them (the same kernels on a GPU)
            ref_v3 = accumulator(a, w, ref_lt, k_step=16) if not cuda else ref
            for name, lt in todo + table:
                c = compiled.get((lt.label, dtype, a.shape[1]))
                row = {"launch": name, "label": lt.label, **base,
                       "family": ("interpreter" if not cuda else "unknown (not compiled ahead)" if c is None else
                                  f"compile failed: {c}" if isinstance(c, str) else instruction_family(c))}
                v3 = name.startswith("v3 table")
                try:
                    got = accumulator(a, w, lt, k_step=16 if v3 else None)
                    n = differing(ref_v3 if v3 else ref, got)
                    row.update(differing=n, negative_zero_outputs=negative_zeros(got),
                               result="same" if n == 0 else f"DIFFER in {n} of {ref.numel()}")
                except Exception as e:
                    row["result"] = f"error: {type(e).__name__}: {e}"[:300]
                emit(row)
            n = differing(ref, split_k_accumulator(a, w, ref_lt))
            caught_everywhere &= n > 0
            emit({"launch": CONTROL, "label": ref_lt.label, **base, "differing": n,
                  "result": f"caught: DIFFER in {n} of {ref.numel()}" if n else "NOT CAUGHT (the sweep fails)"})
    return rows, caught_everywhere


def negative_zeros(t: torch.Tensor) -> int:
    """How many float32 outputs are -0.0 (bits 0x80000000)."""
    from hal.conformance.bits import raw_bits
    return int((raw_bits(t) == -0x80000000).sum())


def table(rows: list[dict]) -> str:
    """One line per launch: per dtype x class, '.' same, a count of differing elements, 'E' error, '?' not run."""
    cols = [(d, c) for d in ("bfloat16", "float16") for c in CLASSES]
    by = {}
    for r in rows:
        res = r["result"]
        cell = ("." if res == "same" else str(r["differing"]) if "differing" in r else
                "?" if res.startswith("not run") else "E")
        by.setdefault((r["launch"], r.get("label", "")), {})[(r["dtype"], r["class"])] = cell
    head = f"{'launch':<64}" + " ".join(f"{d[:4]}:{c[:6]:<6}" for d, c in cols)
    lines = [head]
    for (name, label), cells in by.items():
        lines.append(f"{name + ' ' + label:<64}" + " ".join(f"{cells.get(k, '-'):>11}" for k in cols))
    lines.append("'.' same bits as the reference launch; a number: elements whose float32 accumulator differs; "
                 "E error (jsonl: why); ? not run")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fast_bits_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu-verify-out")
    p.add_argument("--tiny", action="store_true", help="CPU: the interpreter at tiny sizes (the code path only)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds; classes not reached print 'not run'")
    args = p.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.tiny != interpret:
        p.error("--tiny runs in the interpreter (TRITON_INTERPRET=1); without --tiny: CUDA, TRITON_INTERPRET unset")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here (the CPU code path: TRITON_INTERPRET=1 ... --tiny)")
    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "bits_sweep.jsonl")
    device = "cpu" if args.tiny else "cuda"
    import triton
    where = INTERPRETER_NOTE if args.tiny else torch.cuda.get_device_name()
    print(f"bits sweep [triton {triton.__version__}, {where}]", flush=True)
    rows, caught = run(TINY_SIZES if args.tiny else GPU_SIZES, device, time.monotonic() + args.budget, out_path,
                       say=lambda s: print(s, flush=True))
    print(table(rows))
    if args.tiny:
        print(f"NOTE: {INTERPRETER_NOTE}")
    print("bits sweep: negative control caught on every class and dtype" if caught else
          "bits sweep FAILED: the negative control was not caught (or not run) on some class: see the table")
    return 0 if caught else 1


if __name__ == "__main__":
    sys.exit(main())
