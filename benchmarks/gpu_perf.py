"""One GPU run that measures and diagnoses every op (issue 40): ceilings, ratios to stock, profiles, a summary.

    python -m benchmarks.gpu_perf --out OUT                       # CUDA: every stage, each with its time budget
    python -m benchmarks.gpu_perf --out OUT --stage ops --budget 170   # one stage (benchmarks/gpu_check_8min.sh)
    TRITON_INTERPRET=1 python -m benchmarks.gpu_perf --device cpu --tiny --out OUT   # CPU dry run (CI)

Stages, in order; each appends its rows to OUT as it goes (JSONL, one flushed line per row), so a stage cut
short by its budget or by the shell's ``timeout`` keeps what it measured:

* ``env`` (env.json): python, torch, triton, CUDA, driver, GPU name, SM count, L2 size.
* ``ceilings`` (ceilings.jsonl): device-to-device copy bandwidth (read + write bytes), bf16 matmul and fp32
  matmul with TF32 off (the strict kernels' arithmetic runs on fp32 FMA units; this is the measured bound).
* ``ops`` (ops.jsonl, ops.csv, kernels.jsonl): every op at Qwen3-8B shapes (hidden 4096, 32/8 heads, head dim
  128, vocab 151,936; GDN rows at Qwen3-Next's 16/32 heads, d 128) under each policy the triton backend has
  (strict; fast for linear, attention and token_logprobs' logits; exact for linear, its earlier torch glue beside
  it, and the int8 accumulation probe, kernels/exact/probe.py, which raises unless the Triton kernels and torch._int_mm
  accumulate exactly on this device; the exact fast path's rows exact/s*/M*, s = 3 and 4, checked against the
  reference first, with the weight-source (decode rows) and two-kernel paths beside them, run by
  benchmarks/gpu_exact.sh), against stock
  torch. Device time: each input set's call is recorded through ``backends.triton.launch_path`` (stock: the
  torch call itself), all sets are captured in one ``torch.cuda.CUDAGraph`` and the graph is replayed; the
  time per call is the median replay / sets. Memory-bound rows rotate enough input sets (>= 128 MB touched
  per replay) that the 60 MB L2 does not serve them. Per row: bytes (inputs + outputs) and FLOPs, the
  fraction of the measured ceilings, each launched Triton kernel (grid, programs, warps, registers, spills,
  shared memory; on CUDA also its SASS counts from ``kernels/checks/sass_profile``) and raw-bit equality of
  every set's replay against its eager call. A call that cannot be captured (the exact policy's earlier torch
  glue reads values on the host) is timed eagerly by CUDA events, its stock too (the row's ``method`` says so).
* ``profile`` (profile.jsonl, profile.txt): ``torch.profiler`` over the worst rows (lowest ratio): device
  time per kernel and the share of torch ops (copies, fills, cuBLAS) around the Triton kernels.
* ``ncu`` (ncu.jsonl, ncu_0.csv): Nsight Compute on the three worst kernels (one ncu run over one ``--run-case``
  child that runs their cases); if ``ncu`` is absent or fails it is logged and skipped.
* ``summary`` (summary.jsonl, summary.txt, printed last): every row's ratio, then per slow row (ratio < 0.9)
  the symptoms read from what was collected: spills, layout conversions (shared-memory instructions in the
  SASS), too few programs (< one per SM), a secondary kernel (or torch ops) dominating the device time, a
  latency-bound loop (none of those, yet far from every ceiling).

Every row carries the Triton version. ``--device cpu --tiny`` (TRITON_INTERPRET=1) runs the same code paths
with CPU stand-ins: tiny shapes, a host timer in place of CUDA-graph replay, torch.profiler on CPU with the
interpreter's per-launch wall time in place of device time, ncu's command built and its absence logged; its
figures mean nothing, the plumbing is what it checks (tests/test_gpu_perf_dryrun.py).
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

STAGES = ("env", "ceilings", "ops", "profile", "ncu", "summary")
BUDGET_S = {"env": 15, "ceilings": 20, "ops": 170, "profile": 40, "ncu": 75, "summary": 15}
SLOW = 0.9            # a row slower than this fraction of stock's speed is diagnosed in the summary
ROTATE_BYTES = 128 << 20   # touched per replay of a memory-bound row: over twice the H200's 60 MB L2
MAX_SETS = 64
NOMINAL = {"copy_GBps": 4300.0, "bf16_TFLOPs": 790.0, "fp32_TFLOPs": 67.0}  # H200, used only without ceilings


def triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


TRITON = triton_version()


# ---------------------------------------------------------------- output: JSONL rows flushed as they come

class Out:
    """The output folder: one JSONL file per kind of row, each line flushed when written."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def row(self, name: str, rec: dict) -> dict:
        rec = {"triton": TRITON, **rec}
        with open(self.path(name), "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
        return rec

    def rows(self, name: str) -> list[dict]:
        if not os.path.exists(self.path(name)):
            return []
        with open(self.path(name)) as f:
            return [json.loads(line) for line in f if line.strip()]

    def csv_row(self, name: str, rec: dict, fields: list[str]) -> None:
        new = not os.path.exists(self.path(name))
        with open(self.path(name), "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(rec)
            f.flush()

    def text(self, name: str, text: str) -> None:
        with open(self.path(name), "a") as f:
            f.write(text)
            f.flush()


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- timing: CUDA-graph replay, or the CPU stand-in

class Clock:
    """Device time of a list of calls (one per input set). CUDA: captured in one CUDA graph, replayed; the time
    per call is the median replay over the sets. CPU stand-in: the calls in a loop on the host clock."""

    def __init__(self, cuda: bool, target_s: float):
        self.cuda, self.target_s = cuda, target_s

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn) -> float:
        """Seconds of one call (CUDA events on a GPU, host clock on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3

    def _reps(self, one_s: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, int(self.target_s / max(one_s, 1e-7))))

    def per_call(self, thunks: list[Callable], capture: bool = True) -> tuple[float, str, list]:
        """(seconds per call, method, the outputs of the last pass). capture=False: a call known to read values
        on the host (it cannot be captured; trying would sync inside a capture): CUDA events, eager."""
        if not self.cuda:  # CPU stand-in for graph replay: one pass over the same thunks on the host clock
            outs = []
            seconds = self.once(lambda: outs.extend(t() for t in thunks))
            return seconds / len(thunks), "cpu-timer (stand-in for graph replay)", outs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (compiles, workspaces), as torch asks
            for t in thunks:
                t()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            if not capture:
                raise RuntimeError("reads values on the host")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [t() for t in thunks]
            method = "graph"
            run = graph.replay
        except Exception as e:  # a call that syncs or reads back values: eager, timed by events
            torch.cuda.synchronize()
            method = f"events (no graph: {type(e).__name__}: {str(e)[:80]})"
            outs = None
            run = lambda: [t() for t in thunks]  # noqa: E731
        one = self.once(run)
        reps = self._reps(one, 3, 200)
        times = [self.once(run) for _ in range(reps)]
        if outs is None:
            outs = [t() for t in thunks]
        torch.cuda.synchronize()
        return statistics.median(times) / len(thunks), method, outs


# ---------------------------------------------------------------- launched Triton kernels: grid, registers, spills

class Launches:
    """Records every Triton kernel launched while active: name, grid, warps, registers, spills, shared memory,
    host seconds of the launch (on CPU, the interpreter runs the kernel inside it: the stand-in for its time)
    and, on CUDA, the SASS counts of its cubin (kernels/checks/sass_profile)."""

    _sass_cache: dict = {}

    def __init__(self, sass: bool):
        self.sass, self.items = sass, []

    def __enter__(self):
        from triton.runtime import jit
        targets = [jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            targets.append(InterpretedFunction)
        except ImportError:
            pass
        self._saved = [(cls, cls.__dict__["run"]) for cls in targets if "run" in cls.__dict__]
        log = self

        def wrap(real):
            def run(fn, *args, grid, warmup, **kwargs):
                t0 = time.perf_counter()
                kernel = real(fn, *args, grid=grid, warmup=warmup, **kwargs)
                if not warmup and log.describe_name(fn) != "_fma_probe":  # the interpreter's one-off check
                    log.items.append(log.describe(fn, grid, kernel, time.perf_counter() - t0))
                return kernel
            return run
        for cls, real in self._saved:
            cls.run = wrap(real)
        return self

    def __exit__(self, *exc):
        for cls, real in self._saved:
            cls.run = real

    @staticmethod
    def describe_name(fn) -> str:
        return getattr(getattr(fn, "fn", None), "__name__", None) or getattr(fn, "__name__", "?")

    def describe(self, fn, grid, kernel, host_s: float) -> dict:
        name = self.describe_name(fn)
        g = list(grid) if isinstance(grid, (tuple, list)) else "callable"
        meta = getattr(kernel, "metadata", None)
        rec = {"kernel": name, "grid": g, "programs": math.prod(g) if isinstance(g, list) else None,
               "num_warps": getattr(meta, "num_warps", None), "n_regs": getattr(kernel, "n_regs", None),
               "n_spills": getattr(kernel, "n_spills", None), "shared_bytes": getattr(meta, "shared", None),
               "host_s": host_s}
        if self.sass and kernel is not None:
            rec.update(self._sass(kernel))
        return rec

    def _sass(self, kernel) -> dict:
        key = getattr(kernel, "hash", None) or id(kernel)
        if key not in self._sass_cache:
            try:
                from hal.kernels.checks.sass_profile import profile
                p = profile(kernel)
                self._sass_cache[key] = {"sass_shared": p.shared, "sass_barriers": p.barriers, "sass_stack": p.stack,
                                         "sass_ffma": p.ffma, "sass_ldg128": p.vector_loads,
                                         "sass_ldg_narrow": p.narrow_loads, "sass_instr": p.total}
            except Exception as e:  # nvdisasm missing, no cubin: the row says why
                self._sass_cache[key] = {"sass": f"unavailable: {type(e).__name__}: {str(e)[:80]}"}
        return self._sass_cache[key]


# ---------------------------------------------------------------- the cases

@dataclass
class Case:
    """One row: ``build(seed)`` makes one input set and returns (ours, stock, tensors): ours, a thunk of the
    lockstep call (a hal op on the triton backend, or a direct kernel call when ``via_launch_path`` is False),
    stock, the stock torch call (None: no stock here), tensors, the inputs (their bytes count as traffic)."""
    id: str
    op: str
    policy: str
    shape: str
    build: Callable
    flops: float = 0.0          # the op's arithmetic, 2 per multiply-add (0: a memory-bound row)
    stock_name: str = ""
    via_launch_path: bool = True
    #: a second comparison beside stock: ``target(tensors)`` (the build's inputs) -> a thunk, or None when its
    #: library is absent (the row then says ``target_note``, no ratio); ``target_name`` names it
    target: Callable | None = None
    target_name: str = ""


def _randn(shape, dtype, device, seed, scale=1.0):
    """Seeded normal values made on the device itself (a 151,936 x 4096 LM head drawn on the host took seconds
    of the stage's budget; nothing here compares inputs across devices)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    inter: int
    hq: int
    hkv: int
    d: int
    vocab: int
    decode_rows: tuple
    prefill_rows: tuple
    norm_rows: tuple
    vocab_rows: tuple
    logprob_rows: tuple
    attn_T: tuple
    decode_batches: tuple
    ctx: int
    page: int
    gdn: tuple          # (H, HV, d, T, decode batch)
    sms: int            # programs below this count are "too few" (CPU: a stand-in)
    gdn_fast_T: tuple = (4096, 16384)   # the fast GDN rows' prefill lengths
    gdn_fast_B: tuple = (1, 8, 64)      # ... and decode batches
    exact_rows: tuple = (1, 64, 2048, 8192)  # the exact path's rows (benchmarks/gpu_exact.sh)
    exact_decode_rows: tuple = (1, 8, 64)  # ... its decode rows, also on the weight-source path (EXACT_PATHS)


QWEN3_8B = Shapes(hidden=4096, inter=12288, hq=32, hkv=8, d=128, vocab=151936, decode_rows=(1, 8, 64, 256),
                  prefill_rows=(2048, 8192), norm_rows=(1, 8, 256, 8192), vocab_rows=(8, 64), logprob_rows=(8, 64, 256),
                  attn_T=(2048, 8192), decode_batches=(8, 64), ctx=4096, page=16, gdn=(16, 32, 128, 4096, 32), sms=132)
TINY = Shapes(hidden=64, inter=96, hq=4, hkv=2, d=32, vocab=300, decode_rows=(2,), prefill_rows=(24,),
              norm_rows=(3,), vocab_rows=(3,), logprob_rows=(3,), attn_T=(24,), decode_batches=(2,), ctx=32, page=16,
              gdn=(1, 2, 16, 24, 1), sms=4, gdn_fast_T=(70,), gdn_fast_B=(2,), exact_rows=(24,),
              exact_decode_rows=(24,))


def hf_rms_norm(x, w, eps):
    """Hugging Face's Qwen3 RMSNorm (the stock the patched models replace)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def sdpa(q, k, v, causal):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]: torch's scaled_dot_product_attention with GQA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _with_constants(module, fn: Callable, constants: dict) -> Callable:
    """fn run with module constants of a kernel module set, restored after: an earlier kernel path kept selectable,
    for an old-vs-new row pair. The launchers read them at each call; ``launch_path_of`` wraps a row's replay the
    same way, so the replay (and a graph capture of it) runs the chosen path, not the default."""
    def run():
        saved = {k: getattr(module, k) for k in constants}
        for k, v in constants.items():
            setattr(module, k, v)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                setattr(module, k, v)
    run.constants = (module, constants)
    return run


def runs_a_selected_path(case_id: str) -> bool:
    """Whether a row times a kept-selectable path rather than the default: a sweep row, a path named after the
    shape (``op/policy/shape/path``) or a policy variant (``linear/strict-old/...``)."""
    parts = case_id.split("/")
    return parts[0] == "sweep" or len(parts) > 3 or "-" in parts[1]


def launch_path_of(case: "Case", ours: Callable) -> tuple[Callable, object]:
    """(the thunk to time, the eager call's result) of one input set: the backend calls ``ours`` made, replayed
    (``launch_path``), with the module constants ``ours`` was run under set again around the replay; or ``ours``
    itself when the row is not timed through its launch path. A selected-path row must carry its constants
    (``_with_constants``): a thunk that sets and restores them itself would be replayed on the default path."""
    from hal.backends.triton import launch_path
    if runs_a_selected_path(case.id) and not hasattr(ours, "constants"):
        raise AssertionError(f"{case.id}: a selected-path row sets its constants through _with_constants, or its "
                             "replay times the default path")
    if not case.via_launch_path:
        return ours, ours()
    path, result = launch_path(ours)
    if hasattr(ours, "constants"):
        module, constants = ours.constants
        path = _with_constants(module, path, constants)
    return path, result


def _selected(fn: Callable, selectors: dict) -> Callable:
    """fn run with matmul's path constants set (the GEMV selectors, the FMA-dot tile's launch shape)."""
    from hal.kernels.triton import matmul as km
    return _with_constants(km, fn, selectors)


def _attention_knobs(fn: Callable, **knobs) -> Callable:
    """fn run with kernels/triton/attention.py's path constants set."""
    from hal.kernels.triton import attention as tri_attn
    return _with_constants(tri_attn, fn, knobs)


#: fast attention's paths kept selectable (kernels/triton/fast_attention.py), by row suffix: the general block step for
#: every block (the kernel before issue 49), and the interior-block path with a block loop per split
FAST_ATTENTION_PATHS = {"general": dict(FAST_BLOCK_PATH=False), "per_split": dict(FLAT_SPLITS=False)}


def _fast_attention_path(new: "Case", suffix: str, check: Callable) -> "Case":
    """The row ``new`` (fast attention, the default path) on the path FAST_ATTENTION_PATHS[suffix], id
    ``new.id + "/" + suffix``. Speed only: ``check(tensors)`` gives (out, lse) on the row's inputs, and the row fails,
    named, unless both paths give them in the same raw bits."""
    from hal.conformance.bits import same_bits
    from hal.kernels.triton import fast_attention as tri_fast
    constants = FAST_ATTENTION_PATHS[suffix]

    def build(seed):
        ours, stock, tensors = new.build(seed)
        other = _with_constants(tri_fast, lambda: check(tensors), constants)()
        if not all(same_bits(a, b) for a, b in zip(check(tensors), other)):  # speed only, or a bug
            raise AssertionError(f"{new.id}/{suffix}: out / lse bits differ from the default path's")
        return _with_constants(tri_fast, ours, constants), stock, tensors
    return Case(f"{new.id}/{suffix}", new.op, new.policy, f"{new.shape}, {constants}", build, flops=new.flops,
                stock_name=new.stock_name)


#: the id part of the decode-tile spec's rows (hal.spec.FAST_ATTENTION_DECODE), beside the default fast spec's rows of
#: the same shapes: ``attention_decode/fast-m16/B*`` and ``attention_prefill/fast-m16/T*``. Run by gpu_sweep.sh's
#: first stage; gpu_check_8min.sh's perf-ops-c leaves them out (--skip): its 80 s are spent
DECODE_TILE = "fast-m16"


def _decode_tile_decode(fast: "Case", tri: dict) -> "Case":
    """``attention_decode/fast-m16/B*``: the paged decode of the row ``fast`` (the default fast spec) under the
    decode-tile spec, against the same stock. Each input set first checks its raw bits: the decode's out and lse ==
    the last row of the spec's own prefill-sized chunk ending at the decode row (PACK_MAX_Q + 1 rows against the same
    paged cache: one head per program, the interior-block path) -- the spec's promise, checked on the device; the
    row fails by name otherwise."""
    import hal
    from hal.conformance.bits import same_bits
    from hal.kernels.triton import attention as tri_attn, fast_attention as tri_fast
    from hal.spec import FAST_ATTENTION_DECODE as spec

    def build(seed):
        _, stock, tensors = fast.build(seed)
        q, kc, vc, table, lens = tensors
        b, _, hq, d = q.shape
        lead = _randn((b, tri_attn.PACK_MAX_Q, hq, d), q.dtype, q.device, 1000 * seed + 14)
        chunk = torch.cat([lead, q], dim=1)  # a prefill-sized chunk whose last row is the decode row

        def ours():
            return hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, spec=spec, **tri)
        out, lse = hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, return_lse=True,
                                               spec=spec, **tri)
        c_out, c_lse = hal.flash_attn_with_kvcache(chunk, kc, vc, cache_seqlens=lens, block_table=table,
                                                   return_lse=True, spec=spec, **tri)
        if not (same_bits(out, c_out[:, -1:]) and same_bits(lse, c_lse[:, :, -1:])):
            raise AssertionError(f"{fast.id.replace('/fast/', f'/{DECODE_TILE}/')}: {spec.id}'s decode differs from "
                                 "its prefill-sized chunk's last row (out / lse raw bits)")
        return _with_constants(tri_fast, ours, {}), stock, tensors  # the spec selects the path: the replay replays it
    return Case(fast.id.replace("/fast/", f"/{DECODE_TILE}/"), fast.op, "fast", f"{fast.shape} ({spec.id})", build,
                flops=fast.flops, stock_name=fast.stock_name)


