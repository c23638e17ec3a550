"""transformers' continuous-batching engine: log-prob bits across scheduler settings and vs the trainer.

    python -m examples.engine_parity                    # Llama, Qwen3, Qwen3-Next, Qwen3.5; fp32 and bf16
    python -m examples.engine_parity --model llama --dtype float32

For each model and dtype, lockstep (``lt.patch(model)``) and stock (the same weights, sdpa, torch's
kernels) each run the engine twice over the same four greedy requests: an easy configuration (one
16-token page per request, a 64-token budget, no block sharing, no decode fast path) and a hard one
(4-token pages, a 4-token budget that cuts the longest prompt into 5 prefill chunks mixed with decode
rows, 8 blocks so requests get offloaded, block sharing on, the decode fast path on, requests submitted
in another order). Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) run GDN_EASY / GDN_HARD: the same
without block sharing (refused for them) and with 4 blocks, so that requests still get offloaded; stock
transformers cannot run them in the engine at all (its cache has no linear-attention layer). It prints the number
of generated tokens whose recorded log-prob bits differ between the two runs, and from a
teacher-forced trainer forward (``lt.token_logprobs`` on one forward over prompt + response).
Tiny models (2 layers, hidden 64, vocab 128, random weights, nothing downloaded).
"""
from __future__ import annotations

import argparse
import copy

import torch

from hal.integrations import hf_engine
from hal.integrations import transformers as lt
from hal.integrations.hf_testing import VOCAB, tiny_model

NEW = 6  # tokens generated per request
_g = torch.Generator().manual_seed(0)
_PREFIX = torch.randint(0, VOCAB, (9,), generator=_g).tolist()  # shared by two prompts: block sharing has work
PROMPTS = [_PREFIX + torch.randint(0, VOCAB, (8,), generator=_g).tolist(),
           torch.randint(0, VOCAB, (5,), generator=_g).tolist(),
           _PREFIX + torch.randint(0, VOCAB, (3,), generator=_g).tolist(),
           torch.randint(0, VOCAB, (7,), generator=_g).tolist()]
EASY = dict(page_size=16, num_blocks=64, max_batch_tokens=64, allow_block_sharing=False, max_blocks_per_request=0)
HARD = dict(page_size=4, num_blocks=8, max_batch_tokens=4, allow_block_sharing=True, safety_margin=0.0)
HARD_ORDER = [3, 1, 0, 2]
# Gated DeltaNet hybrids (Qwen3-Next): block sharing is refused (a shared prefix skips the tokens a GDN state
# is built from), and the engine pages only the attention layers, so fewer blocks are needed to offload
GDN_EASY = EASY
GDN_HARD = dict(HARD, allow_block_sharing=False, num_blocks=4)


def gen_config(do_sample=False, new=NEW, **kw):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=new, do_sample=do_sample, eos_token_id=-1, pad_token_id=0, **kw)


def run_engine(model, prompts, cb, gen=None, order=None, persistent=False):
    """``model.generate_batch`` with recorded log-probs: ({prompt index: (tokens, float32 log-probs)},
    the engine steps seen by a step hook, the number of token positions the model's forward ran)."""
    from transformers import ContinuousBatchingConfig
    order = list(range(len(prompts))) if order is None else order
    steps, counted = [], []
    hooks = hf_engine.step_hooks(model)
    hooks.append(steps.append)
    h = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kw: counted.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = model.generate_batch([prompts[i] for i in order], generation_config=gen or gen_config(),
                                   continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True, **cb),
                                   progress_bar=False, persistent_manager=persistent)
    finally:
        hooks.remove(steps.append)
        h.remove()
    res = {}
    for j, rid in enumerate(sorted(out, key=lambda r: int(r.split("_")[-1]))):  # ids count on in a kept manager
        res[order[j]] = (list(out[rid].generated_tokens), torch.tensor(out[rid].logprobs, dtype=torch.float32))
    return res, steps, sum(counted)


def teacher_forced(model, prompt, tokens, **kw):
    """The trainer's side: one forward over prompt + response, lt.token_logprobs at the response positions."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
    return lt.token_logprobs(model, hidden[len(prompt) - 1:-1], torch.tensor(tokens), **kw)


def differing_tokens(a, b) -> int:
    """Generated tokens whose log-prob bits differ between two runs {i: (tokens, logprobs)}."""
    return sum(int(x != y) for i in a for x, y in zip(a[i][1].view(torch.int32).tolist(),
                                                       b[i][1].view(torch.int32).tolist()))


GDN_KINDS = ("qwen3_next", "qwen3_5")


def compare(model, gdn=False):
    """(tokens differing easy vs hard, tokens differing engine vs trainer, total tokens) for one model."""
    easy, _, _ = run_engine(model, PROMPTS, GDN_EASY if gdn else EASY)
    hard, _, _ = run_engine(model, PROMPTS, GDN_HARD if gdn else HARD, order=HARD_ORDER)
    teacher = {i: (easy[i][0], teacher_forced(model, p, easy[i][0])) for i, p in enumerate(PROMPTS)}
    return differing_tokens(easy, hard), differing_tokens(easy, teacher), len(PROMPTS) * NEW


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["llama", "qwen3", *GDN_KINDS], action="append")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], action="append")
    args = ap.parse_args(argv)
    lt.register()
    print("| model | dtype | path | log-prob bits differ: easy vs hard scheduler | engine vs trainer |")
    print("|---|---|---|---|---|")
    for kind in args.model or ["llama", "qwen3", *GDN_KINDS]:
        gdn = kind in GDN_KINDS
        for dt in args.dtype or ["float32", "bfloat16"]:
            model = tiny_model(kind, dtype=getattr(torch, dt))
            stock = copy.deepcopy(model)
            stock.set_attn_implementation("sdpa")
            with lt.patch(model):
                rows = [("lockstep", compare(model, gdn))]
            try:
                rows.append(("stock sdpa", compare(stock, gdn)))
            except ValueError as e:  # stock transformers: no engine cache for linear-attention layers
                rows.append(("stock sdpa", f"fails: {e}"))
            for path, row in rows:
                if isinstance(row, str):
                    print(f"| {kind} | {dt} | {path} | {row} | |", flush=True)
                    continue
                sched, trainer, n = row
                print(f"| {kind} | {dt} | {path} | {sched} / {n} | {trainer} / {n} |", flush=True)


if __name__ == "__main__":
    main()
