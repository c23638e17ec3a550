"""Per-call host overhead of the triton backend on small shapes (issue 8), for a GPU run.

    python -m benchmarks.triton_host_overhead --csv host.csv            # CUDA (about a minute)
    TRITON_INTERPRET=1 python -m benchmarks.triton_host_overhead --device cpu --quick   # smoke test only

For each small-shape call (decode GEMV, rms_norm, softmax, silu_mul, rotary, decode / varlen attention)
it reports, as medians over the repeats after warm-up:

* ``wall_us``: host wall time of one call, synchronised before and after (what a Python loop pays);
* ``host_us``: host time until the call returns, without the final sync (dispatch, validation,
  allocations, launches: the part that CUDA graphs or a leaner host path remove);
* ``gpu_us``: CUDA-event time of the same call (the kernels; includes launch gaps between them);
* ``graph_us``: per-replay wall time of the call captured in a CUDA graph (no host work, "-" when the
  call cannot be captured, e.g. it reads a value back to the host);
* ``stock_wall_us``: the stock torch call's wall time, for scale.

A call whose ``host_us`` is far above ``gpu_us`` is host-bound. On CPU (interpreter) only wall time
means anything; the other columns are "-".

    TRITON_INTERPRET=1 python -m benchmarks.triton_host_overhead --device cpu --stub-kernels

measures lockstep's own host work without a GPU: the full-size calls on CPU tensors with every Triton
kernel launch replaced by a no-op (outputs are garbage), reporting per call ``host_us`` (hal's dispatch
and validation and the wrappers' Python and tensor set-up; Triton's own launch path is not included),
``torch_ops`` (torch operations the call runs, views included: on CUDA each costs host time too, a few
microseconds for the ones that launch a kernel) and ``launches`` (Triton kernels launched).

    python -m benchmarks.triton_host_overhead --graph --csv graph.csv      # CUDA only (on CPU it says so)
    TRITON_INTERPRET=1 python -m benchmarks.triton_host_overhead --graph --dry-run   # CPU: the plumbing only

graph replay at the decode target shapes (GEMV 1x4096x4096, rms_norm of 1 and 8 rows, token_logprobs of 8 rows
over a 32000 vocab, paged decode attention: 8 sequences, 32/8 heads, D 128, pages of 16, 4096-key capacity):
each call is made once through hal (which validates it), its launch path (``backends.triton.launch_path``)
is captured in a ``torch.cuda.CUDAGraph`` under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync
raises), replayed, and its output compared in raw bits with the eager call's. Per call, over back-to-back
loops synchronised once at the end: ``eager_us`` (the hal call), ``path_us`` (the launch path alone, eager)
and ``graph_us`` (one replay); ``bits`` is "same" or where replay and eager first differ. ``--dry-run`` runs
the same plumbing at tiny shapes on CPU (interpreter; no capture, no timing).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import hal
from benchmarks.harness import host_seconds, median_seconds, randn, write_csv
from hal.conformance.bits import first_divergence


def cases(device: str, quick: bool) -> list[tuple[str, Callable, Callable]]:
    bf = torch.bfloat16
    tri, sto = dict(backend="triton"), dict(backend="stock")
    h, v, hq, hkv, d = (64, 64, 2, 1, 32) if quick else (4096, 4096, 32, 8, 128)
    x1 = randn((1, h), bf, device, 1)
    w = randn((v, h), bf, device, 2, 0.02)
    nw = randn((h,), bf, device, 3)
    logits = randn((4, 512 if quick else 32000), bf, device, 4)
    gate, up = randn((4, h), bf, device, 5), randn((4, h), bf, device, 6)
    pos = torch.arange(4, device=device)
    q1 = randn((4, 8, hq, d), bf, device, 7)
    cos, sin = hal.rotary_cos_sin(pos, d, backend="triton")
    cos4, sin4 = cos[None, :, None, :].expand(4, 4, 1, d // 2), sin[None, :, None, :].expand(4, 4, 1, d // 2)
    q1 = q1[:, :4]
    cap = 64 if quick else 4096
    kc, vc = randn((4, cap, hkv, d), bf, device, 8), randn((4, cap, hkv, d), bf, device, 9)
    lens = torch.full((4,), cap // 2, dtype=torch.int32, device=device)
    qd = randn((4, 1, hq, d), bf, device, 10)
    cu = torch.tensor([0, 5, 9, 17], dtype=torch.int32, device=device)
    qv, kv = randn((17, hq, d), bf, device, 11), randn((17, hkv, d), bf, device, 12)
    return [
        ("linear decode GEMV", lambda: hal.linear(x1, w, **tri), lambda: F.linear(x1, w)),
        ("rms_norm 1 row", lambda: hal.rms_norm(x1, nw, 1e-6, **tri), lambda: hal.rms_norm(x1, nw, 1e-6, **sto)),
        ("softmax 4 rows", lambda: hal.softmax(logits, **tri), lambda: torch.softmax(logits, -1)),
        ("silu_mul 4 rows", lambda: hal.silu_mul(gate, up, **tri), lambda: F.silu(gate) * up),
        ("rotary_cos_sin 4 positions", lambda: hal.rotary_cos_sin(pos, d, **tri), lambda: None),
        ("apply_rotary 4x4 tokens", lambda: hal.apply_rotary(q1, cos4, sin4, **tri), lambda: None),
        ("attention decode kvcache", lambda: hal.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, **tri),
         lambda: None),
        ("attention varlen 3 seqs", lambda: hal.flash_attn_varlen_func(qv, kv, kv, cu, cu, 8, 8, causal=True, **tri),
         lambda: None),
    ]


def _median_us(fn, reps: int, sync) -> float:
    """Median host microseconds of a call, the device synchronised before and after each (what a loop pays)."""
    def wall():
        sync()
        return host_seconds(lambda: (fn(), sync()))
    return statistics.median(wall() for _ in range(reps)) * 1e6


def measure(name, ours, stock, cuda: bool, reps: int) -> dict:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):  # compile and warm caches
        ours()
    sync()
    row = {"op": name, "wall_us": f"{_median_us(ours, reps, sync):.1f}"}
    if cuda:
        sync()
        row["host_us"] = f"{median_seconds(ours, reps, cuda=False, warmup=0) * 1e6:.1f}"  # no sync: host side only
        row["gpu_us"] = f"{median_seconds(ours, reps, cuda=True, warmup=0) * 1e6:.1f}"
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ours()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ours()
            graph.replay()
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            sync()
            row["graph_us"] = f"{(time.perf_counter() - t0) / reps * 1e6:.1f}"
        except Exception as e:  # e.g. a host read-back inside the call
            row["graph_us"] = f"- ({type(e).__name__})"
    else:
        row.update(host_us="-", gpu_us="-", graph_us="-")
    row["stock_wall_us"] = "-"
    if stock() is not None:
        row["stock_wall_us"] = f"{_median_us(stock, reps, sync):.1f}"
    return row


class _Stubbed:
    """Triton kernel launches become no-ops (counted) and torch operations are counted, while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction
        counter = self
        self.launches = self.torch_ops = 0

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.torch_ops += 1
                return func(*args, **(kwargs or {}))

        def no_launch(fn, grid):
            def run(*args, **kwargs):
                counter.launches += 1
            return run
        self._cls, self._real = InterpretedFunction, InterpretedFunction.__getitem__
        InterpretedFunction.__getitem__ = no_launch
        self._mode = Count()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._cls.__getitem__ = self._real


