"""Benchmark rows for the `cpu` backend (numba) against stock torch on the same tensors.

    python -m benchmarks.run --ops cpu --threads 1 2 --plot     # ratios at 1 and 2 threads + PNG
    python -m benchmarks.cpu --first-call                        # first call vs steady state
    python -m benchmarks.cpu --linear [--threads 1 2] [--quick]  # strict linear vs MKL float32, per vLLM shape
    python -m benchmarks.cpu --decode [--threads 1 2] [--rounds 3] [--cpu-time]  # decode rows: weight GB/s
    python -m benchmarks.cpu --pool [--threads 2]                # what handing a call to the pool's threads costs

Shapes follow issue 9's table: linear decode (M=1, K=N=4096, fp32 and bf16) and 16x256x256 /
128x1024x1024, rms_norm / softmax / log_softmax / token_logprobs at V=32k, attention decode
against a 4k paged cache and a T=512 causal prefill (vs SDPA). Gated delta rule (``_gdn_rows``): a
T=512 prefill and a one-token decode under both specs against transformers' Qwen3-Next torch
functions (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``), plus the GDN
layer's gating, conv1d and SwiGLU's silu_mul against their stock torch formulas.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import hal
from hal.kv_cache import KVCache

B = "cpu"


def _r(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _linear_rows():
    out = []
    for m, k, n, dt in ((1, 4096, 4096, torch.float32), (1, 4096, 4096, torch.bfloat16),
                        (16, 256, 256, torch.float32), (128, 1024, 1024, torch.float32)):
        x, w = _r(m, k, dtype=dt), _r(n, k, seed=1, dtype=dt)
        name = "fp32" if dt == torch.float32 else "bf16"
        out.append(("linear", f"{m}x{k}x{n} {name}", lambda x=x, w=w: hal.linear(x, w, backend=B),
                    lambda x=x, w=w: F.linear(x, w)))
    return out


def _foundation_rows(quick):
    hn, hh = (16, 1024) if quick else (256, 4096)
    sr, sv = (8, 4096) if quick else (32, 32768)
    tn, th, tv = (8, 128, 4096) if quick else (32, 512, 32768)
    x, w = _r(hn, hh), _r(hh, seed=2)
    s = _r(sr, sv)
    h, W, tok = _r(tn, th), _r(tv, th, seed=3), torch.arange(tn) * 13 % tv
    return [
        ("rms_norm", f"{hn}x{hh} fp32", lambda: hal.rms_norm(x, w, backend=B), lambda: F.rms_norm(x, (hh,), w, 1e-6)),
        ("softmax", f"{sr}x{sv} fp32", lambda: hal.softmax(s, backend=B), lambda: torch.softmax(s, -1)),
        ("log_softmax", f"{sr}x{sv} fp32", lambda: hal.log_softmax(s, backend=B), lambda: torch.log_softmax(s, -1)),
        ("token_logprobs", f"N{tn} H{th} V{tv} fp32", lambda: hal.token_logprobs(h, W, tok, backend=B),
         lambda: torch.log_softmax(F.linear(h, W), -1).gather(-1, tok[:, None])),
    ]


def _attention_rows(quick):
    hq, hkv, d = 8, 2, 128
    group = hq // hkv
    t = 128 if quick else 512
    q, k, v = _r(t, hq, d), _r(t, hkv, d, seed=1), _r(t, hkv, d, seed=2)
    cu = torch.tensor([0, t], dtype=torch.int32)
    qt, kt, vt = (x.repeat_interleave(hq // x.shape[1], 1).transpose(0, 1)[None] for x in (q, k, v))
    prefill = (lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, t, t, causal=True, backend=B),
               lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    bsz, ctx = (2, 512) if quick else (4, 4096)
    cache = KVCache.paged(bsz, ctx, hkv, d, page_size=16)
    cache.write(_r(bsz, ctx, hkv, d, seed=3), _r(bsz, ctx, hkv, d, seed=4))
    qd = _r(bsz, 1, hq, d, seed=5)
    kc = torch.stack([cache.keys(b) for b in range(bsz)]).repeat_interleave(group, 2).transpose(1, 2)
    vc = torch.stack([cache.values(b) for b in range(bsz)]).repeat_interleave(group, 2).transpose(1, 2)
    decode = (lambda: hal.flash_attn_with_kvcache(qd, cache.k, cache.v, cache_seqlens=cache.seqlens,
                                                  block_table=cache.block_table, backend=B),
              lambda: F.scaled_dot_product_attention(qd.transpose(1, 2), kc, vc))
    return [("attention prefill", f"T{t} H{hq}/{hkv} D{d} causal", *prefill),
            ("attention decode", f"B{bsz} ctx{ctx} paged16 H{hq}/{hkv} D{d}", *decode)]


def _gdn_rows(quick):
    """Gated delta rule prefill (T=512) and decode (one token at a position inside a chunk), both specs,
    vs transformers' torch path on the same tensors; then the layer pieces vs stock torch."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                   torch_recurrent_gated_delta_rule)
    from hal.spec import GatedDeltaRuleSpec
    b, t, h, hv, d = (1, 128, 1, 2, 64) if quick else (1, 512, 2, 4, 128)
    pos = t - 27  # decode position: inside a chunk, so the chunked spec recomputes its open rows
    q, k, v = _r(b, t, h, d), _r(b, t, h, d, seed=1), _r(b, t, hv, d, seed=2)
    g = -torch.rand(b, t, hv, generator=torch.Generator().manual_seed(3))
    beta = torch.rand(b, t, hv, generator=torch.Generator().manual_seed(4))
    out = []
    for name in ("chunked", "serial"):
        spec = GatedDeltaRuleSpec(variant=name)
        prefix = [x[:, :pos] for x in (q, k, v, g, beta)]
        one = [x[:, pos:pos + 1] for x in (q, k, v, g, beta)]
        st = hal.chunk_gated_delta_rule(*prefix, output_final_state="state", use_qk_l2norm_in_kernel=True,
                                        spec=spec, backend=B)[1]
        out.append((f"gdn prefill {name}", f"B{b} T{t} H{h}/{hv} D{d} fp32",
                    lambda spec=spec: hal.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                                 spec=spec, backend=B),
                    lambda: torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)))
        out.append((f"gdn decode {name}", f"B{b} pos{pos} H{h}/{hv} D{d} fp32",
                    lambda spec=spec, st=st, one=one: hal.fused_recurrent_gated_delta_rule(
                        *one, initial_state=st, output_final_state=True, use_qk_l2norm_in_kernel=True, spec=spec,
                        backend=B),
                    lambda st=st, one=one: torch_recurrent_gated_delta_rule(
                        *one[:3], g=one[3], beta=one[4], initial_state=st.final_state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)))
    # layer pieces (Qwen3-Next-like widths)
    n, nh, dc = (64, 8, 1024) if quick else (512, 32, 8192)
    A_log, dt_bias, a, bb = _r(nh), _r(nh, seed=1), _r(n, nh, seed=2), _r(n, nh, seed=3)
    x, w, cb = _r(1, n, dc, seed=4), _r(dc, 4, seed=5), _r(dc, seed=6)
    ga, gb = _r(n, 4 * dc, seed=7), _r(n, 4 * dc, seed=8)
    out += [
        ("gdn_gating", f"{n}x{nh} fp32", lambda: hal.gdn_gating(A_log, a, dt_bias, bb, backend=B),
         lambda: (-A_log.exp() * F.softplus(a + dt_bias), torch.sigmoid(bb))),
        ("gdn_causal_conv1d", f"T{n} D{dc} K4 fp32", lambda: hal.gdn_causal_conv1d(x, w, cb, backend=B),
         lambda: F.silu(F.conv1d(x.transpose(1, 2), w[:, None], cb, padding=3, groups=dc)[..., :n])),
        ("silu_mul", f"{n}x{4 * dc} fp32", lambda: hal.silu_mul(ga, gb, backend=B), lambda: F.silu(ga) * gb),
    ]
    return out


