"""Where does an RL run's sampler/trainer mismatch come from? A few GRPO steps, lockstep vs stock.

    python -m examples.rl_mismatch                       # 4 steps, tiny Llama, PNGs in bench-results/
    python -m examples.rl_mismatch --steps 6 --lr 0.02 --out /tmp/rl/

A tiny Hugging Face Llama (2 layers, hidden 64, vocab 128, random weights, nothing downloaded) is
trained for a few GRPO-style steps on a toy reward (the share of generated tokens with an even id),
with an asynchronous-RL shape: the sampler runs one update behind the trainer.

Each step:

1. **sampler** (weights theta_old = the trainer's weights before its last update, a snapshot):
   ``model.generate`` on a left-padded batch (``--prompts`` prompts x ``--group`` samples each),
   sampling; records q = the log-prob of every sampled token from the step's raw logits;
2. **trainer** (weights theta): one packed forward with autograd gives log p_theta; the same packed
   forward on the snapshot (no grad) gives log p_theta_old, the trainer evaluated at the sampler's
   weights;
3. ``hal.rl.dlc_decompose`` splits delta_t = log p_theta - log q into the policy lag
   l_t = log p_theta - log p_theta_old (the staleness, what importance weights are for) and the engine
   mismatch e_t = log p_theta_old - log q (two engines, same weights: pure numerics);
4. the loss is the GRPO policy gradient, each token weighted by ``hal.rl.dlc_token_weights`` (the
   clipped lag ratio) times ``hal.rl.truncated_is_weights`` of the engine mismatch; Adam step; the
   sampler receives the pre-update weights (one step stale).

It runs twice from the same initial weights and seeds: **lockstep** (``lt.patch`` on sampler and
trainer, ``hal.log_softmax`` for the log-probs: e_t is exactly 0 on every token, checked on raw bits,
and ESS = batch size before the first update) and **stock** (sdpa, torch's kernels: e_t != 0,
measured). Prints one table per run and saves two PNGs to ``--out``. Exit status 1 if the lockstep
run's e_t bits are not all zero.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from hal import rl
from hal.conformance.bits import raw_bits
from hal.integrations import transformers as lt
from hal.integrations.transformers.testing import tiny_model

from .hf_rollout import make_prompts, packed_logprobs, sample

PATHS = ("lockstep", "stock")


def reward_even_share(responses: torch.Tensor) -> torch.Tensor:
    """Toy reward of each sequence: the share of its generated tokens whose id is even."""
    return (responses % 2 == 0).double().mean(1)


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's standard deviation (+ eps)."""
    r = rewards.reshape(-1, group)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def run(path: str, args) -> list[dict]:
    """``args.steps`` GRPO steps on one path; returns one record per step (tensors + metrics)."""
    attn = "lockstep" if path == "lockstep" else "sdpa"
    trainer = tiny_model("llama", seed=args.seed, attn_implementation=attn)
    sampler = tiny_model("llama", seed=args.seed, attn_implementation=attn)  # holds theta_old
    sampler.load_state_dict(trainer.state_dict())
    handles = [lt.apply(trainer), lt.apply(sampler)] if path == "lockstep" else []
    opt = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    base = make_prompts(args.prompts, args.seed, trainer.config.vocab_size)
    prompts = [p for p in base for _ in range(args.group)]  # GRPO groups: each prompt sampled `group` times
    records = []
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            resp, q = sample(sampler, path, prompts, args.new_tokens, args.seed + step)
            with torch.no_grad():
                p_old = packed_logprobs(sampler, path, prompts, resp)   # trainer engine at theta_old
            p = packed_logprobs(trainer, path, prompts, resp)          # trainer engine at theta, autograd
            d = rl.dlc_decompose(p.detach(), p_old, q)
            engine = rl.mismatch_metrics(p_old, q)                      # e_t alone: same weights, two engines
            total = rl.mismatch_metrics(p.detach(), q)                  # delta_t = l_t + e_t
            rewards = reward_even_share(resp)
            adv = group_advantages(rewards, args.group)
            w = rl.dlc_token_weights(d.lag, adv[:, None]) * rl.truncated_is_weights(p_old, q, cap=args.tis_cap).double()
            loss = -(w.float() * adv[:, None].float() * p).mean()
            snapshot = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.load_state_dict(snapshot)  # the next batch is sampled one update behind the trainer
            records.append(dict(
                path=path, step=step, q=q, p_old=p_old, p=p.detach(), lag=d.lag, e=d.mismatch,
                e_bits_differ=int((raw_bits(p_old) != raw_bits(q)).sum()),
                lag_bits_differ=int((raw_bits(p.detach()) != raw_bits(p_old)).sum()),
                tokens=engine.tokens, batch=d.sequences, reward=float(rewards.mean()),
                max_abs_e=d.max_abs_mismatch, mean_e=d.mismatch_mean, max_abs_lag=d.max_abs_lag,
                ess_lag=d.ess_lag_sequences, resync=d.resync, k3_e=engine.k3, k3_total=total.k3,
                ess_total=total.ess_sequences, seconds=time.perf_counter() - t0))
    finally:
        for h in handles:
            h.revert()
    return records