def measure_stubbed(name, ours, stock, reps: int) -> dict:
    """lockstep's host work per call with the kernels stubbed out (CPU tensors, interpreter kernels)."""
    from triton.runtime.interpreter import InterpretedFunction
    real = InterpretedFunction.__getitem__
    InterpretedFunction.__getitem__ = lambda fn, grid: (lambda *a, **k: None)
    try:
        host = median_seconds(ours, reps, cuda=False, warmup=3) * 1e6  # warm-up: imports, lookups
    finally:
        InterpretedFunction.__getitem__ = real
    with _Stubbed() as counts:
        ours()
    row = {"op": name, "host_us": f"{host:.1f}", "torch_ops": counts.torch_ops, "launches": counts.launches,
           "stock_wall_us": "-"}
    if stock() is not None:
        row["stock_wall_us"] = f"{median_seconds(stock, reps, cuda=False, warmup=3) * 1e6:.1f}"
    return row


def graph_cases(device: str, tiny: bool) -> list[tuple[str, Callable]]:
    """(name, hal call) at the decode target shapes (tiny: interpreter-sized)."""
    bf = torch.bfloat16
    tri = dict(backend="triton")
    h, vocab, rows, bsz, hq, hkv, d, page, cap = ((64, 300, 3, 2, 4, 2, 32, 16, 64) if tiny else
                                                  (4096, 32000, 8, 8, 32, 8, 128, 16, 4096))
    x1, x8 = randn((1, h), bf, device, 1), randn((rows, h), bf, device, 2)
    w = randn((h, h), bf, device, 3, 0.02)
    nw = randn((h,), bf, device, 4)
    head = randn((vocab, h), bf, device, 5, 0.02)
    tokens = torch.arange(rows, device=device) * 7 % vocab
    per_seq = cap // page
    pages = bsz * per_seq
    kc, vc = randn((pages, page, hkv, d), bf, device, 6), randn((pages, page, hkv, d), bf, device, 7)
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(8)).to(torch.int32).reshape(bsz, per_seq)
    table = table.to(device)
    lens = torch.tensor([cap // 2 + 37 * i for i in range(bsz)], dtype=torch.int32, device=device).clamp_max(cap)
    qd = randn((bsz, 1, hq, d), bf, device, 9)
    return [
        ("linear decode GEMV", lambda: hal.linear(x1, w, **tri)),
        ("rms_norm 1 row", lambda: hal.rms_norm(x1, nw, 1e-6, **tri)),
        (f"rms_norm {rows} rows", lambda: hal.rms_norm(x8, nw, 1e-6, **tri)),
        (f"token_logprobs {rows} rows", lambda: hal.token_logprobs(x8, head, tokens, **tri)),
        ("attention paged decode", lambda: hal.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                                                      block_table=table, **tri)),
    ]


def _per_call_us(fn, reps: int) -> float:
    """Microseconds per call of ``reps`` back-to-back calls, the device synchronised once before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def _bits(label, eager, replayed) -> str:
    d = first_divergence(label, eager, replayed)
    return "same" if d is None else f"DIFFER: {d}"


def measure_graph(name, call, reps: int, dry_run: bool) -> dict:
    """The call's launch path captured under sync-debug "error", replayed, its bits checked against eager."""
    from hal.backends.triton import launch_path
    recorded, eager = launch_path(call)
    ops = " ".join(recorded.ops)

    def path():
        return _outputs(recorded())
    if dry_run:  # CPU: the recorded path repeats the eager call's bits
        return {"op": name, "ops": ops, "bits": _bits(name, eager, path()), "eager_us": "-", "path_us": "-",
                "graph_us": "-"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (compiles, workspaces), as torch's docs ask
        for _ in range(3):
            path()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _sync_is_an_error():
        path()  # the eager launch path syncs nowhere either
    with torch.cuda.graph(graph):  # (entering and leaving synchronise on purpose: outside the debug mode)
        with _sync_is_an_error():
            out = path()
    graph.replay()
    torch.cuda.synchronize()
    row = {"op": name, "ops": ops, "bits": _bits(name, eager, out)}
    row["eager_us"] = f"{_per_call_us(call, reps):.1f}"
    row["path_us"] = f"{_per_call_us(path, reps):.1f}"
    row["graph_us"] = f"{_per_call_us(graph.replay, reps):.1f}"
    graph.replay()
    torch.cuda.synchronize()
    if row["bits"] == "same":  # a later replay too
        row["bits"] = _bits(name, eager, out)
    return row


@contextlib.contextmanager
def _sync_is_an_error():
    """Any host synchronisation inside raises (torch.cuda.set_sync_debug_mode, torch >= 1.10)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _outputs(x):
    """The first tensor of a result (attention returns (out, lse) from the backend)."""
    return x[0] if isinstance(x, tuple) else x


def run_graph(args, p) -> int:
    cuda = args.device.startswith("cuda")
    if args.dry_run:
        if cuda or not os.environ.get("TRITON_INTERPRET"):
            p.error("--graph --dry-run needs --device cpu and TRITON_INTERPRET=1")
    elif not (cuda and torch.cuda.is_available()):
        print("graph replay needs CUDA (torch.cuda.CUDAGraph): nothing measured on this machine; "
              "--dry-run checks the plumbing on CPU", flush=True)
        return 0
    rows = []
    for name, call in graph_cases(args.device, args.dry_run):
        try:
            rows.append(measure_graph(name, call, args.reps or 200, args.dry_run))
        except Exception as e:  # report and go on
            rows.append({"op": name, "bits": f"error: {type(e).__name__}: {e}"})
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if args.csv:
        write_csv(args.csv, rows, ["op", "ops", "bits", "eager_us", "path_us", "graph_us"])
    return 0 if all(r.get("bits") == "same" for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.triton_host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (interpreter smoke test)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--csv", default=None)
    p.add_argument("--stub-kernels", action="store_true",
                   help="CPU, TRITON_INTERPRET=1: full-size calls with no-op kernel launches (lockstep's host work)")
    p.add_argument("--graph", action="store_true",
                   help="CUDA: capture each decode op's launch path in a CUDA graph, replay, check bits, time")
    p.add_argument("--dry-run", action="store_true", help="with --graph: the plumbing on CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.graph:
        return run_graph(args, p)
    cuda = args.device.startswith("cuda")
    if args.stub_kernels and (cuda or not os.environ.get("TRITON_INTERPRET")):
        p.error("--stub-kernels needs --device cpu and TRITON_INTERPRET=1")
    reps = args.reps or (200 if args.stub_kernels else 3 if args.quick or not cuda else 200)
    rows = []
    for name, ours, stock in cases(args.device, (args.quick or not cuda) and not args.stub_kernels):
        try:
            rows.append(measure_stubbed(name, ours, stock, reps) if args.stub_kernels else
                        measure(name, ours, stock, cuda, reps))
        except Exception as e:  # report and go on
            rows.append({"op": name, "wall_us": f"error: {type(e).__name__}: {e}"})
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if args.csv:
        cols = (["op", "host_us", "torch_ops", "launches", "stock_wall_us"] if args.stub_kernels else
                ["op", "wall_us", "host_us", "gpu_us", "graph_us", "stock_wall_us"])
        write_csv(args.csv, rows, cols)
    return 1 if any(str(r.get("wall_us", "")).startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