def _decode_tile_prefill(fast: "Case", tri: dict) -> "Case":
    """``attention_prefill/fast-m16/T*``: the causal prefill of the row ``fast`` under the decode-tile spec (its
    prefill-side cost: the trade-off of one spec for both sides), against the same stock. Each input set first checks
    its raw bits: the prefill's last row == that row decoded (one query against the keys as a cache)."""
    import hal
    from hal.conformance.bits import same_bits
    from hal.kernels.triton import fast_attention as tri_fast
    from hal.spec import FAST_ATTENTION_DECODE as spec

    def build(seed):
        _, stock, tensors = fast.build(seed)
        q, k, v = tensors
        T = q.shape[0]
        cu = torch.tensor([0, T], dtype=torch.int32, device=q.device)

        def ours():
            return hal.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True, spec=spec, **tri)
        out, lse = hal.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True, return_lse=True, spec=spec, **tri)
        d_out, d_lse = hal.flash_attn_with_kvcache(q[None, T - 1:], k[None], v[None], return_lse=True, spec=spec,
                                                   cache_seqlens=torch.tensor([T], dtype=torch.int32, device=q.device),
                                                   **tri)
        if not (same_bits(out[T - 1:], d_out[0]) and same_bits(lse[:, T - 1:], d_lse[0])):
            raise AssertionError(f"{fast.id.replace('/fast/', f'/{DECODE_TILE}/')}: {spec.id}'s prefill differs from "
                                 "its decode of the last row (out / lse raw bits)")
        return _with_constants(tri_fast, ours, {}), stock, tensors
    return Case(fast.id.replace("/fast/", f"/{DECODE_TILE}/"), fast.op, "fast", f"{fast.shape} ({spec.id})", build,
                flops=fast.flops, stock_name=fast.stock_name)


