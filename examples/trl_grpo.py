"""TRL's GRPOTrainer with transformers' continuous-batching engine as sampler: lockstep vs stock.

    python -m examples.trl_grpo                      # 3 GRPO steps per path, PNG in bench-results/
    python -m examples.trl_grpo --steps 4 --out /tmp/trl/

Everything is built here, nothing downloaded: a tiny Llama (hal.integrations.transformers.testing, 2 layers,
hidden 64, vocab 128, random weights) saved to a scratch folder, a word-level tokenizer over its 128
ids ("t0" ... "t127"), an in-memory ``datasets.Dataset`` of prompts and a toy reward (the share of
completion tokens with an even id). ``hal.integrations.trl.GRPOTrainer`` runs TRL's GRPO on CPU with
``use_transformers_continuous_batching=True``, KL coefficient ``beta > 0`` (TRL builds and runs its
reference model) and temperature ``--temperature``; it keeps the engine's log-probs, so TRL's own
importance-sampling correction and ``sampling/*`` metrics see them, and it logs hal.rl's metrics.

Two runs from the same weights and seed: **lockstep** (the trainer patches policy and reference model
with ``lt.apply``; the engine runs on lockstep) and **stock** (sdpa, TRL's fused LM head). Each step
TRL scores the sampled batch with the policy at the weights that sampled it, before the optimizer
moves them: that is the sampler/trainer pair compared here, on raw bits. Exit status 1 if a lockstep
token's bits differ, or if the lockstep run could not run (the engine refuses lockstep before
hal.integrations.transformers.ENGINE_SUPPORTED).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

PATHS = ("lockstep", "stock")
TOKENS = [f"t{i}" for i in range(128)]  # the tiny models' vocabulary (hf_testing.VOCAB): one word per id
PAD, EOS = 0, 1


def make_tokenizer():
    """A word-level tokenizer over ``TOKENS`` (pad "t0", eos "t1"), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token=TOKENS[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=TOKENS[PAD], eos_token=TOKENS[EOS],
                                   unk_token=TOKENS[2], padding_side="left")


def make_dataset(n: int, seed: int):
    """``n`` prompts of 3-9 random words (ids 2..127), as an in-memory ``datasets.Dataset``."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 10, (n,), generator=g).tolist()
    prompts = [" ".join(TOKENS[i] for i in torch.randint(2, len(TOKENS), (L,), generator=g).tolist()) for L in lens]
    return Dataset.from_dict({"prompt": prompts})


def reward_even_share(completions, **kwargs) -> list[float]:
    """Toy reward: the share of a completion's words whose id is even (0.0 for an empty completion)."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split()]
        out.append(sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0)
    return out


def save_tiny_model(path: str, folder: str, seed: int) -> str:
    """The tiny Llama with the path's attention, saved where TRL loads policy and reference model from."""
    from hal.integrations.transformers.testing import tiny_model
    model = tiny_model("llama", seed=seed, attn_implementation="lockstep" if path == "lockstep" else "sdpa")
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    model.save_pretrained(folder)
    return folder


def grpo_config(out_dir: str, args):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=args.new_tokens, learning_rate=args.lr,
        beta=args.beta, temperature=args.temperature, seed=args.seed, dataloader_num_workers=0,
        use_transformers_continuous_batching=True,
        # small pages and few blocks: the engine's default sizing is for a GPU's memory
        transformers_continuous_batching_config=dict(page_size=16, num_blocks=64, max_batch_tokens=64),
        disable_tqdm=True)


def run(path: str, args) -> dict:
    """``args.steps`` GRPO steps on one path; returns the trainer's per-step records and TRL's log history."""
    from hal.integrations import transformers as lt
    from hal.integrations.trl import GRPOTrainer
    torch.manual_seed(args.seed)
    if path == "lockstep":
        lt.register()  # attention "lockstep", before the model is built with it
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(path, os.path.join(tmp, "model"), args.seed)
        trainer = GRPOTrainer(model=model_dir, args=grpo_config(os.path.join(tmp, "out"), args),
                              processing_class=make_tokenizer(), reward_funcs=reward_even_share,
                              train_dataset=make_dataset(64, args.seed), lockstep=path == "lockstep")
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            trainer.revert_patches()
        return dict(path=path, records=trainer.mismatch_records, history=trainer.state.log_history,
                    seconds=time.perf_counter() - t0, ref_model=trainer.ref_model is not None)