def rows(quick: bool):
    return _linear_rows() + _foundation_rows(quick) + _attention_rows(quick) + _gdn_rows(quick)


# ---------------------------------------------------------------- the strict linear at the engine's shapes

#: (name, K, N) of the linears of benchmarks/vllm_throughput.py's Llama-shaped model (hidden 1024, 16 heads
#: of 64, 4 KV heads, MLP 2816, vocab 32000)
ENGINE_LINEARS = (("qkv", 1024, 1536), ("o", 1024, 1024), ("gate_up", 1024, 2 * 2816), ("down", 2816, 1024),
                  ("lm_head", 1024, 32000))
ENGINE_ROWS = (1, 2, 4, 8, 16, 64, 512)  # decode batches up to prefill blocks
DECODE_ROWS = (1, 2, 4, 8)  # the streaming kernel's rows (matmul._STREAM_ROWS): a vLLM decode step's batch
LM_HEAD_ROWS = 64  # the engine computes logits for the sampled positions only: a few rows per step
_ROTATE_BYTES = 96 << 20  # each call reads its weight from memory, as in the engine (~180 MB of weights a step)
#: decode rows (weights of 2-4 MB): 96 MB of copies still left some in the 32 MiB L3 (kernel rates above the
#: read bandwidth), so the decode report rotates more
_DECODE_ROTATE_BYTES = 256 << 20