def _old_attention_paths() -> dict:
    """{row suffix: knobs} of the strict attention paths kept selectable where they differ from the default here:
    the decode chains' q loaded as a broadcast [rows, keys, VEC] tile (attention.Q_BROADCAST_LOAD: converted through
    shared memory at every step under Triton 3.6) and one FMA dot per head-dim tile / key block (attention.DOT_K = 0)."""
    from hal.kernels.triton import attention as tri_attn
    return {"broadcast_q": dict(Q_BROADCAST_LOAD=True)} if not tri_attn.Q_BROADCAST_LOAD else {}, \
        {"one_dot": dict(DOT_K=0)} if tri_attn.DOT_K else {}


#: (tile rows, tile columns, warps, pipeline stages or None) of the strict linear's FMA-dot tile timed by the
#: "sweep/" rows (benchmarks/gpu_sweep.sh): the default first. Speed only (the chains do not depend on them); the
#: H200 ran the default at 13 % of the fp32 FMA peak (2026-12-04), and nothing wider was ever timed there
DOT_TILE_SWEEP = ((64, 32, 4, None), (64, 32, 4, 2), (64, 32, 4, 4), (64, 64, 4, None), (64, 64, 8, None),
                  (128, 32, 8, None), (32, 64, 4, None), (128, 64, 8, None), (128, 128, 8, None), (32, 32, 2, None))


#: "sweep/strict-token-logprobs-N{n}/..." rows: token_logprobs' FMA-dot logits tile (rows, vocab entries, warps, stages;
#: token_logprobs._DOT_TILE / _DOT_WARPS / _DOT_STAGES), the default first; the same layout as the linear tile above,
#: on the LM head's 151,936 x 4096 (14 % of the fp32 FMA peak at N >= 64 on 2026-12-04). Speed only
LOGITS_TILE_SWEEP = ((32, 64, 4, None), (32, 64, 4, 2), (64, 64, 4, None), (64, 64, 8, None), (32, 128, 4, None),
                     (64, 128, 8, None), (128, 64, 8, None))


def _logits_tile_sweep(s: Shapes, dev: str) -> list[Case]:
    """Rows "sweep/strict-token-logprobs-N{n}/t{BR}x{BV}-w{warps}[-s{stages}]": hal.token_logprobs (strict, Triton)
    at the largest row count (24 at --tiny, where the interpreter runs its own tile) under each LOGITS_TILE_SWEEP
    choice, each first checked for the default tile's bits."""
    import hal
    from hal.conformance.bits import same_bits
    from hal.kernels.triton import token_logprobs as ktl
    bf, h, n = torch.bfloat16, s.hidden, 24 if s is TINY else s.logprob_rows[-1]
    out = []
    for br, bv, warps, stages in LOGITS_TILE_SWEEP[:2 if s is TINY else None]:
        knobs = {"_DOT_TILE": (br, bv), "_DOT_WARPS": warps, "_DOT_STAGES": stages}

        def build(seed, knobs=knobs):
            x = _randn((n, h), bf, dev, 1000 * seed + 6)
            w = _randn((s.vocab, h), bf, dev, 1000 * seed + 7, h ** -0.5)
            tok = (torch.arange(n, device=dev) * 7919) % s.vocab
            ours = _with_constants(ktl, lambda: hal.token_logprobs(x, w, tok, backend="triton"), knobs)
            if not same_bits(ours(), hal.token_logprobs(x, w, tok, backend="triton")):  # speed only, or a bug
                raise AssertionError(f"{knobs}: bits differ from the default FMA-dot logits tile's")
            stock = lambda: torch.log_softmax(F.linear(x, w).float(), -1).gather(-1, tok[:, None])  # noqa: E731
            return ours, stock, [x, w, tok]
        label = f"t{br}x{bv}-w{warps}" + (f"-s{stages}" if stages else "")
        out.append(Case(f"sweep/strict-token-logprobs-N{n}/{label}", "token_logprobs", "strict",
                        f"N{n} H{h} V{s.vocab} bf16 {knobs}", build, flops=2.0 * n * h * s.vocab,
                        stock_name="F.linear + float32 log_softmax + gather"))
    return out


def _dot_tile_sweep(s: Shapes, dev: str) -> list[Case]:
    """Rows "sweep/strict-linear-M{m}/t{BM}x{BN}-w{warps}[-s{stages}]": hal.linear (strict, Triton) at a prefill
    and a batched-decode row count under each DOT_TILE_SWEEP choice (two choices at --tiny, where the interpreter
    ignores them and runs its own tile); the ids hold no "linear/", so gpu_check_8min.sh's stages leave them out."""
    import hal
    from hal.conformance.bits import same_bits
    bf, h = torch.bfloat16, s.hidden
    out = []
    for m in [m for m in (s.prefill_rows[0], s.decode_rows[-1]) if m > 16]:  # 1-16 rows: always the GEMV
        for bm, bn, warps, stages in DOT_TILE_SWEEP[:2 if s is TINY else None]:
            # GEMV_MAX_ROWS 16: a row count of 17-64 (--tiny's 24) takes the tile too
            knobs = {"_DOT_TILE": (bm, bn), "_DOT_WARPS": warps, "_DOT_STAGES": stages, "GEMV_MAX_ROWS": 16}
            def build(seed, m=m, knobs=knobs):
                x = _randn((m, h), bf, dev, 1000 * seed + 1)
                w = _randn((h, h), bf, dev, 1000 * seed + 2, h ** -0.5)
                ours = _selected(lambda: hal.linear(x, w, backend="triton"), knobs)
                default = _selected(lambda: hal.linear(x, w, backend="triton"), {"GEMV_MAX_ROWS": 16})()
                if not same_bits(ours(), default):  # speed only, or it is a bug: the row fails, named
                    raise AssertionError(f"{knobs}: bits differ from the default FMA-dot tile's")
                return ours, (lambda: F.linear(x, w)), [x, w]
            label = f"t{bm}x{bn}-w{warps}" + (f"-s{stages}" if stages else "")
            out.append(Case(f"sweep/strict-linear-M{m}/{label}", "linear", "strict", f"M{m} K{h} N{h} bf16 {knobs}",
                            build, flops=2.0 * m * h * h, stock_name="F.linear (cuBLAS bf16)"))
    return out


@functools.cache
def _exact_probe(dev: str) -> None:
    """kernels/exact/probe.py on this device, once per process: the Triton products kernel (one program's K, and
    split-K) and torch._int_mm with K pieces must each give exactly 127**2 x K, the one-pass diagonal kernel its
    exact limbs at its int32 bound (s = 4), the fused kernel (the default exact path) the rounded exact values at,
    just past and far past its int32 bound (s = 4); AssertionError names what did not."""
    from hal.kernels.exact import probe
    paths = {"triton": probe.triton_sums, "triton split-K 3": lambda a, w: probe.triton_sums(a, w, split_k=3),
             "torch._int_mm": probe.int_mm_sums}
    problems = [f"{name}: {p}" for name, sums in paths.items() for p in probe.accumulation_problems(sums, dev)]
    from hal.kernels.exact import triton_matmul as tx
    problems += [f"triton diagonal kernel: {p}" for p in
                 probe.diagonal_problems(lambda da, dw: tx.limbs(da, dw, products="diagonal"), dev)]
    problems += [f"triton fused kernel: {p}" for p in probe.fused_problems(probe.triton_fused_linear, dev)]
    if problems:
        raise AssertionError("int8 accumulation is not exact, the path is not admitted: " + "; ".join(problems))


def _exact_probe_case(dev: str) -> "Case":
    """Row exact_probe/int8/K..: raises unless _exact_probe passes; times the Triton products kernel over one full
    int32 piece of extreme digits against torch._int_mm on the same digits."""
    from hal.kernels.exact import probe
    k = probe.PROBE_K[0]

    def build(seed):
        _exact_probe(dev)
        a, w = probe.probe_inputs(k, dev)
        return (lambda: probe.triton_sums(a, w)), (lambda: probe.int_mm_sums(a, w)), [a, w]
    return Case(f"exact_probe/int8/K{k}", "linear", "exact", f"digits 127 M{probe.PROBE_ROWS} K{k} N{probe.PROBE_COLS} "
                "s1, probe Ks " + ",".join(map(str, probe.PROBE_K)), build,
                flops=2.0 * probe.PROBE_ROWS * k * probe.PROBE_COLS, stock_name="torch._int_mm (int8 -> int32)",
                via_launch_path=False)


#: the exact path's rows besides the default (the fused kernel reading the weight's prepared int8 planes), each
#: (module constants, the Shapes field of its row counts): the fused kernel slicing the weight's own bf16 tensor in
#: registers (decode rows: there the weight's bytes decide; s bytes a parameter read as planes, 2 as bf16), then the
#: two-kernel path (products kernel writing int64 limbs, then the finish kernel); same bits, so one run says which is
#: faster at each row count
EXACT_PATHS = {"weight-source": ({"WEIGHT_SOURCE": True}, "exact_decode_rows"),
               "two-kernel": ({"FUSED": False}, "exact_rows")}


@functools.cache
def _exact_reference_weight(h: int, s: int, dev: str):
    """Input set 0's weight of the exact-path rows (as their build draws it) on the CPU, and its reference slices."""
    from hal.kernels.exact import core
    w = _randn((h, h), torch.bfloat16, dev, 2, h ** -0.5).cpu()
    return w, core.slice_rows(w, s)


def _check_exact_reference(x: torch.Tensor, got: torch.Tensor, s: int, h: int, dev: str) -> None:
    """Raises unless rows of ``got`` (the exact linear of x [M, h] with set 0's weight, on the device) have the raw bits
    of kernels/reference/exact_matmul (int64 slice products, on the CPU): the first, the last and two drawn rows (a
    row's bits depend only on that row and the weight, so the rows can be checked apart)."""
    from hal.conformance.bits import first_divergence
    from hal.kernels.exact import core
    from hal.kernels.reference.exact_matmul import products_int64
    m = x.shape[0]
    rows = sorted({0, m - 1, *torch.randint(0, m, (2,), generator=torch.Generator().manual_seed(m)).tolist()})
    w, sliced = _exact_reference_weight(h, s, dev)
    want = core.exact_linear(x[rows].cpu(), w, None, s, products_int64, sliced)
    d = first_divergence(f"exact s{s} M{m} rows {rows}", want, got[rows].cpu())
    if d is not None:
        raise AssertionError(f"bits differ from the reference: {d}")


