"""hal.jax (strict, emulated fma) vs stock jax.numpy, same shapes, same run; median seconds and ratio.

    python -m benchmarks.jax_bench                 # CPU, the CPU backend's shapes
    python -m benchmarks.jax_bench --quick         # smaller shapes
    python -m benchmarks.jax_bench --gpu           # the GPU check (H200 script): see gpu_check()

Both sides are jitted and timed after a warm-up call (compilation excluded), with
``block_until_ready``. Stock is what a JAX trainer runs without lockstep (XLA's dot, its own exp/log,
flush-to-zero on CPU); it computes different bits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def median_time(fn, repeats: int = 5, min_seconds: float = 0.3) -> float:
    fn()  # compile + warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 30):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _arr(shape, seed, scale=1.0):
    import jax.numpy as jnp
    return jnp.asarray((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


def rows(quick: bool = False):
    """(op, shape, strict fn, stock fn): each fn returns a ready jax array."""
    import jax
    import jax.numpy as jnp
    import hal.jax as hj

    def ready(f, *a):
        return lambda: jax.block_until_ready(f(*a))

    out = []
    lin_shapes = [(16, 256, 256)] + ([] if quick else [(1, 4096, 4096)])
    for m, k, n in lin_shapes:
        x, w = _arr((m, k), 0), _arr((n, k), 1, k ** -0.5)
        out.append(("linear", f"{m}x{k}x{n} fp32", ready(jax.jit(hj.linear), x, w),
                    ready(jax.jit(lambda a, b: a @ b.T), x, w)))
    hn, hh = (16, 1024)
    x, w = _arr((hn, hh), 2), _arr((hh,), 3)
    stock_rms = jax.jit(lambda a, g: a * jax.lax.rsqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6) * g)
    out.append(("rms_norm", f"{hn}x{hh} fp32", ready(jax.jit(hj.rms_norm), x, w), ready(stock_rms, x, w)))
    s = _arr((8, 4096), 4, 3.0)
    out.append(("softmax", "8x4096 fp32", ready(jax.jit(hj.softmax), s), ready(jax.jit(jax.nn.softmax), s)))
    out.append(("log_softmax", "8x4096 fp32", ready(jax.jit(hj.log_softmax), s),
                ready(jax.jit(jax.nn.log_softmax), s)))
    tn, th, tv = (8, 128, 4096) if quick else (8, 128, 32000)
    h, W = _arr((tn, th), 5), _arr((tv, th), 6, th ** -0.5)
    tok = jnp.asarray((np.arange(tn) * 13) % tv, jnp.int32)

    def stock_tlp(h, W, t):
        lp = jax.nn.log_softmax(h @ W.T, -1)
        return jnp.take_along_axis(lp, t[:, None], -1)[:, 0]
    out.append(("token_logprobs", f"N{tn} H{th} V{tv} fp32", ready(jax.jit(hj.token_logprobs), h, W, tok),
                ready(jax.jit(stock_tlp), h, W, tok)))
    out += _attention_rows(quick, ready)
    out += _gdn_rows(quick, ready)
    return out


def _attention_rows(quick: bool, ready):
    """Causal GQA prefill (varlen, one sequence) and decode (contiguous cache) against
    jax.nn.dot_product_attention (XLA's own softmax attention)."""
    import jax
    import jax.numpy as jnp
    import hal.jax as hj
    t, hq, hkv, d = (128 if quick else 1024), 4, 2, 64
    q, k, v = _arr((t, hq, d), 12), _arr((t, hkv, d), 13), _arr((t, hkv, d), 14)
    cu = jnp.asarray([0, t], jnp.int32)
    out = [("attention prefill", f"T{t} Hq{hq} Hkv{hkv} D{d} causal fp32",
            ready(jax.jit(lambda q, k, v, cu: hj.flash_attn_varlen_func(q, k, v, cu, cu, t, t, causal=True)), q, k, v, cu),
            ready(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]),
                  q, k, v))]
    b = 8
    qd, kc, vc = _arr((b, 1, hq, d), 15), _arr((b, t, hkv, d), 16), _arr((b, t, hkv, d), 17)
    lens = jnp.full((b,), t, jnp.int32)
    out.append(("attention decode", f"B{b} K{t} Hq{hq} Hkv{hkv} D{d} fp32",
                ready(jax.jit(lambda q, kc, vc, n: hj.flash_attn_with_kvcache(q, kc, vc, n, max_seqlen_k=t)), qd, kc, vc, lens),
                ready(jax.jit(lambda q, kc, vc, n: jax.nn.dot_product_attention(q, kc, vc, key_value_seq_lengths=n)),
                      qd, kc, vc, lens)))
    return out


