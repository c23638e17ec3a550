"""Benchmark rows for attention on CPU: the reference backend vs torch's scaled_dot_product_attention.

Rows: a causal prefill (varlen, one sequence) and a batch of decode steps against a paged cache.
The stock side calls SDPA the way an eager engine does (is_causal for prefill, one query against
the cached keys for decode), on the same tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import hal
from hal.kv_cache import KVCache


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def rows(quick: bool):
    n, hq, hkv, d = (128, 4, 2, 64) if quick else (256, 8, 2, 128)
    bsz, ctx = (4, 128) if quick else (8, 512)
    group = hq // hkv
    q, k, v = _r(n, hq, d), _r(n, hkv, d, seed=1), _r(n, hkv, d, seed=2)
    cu = torch.tensor([0, n], dtype=torch.int32)
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(group, 1).transpose(0, 1)[None]
    vt = v.repeat_interleave(group, 1).transpose(0, 1)[None]

    # decode: bsz sequences with ctx cached tokens each, one new query per sequence
    cache = KVCache.paged(bsz, ctx + 1, hkv, d, page_size=16)
    qd, kd, vd = _r(bsz, 1, hq, d, seed=5), _r(bsz, 1, hkv, d, seed=6), _r(bsz, 1, hkv, d, seed=7)
    cache.write(torch.cat([_r(bsz, ctx, hkv, d, seed=3), kd], 1), torch.cat([_r(bsz, ctx, hkv, d, seed=4), vd], 1))
    base_lens = cache.seqlens - 1  # every call re-appends the same new token at position ctx
    kc_all = torch.stack([cache.keys(b) for b in range(bsz)])  # [B, ctx+1, Hkv, D]
    vc_all = torch.stack([cache.values(b) for b in range(bsz)])
    kdt = kc_all.repeat_interleave(group, 2).transpose(1, 2)
    vdt = vc_all.repeat_interleave(group, 2).transpose(1, 2)

    def decode():
        return hal.flash_attn_with_kvcache(qd, cache.k, cache.v, kd, vd, cache_seqlens=base_lens,
                                           block_table=cache.block_table)

    return [
        ("flash_attn_varlen (prefill)", f"T{n} H{hq}/{hkv} D{d} causal fp32",
         lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True),
         lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)),
        ("flash_attn_with_kvcache", f"decode B{bsz} ctx{ctx} H{hq}/{hkv} D{d} paged fp32", decode,
         lambda: F.scaled_dot_product_attention(qd.transpose(1, 2), kdt, vdt)),
    ]
