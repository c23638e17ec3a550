"""RL parity on an unmodified Hugging Face model: sampler log-probs vs trainer log-probs, lockstep vs stock.

    python -m examples.hf_parity --model llama          # or qwen3, qwen3_next
    python -m examples.hf_parity --model qwen3_next --out bench-results/

For each path (lockstep = ``lt.patch(model)`` with attention "lockstep"; stock = the same weights
with sdpa and torch's kernels):

1. **sampler**: ``model.generate`` on a left-padded batch of prompts of different lengths (as a
   batching engine pads them), sampling; the log-prob of every sampled token is recorded from the
   step's logits;
2. **trainer**: one packed forward (all prompt+response sequences in one row, position_ids restarting
   at 0, autograd on, train mode) recomputes those log-probs, and a policy-gradient-shaped loss is
   back-propagated;
3. prints per-token mismatch metrics -- max |dlogp|, the KL estimators k1/k2/k3 (Schulman) of
   KL(sampler || trainer) from the sampled tokens, the share of tokens whose log-prob bits differ --
   and saves a scatter plot of sampler vs trainer log-probs for both paths.

Tiny model (2 layers, hidden 64, vocab 128, random weights, nothing downloaded).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from hal.integrations import transformers as lt
from hal.integrations.transformers.testing import KINDS, tiny_model

from .hf_rollout import make_prompts, packed_logprobs, sample


def train_forward(model, path, prompts, responses):
    """The packed trainer forward with autograd, then a policy-gradient-shaped backward."""
    lp = packed_logprobs(model, path, prompts, responses)
    advantages = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    (-(advantages * lp).mean()).backward()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    return lp.detach(), grad_norm


def metrics(sampler, trainer):
    lr = (trainer.double() - sampler.double()).reshape(-1)  # log pi_train / pi_sample per token
    differ = sampler.reshape(-1).view(torch.int32) != trainer.reshape(-1).view(torch.int32)
    return dict(tokens=lr.numel(), max_abs=float(lr.abs().max()), k1=float((-lr).mean()),
                k2=float((lr ** 2 / 2).mean()), k3=float((torch.expm1(lr) - lr).mean()),
                share_differing=float(differ.double().mean()))


def run(kind, path, args):
    model = tiny_model(kind, seed=args.seed, attn_implementation="lockstep" if path == "lockstep" else "sdpa")
    prompts = make_prompts(args.prompts, args.seed, model.config.vocab_size)
    handle = lt.apply(model) if path == "lockstep" else None
    try:
        t0 = time.perf_counter()
        resp, lp_s = sample(model, path, prompts, args.new_tokens, args.seed)
        t1 = time.perf_counter()
        lp_t, gnorm = train_forward(model, path, prompts, resp)
        t2 = time.perf_counter()
    finally:
        if handle is not None:
            handle.revert()
    return dict(path=path, sampler=lp_s, trainer=lp_t, grad_norm=gnorm, t_sample=t1 - t0, t_train=t2 - t1,
                **metrics(lp_s, lp_t))


def plot(results, kind, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.5))
    for ax, r in zip(axes, results):
        x, y = r["sampler"].reshape(-1).numpy(), r["trainer"].reshape(-1).numpy()
        ax.scatter(x, y, s=12, alpha=0.7, c=["tab:red" if d else "tab:blue" for d in
                                             (r["sampler"].reshape(-1).view(torch.int32)
                                              != r["trainer"].reshape(-1).view(torch.int32)).tolist()])
        lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_title(f"{r['path']}: max |dlogp| = {r['max_abs']:.2e}\n"
                     f"{100 * r['share_differing']:.0f}% of tokens differ (red)")
        ax.set_xlabel("sampler log-prob (generate, left-padded batch)")
        ax.set_ylabel("trainer log-prob (packed forward, autograd)")
    fig.suptitle(f"tiny {kind}: sampler vs trainer log-probs of the sampled tokens")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"hf_parity_{kind}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=KINDS, default="llama")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/", help="folder for the PNG scatter")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: these tensors are tiny; more threads only add overhead)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lt.register()
    print(f"tiny {args.model} (random weights), {args.prompts} prompts of 3-12 tokens, left-padded batched generate "
          f"of {args.new_tokens} sampled tokens each; transformers {lt.check_version()}, torch {torch.__version__}")
    results = [run(args.model, path, args) for path in ("lockstep", "stock")]
    print(f"\n  {'path':<9} {'tokens':>6} {'max |dlogp|':>12} {'k1':>10} {'k2':>10} {'k3':>10} {'differ':>7} "
          f"{'|grad|':>9} {'sample s':>8} {'train s':>7}")
    for r in results:
        print(f"  {r['path']:<9} {r['tokens']:>6} {r['max_abs']:>12.3e} {r['k1']:>10.2e} {r['k2']:>10.2e} "
              f"{r['k3']:>10.2e} {100 * r['share_differing']:>6.1f}% {r['grad_norm']:>9.3e} {r['t_sample']:>8.1f} "
              f"{r['t_train']:>7.1f}")
    print(f"\nscatter: {plot(results, args.model, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
