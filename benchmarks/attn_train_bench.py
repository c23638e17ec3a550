"""Attention training step on CUDA: hal (triton backend) vs flash-attn, or torch SDPA when flash-attn is absent.

    python -m benchmarks.attn_train_bench --csv OUT.csv      # CUDA only (benchmarks/gpu_check.sh step attn-train)

Shapes: one packed sequence of T = 1024 / 4096 tokens, Hq 16 / Hkv 4 (GQA), D 128, bf16, causal. Rows per T
(median of CUDA-event timings after a warm-up; ratio = stock time / hal time in the same run, > 1 means
hal is faster):

* ``fwd+bwd``: ``hal.flash_attn_varlen_func(..., backend="triton")`` forward (strict kernel) + autograd
  backward (the deterministic Triton backward kernels) vs the stock forward + backward;
* ``bwd``: the backward kernels alone (``kernels/triton/attention_backward.py`` on saved out / lse) vs the
  stock backward (autograd on a retained graph), with the share of the H200's dense bf16 tensor-core peak;
* ``bwd torch``: hal's torch backward (``hal.attention._backward_math``, what other backends run).

Before timing, each T also checks the kernels on the GPU: two backward runs give the same raw bits, and
the gradients' max error relative to ``_backward_math`` in float64 (printed; not a spec).
No CPU path: the interpreter checks live in tests/test_triton_attention_backward.py.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import median_seconds, randn, write_csv

H200_BF16_PEAK = 989e12  # FLOP/s, dense bf16 tensor cores (NVIDIA H200 SXM datasheet)


def _stock(hq, hkv):
    """(name, attend(q, k, v, cu, T) -> out [T, Hq, D]): flash-attn's varlen function, else SDPA (flash /
    memory-efficient backends) on [1, H, T, D] views."""
    try:
        from flash_attn import flash_attn_varlen_func as fa
        return "flash-attn", lambda q, k, v, cu, T: fa(q, k, v, cu, cu, T, T, causal=True)
    except ImportError:
        pass
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v, cu, T):
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            if hkv != hq:  # repeat kv heads: the flash / efficient backends' GQA support varies by version
                kt, vt = kt.repeat_interleave(hq // hkv, dim=1), vt.repeat_interleave(hq // hkv, dim=1)
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return o.squeeze(0).transpose(0, 1)
    return "torch SDPA (flash/efficient)", sdpa


def _rand(shape, seed, dev):
    return randn(shape, torch.bfloat16, dev, seed)


def rows(T, hq, hkv, d, reps, dev=None, timer=median_seconds):
    import hal
    from hal.attention import _backward_math
    from hal.conformance.bits import first_divergence
    from hal.kernels.triton import attention_backward as bwd
    dev = dev or torch.device("cuda")
    q, k, v, gout = _rand((T, hq, d), 1, dev), _rand((T, hkv, d), 2, dev), _rand((T, hkv, d), 3, dev), \
        _rand((T, hq, d), 4, dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    scale = d ** -0.5
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    stock_name, stock = _stock(hq, hkv)

    def hal_step():
        out = hal.flash_attn_varlen_func(*leaves, cu, cu, T, T, causal=True, backend="triton")
        torch.autograd.grad(out, leaves, gout)

    def stock_step():
        torch.autograd.grad(stock(*leaves, cu, T), leaves, gout)

    with torch.no_grad():
        out, lse = hal.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True, return_lse=True, backend="triton")

    def hal_bwd():
        return bwd.flash_attn_varlen_backward(q, k, v, out, lse, cu, cu, T, T, scale, True, (-1, -1), gout, None)

    stock_out = stock(*leaves, cu, T)

    def stock_bwd():
        torch.autograd.grad(stock_out, leaves, gout, retain_graph=True)

    def torch_bwd():
        _backward_math(q, k, v, cu, cu, scale, True, (-1, -1), gout, None)

    # on-GPU checks of the kernels: determinism (raw bits) and error vs the float64 torch backward
    g1, g2 = hal_bwd(), hal_bwd()
    div = [s for s in (first_divergence(n, a, b) for n, a, b in zip(("dq", "dk", "dv"), g1, g2)) if s]
    f64 = _backward_math(*(x.double() for x in (q, k, v)), cu, cu, scale, True, (-1, -1), gout.double(), None)
    errs = {n: float((a.double() - b).abs().max() / b.abs().max()) for n, a, b in zip(("dq", "dk", "dv"), g1, f64)}
    print(f"T{T}: two backward runs {'same bits' if not div else 'DIFFER: ' + str(div[0])}; max error / max |grad| "
          f"vs float64: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)
    pairs = T * (T + 1) // 2  # causal (query, key) pairs
    shape = f"T{T} Hq{hq}/{hkv} D{d} bf16 causal"
    for name, ours, theirs, flops in (("fwd+bwd", hal_step, stock_step, 7 * 2 * hq * d * pairs),
                                      ("bwd", hal_bwd, stock_bwd, 5 * 2 * hq * d * pairs),
                                      ("bwd torch", torch_bwd, stock_bwd, 5 * 2 * hq * d * pairs)):
        t_ours, t_stock = timer(ours, reps), timer(theirs, reps)
        yield dict(row=f"attn train {name}", shape=shape, stock=stock_name, hal_ms=t_ours * 1e3,
                   stock_ms=t_stock * 1e3, ratio=t_stock / t_ours, bf16_peak_share=flops / t_ours / H200_BF16_PEAK,
                   deterministic=not div, **{f"err_{n}": e for n, e in errs.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", help="write the rows here")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--T", type=int, nargs="*", default=[1024, 4096])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attn_train_bench: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a "
              "GPU only (the CPU interpreter checks are tests/test_triton_attention_backward.py)", file=sys.stderr)
        return 2
    out = []
    print(f"{'row':22} {'shape':30} {'hal ms':>9} {'stock ms':>9} {'ratio':>7} {'bf16 peak':>9}  stock")
    for T in args.T:
        for row in rows(T, 16, 4, 128, args.reps):
            out.append(row)
            print(f"{row['row']:22} {row['shape']:30} {row['hal_ms']:9.3f} {row['stock_ms']:9.3f} {row['ratio']:7.3f} "
                  f"{row['bf16_peak_share']:9.1%}  {row['stock']}", flush=True)
    if args.csv and out:
        write_csv(args.csv, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
