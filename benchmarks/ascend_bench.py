"""lockstep's ascend backend against stock torch / torch_npu ops on the same NPU, same run.

    python -m benchmarks.ascend_bench --csv ascend_bench.csv            # on an Ascend NPU
    TRITON_INTERPRET=1 python -m benchmarks.ascend_bench --device cpu --csv /tmp/a.csv
                                                                        # CPU interpreter smoke test

Timing: synchronize, wall clock around each call, warm-up calls first (compilation), median of the
repeats; ratio = stock_time / lockstep_time (>= 1: lockstep is faster). Stock rows use torch on the
NPU (aclnn kernels), ``torch_npu.npu_rms_norm`` where present, ``torch_npu.npu_fusion_attention`` for
causal prefill attention (torch's scaled_dot_product_attention in the CPU smoke test); the gated delta
rule has no stock NPU kernel to compare with, so its row has a lockstep time only. Nothing here is
asserted; failing rows are logged and the run goes on.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import hal


def _sync(device):
    if device == "npu":
        torch.npu.synchronize()


def _time(fn, device, repeats, max_seconds):
    for _ in range(2):
        fn()
    _sync(device)
    times, t_end = [], time.perf_counter() + max_seconds
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return statistics.median(times)


def rows(device, quick):
    dt = torch.bfloat16 if device == "npu" else torch.float32
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dt).to(device)
    asc, sto = dict(backend="ascend"), dict(backend="stock")
    k, n, v, t = (64, 48, 300, 5) if quick else (4096, 4096, 151936, 256)
    out = []
    for m in ((1, 3) if quick else (1, 16, 256)):
        x, w = r(m, k), r(n, k, scale=0.02)
        out.append((f"linear m={m}", f"{m}x{k}x{n}", lambda x=x, w=w: hal.linear(x, w, **asc),
                    lambda x=x, w=w: F.linear(x, w)))
    h, rw = r(t, k), r(k)
    npu_rms = None
    if device == "npu":
        import torch_npu
        npu_rms = getattr(torch_npu, "npu_rms_norm", None)
    out.append(("rms_norm", f"{t}x{k}", lambda: hal.rms_norm(h, rw, 1e-6, **asc),
                (lambda: npu_rms(h, rw, 1e-6)) if npu_rms else (lambda: hal.rms_norm(h, rw, 1e-6, **sto))))
    s = r(t, v // 8)
    out.append(("softmax", f"{t}x{v // 8}", lambda: hal.softmax(s, **asc), lambda: torch.softmax(s, -1)))
    hid, lm = r(t if not quick else 4, k), r(v, k, scale=0.02)
    tok = torch.randint(0, v, (hid.shape[0],), generator=g).to(device)
    out.append(("token_logprobs", f"{hid.shape[0]}x{k}, V={v}", lambda: hal.token_logprobs(hid, lm, tok, **asc),
                lambda: torch.log_softmax(F.linear(hid, lm).float(), -1).gather(-1, tok[:, None])))
    # causal prefill attention, one sequence: lockstep takes packed [S, H, D], the stock kernel BNSD
    heads, seq, hd = (2, 24, 16) if quick else (32, 4096, 128)
    qb, kb, vb = r(1, heads, seq, hd), r(1, heads, seq, hd), r(1, heads, seq, hd)
    qp, kp, vp = (x[0].transpose(0, 1).contiguous() for x in (qb, kb, vb))
    cu = torch.tensor([0, seq], dtype=torch.int32, device=device)
    if device == "npu":
        import torch_npu
        stock_attn = lambda: torch_npu.npu_fusion_attention(qb, kb, vb, heads, "BNSD", scale=hd ** -0.5,  # noqa: E731
                                                            pre_tockens=65536, next_tockens=0)
    else:
        stock_attn = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)  # noqa: E731
    out.append(("attention prefill causal", f"1x{heads}x{seq}x{hd}",
                lambda: hal.flash_attn_varlen_func(qp, kp, vp, cu, cu, seq, seq, causal=True, **asc), stock_attn))
    # gated delta rule (chunked spec), Qwen3-Next-like heads; no stock kernel
    gh, gt, gd = (1, 20, 16) if quick else (16, 2048, 128)
    gq, gk, gv = r(1, gt, gh, gd), r(1, gt, gh, gd), r(1, gt, 2 * gh, gd)
    gg = -torch.rand(1, gt, 2 * gh, generator=g).to(device)
    gb = torch.rand(1, gt, 2 * gh, generator=g).to(dtype=dt).to(device)
    out.append(("gated delta rule chunked", f"1x{gt}x{gh}(x2)x{gd}",
                lambda: hal.chunk_gated_delta_rule(gq, gk, gv, gg, gb, use_qk_l2norm_in_kernel=True, **asc), None))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ascend_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="npu", choices=["npu", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny shapes (always on for the CPU interpreter)")
    p.add_argument("--csv", default="bench-results/ascend_bench.csv")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=3.0)
    a = p.parse_args(argv)
    if a.device == "npu":
        from hal.backends.ascend import enable_npu
        enable_npu()
    quick = a.quick or a.device == "cpu"
    os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
    results = []
    for op, shape, ours, stock in rows(a.device, quick):
        rec = {"op": op, "shape": shape, "lockstep_s": "", "stock_s": "", "ratio": "", "status": "ok"}
        try:
            rec["lockstep_s"] = f"{_time(ours, a.device, a.repeats, a.max_seconds):.6g}"
            if stock is not None:
                rec["stock_s"] = f"{_time(stock, a.device, a.repeats, a.max_seconds):.6g}"
                rec["ratio"] = f"{float(rec['stock_s']) / float(rec['lockstep_s']):.3f}"
        except Exception as exc:  # keep going: one broken row must not hide the others
            rec["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        results.append(rec)
        print(f"{op:<30} {shape:<28} lockstep {rec['lockstep_s'] or '-':>10} stock {rec['stock_s'] or '-':>10} "
              f"ratio {rec['ratio'] or '-':>7}  {rec['status']}", flush=True)
    with open(a.csv, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(results[0]))
        wr.writeheader()
        wr.writerows(results)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
