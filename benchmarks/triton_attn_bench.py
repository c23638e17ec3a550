"""Triton strict attention and gated delta rule vs stock torch, on CUDA (or a tiny smoke run on CPU).

    python -m benchmarks.triton_attn_bench --csv OUT.csv            # CUDA: the rows below
    TRITON_INTERPRET=1 python -m benchmarks.triton_attn_bench --smoke  # CPU: tiny shapes, runs every row once

Rows (median of CUDA-event timings after warm-up; the ratio is stock time / lockstep time, measured
in the same run, so > 1 means lockstep is faster):

* decode attention, paged KV (page 64), 4k context, batch 16 / 32 / 64, Hq 32 / Hkv 8, D 128, bf16,
  split-KV (num_splits 16) vs ``torch.nn.functional.scaled_dot_product_attention`` on the
  contiguous cache (``enable_gqa``);
* prefill attention, T = 4096 causal, Hq 8 / Hkv 2, D 128, bf16, vs SDPA (causal);
* GDN decode (serial spec: one token from a state) and GDN chunked prefill T = 4096 (Qwen3-Next
  heads: H 16, HV 32, d 128, bf16) vs transformers' torch recurrent / chunk functions.

Every lockstep row also reports the share of the H200's fp32 FMA peak it reaches (the strict
kernels run on fp32 FMA units by design; FLOPs counted as 2 per fma of the spec's arithmetic).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import median_seconds, randn, write_csv

H200_FP32_PEAK = 67e12  # FLOP/s, FMA = 2 FLOPs (NVIDIA H200 SXM datasheet)


def _timer(device):
    """(fn, reps) -> seconds: the median of CUDA-event timings after a warm-up call; on CPU one host-timed call."""
    cuda = device.type == "cuda"
    return lambda fn, reps: median_seconds(fn, reps if cuda else 1, cuda, warmup=1 if cuda else 0)


def decode_rows(device, smoke):
    from hal.kernels.triton import attention as tri
    from hal.spec import AttentionSpec
    import torch.nn.functional as F
    spec = AttentionSpec()
    ctx, hq, hkv, d, page = (40, 2, 1, 16, 8) if smoke else (4096, 32, 8, 128, 64)
    dt = torch.bfloat16
    for bsz in ((2,) if smoke else (16, 32, 64)):
        pages = bsz * (ctx // page)
        kc, vc = randn((pages, page, hkv, d), dt, device, 1), randn((pages, page, hkv, d), dt, device, 2)
        table = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).reshape(bsz, -1).to(device, torch.int32)
        lens = torch.full((bsz,), ctx, dtype=torch.int32, device=device)
        q = randn((bsz, 1, hq, d), dt, device, 4)
        kk = kc[table.long()].reshape(bsz, ctx, hkv, d).transpose(1, 2).contiguous()
        vv = vc[table.long()].reshape(bsz, ctx, hkv, d).transpose(1, 2).contiguous()
        qt = q.transpose(1, 2)
        n_splits = max(1, ctx // spec.kv_split)

        def ours():
            tri.flash_attn_with_kvcache(q, kc, vc, lens, table, d ** -0.5, True, (-1, -1), n_splits, spec)

        def stock():
            F.scaled_dot_product_attention(qt, kk, vv, enable_gqa=True)
        flops = 2 * 2 * bsz * hq * ctx * d  # q.k and p.v fma chains
        yield f"attn decode paged ctx{ctx}", f"B{bsz} Hq{hq}/{hkv} D{d} bf16", ours, stock, flops


def prefill_rows(device, smoke):
    from hal.kernels.triton import attention as tri
    from hal.spec import AttentionSpec
    import torch.nn.functional as F
    spec = AttentionSpec()
    T, hq, hkv, d = (40, 2, 1, 16) if smoke else (4096, 8, 2, 128)
    dt = torch.bfloat16
    q, k, v = (randn((T, h, d), dt, device, s) for s, h in ((5, hq), (6, hkv), (7, hkv)))
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)

    def ours():
        tri.flash_attn_varlen_func(q, k, v, cu, cu, T, T, d ** -0.5, True, (-1, -1), spec)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def stock():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    flops = 2 * 2 * hq * (T * (T + 1) // 2) * d
    yield f"attn prefill causal T{T}", f"Hq{hq}/{hkv} D{d} bf16", ours, stock, flops


def gdn_rows(device, smoke):
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                   torch_recurrent_gated_delta_rule)
    from hal.kernels.reference.gated_delta_rule import Parts
    from hal.kernels.triton import gated_delta_rule as tri
    from hal.spec import GatedDeltaRuleSpec
    B, T, H, HV, d = (1, 40, 1, 2, 16) if smoke else (1, 4096, 16, 32, 128)
    dt = torch.bfloat16
    q, k = randn((B, T, H, d), dt, device, 8), randn((B, T, H, d), dt, device, 9)
    v = randn((B, T, HV, d), dt, device, 10)
    g = -randn((B, T, HV), torch.float32, device, 11).abs()
    beta = torch.sigmoid(randn((B, T, HV), torch.float32, device, 12)).to(dt)
    zero = Parts(torch.zeros(B, dtype=torch.int64), torch.zeros(B, HV, d, d, device=device), None, None, None, None, None)
    chunked = GatedDeltaRuleSpec(variant="chunked")

    def ours_prefill():
        tri.gated_delta_rule(q, k, v, g, beta, d ** -0.5, zero, None, True, chunked, True)

    # transformers' functions take q and k already repeated to the value heads (as Qwen3-Next does)
    qx, kx = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)

    def stock_prefill():
        torch_chunk_gated_delta_rule(qx, kx, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    # per token and head: w, state update, o (3 d x d fma) + chunk extras (KK, QK, substitution), ~5 d^2
    yield f"gdn chunked prefill T{T}", f"B{B} H{H}/{HV} d{d} bf16", ours_prefill, stock_prefill, 2 * 5 * B * T * HV * d * d

    nb = 2 if smoke else 32
    serial = GatedDeltaRuleSpec(variant="serial")
    S = randn((nb, HV, d, d), torch.float32, device, 13, 0.1)
    st = Parts(torch.full((nb,), 100, dtype=torch.int64), S, None, None, None, None, S)
    x1 = [randn((nb, 1, H, d), dt, device, 14), randn((nb, 1, H, d), dt, device, 15),
          randn((nb, 1, HV, d), dt, device, 16)]
    g1 = -randn((nb, 1, HV), torch.float32, device, 17).abs()
    b1 = torch.sigmoid(randn((nb, 1, HV), torch.float32, device, 18)).to(dt)

    def ours_decode():
        tri.gated_delta_rule(*x1, g1, b1, d ** -0.5, st, None, True, serial, True)

    x1x = [x1[0].repeat_interleave(HV // H, dim=2), x1[1].repeat_interleave(HV // H, dim=2), x1[2]]

    def stock_decode():
        torch_recurrent_gated_delta_rule(*x1x, g=g1, beta=b1, initial_state=S, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    yield "gdn decode serial", f"B{nb} H{H}/{HV} d{d} bf16", ours_decode, stock_decode, 2 * 3 * nb * HV * d * d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one run each (CPU interpreter)")
    p.add_argument("--csv", help="write the rows here")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA device: run with TRITON_INTERPRET=1 --smoke for the CPU smoke test", file=sys.stderr)
        return 2
    smoke = args.smoke or device.type == "cpu"
    timer = _timer(device)
    reps = 1 if smoke else args.reps
    out = []
    print(f"{'row':34} {'shape':28} {'lockstep ms':>12} {'stock ms':>10} {'ratio':>7} {'fp32 peak':>9}")
    for gen in (decode_rows, prefill_rows, gdn_rows):
        for name, shape, ours, stock, flops in gen(device, smoke):
            t_ours, t_stock = timer(ours, reps), timer(stock, reps)
            share = flops / t_ours / H200_FP32_PEAK if device.type == "cuda" else float("nan")
            row = dict(row=name, shape=shape, lockstep_ms=t_ours * 1e3, stock_ms=t_stock * 1e3,
                       ratio=t_stock / t_ours, fp32_peak_share=share, device=str(device))
            out.append(row)
            print(f"{name:34} {shape:28} {row['lockstep_ms']:12.3f} {row['stock_ms']:10.3f} {row['ratio']:7.3f} "
                  f"{share:9.1%}", flush=True)
    if args.csv:
        write_csv(args.csv, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