def table(records: list[dict]) -> str:
    head = (f"  {'step':>4} {'reward':>6} {'max|e|':>9} {'mean e':>10} {'e bits differ':>14} {'k3(e)':>9} "
            f"{'max|l|':>9} {'ESS(l)':>9} {'k3(delta)':>9} {'resync':>6} {'s':>5}")
    rows = [head]
    for r in records:
        rows.append(f"  {r['step']:>4} {r['reward']:>6.3f} {r['max_abs_e']:>9.2e} {r['mean_e']:>10.2e} "
                    f"{r['e_bits_differ']:>4}/{r['tokens']:<3} ({100 * r['e_bits_differ'] / r['tokens']:>3.0f}%) "
                    f"{r['k3_e']:>9.2e} {r['max_abs_lag']:>9.2e} {r['ess_lag']:>5.2f}/{r['batch']:<3} "
                    f"{r['k3_total']:>9.2e} {'yes' if r['resync'] else 'no':>6} {r['seconds']:>5.1f}")
    return "\n".join(rows)


def plot(results: dict[str, list[dict]], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for col, (path, recs) in enumerate(results.items()):
        q = torch.cat([r["q"].reshape(-1) for r in recs])
        p_old = torch.cat([r["p_old"].reshape(-1) for r in recs])
        differ = (raw_bits(q) != raw_bits(p_old)).tolist()
        colors = ["tab:red" if x else "tab:blue" for x in differ]
        ax = axes[0][col]
        ax.scatter(q.numpy(), p_old.numpy(), s=10, alpha=0.7, c=colors)
        lo, hi = float(min(q.min(), p_old.min())), float(max(q.max(), p_old.max()))
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_title(f"{path}: max |e| = {max(r['max_abs_e'] for r in recs):.2e}\n"
                     f"{sum(differ)} of {len(differ)} tokens' bits differ (red)")
        ax.set_xlabel("sampler log q (generate, left-padded batch)")
        ax.set_ylabel("trainer log p at sampler's weights (packed)")
        ax = axes[1][col]  # the residual, where a few float32 ulps become visible
        ax.scatter(q.numpy(), (p_old.double() - q.double()).numpy(), s=10, alpha=0.7, c=colors)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_xlabel("sampler log q")
        ax.set_ylabel("e_t = log p_old - log q")
    fig.suptitle("engine mismatch e_t: same weights, sampler vs trainer, all steps")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "rl_mismatch_scatter.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, (path, recs) in enumerate(results.items()):
        for row, (key, name) in enumerate((("e", "engine mismatch e_t = log p_old - log q"),
                                           ("lag", "policy lag l_t = log p - log p_old"))):
            ax = axes[row][col]
            g = torch.Generator().manual_seed(0)
            for r in recs:
                v = r[key].reshape(-1)
                x = r["step"] + 0.3 * (torch.rand(v.numel(), generator=g) - 0.5)
                ax.scatter(x.numpy(), v.numpy(), s=8, alpha=0.6)
            ax.axhline(0.0, color="k", lw=0.6)
            ax.set_xticks([r["step"] for r in recs])
            ax.set_xlabel("step")
            ax.set_title(f"{path}: {name}", fontsize=9)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "rl_mismatch_steps.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def save_npz(results: dict[str, list[dict]], out_dir: str) -> list[str]:
    """Each run's engine-mismatch pair, all steps stacked [steps * batch, new_tokens], in the format of
    ``hal rl report``: ``sampler`` = log q, ``trainer`` = log p at the sampler's weights (float32)."""
    import numpy as np
    os.makedirs(out_dir, exist_ok=True)
    out = []
    for path, recs in results.items():
        out.append(os.path.join(out_dir, f"rl_mismatch_{path}.npz"))
        np.savez(out[-1], sampler=torch.cat([r["q"] for r in recs]).numpy(),
                 trainer=torch.cat([r["p_old"] for r in recs]).numpy())
    return out


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=3, help="distinct prompts (3-12 tokens) per batch")
    ap.add_argument("--group", type=int, default=4, help="GRPO group: samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="truncated IS cap on the engine mismatch ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/", help="folder for the PNGs")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: these tensors are tiny; more threads only add overhead)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    lt.register()
    print(f"tiny llama (random weights), {args.steps} GRPO steps, batch {args.prompts} prompts x {args.group} "
          f"samples x {args.new_tokens} sampled tokens, sampler one update stale, Adam lr {args.lr}; "
          f"transformers {lt.check_version()}, torch {torch.__version__}")
    results = {path: run(path, args) for path in PATHS}
    for path, recs in results.items():
        print(f"\n{path}:\n{table(recs)}")
    lock = results["lockstep"]
    bad = sum(r["e_bits_differ"] for r in lock)
    n = sum(r["tokens"] for r in lock)
    first = lock[0]
    print(f"\nlockstep: e_t bits differ on {bad} of {n} tokens; ESS of the lag before any update "
          f"{first['ess_lag']:.2f} of {first['batch']}")
    stock_bad = sum(r["e_bits_differ"] for r in results["stock"])
    print(f"stock:    e_t bits differ on {stock_bad} of {sum(r['tokens'] for r in results['stock'])} tokens")
    print("\n" + "\n".join(plot(results, args.out) + save_npz(results, args.out)))
    return 0 if bad == 0 and first["ess_lag"] == first["batch"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