def _best_seconds(fn, min_calls=5, min_seconds=0.3, clock=time.perf_counter):
    """The fastest of at least ``min_calls`` calls (and ``min_seconds`` of calls): on a machine shared with
    other jobs the fastest call is the one least disturbed. ``fn(i)`` gets the call number. ``clock``:
    wall time, or ``time.thread_time`` (the calling thread's CPU time: a one-thread kernel's time without
    the slices other jobs take; not for calls that use other threads)."""
    fn(0)
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        t0 = clock()
        fn(calls)
        best = min(best, clock() - t0)
        calls += 1
    return best


@functools.lru_cache(maxsize=1)
def _reader():
    """A compiled read of a 256 MiB float32 buffer (beyond the caches) with sixteen-lane vector loads."""
    import numpy as np
    from numba import njit
    from hal.kernels.cpu.pool import claim
    from hal.kernels.cpu.simd import vadd, vload16, vstore16, vzero16

    @njit(nogil=True)
    def read(buf, out, work):  # chunks of 64 KiB; eight independent sums hide the add latency
        lo, hi = claim(work)
        while lo < hi:
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero16()
            for c in range(lo, hi):
                for i in range(c * 16384, (c + 1) * 16384, 128):
                    a0, a1 = vadd(a0, vload16(buf, i)), vadd(a1, vload16(buf, i + 16))
                    a2, a3 = vadd(a2, vload16(buf, i + 32)), vadd(a3, vload16(buf, i + 48))
                    a4, a5 = vadd(a4, vload16(buf, i + 64)), vadd(a5, vload16(buf, i + 80))
                    a6, a7 = vadd(a6, vload16(buf, i + 96)), vadd(a7, vload16(buf, i + 112))
            vstore16(out, 16 * (lo % 64), vadd(vadd(vadd(a0, a1), vadd(a2, a3)), vadd(vadd(a4, a5), vadd(a6, a7))))
            lo, hi = claim(work)

    return read, np.ones(64 << 20, np.float32), np.zeros(16 * 64, np.float32)


def read_bandwidth(min_seconds: float = 1.0, clock=time.perf_counter) -> float:
    """Bytes per second of reading a 256 MiB float32 buffer with sixteen-lane vector loads on torch's
    thread count (hal's cpu pool), best of at least 5 reads: the ceiling of a kernel that streams a weight
    from memory."""
    from hal.kernels.cpu import pool
    read, buf, out = _reader()
    chunks = buf.size // 16384
    return buf.nbytes / _best_seconds(lambda i: pool.run(read, chunks, buf, out, parallel=True), 5, min_seconds,
                                      clock)


@functools.cache
def _fma_chains():
    from numba import njit
    from hal.kernels.cpu.pool import claim
    from hal.kernels.cpu.simd import vadd, vfma, vload16, vstore16

    @njit(nogil=True)
    def chains(v, out, work):  # twelve independent sixteen-lane chains: enough to fill both FMA ports
        a = vload16(v, 0)
        b = vload16(v, 16)
        lo, hi = claim(work)
        while lo < hi:
            c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = vload16(v, 32)
            for _ in range(lo, hi):
                for _ in range(1024):
                    c0, c1, c2, c3 = vfma(a, c0, b), vfma(a, c1, b), vfma(a, c2, b), vfma(a, c3, b)
                    c4, c5, c6, c7 = vfma(a, c4, b), vfma(a, c5, b), vfma(a, c6, b), vfma(a, c7, b)
                    c8, c9, c10, c11 = vfma(a, c8, b), vfma(a, c9, b), vfma(a, c10, b), vfma(a, c11, b)
            s = vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7)))
            vstore16(out, 16 * (lo % 64), vadd(s, vadd(vadd(c8, c9), vadd(c10, c11))))
            lo, hi = claim(work)

    return chains