def _exact_path_cases(s: Shapes, dev: str) -> list[Case]:
    """Rows exact/s{3,4}/M{rows}: hal.linear under ExactMatmulSpec(slices) on the triton backend, bf16, K = N = hidden,
    the weight prepared once, by CUDA-graph replay against cuBLAS bf16; each row's set 0 checked against the reference
    first (_check_exact_reference); the default path at exact_rows and exact_decode_rows. Then each EXACT_PATHS path at
    its rows."""
    import hal
    from hal.kernels.exact import triton_matmul as tx
    from hal.spec import ExactMatmulSpec
    h, out = s.hidden, []
    default = ({}, tuple(sorted(set(s.exact_rows) | set(s.exact_decode_rows))))
    paths = {"": default, **{path: (constants, getattr(s, rows)) for path, (constants, rows) in EXACT_PATHS.items()}}
    for path, (constants, row_counts) in paths.items():
        for slices in (3, 4):
            for m in row_counts:
                def build(seed, m=m, slices=slices, constants=constants):
                    x = _randn((m, h), torch.bfloat16, dev, 1000 * seed + 1)
                    w = _randn((h, h), torch.bfloat16, dev, 1000 * seed + 2, h ** -0.5)
                    spec = ExactMatmulSpec(slices=slices)
                    ew = hal.exact_weight(w, spec=spec, backend="triton")
                    ours = _with_constants(tx, lambda: hal.linear(x, ew, spec=spec, backend="triton"), constants)
                    if seed == 0:
                        _check_exact_reference(x, ours(), slices, h, dev)
                    return ours, (lambda: F.linear(x, w)), [x, w]
                out.append(Case(f"exact/s{slices}/M{m}" + (f"/{path}" if path else ""), "linear", "exact",
                                f"M{m} K{h} N{h} bf16 s{slices}" + (f" {constants}" if constants else ""), build,
                                flops=2.0 * m * h * h, stock_name="F.linear (cuBLAS bf16)"))
    return out


