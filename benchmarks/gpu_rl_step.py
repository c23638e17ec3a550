"""One RL step end to end, lockstep against stock in one process: sample with transformers' continuous-batching
engine, then train on the same sequences (issue 51).

    python -m benchmarks.gpu_rl_step --out OUT                       # CUDA, the strict policy's sizes
    python -m benchmarks.gpu_rl_step --policy fast --out OUT         # the fast policy (where lt.patch has it)
    python -m benchmarks.gpu_rl_step --tiny --device cpu --out OUT   # the dry run (CI: tests/test_gpu_rl_step.py)

The model: Qwen3-8B-shaped decoder layers (hidden 4096, 32 query / 8 KV heads of 128, MLP 12288, vocabulary
151,936; ``--layers``, 4 by default), random weights built on the device, bf16 (``--tiny``: hidden 64, vocabulary
128). One model, its weights shared: lockstep runs it under ``lt.patch(model)``, stock with the patch reverted
(sdpa; the engine picks its own attention). Each side runs one untimed warm-up step, then the timed step:

* sample: ``model.generate_batch`` on N random prompts of P tokens, G new tokens each, sampled at temperature 1 with
  top-p 0.9, the log-probs recorded by the engine;
* train: a teacher-forced forward of the same prompt + response sequences in micro-batches of at most 8, the
  response tokens' log-probs (lockstep: ``lt.token_logprobs`` under the same sampling settings; stock: the LM head's
  logits through transformers' temperature / top-p warpers, log-softmax, as the engine computes them), a GRPO-style
  loss (advantages normalised within groups of ``--group`` sequences, a clipped ratio against the sampled
  log-probs) and its backward pass (gradients of every weight, accumulated over the micro-batches).

Reported (``OUT/rl_step.jsonl``, one row per side, and a table): seconds and tokens/s of each phase (sample:
generated tokens/s; train: sequence tokens/s) and of the step (generated tokens/s), the lockstep / stock ratios,
the count of response tokens whose recorded log-prob bits differ between engine and trainer (lockstep: 0 is the
claim, checked on raw bits; stock's count beside it), and peak device memory. Sizes follow the policy (strict is
slower: 8 prompts x 256 + 64 new; fast: 64 x 512 + 128); ``--prompts/--prompt-len/--new`` override them. A run that
does not fit -- the device memory it needs, or ``--budget`` seconds after the first warm-up -- stops and says so
(``OUT/rl_step.jsonl``'s ``error`` row, exit status 3); it never shrinks itself. It needs a transformers release
whose continuous-batching engine lockstep tested or covers by source (5.17 to 5.25: docs/integrations.md, "Which
transformers releases"); on another it stops at once, naming the engine functions that differ.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

from hal.conformance.bits import raw_bits
from hal.integrations import transformers as lt

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=1e6,
                initializer_range=0.02, tie_word_embeddings=False, rms_norm_eps=1e-6)
TINY = dict(QWEN3_8B, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)
#: (prompts, prompt tokens, new tokens) per policy; the strict policy's kernels are slower, so it runs smaller
SIZES = {"strict": (8, 256, 64), "fast": (64, 512, 128)}
TINY_SIZES = (4, 12, 4)
MICRO_BATCH = 8  # sequences per trainer forward: [micro-batch x new x vocab] float32 scores must fit
TEMPERATURE, TOP_P = 1.0, 0.9
CLIP = 0.2


class DoesNotFit(Exception):
    """The run as asked does not fit the device memory or the time budget: reported, never shrunk."""


def build_model(shape: dict, layers: int, device: str, dtype, seed: int = 0):
    """A Qwen3ForCausalLM of ``shape`` with ``layers`` decoder layers, random weights drawn on ``device``
    (HF's initialisation skipped): matrices U(-a, a), a = sqrt(3) * initializer_range; norm weights 1 + U(-0.1, 0.1)."""
    import transformers as tf
    from transformers.initialization import no_init_weights
    cfg = tf.Qwen3Config(**shape, num_hidden_layers=layers)
    cfg._attn_implementation = "lockstep"
    old = torch.get_default_dtype()
    with no_init_weights(), torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            model = tf.Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    a = 3 ** 0.5 * cfg.initializer_range
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + torch.rand(p.shape, generator=g, device=device, dtype=torch.float32) * 0.2 - 0.1)
            else:
                p.copy_(torch.rand(p.shape, generator=g, device=device, dtype=torch.float32).mul_(2 * a).sub_(a))
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq"):  # HF's rotary tables are float32 whatever the default dtype; rebuild if not
            if buf.dtype != torch.float32:
                raise AssertionError(f"{name} built as {buf.dtype}")
    return model.eval()


def patch_kwargs(policy: str) -> dict:
    """lt.patch's arguments for ``policy``: strict is lt.patch's default; "fast" is its switch (refused by name by
    lt.patch where no backend claims the fast suites on the device)."""
    return {} if policy == "strict" else {"policy": policy}