def fma_rate(min_seconds: float = 0.3, clock=time.perf_counter) -> float:
    """float32 fused multiply-adds per second of independent sixteen-lane chains on torch's thread count
    (hal's cpu pool), best of at least 5 runs: the ceiling of the strict spec's products, whose every step is
    one float32 FMA. A linear of M rows over a weight of P parameters does M x P of them."""
    import numpy as np
    from hal.kernels.cpu import pool
    chains, tasks = _fma_chains(), 256
    v, out = np.full(48, 0.5, np.float32), np.zeros(16 * 64, np.float32)
    fmas = tasks * 1024 * 12 * 16
    return fmas / _best_seconds(lambda i: pool.run(chains, tasks, v, out, parallel=True), 5, min_seconds, clock)


def _rotated_weights(n: int, k: int, dt, rotate_bytes: int, min_copies: int):
    """(generator, copies of a random [n, k] weight in dt filling rotate_bytes, float32 copies for MKL, bf16 copies
    for stock): each call of a report takes the next copy, so it reads its weight from memory, as the engine does."""
    copies = max(min_copies, rotate_bytes // (n * k * dt.itemsize))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(dt) for _ in range(copies)]
    w32 = ws if dt == torch.float32 else [w.float() for w in ws[:max(min_copies, copies // 2)]]
    w16 = ws if dt == torch.bfloat16 else [w.bfloat16() for w in ws[:copies * 2]]
    return g, ws, w32, w16


def linear_report(quick: bool) -> list[dict]:
    """Per engine shape and row count, bf16 and float32: the strict linear on the cpu backend beside MKL's
    float32 ``F.linear`` (the strict spec's products are float32 fmas: its rate is the bar) and stock bf16
    ``F.linear`` (oneDNN: AVX512-BF16 / AMX dot products, not an fma chain: the stock engine's speed).
    GFLOP/s = 2 M N K / fastest call; GB/s = the weight's bytes / fastest call; ratio = strict / MKL float32
    rate; for up to 8 rows, the share of :func:`read_bandwidth` (measured again just before the row: the load
    of a shared machine moves it) the strict linear streams its weight at."""
    import numpy as np
    rows = (1, 8, 64) if quick else ENGINE_ROWS
    shapes = ENGINE_LINEARS[::2] if quick else ENGINE_LINEARS
    load = os.getloadavg()
    bw = read_bandwidth()
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"(1 / 5 / 15 min); measured read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    print(f"{'linear':<8} {'M':>4} {'K':>5} {'N':>6} {'dtype':<5} | {'strict GF/s':>11} {'GB/s':>6} {'of bw':>11} | "
          f"{'MKL fp32 GF/s':>13} | {'stock bf16 GF/s':>15} | {'strict / MKL':>12}")
    out = []
    for name, k, n in shapes:
        for dt in (torch.bfloat16, torch.float32):
            g, ws, w32, w16 = _rotated_weights(n, k, dt, _ROTATE_BYTES, 1)
            for m in rows:
                if name == "lm_head" and m > LM_HEAD_ROWS:
                    continue
                x = torch.randn(m, k, generator=g).to(dt)
                x32, x16 = x.float(), x.bfloat16()
                row_bw = read_bandwidth(0.3) if m <= 8 else float("nan")
                t = _best_seconds(lambda i: hal.linear(x, ws[i % len(ws)], backend=B))
                t_mkl = _best_seconds(lambda i: F.linear(x32, w32[i % len(w32)]))
                t_bf16 = _best_seconds(lambda i: F.linear(x16, w16[i % len(w16)]))
                flop, wbytes = 2 * m * n * k, n * k * dt.itemsize
                row = dict(linear=name, M=m, K=k, N=n, dtype=str(dt).removeprefix("torch."),
                           strict_gflops=flop / t / 1e9, strict_gbps=wbytes / t / 1e9,
                           mkl_fp32_gflops=flop / t_mkl / 1e9, stock_bf16_gflops=flop / t_bf16 / 1e9,
                           ratio=t_mkl / t, read_gbps=row_bw / 1e9, of_bandwidth=(wbytes / t) / row_bw,
                           threads=torch.get_num_threads(), load1=load[0])
                out.append(row)
                share = f"{row['of_bandwidth']:4.0%} of {row_bw / 1e9:4.1f}" if m <= 8 else f"{'':>11}"
                print(f"{name:<8} {m:>4} {k:>5} {n:>6} {row['dtype'][:5]:<5} | {row['strict_gflops']:11.1f} "
                      f"{row['strict_gbps']:6.1f} {share} | {row['mkl_fp32_gflops']:13.1f} | "
                      f"{row['stock_bf16_gflops']:15.1f} | {row['ratio']:11.2f}x", flush=True)
            del ws, w32, w16
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; read bandwidth measured again: "
          f"{read_bandwidth() / 1e9:.1f} GB/s")
    return out


def decode_report(rounds: int = 3, cpu_time: bool = False) -> list[dict]:
    """The streaming linear at the engine's decode shapes (1, 2, 4, 8 rows; every engine linear, bf16 and float32
    weights): the weight's bytes / fastest call of ``hal.linear`` (the whole call: checks, dispatch, the output
    rounded to the input dtype by torch) and of its kernel alone (``matmul.dot_rows_nk`` on the stored arrays),
    each as a share of the machine's read bandwidth (:func:`read_bandwidth` on the same threads), beside MKL's
    float32 ``F.linear`` and stock bf16 ``F.linear``. The machine is shared, so each shape runs ``rounds``
    interleaved rounds (the bandwidth, then every row count's four calls), each figure is the fastest call over
    all of them, and the shares are against the median of the rounds' bandwidths (their range printed). Each
    call reads its weight from memory (copies rotated past the L3), as the engine does. ``cpu_time`` (one
    thread only): time calls by the thread's CPU time, which leaves out the slices other jobs take (not the
    memory bandwidth they use)."""
    from hal.kernels.cpu import matmul
    from hal.kernels.cpu.host import raw
    from hal.spec import MatmulSpec
    tile = MatmulSpec().k_tile
    threads = torch.get_num_threads()
    if cpu_time and threads != 1:
        raise SystemExit("--cpu-time times the calling thread: use it with --threads 1")
    clock = time.thread_time if cpu_time else time.perf_counter
    load = os.getloadavg()
    print(f"decode rows, threads {threads}, {'thread CPU time' if cpu_time else 'wall time'}, {rounds} interleaved "
          f"rounds, fastest call of each; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (as uptime)",
          flush=True)
    print("per row count M: hal.linear's weight GB/s (its share of the read bandwidth), its kernel's and the "
          "share the FMA rate allows (M float32 FMAs per parameter read), then MKL float32 / stock bf16 F.linear "
          "in us")
    print(f"{'linear':<8} {'K':>5} {'N':>6} {'dtype':<5} {'read GB/s (range)':>17} {'FMA':>11} | M=...")
    out = []
    for name, k, n in ENGINE_LINEARS:
        for dt in (torch.bfloat16, torch.float32):
            g, ws, w32, w16 = _rotated_weights(n, k, dt, _DECODE_ROTATE_BYTES, 2)
            xs = {m: torch.randn(m, k, generator=g).to(dt) for m in DECODE_ROWS}
            raws = [raw(w) for w in ws]
            best = {}
            bws, fmas = [], []
            for _ in range(rounds):
                bws.append(read_bandwidth(0.3, clock))
                fmas.append(fma_rate(0.1, clock))
                for m in DECODE_ROWS:
                    x = xs[m]
                    x32, x16 = x.float(), x.bfloat16()
                    rx = raw(x)
                    for key, fn in (("strict", lambda i: hal.linear(x, ws[i % len(ws)], backend=B)),
                                    ("kernel", lambda i: matmul.dot_rows_nk(rx, raws[i % len(raws)], tile)),
                                    ("mkl", lambda i: F.linear(x32, w32[i % len(w32)])),
                                    ("bf16", lambda i: F.linear(x16, w16[i % len(w16)]))):
                        t = _best_seconds(fn, 5, 0.1, clock)
                        best[m, key] = min(best.get((m, key), float("inf")), t)
            bw, fma = statistics.median(bws), statistics.median(fmas)
            wbytes = n * k * dt.itemsize
            cells = []
            for m in DECODE_ROWS:
                gbps, kernel = wbytes / best[m, "strict"] / 1e9, wbytes / best[m, "kernel"] / 1e9
                row = dict(linear=name, M=m, K=k, N=n, dtype="bf16" if dt == torch.bfloat16 else "fp32",
                           strict_gbps=gbps, of_bandwidth=gbps * 1e9 / bw, kernel_gbps=kernel,
                           kernel_of_bandwidth=kernel * 1e9 / bw, read_gbps=bw / 1e9,
                           # the FMA ceiling: M FMAs per parameter read cap the share of the bandwidth
                           fma_ceiling=min(1.0, fma * dt.itemsize / (m * bw)), gfma=fma / 1e9,
                           read_gbps_range=(min(bws) / 1e9, max(bws) / 1e9),
                           strict_us=best[m, "strict"] * 1e6, mkl_fp32_us=best[m, "mkl"] * 1e6,
                           stock_bf16_us=best[m, "bf16"] * 1e6, threads=threads, load1=load[0])
                out.append(row)
                share, kshare = row["of_bandwidth"], row["kernel_of_bandwidth"]
                cells.append(f"M={m}: {gbps:4.1f} ({share:4.0%}) {kernel:4.1f} ({kshare:4.0%}, ceiling "
                             f"{row['fma_ceiling']:4.0%}) "
                             f"{row['mkl_fp32_us']:5.0f} / {row['stock_bf16_us']:5.0f}")
            print(f"{name:<8} {k:>5} {n:>6} {row['dtype']:<5} {bw / 1e9:4.1f} ({min(bws) / 1e9:4.1f}-"
                  f"{max(bws) / 1e9:4.1f}) {fma / 1e9:4.0f} GFMA/s | " + " | ".join(cells), flush=True)
            del ws, w32, w16, raws
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return out


def _first_call_child():
    """Run in a fresh process: the first call of each row (numba loads or compiles), then steady state."""
    from benchmarks.run import median_time
    torch.set_grad_enabled(False)
    for op, shape, ours, _ in rows(quick=True):
        t0 = time.perf_counter()
        ours()
        first = time.perf_counter() - t0
        print(f"{op:<20} {shape:<32} first call {first * 1e3:9.1f} ms   steady {median_time(ours, 3) * 1e3:8.2f} ms",
              flush=True)


def first_call_report():
    """First-call vs steady-state times in fresh processes: with an empty numba cache (JIT compile)
    and with the cache that the first process left on disk (load only)."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        for label in ("empty numba cache (compiles)", "warm numba cache (loads from disk)"):
            print(f"--- fresh process, {label}", flush=True)
            subprocess.run([sys.executable, "-m", "benchmarks.cpu", "--child"], env=env, check=True)


def pool_report(calls: int = 3000) -> dict:
    """What a parallel call costs beyond its work: the median wall time of ``pool.run`` over a kernel with nothing
    to do (64 one-element tasks, every thread claiming in turn) on the current thread count, beside the same call
    forced onto the calling thread alone. The difference is the hand-over: posting to the workers, their start,
    and waiting for their ends."""
    import numpy as np
    from numba import njit

    from hal.kernels.cpu import pool
    from hal.kernels.cpu.pool import claim

    @njit(nogil=True)
    def touch(a, work):
        lo, hi = claim(work)
        while lo < hi:
            for i in range(lo, hi):
                a[i] += 1.0
            lo, hi = claim(work)

    a = np.zeros(64)
    out = {}
    for parallel in (False, True):
        for _ in range(200):
            pool.run(touch, 64, a, parallel=parallel)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            pool.run(touch, 64, a, parallel=parallel)
            ts.append(time.perf_counter() - t0)
        out["parallel" if parallel else "alone"] = float(np.median(ts)) * 1e6
    load = os.getloadavg()
    print(f"pool hand-over, {pool.threads()} threads, median of {calls} calls, load average {load[0]:.2f}: "
          f"a call on the calling thread alone {out['alone']:.1f} us, on {pool.threads()} threads "
          f"{out['parallel']:.1f} us", flush=True)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--first-call", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--linear", action="store_true", help="the strict linear vs MKL float32 at the engine's shapes")
    p.add_argument("--threads", nargs="*", type=int, default=None, help="with --linear: thread counts")
    p.add_argument("--quick", action="store_true", help="with --linear: a few shapes and row counts")
    p.add_argument("--decode", action="store_true",
                   help="the streaming linear's decode rows: weight GB/s against the read bandwidth")
    p.add_argument("--rounds", type=int, default=3, help="with --decode: interleaved rounds per shape")
    p.add_argument("--cpu-time", action="store_true", help="with --decode --threads 1: time by the thread's CPU time")
    p.add_argument("--pool", action="store_true", help="what a call handed to the pool's threads costs beyond its work")
    a = p.parse_args()
    if a.child:
        _first_call_child()
    elif a.pool:
        for threads in a.threads or [2]:
            torch.set_num_threads(threads)
            pool_report()
    elif a.linear or a.decode:
        torch.set_grad_enabled(False)
        for threads in a.threads or [torch.get_num_threads()]:
            torch.set_num_threads(threads)
            if a.decode:
                decode_report(a.rounds, a.cpu_time)
            else:
                linear_report(a.quick)
    else:
        first_call_report()
