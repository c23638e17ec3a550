"""The torch ops of one vLLM + lockstep engine step, counted: the glue around lockstep's kernels (issue 52, item 3).

    python -m benchmarks.vllm_step_profile [--layers 4 --hidden 512 --prompts 8 --prompt-len 128] [--out DIR]
    python -m benchmarks.vllm_step_profile --thread-steps 20 [--layers 8 --hidden 1024 --mlp 2816 --vocab 32000]

Builds a small Llama-shaped model with random weights (default: hidden 512, 4 layers, 8 heads of 64, 2 KV heads,
MLP 1408, vocab 8000, bf16), starts an eager in-process vLLM engine with lockstep's plugin (LOCKSTEP_VLLM=1) and
drives it one ``step()`` at a time: ``--prompts`` prompts of ``--prompt-len`` tokens, all prefilled in one step,
then decode steps (greedy, and in a second round top-p 0.9 at temperature 1 with the log-prob recorded). One
warm-up round, then under torch.profiler (CPU, with Python stacks) one prefill step, one greedy decode step and
one top-p decode step. Per step it prints the step's wall time, every torch op's calls and self time (the ops
lockstep's kernels are surrounded by: in eager mode the numba kernels run outside any torch op), and which
lockstep function issued them (the innermost frame under hal/); ``vllm_step_profile.json`` keeps it all.
The load average is printed: on a loaded machine the self times mean little, the counts still do.

``--thread-steps N``: after the profiled round, N greedy decode steps unprofiled: the median step's wall time and
the CPU time each thread of the process used per step (``/proc/self/task``; lockstep's pool threads by name, the
rest -- torch's OpenMP workers among them -- as "other"). ``LOCKSTEP_VLLM=0`` in the environment runs stock vLLM
for the comparison. Where a spinning worker takes a core, its CPU time is about the step's wall time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

_FRAME = re.compile(r"(?:^|/)((hal|kernels|backends|vllm)/[\w/]+\.py)\(\d+\): (\w+)")


def issuer(event) -> str:
    """The innermost lockstep or vLLM frame above a torch op (the profiler's Python function events are its
    parents; torch's own wrappers are skipped), as ``file:function``."""
    e = event.cpu_parent
    while e is not None:
        m = _FRAME.search(e.key)
        if m:
            return f"{m.group(1)}:{m.group(3)}"
        e = e.cpu_parent
    return "other"


def summarise(prof, wall_s: float) -> dict:
    """Ops by name (calls, self ms) and by issuing lockstep function, from one profiled step."""
    by_op = collections.defaultdict(lambda: [0, 0.0])
    by_issuer = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name != "CPU" or e.key.startswith("ProfilerStep"):
            continue
        if "::" not in e.key or "(" in e.key:
            continue  # Python function events (the stack) and record_function ranges: not torch ops
        ms = e.self_cpu_time_total / 1000
        by_op[e.key][0] += 1
        by_op[e.key][1] += ms
        who = by_issuer[issuer(e)]
        who[0] += 1
        who[1] += ms
    rows = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    return dict(wall_ms=wall_s * 1000, ops_calls=sum(c for c, _ in by_op.values()),
                ops_self_ms=sum(t for _, t in by_op.values()),
                by_op=[(k, c, round(t, 3)) for k, (c, t) in rows],
                by_issuer=[(k, c, round(t, 3)) for k, (c, t) in sorted(by_issuer.items(), key=lambda kv: -kv[1][1])])


def thread_cpu_ms() -> dict[int, tuple[str, float]]:
    """Native thread id -> (name, CPU ms used so far) for every thread of this process (Linux's /proc; Python
    threads by their ``threading`` name, the main thread as "main", the others as "other")."""
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[os.getpid()] = "main"
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (names.get(int(tid), "other"), (int(fields[11]) + int(fields[12])) * tick_ms)
    return out


def per_step_threads(step, n: int) -> dict:
    """``n`` calls of ``step``: the median wall ms and each thread's CPU ms per step (threads that used any)."""
    walls, before = [], thread_cpu_ms()
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1000)
    after = thread_cpu_ms()
    used = [(name, (ms - before.get(tid, (name, 0.0))[1]) / n) for tid, (name, ms) in after.items()]
    return dict(steps=n, median_wall_ms=sorted(walls)[n // 2],
                threads=sorted([(name, round(ms, 2)) for name, ms in used if ms > 0], key=lambda r: -r[1]))


def build(path: str, a) -> str:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                         num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256), head_dim=64,
                         max_position_embeddings=1024, initializer_range=0.02, tie_word_embeddings=False)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def run(path: str, a) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024, block_size=32, seed=0,
              kv_cache_memory_bytes=256 << 20, enforce_eager=True, enable_prefix_caching=False,
              max_num_batched_tokens=max(4096, a.prompts * a.prompt_len))
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, a.vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    kinds = {"greedy": dict(temperature=0.0), "top-p": dict(temperature=1.0, top_p=0.9, logprobs=0, seed=1)}
    out, rid = {}, 0

    def one_step(label):
        t0 = time.perf_counter()
        if label is None:
            engine.step()
            return
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            engine.step()
        out[label] = summarise(prof, time.perf_counter() - t0)
        out[label]["torch_threads"] = torch.get_num_threads()  # vLLM's CPU worker may set its own

    try:
        for rnd in ("warm-up", "profiled"):
            for kind, sampling in kinds.items():
                sp = SamplingParams(max_tokens=4, ignore_eos=True, **sampling)
                for p in prompts:
                    engine.add_request(f"r{rid}", TokensPrompt(prompt_token_ids=p), sp)
                    rid += 1
                profiled = rnd == "profiled"
                one_step("prefill" if profiled and kind == "greedy" else None)  # the whole batch's prompts
                one_step(None)  # first decode step (vLLM may still settle its batch here)
                one_step(f"decode {kind}" if profiled else None)
                while engine.has_unfinished_requests():
                    engine.step()
        if a.thread_steps:
            sp = SamplingParams(max_tokens=a.thread_steps + 8, ignore_eos=True, temperature=0.0)
            for p in prompts:
                engine.add_request(f"r{rid}", TokensPrompt(prompt_token_ids=p), sp)
                rid += 1
            for _ in range(4):  # the prefill and the first decode steps
                engine.step()
            out["threads"] = per_step_threads(engine.step, a.thread_steps)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.engine_core.shutdown()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--mlp", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=15, help="ops printed per step")
    ap.add_argument("--thread-steps", type=int, default=0, help="greedy decode steps timed per thread after the profile")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    os.environ.setdefault("LOCKSTEP_VLLM", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(work, "vllm_cache"))
        res = run(build(os.path.join(work, "llama"), a), a)
    load = "load average (1/5/15 min) at start {:.2f} / {:.2f} / {:.2f}, at end {:.2f} / {:.2f} / {:.2f}; " \
           "{} CPUs".format(*load0, *os.getloadavg(), os.cpu_count())
    res = dict(load=load, args=vars(a), steps=res)
    os.makedirs(a.out, exist_ok=True)
    json.dump(res, open(os.path.join(a.out, "vllm_step_profile.json"), "w"), indent=1)
    print(load, file=sys.stderr)
    threads = res["steps"].pop("threads", None)
    for label, s in res["steps"].items():
        print(f"\n## {label}: step {s['wall_ms']:.1f} ms, {s['ops_calls']} torch op calls, "
              f"{s['ops_self_ms']:.1f} ms self time in them, torch threads {s['torch_threads']}\n\n| op | calls | self ms |\n|---|---|---|")
        for k, c, t in s["by_op"][:a.top]:
            print(f"| {k} | {c} | {t:.2f} |")
        print("\n| issued by | calls | self ms |\n|---|---|---|")
        for k, c, t in s["by_issuer"][:a.top]:
            print(f"| {k} | {c} | {t:.2f} |")
    if threads:
        print(f"\n## {threads['steps']} greedy decode steps ({'lockstep' if os.environ['LOCKSTEP_VLLM'] == '1' else 'stock'}): "
              f"median {threads['median_wall_ms']:.2f} ms a step\n\n| thread | CPU ms a step |\n|---|---|")
        for name, ms in threads["threads"]:
            print(f"| {name} | {ms:.2f} |")
        res["threads"] = threads
        json.dump(res, open(os.path.join(a.out, "vllm_step_profile.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