def random_prompts(n: int, length: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine_config(n: int, length: int, new: int, tiny: bool):
    """The engine's configuration: pages for every request at once (no offloading: a timing, not a stress test),
    no block sharing (random prompts share nothing), recorded log-probs."""
    from hal.integrations.transformers.testing import continuous_batching_config
    page = 16
    blocks = n * (-(-(length + new) // page) + 1)
    return continuous_batching_config(return_logprobs=True, page_size=page, num_blocks=blocks,
                                      max_batch_tokens=32 if tiny else 4096, allow_block_sharing=False)


def sample(model, prompts, new: int, cb, seed: int):
    """generate_batch: the responses ``[N, new]`` and the engine's recorded float32 log-probs ``[N, new]``."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                           eos_token_id=-1, pad_token_id=0)
    torch.manual_seed(seed)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    rows = sorted(out, key=lambda r: int(r.split("_")[-1]))
    tokens = torch.tensor([list(out[r].generated_tokens) for r in rows])
    logprobs = torch.tensor([list(out[r].logprobs) for r in rows], dtype=torch.float32)
    if tokens.shape != (len(prompts), new):
        raise AssertionError(f"the engine returned {tuple(tokens.shape)} tokens, asked {len(prompts)} x {new}")
    return tokens, logprobs


def stock_logprobs(model, hidden, tokens):
    """The stock trainer's log-probs of ``tokens``: the LM head's logits through transformers' temperature and
    top-p warpers, log-softmax, gathered (the engine's formula)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
    scores = model.get_output_embeddings()(hidden).float().flatten(0, 1)
    scores = TopPLogitsWarper(TOP_P)(None, TemperatureLogitsWarper(TEMPERATURE)(None, scores))
    return torch.log_softmax(scores, -1).gather(1, tokens.reshape(-1, 1)).view(tokens.shape)


def grpo_loss(logprobs, old, advantages):
    """A GRPO-style loss: the clipped ratio of new to sampled probabilities times each sequence's advantage."""
    ratio = torch.exp(logprobs - old)
    adv = advantages[:, None]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def train(model, lockstep: bool, prompts, tokens, sampled, advantages, micro_batch: int):
    """Teacher-forced forward, loss and backward over micro-batches; the trainer's log-probs ``[N, new]``."""
    seqs = torch.cat([torch.tensor(prompts), tokens], 1)
    P, device = len(prompts[0]), next(model.parameters()).device
    out = []
    model.zero_grad(set_to_none=True)
    for i in range(0, len(prompts), micro_batch):
        ids = seqs[i:i + micro_batch].to(device)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, P - 1:-1]
        tgt = ids[:, P:]
        lp = (lt.token_logprobs(model, hidden, tgt, temperature=TEMPERATURE, top_p=TOP_P) if lockstep
              else stock_logprobs(model, hidden, tgt))
        loss = grpo_loss(lp, sampled[i:i + micro_batch].to(device), advantages[i:i + micro_batch].to(device))
        (loss * len(ids) / len(prompts)).backward()
        out.append(lp.detach().cpu())
    return torch.cat(out)


def group_advantages(n: int, group: int, seed: int):
    """Random rewards, normalised within each group of ``group`` sequences (GRPO's advantage)."""
    r = torch.rand(n, generator=torch.Generator().manual_seed(seed)).view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()


def differing_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements' raw bits differ (-0.0 != +0.0; no tolerance)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"comparing {a.dtype} {tuple(a.shape)} with {b.dtype} {tuple(b.shape)}")
    return int((raw_bits(a) != raw_bits(b)).sum())


class Clock:
    def __init__(self, device):
        self.cuda = device.startswith("cuda")

    def now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def one_step(model, lockstep, prompts, new, cb, advantages, micro_batch, clock, seed):
    t0 = clock.now()
    tokens, sampled = sample(model, prompts, new, cb, seed)
    t1 = clock.now()
    trained = train(model, lockstep, prompts, tokens, sampled, advantages, micro_batch)
    t2 = clock.now()
    differ = differing_bits(sampled, trained)
    grads = sum(p.grad is not None for p in model.parameters())
    return dict(sample_s=t1 - t0, train_s=t2 - t1, step_s=t2 - t0, logprob_bits_differ=differ,
                tokens=tokens.numel(), params_with_grad=grads, params=sum(1 for _ in model.parameters()))


def memory_needed(model, n, length, new, micro_batch) -> int:
    """A lower bound of the device bytes a side needs: weights and their gradients, the engine's KV pages, and one
    micro-batch's float32 scores over the vocabulary (activations come on top)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * n * (length + new)
    scores = 3 * micro_batch * new * cfg.vocab_size * 4
    return 2 * weights + kv + scores


def run(args) -> list[dict]:
    device, tiny = args.device, args.tiny
    n, length, new = TINY_SIZES if tiny else SIZES[args.policy]
    n, length, new = args.prompts or n, args.prompt_len or length, args.new or new
    if n % args.group:
        raise SystemExit(f"--prompts {n} must be a multiple of --group {args.group}")
    kwargs = patch_kwargs(args.policy)
    lt.register()
    from hal.integrations.transformers.engine_install import _engine_refusal
    refusal = _engine_refusal()  # before building anything: the sampler is the engine (an untested one is refused)
    if refusal is not None:
        raise SystemExit(f"the sampler (transformers' continuous-batching engine) cannot run here: {refusal}")
    cuda = device.startswith("cuda")
    model = build_model(TINY if tiny else QWEN3_8B, args.layers, device, torch.bfloat16)
    micro_batch = min(args.micro_batch, MICRO_BATCH)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        need = memory_needed(model, n, length, new, micro_batch)
        if need > free:
            raise DoesNotFit(f"{n} prompts x {length} + {new} new on {args.layers} layers needs at least "
                             f"{need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free")
    prompts = random_prompts(n, length, model.config.vocab_size, seed=1)
    advantages = group_advantages(n, args.group, seed=2)
    cb = engine_config(n, length, new, tiny)
    clock, start, rows = Clock(device), time.perf_counter(), []
    for side in ("lockstep", "stock"):
        if side == "stock":
            model.config._attn_implementation = "sdpa"
        patch = lt.patch(model, **kwargs) if side == "lockstep" else None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            one_step(model, side == "lockstep", prompts, new, copy.deepcopy(cb), advantages, micro_batch, clock, 3)
            spent = time.perf_counter() - start
            if side == "lockstep" and args.budget and spent * 4 > args.budget:  # 3 more steps of about this one
                raise DoesNotFit(f"the lockstep warm-up step took {spent:.0f} s: the three steps left would not fit "
                                 f"--budget {args.budget:.0f} s (pass fewer --prompts / --layers, or a larger budget)")
            row = one_step(model, side == "lockstep", prompts, new, copy.deepcopy(cb), advantages, micro_batch,
                           clock, 4)
        finally:
            if patch is not None:
                patch.revert()
        row.update(side=side, policy=args.policy if side == "lockstep" else "stock", prompts=n, prompt_len=length,
                   new=new, layers=args.layers, micro_batch=micro_batch,
                   sample_tok_s=row["tokens"] / row["sample_s"], train_tok_s=n * (length + new) / row["train_s"],
                   step_tok_s=row["tokens"] / row["step_s"],
                   peak_mem_GiB=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        rows.append(row)
        model.zero_grad(set_to_none=True)
    lock, stock = rows
    for phase in ("sample", "train", "step"):
        lock[f"{phase}_ratio"] = lock[f"{phase}_s"] / stock[f"{phase}_s"]
    return rows


def environment(device: str) -> dict:
    import transformers
    env = dict(torch=torch.__version__, transformers=transformers.__version__, device=device)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and sizes: the dry run of the same code")
    ap.add_argument("--policy", choices=["strict", "fast"], default="strict")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --tiny: 2)")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new", type=int)
    ap.add_argument("--group", type=int, default=None, help="GRPO group size (default 8; --tiny: 2)")
    ap.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help=f"sequences per trainer forward (<= {MICRO_BATCH})")
    ap.add_argument("--budget", type=float, default=0, help="seconds the run may take (0: no limit)")
    ap.add_argument("--out", default="rl-step-out")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 4)
    args.group = args.group or (2 if args.tiny else 8)
    if args.tiny:
        args.micro_batch = min(args.micro_batch, 2)  # the dry run still cuts the batch into micro-batches
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.device)
    path = os.path.join(args.out, "rl_step.jsonl")
    try:
        rows = run(args)
    except DoesNotFit as e:
        with open(path, "w") as f:
            f.write(json.dumps(dict(env, error=f"does not fit: {e}")) + "\n")
        print(f"does not fit: {e}", file=sys.stderr)
        return 3
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(dict(env, **r)) + "\n")
    lock, stock = rows
    print(f"# one RL step: {lock['prompts']} prompts x {lock['prompt_len']} + {lock['new']} new, {lock['layers']} "
          f"Qwen3-8B-shaped layers{' (tiny)' if args.tiny else ''}, bf16; {env}")
    print("| side | sample tok/s | train tok/s | step tok/s | step s | log-prob bits differ | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = "" if r["peak_mem_GiB"] is None else f"{r['peak_mem_GiB']:.1f}"
        print(f"| {r['policy']} | {r['sample_tok_s']:.1f} | {r['train_tok_s']:.1f} | {r['step_tok_s']:.1f} | "
              f"{r['step_s']:.2f} | {r['logprob_bits_differ']} / {r['tokens']} | {mem} |")
    print(f"lockstep / stock time: sample {lock['sample_ratio']:.2f}x, train {lock['train_ratio']:.2f}x, "
          f"step {lock['step_ratio']:.2f}x")
    if lock["logprob_bits_differ"]:
        print(f"FAIL: {lock['logprob_bits_differ']} lockstep tokens' recorded log-prob bits differ from the trainer's",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
