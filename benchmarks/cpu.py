"""Benchmark rows for the `cpu` backend (numba) against stock torch on the same tensors.

    python -m benchmarks.run --ops cpu --threads 1 2 --plot     # ratios at 1 and 2 threads + PNG
    python -m benchmarks.cpu --first-call                        # first call vs steady state

Shapes follow issue 9's table: linear decode (M=1, K=N=4096, fp32 and bf16) and 16x256x256 /
128x1024x1024, rms_norm / softmax / log_softmax / token_logprobs at V=32k, attention decode
against a 4k paged cache and a T=512 causal prefill (vs SDPA). Gated delta rule (``_gdn_rows``): a
T=512 prefill and a one-token decode under both specs against transformers' Qwen3-Next torch
functions (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``), plus the GDN
layer's gating, conv1d and SwiGLU's silu_mul against their stock torch formulas.
"""
from __future__ import annotations

import argparse
import os
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


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--first-call", action="store_true")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        _first_call_child()
    else:
        first_call_report()