def cases(s: Shapes, dev: str) -> list[Case]:
    import hal
    from hal.spec import ExactMatmulSpec, FastAttentionSpec, FastMatmulSpec
    bf = torch.bfloat16
    tri = dict(backend="triton")
    out: list[Case] = []
    h = s.hidden
    old_decode, old_prefill = _old_attention_paths()

    # matmul / linear: decode rows and prefill, strict / fast / exact; "fast" is FastMatmulV3Spec (its launch table,
    # opt-in until the device sweep answers its hypothesis), "fast-v2" the v2 default's one 128 x 128 x 64 launch
    from hal.kernels.triton import fast_matmul as kfm
    from hal.spec import FastMatmulV3Spec
    for m in s.decode_rows + s.prefill_rows:
        for policy in ("strict", "fast", "fast-v2", "exact"):
            def build(seed, m=m, policy=policy):
                x = _randn((m, h), bf, dev, 1000 * seed + 1)
                w = _randn((h, h), bf, dev, 1000 * seed + 2, h ** -0.5)
                stock = lambda: F.linear(x, w)  # noqa: E731
                if policy == "exact":  # the triton backend's exact path, the weight prepared once (hal.exact_weight)
                    spec = ExactMatmulSpec()
                    ew = hal.exact_weight(w, spec=spec, **tri)
                    return (lambda: hal.linear(x, ew, spec=spec, **tri)), stock, [x, w]
                if policy == "fast-v2":  # the spec selects the path (no module constant: the replay replays it)
                    spec = FastMatmulSpec()
                    return _with_constants(kfm, lambda: hal.linear(x, w, spec=spec, **tri), {}), stock, [x, w]
                spec = FastMatmulV3Spec() if policy == "fast" else None
                return (lambda: hal.linear(x, w, spec=spec, **tri)), stock, [x, w]
            out.append(Case(f"linear/{policy}/M{m}", "linear", policy.split("-")[0],
                            f"M{m} K{h} N{h} bf16" + (" (FastMatmulSpec v2)" if policy == "fast-v2" else
                                                      " (FastMatmulV3Spec)" if policy == "fast" else ""), build,
                            flops=2.0 * m * h * h, stock_name="F.linear (cuBLAS bf16)"))
    # the exact path's earlier torch glue around the same products kernel (host syncs: timed eagerly, by events), so
    # one run compares it with the slicing / finish kernels above; then the int8 accumulation probe
    # and the first products kernel (a K pass per slice pair) in place of the one-pass diagonal kernel
    for variant, constants in (("exact-torch-glue", {"GLUE": "torch"}), ("exact-pairs", {"PRODUCTS": "pairs"})):
        for m in sorted({s.decode_rows[0], s.prefill_rows[-1]}):
            def build(seed, m=m, constants=constants):
                from hal.kernels.exact import triton_matmul as tx
                x = _randn((m, h), bf, dev, 1000 * seed + 1)
                w = _randn((h, h), bf, dev, 1000 * seed + 2, h ** -0.5)
                spec = ExactMatmulSpec()
                ew = hal.exact_weight(w, spec=spec, **tri)
                return (_with_constants(tx, lambda: hal.linear(x, ew, spec=spec, **tri), constants),
                        (lambda: F.linear(x, w)), [x, w])
            out.append(Case(f"linear/{variant}/M{m}", "linear", "exact", f"M{m} K{h} N{h} bf16 {constants}", build,
                            flops=2.0 * m * h * h, stock_name="F.linear (cuBLAS bf16)",
                            via_launch_path=variant != "exact-torch-glue"))  # the old glue reads values on the host
    out.append(_exact_probe_case(dev))
    out += _exact_path_cases(s, dev)  # benchmarks/gpu_exact.sh (after fast's and the RL step's device calls)

    # old-vs-new pairs of the strict GEMV's selectors (kernels/triton/matmul.py), so one run decides which to keep:
    # "strict-old" is the layout measured on 2026-12-04 (lanes 4 columns x 8 K tiles a warp, one partial a combine
    # step on 32 programs) against "strict" (the defaults); "strict-dot" takes 17-64 rows through the 64 x 32 FMA-dot
    # tiles instead of the GEMV "strict" runs there (GEMV_MAX_ROWS 64: measured faster at 64 rows on 2026-12-04)
    variants = {"strict-old": ([m for m in s.decode_rows if m <= 16], {"GEMV_LANES": "tiles", "COMBINE_UNROLL": 1,
                                                                           "GEMV_EVEN_K": False}),
                "strict-dot": ([m for m in s.decode_rows + s.prefill_rows if 16 < m <= 64], {"GEMV_MAX_ROWS": 16})}
    for name, (rows, selectors) in variants.items():
        for m in rows:
            def build(seed, m=m, selectors=selectors):
                x = _randn((m, h), bf, dev, 1000 * seed + 1)
                w = _randn((h, h), bf, dev, 1000 * seed + 2, h ** -0.5)
                return _selected(lambda: hal.linear(x, w, **tri), selectors), (lambda: F.linear(x, w)), [x, w]
            out.append(Case(f"linear/{name}/M{m}", "linear", "strict", f"M{m} K{h} N{h} bf16 {selectors}", build,
                            flops=2.0 * m * h * h, stock_name="F.linear (cuBLAS bf16)"))

    out += _dot_tile_sweep(s, dev) + _logits_tile_sweep(s, dev)

    for rows in s.norm_rows:
        def build(seed, rows=rows):
            x, w = _randn((rows, h), bf, dev, 1000 * seed + 3), _randn((h,), bf, dev, 1000 * seed + 4)
            return (lambda: hal.rms_norm(x, w, 1e-6, **tri)), (lambda: hf_rms_norm(x, w, 1e-6)), [x, w]
        out.append(Case(f"rms_norm/strict/R{rows}", "rms_norm", "strict", f"{rows}x{h} bf16", build,
                        stock_name="HF Qwen3RMSNorm (torch)"))

    for kind in ("softmax", "log_softmax", "logsumexp"):
        ours_fn, stock_fn = getattr(hal, kind), getattr(torch, kind)
        for rows in s.vocab_rows:
            def build(seed, rows=rows, ours_fn=ours_fn, stock_fn=stock_fn):
                x = _randn((rows, s.vocab), bf, dev, 1000 * seed + 5, 3.0)
                return (lambda: ours_fn(x, -1, **tri)), (lambda: stock_fn(x, -1)), [x]
            out.append(Case(f"{kind}/strict/R{rows}", kind, "strict", f"{rows}x{s.vocab} bf16", build,
                            stock_name=f"torch.{kind}"))

    # strict, and fast: the logits on tensor cores under the fast switch's spec (hal.spec.POLICY_SPECS["fast"]:
    # FastMatmulSpec's 128 x 128 x 64 launch, float32 accumulator kept), the log-softmax strict (issue 49 item 4)
    from hal.spec import POLICY_SPECS
    for policy in ("strict", "fast"):
        for n in s.logprob_rows:
            def build(seed, n=n, policy=policy):
                x = _randn((n, h), bf, dev, 1000 * seed + 6)
                w = _randn((s.vocab, h), bf, dev, 1000 * seed + 7, h ** -0.5)
                tok = (torch.arange(n, device=dev) * 7919) % s.vocab
                stock = lambda: torch.log_softmax(F.linear(x, w).float(), -1).gather(-1, tok[:, None])  # noqa: E731
                spec = POLICY_SPECS["fast"]["token_logprobs"] if policy == "fast" else None
                return (lambda: hal.token_logprobs(x, w, tok, spec=spec, **tri)), stock, [x, w, tok]
            out.append(Case(f"token_logprobs/{policy}/N{n}", "token_logprobs", policy, f"N{n} H{h} V{s.vocab} bf16"
                            + (" (fast logits, strict log-softmax)" if policy == "fast" else ""),
                            build, flops=2.0 * n * h * s.vocab,  # the LM head once: its float32 logits are kept
                            stock_name="F.linear + float32 log_softmax + gather"))

    # the bet of the words logits on 16 warps at 8 rows (token_logprobs.WORDS_WARPS, Triton < 3.7): the same call on
    # the earlier 8 warps, against the row above (same inputs: the seed is the row's). Set through _with_constants, so
    # that the replay runs it too: the words chains' pair of 2026-12-04 (vec_chains) restored its constant by hand,
    # and its replay ran the default path (its graph figure, 1164 vs 1156 us, is the words path twice)
    n = s.logprob_rows[0]

    def build_8_warps(seed, n=n):
        from hal.kernels.triton import token_logprobs as ktl
        ours, stock, tensors = next(c for c in out if c.id == f"token_logprobs/strict/N{n}").build(seed)
        return _with_constants(ktl, ours, dict(WORDS_WARPS=8)), stock, tensors
    out.append(Case(f"token_logprobs/strict/N{n}/words_8_warps", "token_logprobs", "strict",
                    f"N{n} H{h} V{s.vocab} bf16 (WORDS_WARPS=8)", build_8_warps, flops=2.0 * n * h * s.vocab,
                    stock_name="F.linear + float32 log_softmax + gather"))

    for b in s.decode_batches:
        for policy in ("strict", "fast"):
            def build(seed, b=b, policy=policy):
                per_seq = s.ctx // s.page
                pages = b * per_seq
                kc = _randn((pages, s.page, s.hkv, s.d), bf, dev, 1000 * seed + 11)
                vc = _randn((pages, s.page, s.hkv, s.d), bf, dev, 1000 * seed + 12)
                perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
                table = perm.to(torch.int32).reshape(b, per_seq).to(dev)
                lens = torch.full((b,), s.ctx, dtype=torch.int32, device=dev)
                q = _randn((b, 1, s.hq, s.d), bf, dev, 1000 * seed + 13)
                # stock: the same keys as a contiguous cache (no paging in torch)
                kt = kc[table.long()].reshape(b, s.ctx, s.hkv, s.d).transpose(1, 2).contiguous()
                vt = vc[table.long()].reshape(b, s.ctx, s.hkv, s.d).transpose(1, 2).contiguous()
                qt = q.transpose(1, 2).contiguous()
                spec = FastAttentionSpec() if policy == "fast" else None
                return ((lambda: hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                             spec=spec, **tri)),
                        (lambda: sdpa(qt, kt, vt, False)), [q, kc, vc, table, lens])
            out.append(Case(f"attention_decode/{policy}/B{b}", "attention_decode", policy,
                            f"B{b} ctx{s.ctx} page{s.page} Hq{s.hq}/Hkv{s.hkv} D{s.d} bf16", build,
                            stock_name="SDPA on a contiguous cache (enable_gqa)"))
        fast = out[-1]  # this batch's fast row, beside its earlier path

        def check_decode(tensors):
            q, kc, vc, table, lens = tensors
            return hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, return_lse=True,
                                               spec=FastAttentionSpec(), **tri)
        out.append(_fast_attention_path(fast, "general", check_decode))
        new = out[-3]  # this batch's strict row
        for name, knobs in old_decode.items():  # the earlier strict path, beside it (one run decides)
            def build_old(seed, knobs=knobs, build=new.build):
                ours, stock, tensors = build(seed)
                return _attention_knobs(ours, **knobs), stock, tensors
            out.append(Case(f"attention_decode/strict/B{b}/{name}", "attention_decode", "strict", new.shape,
                            build_old, stock_name=new.stock_name))
        out.append(_decode_tile_decode(next(c for c in out if c.id == f"attention_decode/fast/B{b}"), tri))

    H, HV, d, t_gdn, nb = s.gdn  # names no later loop rebinds (the builders read them when called)
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                       torch_recurrent_gated_delta_rule)
    except Exception:  # no transformers: the rows run without a stock
        torch_chunk_gated_delta_rule = torch_recurrent_gated_delta_rule = None

    def gdn_inputs(seed, n, t):
        q, k = _randn((n, t, H, d), bf, dev, 1000 * seed + 14), _randn((n, t, H, d), bf, dev, 1000 * seed + 15)
        v = _randn((n, t, HV, d), bf, dev, 1000 * seed + 16)
        g = -_randn((n, t, HV), torch.float32, dev, 1000 * seed + 17).abs()
        beta = torch.sigmoid(_randn((n, t, HV), torch.float32, dev, 1000 * seed + 18)).to(bf)
        return q, k, v, g, beta

    def build_decode(seed):
        q, k, v, g, beta = gdn_inputs(seed, nb, 1)
        S = _randn((nb, HV, d, d), torch.float32, dev, 1000 * seed + 19, 0.1)
        qx, kx = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
        stock = None if torch_recurrent_gated_delta_rule is None else (
            lambda: torch_recurrent_gated_delta_rule(qx, kx, v, g=g, beta=beta, initial_state=S,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True))
        return ((lambda: hal.fused_recurrent_gated_delta_rule(q, k, v, g, beta, d ** -0.5, S, True,
                                                              use_qk_l2norm_in_kernel=True, **tri)),
                stock, [q, k, v, g, beta, S])
    out.append(Case(f"gdn_decode/strict/B{nb}", "gdn_decode", "strict", f"B{nb} 1 token H{H}/{HV} d{d} bf16",
                    build_decode, flops=2.0 * 3 * nb * HV * d * d, stock_name=GDN_STOCK_RECURRENT))

    def build_chunk(seed):
        q, k, v, g, beta = gdn_inputs(seed, 1, t_gdn)
        qx, kx = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
        stock = None if torch_chunk_gated_delta_rule is None else (
            lambda: torch_chunk_gated_delta_rule(qx, kx, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True))
        return ((lambda: hal.chunk_gated_delta_rule(q, k, v, g, beta, d ** -0.5, None, True,
                                                    use_qk_l2norm_in_kernel=True, **tri)), stock, [q, k, v, g, beta])
    out.append(Case(f"gdn_chunked/strict/T{t_gdn}", "gdn_chunked", "strict", f"B1 T{t_gdn} H{H}/{HV} d{d} bf16",
                    build_chunk, flops=2.0 * 5 * t_gdn * HV * d * d, stock_name=GDN_STOCK_CHUNK))

    def build_chunk_one_dot(seed):  # the row above with one dot per d_k tile (64 lanes; the path before)
        from hal.kernels.triton import gated_delta_rule as tri_gdn
        ours, stock, tensors = build_chunk(seed)
        return _with_constants(tri_gdn, ours, dict(FULL_DOT_K=0)), stock, tensors
    # old vs new (issue 41, Triton 3.6 spill): gated_delta_rule.FULL_DOT_K 0, one 64-lane dot per d_k tile (56 B of
    # stack under 3.6); the row above runs each tile's chain through two 32-lane dots (no stack). The FMA dots against
    # the explicit chains was measured before (docs/gpu_h200/2026-12-04d: dots 1.27x, kept)
    out.append(Case(f"gdn_chunked/strict/T{t_gdn}/one_dot", "gdn_chunked", "strict",
                    f"B1 T{t_gdn} H{H}/{HV} d{d} bf16, one 64-lane dot per d_k tile", build_chunk_one_dot,
                    flops=2.0 * 5 * t_gdn * HV * d * d, stock_name=GDN_STOCK_CHUNK))

    out += _gdn_fast_cases(s, dev, gdn_inputs, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

    for T in s.attn_T:
        for policy in ("strict", "fast"):
            def build(seed, T=T, policy=policy):
                q = _randn((T, s.hq, s.d), bf, dev, 1000 * seed + 8)
                k, v = (_randn((T, s.hkv, s.d), bf, dev, 1000 * seed + i) for i in (9, 10))
                cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
                qt, kt, vt = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
                spec = FastAttentionSpec() if policy == "fast" else None
                return ((lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True, spec=spec, **tri)),
                        (lambda: sdpa(qt, kt, vt, True)), [q, k, v])
            out.append(Case(f"attention_prefill/{policy}/T{T}", "attention_prefill", policy,
                            f"T{T} causal Hq{s.hq}/Hkv{s.hkv} D{s.d} bf16", build,
                            flops=2.0 * 2 * T * T * s.hq * s.d / 2, stock_name="SDPA causal (enable_gqa)"))
        if T == s.attn_T[0]:  # the fast row's other paths, the shorter T only (the stage budget)
            def check_prefill(tensors, T=T):
                q, k, v = tensors
                cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
                return hal.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True, return_lse=True,
                                                  spec=FastAttentionSpec(), **tri)
            fast = out[-1]
            out += [_fast_attention_path(fast, suffix, check_prefill) for suffix in FAST_ATTENTION_PATHS]
        if T == s.attn_T[0]:  # the decode-tile spec's prefill, the shorter T only (the stage budget)
            out.append(_decode_tile_prefill(next(c for c in out if c.id == f"attention_prefill/fast/T{T}"), tri))
        new = next(c for c in out if c.id == f"attention_prefill/strict/T{T}")  # this length's strict row
        for name, knobs in old_prefill.items() if T == s.attn_T[0] else ():  # the shorter T only: the stage budget
            def build_old(seed, knobs=knobs, build=new.build):
                ours, stock, tensors = build(seed)
                return _attention_knobs(ours, **knobs), stock, tensors
            out.append(Case(f"attention_prefill/strict/T{T}/{name}", "attention_prefill", "strict", new.shape,
                            build_old, flops=new.flops, stock_name=new.stock_name))

    for rows in (s.decode_rows[0], s.prefill_rows[0]):
        def build(seed, rows=rows):
            a = _randn((rows, s.inter), bf, dev, 1000 * seed + 20)
            b = _randn((rows, s.inter), bf, dev, 1000 * seed + 21)
            return (lambda: hal.silu_mul(a, b, **tri)), (lambda: F.silu(a) * b), [a, b]
        out.append(Case(f"silu_mul/strict/R{rows}", "silu_mul", "strict", f"{rows}x{s.inter} bf16", build,
                        stock_name="F.silu(a) * b"))

    def build_rot(seed, rows=s.prefill_rows[0]):
        x = _randn((rows, s.hq, s.d), bf, dev, 1000 * seed + 22)
        cos, sin = hal.rotary_cos_sin(torch.arange(rows, device=dev), s.d, **tri)
        c, sn = cos[:, None, :], sin[:, None, :]
        cf, sf = torch.cat([c, c], -1).to(bf), torch.cat([sn, sn], -1).to(bf)

        def stock():  # HF rotate_half
            x1, x2 = x[..., : s.d // 2], x[..., s.d // 2:]
            return x * cf + torch.cat([-x2, x1], -1) * sf
        return (lambda: hal.apply_rotary(x, c, sn, **tri)), stock, [x, cos, sin]
    rows = s.prefill_rows[0]
    out.append(Case(f"apply_rotary/strict/T{rows}", "apply_rotary", "strict", f"T{rows} H{s.hq} D{s.d} bf16",
                    build_rot, stock_name="HF rotate_half (torch)"))
    return out


GDN_STOCK_CHUNK = "transformers torch_chunk_gated_delta_rule (pure-torch reference, not FLA)"
GDN_STOCK_RECURRENT = "transformers torch_recurrent_gated_delta_rule (pure-torch reference, not FLA)"
#: the fast GDN decode rows' position in the open chunk (a decode step recomputes the rows since the boundary)
GDN_FAST_DECODE_ROW = 32


def _fla_gdn():
    """FLA's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), or None when fla does not import (the
    device has no network: its wheel must travel with the command)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _gdn_fast_cases(s: Shapes, dev: str, gdn_inputs, hf_chunk, hf_recurrent) -> list[Case]:
    """``gdn_chunked/fast/T*`` and ``gdn_decode/fast/B*`` (FastGatedDeltaRuleSpec, Qwen3-Next / Qwen3.5 GDN heads):
    stock is transformers' pure-torch reference, the target FLA's Triton kernels (``target_*``; "no FLA: no
    ratio" when fla does not import). Decode: one token per sequence at row GDN_FAST_DECODE_ROW of the open chunk
    (the state object of a prefill of that many tokens), FLA from its bare state."""
    import hal
    from hal.spec import FastGatedDeltaRuleSpec
    spec = FastGatedDeltaRuleSpec()
    H, HV, d = s.gdn[:3]
    tri = dict(backend="triton", spec=spec)
    fla = _fla_gdn()
    widen = lambda x: x.repeat_interleave(HV // H, dim=2)  # noqa: E731  value head j reads q/k head j // (HV / H)
    out = []

    def fla_chunk(tensors):
        if fla is None:
            return None
        q, k, v, g, beta = tensors
        qx, kx = widen(q), widen(k)
        return lambda: fla[0](qx, kx, v, g, beta, scale=d ** -0.5, use_qk_l2norm_in_kernel=True)

    def fla_step(tensors):
        if fla is None:
            return None
        q, k, v, g, beta, S = tensors
        qx, kx = widen(q), widen(k)
        return lambda: fla[1](qx, kx, v, g, beta, scale=d ** -0.5, initial_state=S, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)

    for T in s.gdn_fast_T:
        def build(seed, T=T):
            q, k, v, g, beta = gdn_inputs(seed, 1, T)
            qx, kx = widen(q), widen(k)
            stock = None if hf_chunk is None else (
                lambda: hf_chunk(qx, kx, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True))
            ours = lambda: hal.chunk_gated_delta_rule(q, k, v, g, beta, d ** -0.5, None, True,  # noqa: E731
                                                      use_qk_l2norm_in_kernel=True, **tri)
            return ours, stock, [q, k, v, g, beta]
        out.append(Case(f"gdn_chunked/fast/T{T}", "gdn_chunked", "fast", f"B1 T{T} H{H}/{HV} d{d} bf16", build,
                        flops=2.0 * 5 * T * HV * d * d, stock_name=GDN_STOCK_CHUNK, target=fla_chunk,
                        target_name="FLA chunk_gated_delta_rule"))
    r = GDN_FAST_DECODE_ROW
    for nb in s.gdn_fast_B:
        def build_decode(seed, nb=nb):
            q0, k0, v0, g0, b0 = gdn_inputs(seed + 500, nb, r)
            _, st = hal.chunk_gated_delta_rule(q0, k0, v0, g0, b0, d ** -0.5, None, "state",
                                               use_qk_l2norm_in_kernel=True, **tri)
            q, k, v, g, beta = gdn_inputs(seed, nb, 1)
            S = st.final_state
            qx, kx = widen(q), widen(k)
            stock = None if hf_recurrent is None else (
                lambda: hf_recurrent(qx, kx, v, g=g, beta=beta, initial_state=S, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True))
            return ((lambda: hal.fused_recurrent_gated_delta_rule(q, k, v, g, beta, d ** -0.5, st, "state",
                                                                  use_qk_l2norm_in_kernel=True, **tri)),
                    stock, [q, k, v, g, beta, S])
        out.append(Case(f"gdn_decode/fast/B{nb}", "gdn_decode", "fast",
                        f"B{nb} 1 token at chunk row {r} H{H}/{HV} d{d} bf16", build_decode,
                        flops=2.0 * 3 * nb * HV * d * d, stock_name=GDN_STOCK_RECURRENT, target=fla_step,
                        target_name="FLA fused_recurrent_gated_delta_rule"))
    return out


# ---------------------------------------------------------------- helpers on results

def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts) -> int:
    seen, n = set(), 0
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


def _first(x):
    ts = _tensors(x)
    return ts[0] if ts else None


def _bits(label, eager, replayed) -> str:
    from hal.conformance.bits import first_divergence
    e, r = _first(eager), _first(replayed)
    if e is None or r is None:
        return "no tensor output"
    d = first_divergence(label, e, r)
    return "same" if d is None else f"DIFFER: {d}"


def _ceilings(out: Out) -> tuple[dict, str]:
    got = {r["name"]: r["value"] for r in out.rows("ceilings.jsonl") if "value" in r}
    if {"copy_GBps", "bf16_TFLOPs", "fp32_TFLOPs"} <= got.keys():
        return got, "measured"
    return {**NOMINAL, **got}, "nominal H200 (ceilings stage missing)"


def _free(cuda: bool):
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- stages

def stage_env(args, out: Out, deadline: float) -> None:
    import triton
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "device": args.device, "host": platform.node(), "cpus": os.cpu_count(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    if args.cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None),
                    memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
    else:
        info.update(gpu="none (CPU stand-in)", sms=args.shapes.sms, cpu=platform.processor() or platform.machine())
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            info["driver"] = subprocess.run([smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:
            info["driver"] = f"nvidia-smi failed: {e}"
    else:
        info["driver"] = "nvidia-smi not found"
    with open(out.path("env.json"), "w") as f:
        json.dump(info, f, indent=1)
    say("env: " + "  ".join(f"{k}={v}" for k, v in info.items()))


def stage_ceilings(args, out: Out, deadline: float) -> None:
    clock = Clock(args.cuda, 0.2 if args.cuda else 0.02)
    dev = args.device
    n_copy = (1 << 30) if args.cuda else (8 << 20)
    src = torch.empty(n_copy, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    t, method, _ = clock.per_call([lambda: dst.copy_(src)])
    out.row("ceilings.jsonl", {"name": "copy_GBps", "value": 2 * n_copy / t / 1e9, "bytes": 2 * n_copy,
                               "seconds": t, "method": method, "what": "device-to-device copy, read + write bytes"})
    del src, dst
    n = 8192 if args.cuda else 256
    for name, dtype in (("bf16_TFLOPs", torch.bfloat16), ("fp32_TFLOPs", torch.float32)):
        if time.monotonic() > deadline:
            out.row("ceilings.jsonl", {"name": name, "skipped": "stage budget spent"})
            continue
        a, b = _randn((n, n), dtype, dev, 1), _randn((n, n), dtype, dev, 2)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32: true fp32 FMA (SGEMM), no TF32 tensor cores
        try:
            t, method, _ = clock.per_call([lambda: a @ b])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        out.row("ceilings.jsonl", {"name": name, "value": 2.0 * n ** 3 / t / 1e12, "flops": 2.0 * n ** 3,
                                   "seconds": t, "method": method, "what": f"{n}^3 matmul, {dtype}, TF32 off"})
        del a, b
    _free(args.cuda)
    for r in out.rows("ceilings.jsonl"):
        say(f"ceiling {r['name']}: {r.get('value', r.get('skipped'))}  [triton {TRITON}]")


def _n_sets(bytes_per_call: int, cuda: bool, flops: float, ceil: dict) -> int:
    """Input sets to rotate: enough that one replay touches ROTATE_BYTES (CPU: 2, to exercise rotation)."""
    if not cuda:
        return 2
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1))))


def measure(case: Case, args, clock: Clock, ceil: dict) -> tuple[dict, list]:
    cuda = args.cuda
    row = {"id": case.id, "op": case.op, "policy": case.policy, "shape": case.shape, "stock": case.stock_name}
    t0 = time.perf_counter()
    ours0, stock0, tensors0 = case.build(0)
    with Launches(sass=cuda) as log:  # the kernels this call launches: the ones its launch path repeats
        path0, eager0 = launch_path_of(case, ours0)  # the eager call: validation and the kernels' compiles
        clock.sync()
    row["first_call_s"] = time.perf_counter() - t0
    nbytes = _nbytes(tensors0) + _nbytes(_tensors(eager0))
    row["bytes"], row["flops"] = nbytes, case.flops
    n = _n_sets(nbytes, cuda, case.flops, ceil)
    sets = [(ours0, stock0, path0, eager0)]
    targets = [case.target(tensors0)] if case.target else []
    for i in range(1, n):
        o, st, tens = case.build(i)
        p, e = launch_path_of(case, o)
        sets.append((o, st, p, e))
        if case.target:
            targets.append(case.target(tens))
    row["sets"], row["touched_MB"] = n, n * nbytes / 1e6
    kernels = log.items
    row["kernels"] = [k["kernel"] for k in kernels]
    row["grids"] = [k["grid"] for k in kernels]
    row["n_regs"] = [k["n_regs"] for k in kernels]
    row["n_spills"] = [k["n_spills"] for k in kernels]
    one = clock.once(path0) if cuda else 0.0  # a warm call (the first one compiled)
    if one > args.slow_call_s:  # a graph of it would eat the stage: that one timed call is the figure
        t, method, outs = one, f"events (1 call: {one:.2f} s > --slow-call-s)", [path0()]
        sets = sets[:1]
    else:
        t, method, outs = clock.per_call([p for _, _, p, _ in sets], capture=case.via_launch_path)
    row["ours_s"], row["method"] = t, method
    bits = [_bits(f"{case.id} set {i}", e, o) for i, ((_, _, _, e), o) in enumerate(zip(sets, outs))]
    row["bits"] = "same" if all(b == "same" for b in bits) else next(b for b in bits if b != "same")
    if stock0 is not None:
        # stock timed the same way as ours (eager by events when ours cannot be captured), so the ratio compares like
        ts, smethod, _ = clock.per_call([st for _, st, _, _ in sets], capture=case.via_launch_path)
        row["stock_s"], row["stock_method"], row["ratio"] = ts, smethod, ts / t
    else:
        row["stock_s"], row["ratio"] = None, None
    if case.target:  # the row's target beside stock (FLA for the fast GDN rows), timed as stock is
        row["target"] = case.target_name
        targets = targets[:len(sets)]
        if all(x is not None for x in targets):
            tt, tmethod, _ = clock.per_call(targets, capture=case.via_launch_path)
            row["target_s"], row["target_method"], row["target_ratio"] = tt, tmethod, tt / t
        else:
            row["target_s"], row["target_ratio"] = None, None
            row["target_note"] = f"no {case.target_name.split()[0]}: no ratio"
    row["GBps"] = nbytes / t / 1e9
    row["mem_frac"] = row["GBps"] / ceil["copy_GBps"]
    if case.flops:
        row["TFLOPs"] = case.flops / t / 1e12
        row["fp32_frac"] = row["TFLOPs"] / ceil["fp32_TFLOPs"]
        row["bf16_frac"] = row["TFLOPs"] / ceil["bf16_TFLOPs"]
    # strict arithmetic runs on fp32 FMA units; fast / exact on tensor cores (bf16 is the measured bound there)
    fracs = {"copy": row["mem_frac"]}
    if case.flops:
        unit = "fp32" if case.policy == "strict" else "bf16"
        fracs[unit] = row[f"{unit}_frac"]
    row["ceiling"], row["frac"] = max(fracs.items(), key=lambda kv: kv[1])
    del sets, outs
    return row, kernels


OPS_FIELDS = ["triton", "id", "shape", "ratio", "ours_s", "stock_s", "bytes", "flops", "GBps", "TFLOPs", "frac",
              "ceiling", "sets", "touched_MB", "method", "bits", "kernels", "grids", "n_regs", "n_spills", "error",
              "target", "target_ratio", "target_s", "target_note"]


def _fmt_row(r: dict) -> str:
    if r.get("error"):
        return f"{r['id']:<34} ERROR {r['error'][:150]}"
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}x"
    return (f"{r['id']:<34} {ratio:>9} ours {r['ours_s'] * 1e6:10.1f} us  stock "
            f"{(r['stock_s'] or 0) * 1e6:10.1f} us  {r['frac'] * 100:5.1f}% of {r['ceiling']}  sets {r['sets']:>2}  "
            f"bits {r['bits'][:40]}  kernels {','.join(r['kernels'])}  regs {r['n_regs']} spills {r['n_spills']}  "
            f"[triton {TRITON}, {r['method'][:20]}]" + _fmt_target(r))


def _fmt_target(r: dict) -> str:
    if not r.get("target"):
        return ""
    if r.get("target_ratio") is None:
        return f"  vs {r['target']}: {r.get('target_note', 'no ratio')}"
    return f"  vs {r['target']}: {r['target_ratio']:.3f}x ({r['target_s'] * 1e6:.1f} us)"


def stage_ops(args, out: Out, deadline: float) -> None:
    ceil, source = _ceilings(out)
    say(f"ops: ceilings {source}: {ceil}  [triton {TRITON}]")
    clock = Clock(args.cuda, args.target_s)
    todo = [c for c in cases(args.shapes, args.device) if (not args.only or any(s in c.id for s in args.only))
            and not any(s in c.id for s in args.skip or ())]
    for case in todo:  # what this stage means to measure: a row the shell's timeout cut off stays "not run"
        out.row("planned.jsonl", {"id": case.id, "op": case.op, "policy": case.policy})
    for i, case in enumerate(todo):
        if time.monotonic() > deadline:
            for rest in todo[i:]:
                out.row("ops.jsonl", {"id": rest.id, "op": rest.op, "policy": rest.policy,
                                      "skipped": "not run (stage budget spent)"})
            say(f"ops: budget spent, {len(todo) - i} rows not measured (ops.jsonl: skipped)")
            break
        try:
            row, kernels = measure(case, args, clock, ceil)
        except Exception as e:  # report and go on
            row, kernels = {"id": case.id, "op": case.op, "policy": case.policy, "shape": case.shape,
                            "error": f"{type(e).__name__}: {e}"[:400]}, []
        row["ceiling_source"] = source
        row = out.row("ops.jsonl", row)
        for k in kernels:
            out.row("kernels.jsonl", {"id": case.id, **k})
        out.csv_row("ops.csv", row, OPS_FIELDS)
        say(_fmt_row(row))
        _free(args.cuda)


def _measured(out: Out) -> list[dict]:
    return [r for r in out.rows("ops.jsonl") if r.get("ours_s") is not None]


def _worst(out: Out, k: int) -> list[dict]:
    rows = [r for r in _measured(out) if r.get("ratio") is not None]
    return sorted(rows, key=lambda r: r["ratio"])[:k]


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


def stage_profile(args, out: Out, deadline: float) -> None:
    from torch.profiler import ProfilerActivity, profile
    by_id = {c.id: c for c in cases(args.shapes, args.device)}
    worst = _worst(out, args.profile_rows)
    if not worst:
        out.row("profile.jsonl", {"skipped": "no measured row with a ratio in ops.jsonl"})
        say("profile: nothing to profile")
        return
    for r in worst:
        if time.monotonic() > deadline:
            out.row("profile.jsonl", {"id": r["id"], "skipped": "stage budget"})
            continue
        case = by_id.get(r["id"])
        try:
            ours, _, _ = case.build(0)
            path, _ = launch_path_of(case, ours)
            if args.cuda:  # warm (the eager call compiled)
                path()
                torch.cuda.synchronize()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.cuda else [])
            calls = 3 if args.cuda else 1
            with Launches(sass=False) as log, profile(activities=acts) as prof:
                for _ in range(calls):
                    path()
                if args.cuda:
                    torch.cuda.synchronize()
            names = {k["kernel"] for k in log.items}
            per: dict[str, float] = {}
            if args.cuda:  # device time per kernel; torch's own kernels (copies, fills, cuBLAS) as "torch:..."
                for evt in prof.key_averages():
                    us = _device_us(evt)
                    if us > 0 and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
                        key = evt.key if any(nm in evt.key for nm in names) else f"torch:{evt.key[:60]}"
                        per[key] = per.get(key, 0.0) + us
                source = f"torch.profiler CUDA ({calls} eager launch-path calls)"
            else:  # stand-in: the interpreter runs each kernel inside its launch, so launch wall time is its time
                for k in log.items:
                    per[k["kernel"]] = per.get(k["kernel"], 0.0) + k["host_s"] * 1e6
                source = "cpu stand-in: interpreter wall time per launch"
            total = sum(per.values()) or 1.0
            top = sorted(per.items(), key=lambda kv: -kv[1])
            first = log.items[0]["kernel"] if log.items else None
            rec = {"id": r["id"], "ratio": r["ratio"], "source": source, "first_kernel": first,
                   "kernels": [{"name": n, "us": us / calls, "share": us / total} for n, us in top],
                   "torch_share": sum(us for n, us in per.items() if n.startswith("torch:")) / total}
            out.row("profile.jsonl", rec)
            avg = prof.key_averages()
            sort = "self_cpu_time_total" if not args.cuda else next(
                (k for k in ("self_device_time_total", "self_cuda_time_total") if avg and hasattr(avg[0], k)),
                "self_cpu_time_total")
            out.text("profile.txt", f"\n==== {r['id']} (ratio {r['ratio']:.3f}) [triton {TRITON}] ====\n"
                     + avg.table(sort_by=sort, row_limit=12) + "\n")
            say(f"profile {r['id']}: " + ", ".join(f"{n} {s['share'] * 100:.0f}%" for n, s in
                                                  zip([k['name'] for k in rec['kernels']], rec['kernels'][:4])))
        except Exception as e:
            out.row("profile.jsonl", {"id": r["id"], "error": f"{type(e).__name__}: {e}"[:300]})
            say(f"profile {r['id']}: error {type(e).__name__}: {e}")
        _free(args.cuda)


def find_ncu() -> str | None:
    for p in (shutil.which("ncu"), "/usr/local/cuda/bin/ncu", *sorted(_glob("/opt/nvidia/nsight-compute/*/ncu")),
              *sorted(_glob("/usr/local/cuda*/bin/ncu"))):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _glob(pattern):
    import glob
    return glob.glob(pattern)


#: rows slower than this are not profiled by Nsight Compute: it replays each profiled launch once per counter pass
#: (tens of passes for its sections), so a 118 ms prefill launch alone took the 40 s stage (H200, 2026-12-04)
NCU_MAX_ROW_US = 5000.0


def worst_kernels(out: Out, k: int = 3, max_row_us: float | None = None) -> list[tuple[str, str]]:
    """(case id, kernel name) of the three worst kernels among rows under max_row_us (None: every row): each worst
    row's kernel with the most device time (profile), else its first launched kernel; one per kernel name."""
    prof = {p["id"]: p for p in out.rows("profile.jsonl") if p.get("kernels")}
    picked, seen = [], set()
    for r in _worst(out, 50):
        if max_row_us is not None and (r.get("ours_s") or 0.0) * 1e6 > max_row_us:
            continue
        p = prof.get(r["id"])
        names = [kk["name"] for kk in p["kernels"] if not kk["name"].startswith("torch:")] if p else r["kernels"]
        for name in names[:1]:
            if name not in seen:
                seen.add(name)
                picked.append((r["id"], name))
        if len(picked) == k:
            break
    return picked


def ncu_command(ncu: str, picked: list[tuple[str, str]], args) -> list[str]:
    """One ncu run over one child that runs every picked case (one process start-up for the three kernels)."""
    target = [sys.executable, "-m", "benchmarks.gpu_perf", "--device", args.device, *(["--tiny"] if args.tiny else []),
              "--run-case", *dict.fromkeys(case for case, _ in picked)]
    names = "|".join(dict.fromkeys(kernel for _, kernel in picked))
    return [ncu, "--target-processes", "all", "--kernel-name-base", "function", "--kernel-name", f"regex:^({names})$",
            "--launch-count", str(2 * len(picked)), "--section", "SpeedOfLight", "--section", "LaunchStats",
            "--section", "Occupancy", "--section", "MemoryWorkloadAnalysis", "--section", "WarpStateStats",
            "--csv", "--page", "details", *target]


NCU_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
               "Registers Per Thread", "Grid Size", "Block Size", "Waves Per SM")


def parse_ncu(text: str) -> dict:
    """The key metrics of ncu's ``--csv --page details`` output: kernel name -> {metric: "value unit"}, from the
    kernel's last profiled launch (a replay, after the compiling call)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    launches: dict[str, dict] = {}
    for rec in csv.DictReader(lines):
        name = rec.get("Metric Name")
        if name in NCU_METRICS:
            launches.setdefault((rec.get("Kernel Name", "?"), rec.get("ID", "")), {})[name] = \
                f"{rec.get('Metric Value', '')} {rec.get('Metric Unit', '')}".strip()
    got = {}
    for (kernel, _), metrics in launches.items():  # csv order: later launches overwrite earlier ones
        got[kernel] = metrics
    return got


def stage_ncu(args, out: Out, deadline: float) -> None:
    picked = worst_kernels(out, max_row_us=NCU_MAX_ROW_US if args.cuda else None)  # CPU: interpreter times
    ncu = find_ncu()
    if not picked:
        out.row("ncu.jsonl", {"skipped": "no measured kernel in ops.jsonl"})
        say("ncu: no kernel to profile")
        return
    cmd = ncu_command(ncu or "ncu", picked, args)
    rec = {"cmd": " ".join(cmd)}
    if ncu is None:
        rec["status"] = "skipped: ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)"
        if not args.cuda:  # CPU dry run: the target command itself must run
            left = max(5.0, deadline - time.monotonic())
            p = subprocess.run(cmd[cmd.index(sys.executable):], capture_output=True, text=True, timeout=left)
            rec["target_rc"], rec["target_tail"] = p.returncode, (p.stdout + p.stderr)[-300:]
        metrics = {}
    elif deadline - time.monotonic() < 10:
        rec["status"], metrics = "skipped: stage budget", {}
    else:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline - time.monotonic())
            out.text("ncu_0.csv", p.stdout + ("\n# stderr:\n" + p.stderr[-4000:] if p.stderr else ""))
            metrics = parse_ncu(p.stdout)
            rec["status"] = "ok" if p.returncode == 0 and metrics else f"failed rc={p.returncode}"
            if not metrics:
                rec["tail"] = (p.stderr or p.stdout)[-300:]
        except Exception as e:  # timeout, counters not permitted (ERR_NVGPUCTRPERM): logged, the next stage runs
            rec["status"], metrics = f"failed: {type(e).__name__}: {str(e)[:200]}", {}
    for case_id, kernel in picked:
        got = next((m for name, m in metrics.items() if name == kernel or name.startswith(kernel + "(")), None)
        row = out.row("ncu.jsonl", {"id": case_id, "kernel": kernel, **rec,
                                    **({"metrics": got} if got else {})})
        say(f"ncu {kernel} ({case_id}): {row['status']} {got or ''}")


# ---------------------------------------------------------------- summary: symptoms from what was collected

def classify(row: dict, kernels: list[dict], prof: dict | None, ncu: list[dict], sms: int) -> list[str]:
    """The symptoms of one slow row, each with its evidence. Kernels: the row's kernels.jsonl records."""
    out = []
    spilled = [k for k in kernels if (k.get("n_spills") or 0) > 0 or (k.get("sass_stack") or 0) > 0]
    if spilled:
        out.append("spills: " + ", ".join(f"{k['kernel']} {k.get('n_spills')} spills/{k.get('sass_stack', '?')} B stack"
                                          for k in spilled))
    conv = [k for k in kernels if (k.get("sass_shared") or 0) >= 64 and (k.get("sass_barriers") or 0) >= 16]
    if conv:
        out.append("layout conversions: " + ", ".join(
            f"{k['kernel']} {k['sass_shared']} LDS/STS {k['sass_barriers']} BAR" for k in conv))
    main = None
    if prof and prof.get("kernels"):
        tri = [k for k in prof["kernels"] if not k["name"].startswith("torch:")]
        main_name = tri[0]["name"] if tri else None
        main = next((k for k in kernels if main_name and k["kernel"] in main_name), None)
        top = prof["kernels"][0]
        if prof.get("torch_share", 0) >= 0.3:
            out.append(f"secondary kernels dominating: torch ops take {prof['torch_share'] * 100:.0f}% of the device "
                       f"time (top {top['name'][:40]})")
        elif prof.get("first_kernel") and len(tri) > 1 and prof["first_kernel"] not in top["name"] \
                and top["share"] >= 0.4:
            out.append(f"secondary kernel dominating: {top['name'][:40]} {top['share'] * 100:.0f}% of the device time "
                       f"(first kernel {prof['first_kernel']})")
    main = main or (max(kernels, key=lambda k: k.get("programs") or 0) if kernels else None)
    if main and main.get("programs") is not None and main["programs"] < sms:
        out.append(f"too few programs: {main['kernel']} grid {main['grid']} = {main['programs']} < {sms} SMs")
    for n in ncu:
        if n.get("metrics"):
            out.append(f"ncu {n['kernel']}: " + ", ".join(f"{k} {v}" for k, v in n["metrics"].items()
                                                         if k in ("DRAM Throughput", "Compute (SM) Throughput",
                                                                  "Achieved Occupancy")))
    if not [s for s in out if not s.startswith("ncu")] and row.get("frac") is not None and row["frac"] < 0.3:
        out.append(f"latency-bound loop: {row['frac'] * 100:.1f}% of the {row['ceiling']} ceiling with "
                   f"{main['programs'] if main else '?'} programs, no spills or conversions")
    return out or ["unclassified (near a ceiling, or nothing collected)"]


def stage_summary(args, out: Out, deadline: float) -> None:
    rows = out.rows("ops.jsonl")
    kernels: dict[str, list] = {}
    for k in out.rows("kernels.jsonl"):
        kernels.setdefault(k["id"], []).append(k)
    prof = {p["id"]: p for p in out.rows("profile.jsonl") if "id" in p}
    ncu = out.rows("ncu.jsonl")
    env = {}
    if os.path.exists(out.path("env.json")):
        with open(out.path("env.json")) as f:
            env = json.load(f)
    sms = int(env.get("sms") or args.shapes.sms)
    ceil, source = _ceilings(out)
    lines = [f"==== gpu_perf summary [triton {TRITON}, torch {torch.__version__}, {env.get('gpu', '?')}; "
             f"ceilings ({source}): copy {ceil['copy_GBps']:.0f} GB/s, bf16 {ceil['bf16_TFLOPs']:.1f} TFLOP/s, "
             f"fp32 {ceil['fp32_TFLOPs']:.1f} TFLOP/s] ====",
             f"{'row':<34} {'ratio':>8} {'ours us':>10} {'stock us':>10} {'of ceiling':>14}  bits"]
    reached = {r["id"] for r in rows}
    rows = rows + [{"id": p["id"], "skipped": "not run (its stage ended before it)"}
                   for p in out.rows("planned.jsonl") if p["id"] not in reached and not reached.add(p["id"])]
    for r in rows:
        if r.get("ours_s") is None:
            lines.append(f"{r['id']:<34} {'-':>8}  {r.get('error') or r.get('skipped')}"[:200])
            continue
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}x"
        lines.append(f"{r['id']:<34} {ratio:>8} {r['ours_s'] * 1e6:10.1f} {(r.get('stock_s') or 0) * 1e6:10.1f} "
                     f"{r['frac'] * 100:6.1f}% {r['ceiling']:<6}  {r['bits'][:60]}")
    lines.append(f"---- slow rows (ratio < {SLOW}), worst first: symptoms [triton {TRITON}] ----")
    slow = sorted((r for r in _measured(out) if r.get("ratio") is not None and r["ratio"] < SLOW),
                  key=lambda r: r["ratio"])
    for r in slow:
        ks = kernels.get(r["id"], [])
        symptoms = classify(r, ks, prof.get(r["id"]), [n for n in ncu if n.get("id") == r["id"]], sms)
        out.row("summary.jsonl", {"id": r["id"], "ratio": r["ratio"], "symptoms": symptoms})
        lines.append((f"{r['id']:<34} {r['ratio']:.3f}x  " + " | ".join(symptoms))[:300])  # in full: summary.jsonl
    if not slow:
        lines.append("(none)")
    broken = [r for r in _measured(out) if r.get("bits") != "same"]
    lines.append(f"replay vs eager bits: {len(_measured(out)) - len(broken)} rows same, {len(broken)} differ"
                 + "".join(f"\n  {r['id']}: {r['bits'][:160]}" for r in broken))
    text = "\n".join(lines) + "\n"
    with open(out.path("summary.txt"), "w") as f:
        f.write(text)
    say(text)