def _gdn_rows(quick: bool, ready):
    """The gated delta rule (both specs) against the plain float32 jnp recurrence (lax.scan)."""
    import functools

    import jax
    import jax.numpy as jnp
    import hal.jax as hj
    from hal.jax import gated_delta_rule as jg
    from hal.spec import GatedDeltaRuleSpec
    b, t, h, hv, dk, dv = (1, 64, 1, 2, 64, 64) if quick else (1, 256, 2, 4, 64, 64)
    q, k = _arr((b, t, h, dk), 7), _arr((b, t, h, dk), 8)
    v = _arr((b, t, hv, dv), 9)
    g = -jnp.abs(_arr((b, t, hv), 10, 0.5))
    beta = jax.nn.sigmoid(_arr((b, t, hv), 11))
    serial = GatedDeltaRuleSpec(variant="serial")
    st, _ = jg._start_state(None, serial, b, (h, hv, dk, dv))

    def stock(q, k, v, g, beta):
        return jg._stock_padded(q, k, v, g, beta, jnp.full((b,), t, jnp.int32), st.position, st.S, None, None, None,
                                None, scale=dk ** -0.5, l2=True, spec=serial)[0]
    out = []
    for variant in ("chunked", "serial"):
        ours = functools.partial(hj.chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True,
                                 spec=GatedDeltaRuleSpec(variant=variant))
        out.append((f"gated_delta_rule ({variant})", f"B{b} T{t} H{h} HV{hv} dk{dk} dv{dv} fp32",
                    ready(jax.jit(lambda *a, f=ours: f(*a)[0]), q, k, v, g, beta),
                    ready(jax.jit(stock), q, k, v, g, beta)))
    return out


def run_cpu(quick: bool) -> list[dict]:
    import jax
    results = []
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; median seconds per call (jitted, compile excluded)")
    print(f"{'op':<28}{'shape':<36}{'hal.jax':>12}{'jax.numpy':>12}{'ratio':>9}")
    for op, shape, ours, stock in rows(quick):
        t_o, t_s = median_time(ours), median_time(stock)
        results.append({"op": op, "shape": shape, "hal_jax_s": t_o, "stock_s": t_s, "ratio": t_o / t_s})
        print(f"{op:<28}{shape:<36}{t_o:>12.5f}{t_s:>12.5f}{t_o / t_s:>8.1f}x", flush=True)
    return results


# ---------------------------------------------------------------- GPU (jax with CUDA)


def _pallas_inline_asm() -> str:
    """Whether this jax offers Pallas ``elementwise_inline_asm`` (the route to the GPU's own
    ``fma.rn.f32``). A strict kernel on it is NOT implemented (left out; see docs/jax.md)."""
    try:
        from jax.experimental.pallas import triton as plgpu
    except Exception as e:
        return f"no pallas triton module ({type(e).__name__})"
    return "available (kernel not implemented)" if hasattr(plgpu, "elementwise_inline_asm") else "absent"


def gpu_check(shapes=((1, 4096, 4096), (64, 4096, 4096))) -> dict:
    """For the GPU check script: emulated-fma strict linear vs jnp.dot on the default (GPU) device,
    bits of the GPU result vs the same op on jax's CPU device, and the Pallas fma route if any."""
    import jax
    import hal.jax as hj
    dev = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    report = {"jax": jax.__version__, "device": str(dev), "rows": []}
    for m, k, n in shapes:
        x, w = _arr((m, k), 0), _arr((n, k), 1, k ** -0.5)
        xg, wg = jax.device_put(x, dev), jax.device_put(w, dev)
        strict = jax.jit(hj.linear)
        stock = jax.jit(lambda a, b: a @ b.T)
        t_s = median_time(lambda: jax.block_until_ready(strict(xg, wg)))
        t_d = median_time(lambda: jax.block_until_ready(stock(xg, wg)))
        g = np.asarray(strict(xg, wg)).view(np.uint32)
        # the same jitted op on jax's CPU device (inputs committed there): the bits must agree
        c = np.asarray(strict(jax.device_put(x, cpu), jax.device_put(w, cpu))).view(np.uint32) if m <= 8 else None
        row = {"shape": f"{m}x{k}x{n}", "strict_s": t_s, "jnp_dot_s": t_d, "ratio": t_s / t_d,
               "gpu_vs_cpu_bits_equal": None if c is None else bool((g == c).all())}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    report["pallas_elementwise_inline_asm"] = _pallas_inline_asm()
    print(json.dumps({"pallas_elementwise_inline_asm": report["pallas_elementwise_inline_asm"]}))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.jax_bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="run gpu_check() on jax's default GPU device")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    res = gpu_check() if args.gpu else run_cpu(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