def step_rows(result: dict) -> list[dict]:
    """One row per step: raw-bit count and TRL's own metrics of that step."""
    logs = [h for h in result["history"] if "sampling/sampling_logp_difference/max" in h]
    rows = []
    for rec, log in zip(result["records"], logs, strict=True):
        m = rec["metrics"]
        rows.append(dict(step=rec["step"], tokens=m.tokens, bits_differ=round(m.share_bits_differ * m.tokens),
                         max_abs=m.max_abs_log_ratio, k3=m.k3, ess=m.ess_sequences, seqs=m.sequences,
                         trl_max=log["sampling/sampling_logp_difference/max"],
                         trl_mean=log["sampling/sampling_logp_difference/mean"],
                         is_min=log["sampling/importance_sampling_ratio/min"],
                         is_max=log["sampling/importance_sampling_ratio/max"],
                         kl=log.get("kl"), reward=log.get("reward")))
    return rows


def table(rows: list[dict]) -> str:
    head = (f"  {'step':>4} {'bits differ':>14} {'max|log p - log q|':>18} {'k3':>9} {'ESS seq':>9} "
            f"{'TRL logp diff max':>17} {'TRL IS ratio min/max':>22} {'kl':>9} {'reward':>6}")
    out = [head]
    for r in rows:
        out.append(f"  {r['step']:>4} {r['bits_differ']:>4}/{r['tokens']:<3} ({100 * r['bits_differ'] / r['tokens']:>3.0f}%) "
                   f"{r['max_abs']:>18.2e} {r['k3']:>9.2e} {r['ess']:>5.2f}/{r['seqs']:<3} {r['trl_max']:>17.2e} "
                   f"{r['is_min']:>10.7f}/{r['is_max']:<10.7f} {r['kl'] or 0.0:>9.2e} {r['reward'] or 0.0:>6.3f}")
    return "\n".join(out)


def plot(rows_by_path: dict[str, list[dict]], records_by_path: dict[str, list[dict]], out_dir: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path, recs in records_by_path.items():
        g = torch.Generator().manual_seed(0)
        for rec in recs:
            d = (rec["trainer"].double() - rec["sampler"].double())[rec["mask"]]
            x = rec["step"] + 0.3 * (torch.rand(d.numel(), generator=g) - 0.5) + (0.0 if path == "lockstep" else 0.05)
            axes[0].scatter(x.numpy(), d.numpy(), s=8, alpha=0.6, color="tab:blue" if path == "lockstep" else "tab:red",
                            label=path if rec is recs[0] else None)
        rows = rows_by_path[path]
        axes[1].plot([r["step"] for r in rows], [r["is_min"] for r in rows], "v-", label=f"{path} min",
                     color="tab:blue" if path == "lockstep" else "tab:red")
        axes[1].plot([r["step"] for r in rows], [r["is_max"] for r in rows], "^--", label=f"{path} max",
                     color="tab:blue" if path == "lockstep" else "tab:red")
    steps = sorted({r["step"] for rows in rows_by_path.values() for r in rows})
    for ax in axes:
        ax.set_xticks(steps)
    axes[0].axhline(0.0, color="k", lw=0.6)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("log p (trainer, sampler's weights) - log q (engine)")
    axes[0].set_title("per-token sampler/trainer mismatch, every step", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].axhline(1.0, color="k", lw=0.6)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("TRL's importance-sampling ratio")
    axes[1].set_title("sampling/importance_sampling_ratio/{min,max}", fontsize=9)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(out_dir, "trl_grpo_mismatch.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--group", type=int, default=4, help="GRPO group: completions per prompt (num_generations)")
    ap.add_argument("--new-tokens", type=int, default=8, help="max_completion_length")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0: TRL runs its reference model)")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/", help="folder for the PNG")
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from hal.integrations import trl as lt_trl
    print(f"tiny llama (random weights), TRL {lt_trl.check_version()} GRPOTrainer, transformers "
          f"{transformers.__version__} continuous batching as sampler, {args.steps} steps x {args.batch} completions "
          f"({args.group} per prompt) x <= {args.new_tokens} tokens, temperature {args.temperature}, beta {args.beta}")
    del trl
    paths = PATHS if lt_trl.engine_supports_lockstep() else ("stock",)
    results = {path: run(path, args) for path in paths}
    rows = {path: step_rows(r) for path, r in results.items()}
    for path in paths:
        print(f"\n{path} ({results[path]['seconds']:.1f} s, reference model: {results[path]['ref_model']}):\n"
              f"{table(rows[path])}")
    print("\n" + plot(rows, {p: r["records"] for p, r in results.items()}, args.out))
    stock_bad = sum(r["bits_differ"] for r in rows["stock"])
    print(f"stock:    sampler/trainer bits differ on {stock_bad} of {sum(r['tokens'] for r in rows['stock'])} tokens")
    if "lockstep" not in results:
        print("lockstep: NOT RUN -- transformers' continuous-batching engine refuses lockstep in this build "
              "(hal.integrations.transformers.ENGINE_SUPPORTED is not set)")
        return 1
    bad = sum(r["bits_differ"] for r in rows["lockstep"])
    print(f"lockstep: sampler/trainer bits differ on {bad} of {sum(r['tokens'] for r in rows['lockstep'])} tokens")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