def run_case(args) -> int:
    """The ncu target: each named case's lockstep call, eagerly through its launch path, then one replay of it
    (no timing)."""
    by_id = {c.id: c for c in cases(args.shapes, args.device)}
    for case_id in args.run_case:
        case = by_id[case_id]
        ours, _, _ = case.build(0)
        path, _ = launch_path_of(case, ours)
        if args.cuda:
            path()
            torch.cuda.synchronize()
        print(f"ran {case.id} [triton {TRITON}]", flush=True)
    return 0


RUNNERS = {"env": stage_env, "ceilings": stage_ceilings, "ops": stage_ops, "profile": stage_profile,
           "ncu": stage_ncu, "summary": stage_summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_perf", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu-perf-out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="interpreter-sized shapes (the CPU dry run)")
    p.add_argument("--stage", nargs="*", choices=STAGES, default=list(STAGES))
    p.add_argument("--budget", type=float, default=None, help="seconds for each stage run (default: per stage)")
    p.add_argument("--only", nargs="*", default=None, help="ops rows whose id contains one of these")
    p.add_argument("--skip", nargs="*", default=None, help="... leaving out those whose id contains one of these")
    p.add_argument("--target-s", type=float, default=0.05, help="timed replays per side, seconds (CUDA)")
    p.add_argument("--slow-call-s", type=float, default=1.0, help="a first call slower than this is timed once")
    p.add_argument("--profile-rows", type=int, default=None, help="worst rows profiled (default 4; --tiny 2)")
    p.add_argument("--run-case", nargs="+", default=None, help=argparse.SUPPRESS)  # the ncu stage's child
    args = p.parse_args(argv)
    args.cuda = args.device.startswith("cuda")
    if args.cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (the CPU dry run: TRITON_INTERPRET=1 ... --device cpu --tiny)")
    if not args.cuda and not os.environ.get("TRITON_INTERPRET"):
        p.error("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    args.shapes = TINY if args.tiny else QWEN3_8B
    args.profile_rows = args.profile_rows or (2 if args.tiny else 4)
    if args.run_case:
        return run_case(args)
    out = Out(args.out)
    for stage in args.stage:
        budget = args.budget if args.budget is not None else BUDGET_S[stage]
        t0 = time.monotonic()
        say(f"== stage {stage} (budget {budget:.0f} s) [triton {TRITON}]")
        try:
            RUNNERS[stage](args, out, t0 + budget)
        except Exception as e:  # a stage that fails is logged; the next one runs
            out.row("errors.jsonl", {"stage": stage, "error": f"{type(e).__name__}: {e}"[:500]})
            say(f"stage {stage} failed: {type(e).__name__}: {e}")
        say(f"== stage {stage} done in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
