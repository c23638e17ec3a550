"""transformers' continuous-batching engine: log-prob bits across scheduler settings and vs the trainer.

    python -m examples.engine_parity                    # Llama, Qwen3, Qwen3-Next, Qwen3.5; fp32 and bf16
    python -m examples.engine_parity --model llama --dtype float32
    python -m examples.engine_parity --model llama --sampled      # + sampled top-p rows
    python -m examples.engine_parity --model qwen3_5 --real-shaped  # + Qwen3.5's real shapes (minutes)

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

``--sampled`` adds sampled rows (temperature 0.7 with top-p 0.8, and with top-k 20 + top-p 0.8, the hard
configuration): the tokens whose recorded log-prob bits differ from the trainer's value of the same
distribution -- lockstep: ``lt.token_logprobs(..., temperature, top_k, top_p)`` (the engine sampled from
lockstep's kept set); stock: the engine's own warpers and ``log(softmax(scores)[token])``, recomputed by the
trainer with transformers' warpers on a teacher-forced forward. ``--real-shaped`` adds Qwen3.5's real layer
shapes (hidden 2048, the 248,320-token vocabulary; ``hf_testing.real_shaped_qwen3_5``): two greedy requests
through the engine, lockstep's trainer and the trainer on stock kernels (stock cannot build the engine).
"""
from __future__ import annotations

import argparse
import copy

import torch

from hal.integrations.transformers import engine as hf_engine
from hal.integrations import transformers as lt
from hal.integrations.transformers.testing import VOCAB, tiny_model

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


def _gdn_hard_blocks() -> int:
    """transformers 5.25's scheduler needs 6 blocks to put a prefill chunk beside two decode rows (with 4 or 5 it
    admits one request at a time, and runs out of blocks at 4); 5.17's offloader, with 4 or 5, stops with "no
    requests can be scheduled and no requests can be offloaded"; 5.18 to 5.24 mix and offload with 4 (with 6 they
    need not offload)."""
    from importlib.metadata import version

    from hal.integrations._versions import release
    return 4 if (5, 18) <= release(version("transformers")) < (5, 25) else 6


GDN_HARD = dict(HARD, allow_block_sharing=False, num_blocks=_gdn_hard_blocks())


def gen_config(do_sample=False, new=NEW, **kw):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=new, do_sample=do_sample, eos_token_id=-1, pad_token_id=0, **kw)


def run_engine(model, prompts, cb, gen=None, order=None, persistent=False):
    """``model.generate_batch`` with recorded log-probs: ({prompt index: (tokens, float32 log-probs)},
    the engine steps seen by a step hook, the number of token positions the model's forward ran)."""
    from hal.integrations.transformers.testing import continuous_batching_config
    order = list(range(len(prompts))) if order is None else order
    steps, counted = [], []
    hooks = hf_engine.step_hooks(model)
    hooks.append(steps.append)
    h = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kw: counted.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = model.generate_batch([prompts[i] for i in order], generation_config=gen or gen_config(),
                                   continuous_batching_config=continuous_batching_config(return_logprobs=True, **cb),
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


SAMPLED = {"top-p 0.8": dict(top_p=0.8), "top-k 20 + top-p 0.8": dict(top_k=20, top_p=0.8)}
TEMPERATURE = 0.7


def stock_sampled_trainer(model, prompt, tokens, top_k=None, top_p=None):
    """What a stock trainer recomputes for the stock engine's sampled log-probs: its logits, transformers'
    temperature / top-k / top-p warpers, log of the softmax at the token (the engine's own formula)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    with torch.no_grad():
        scores = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    scores = TemperatureLogitsWarper(TEMPERATURE)(None, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).log()


def compare_sampled(model, settings, lockstep):
    """(tokens whose engine log-prob bits differ from the trainer's, total tokens), sampled, hard configuration."""
    torch.manual_seed(1)
    out, _, _ = run_engine(model, PROMPTS, HARD, gen=gen_config(do_sample=True, temperature=TEMPERATURE, **settings))
    if lockstep:
        trainer = {i: (out[i][0], teacher_forced(model, p, out[i][0], temperature=TEMPERATURE, **settings))
                   for i, p in enumerate(PROMPTS)}
    else:
        trainer = {i: (out[i][0], stock_sampled_trainer(model, p, out[i][0], **settings)) for i, p in enumerate(PROMPTS)}
    return differing_tokens(out, trainer), len(PROMPTS) * NEW


# the real-shaped runs: two requests (5 and 3 tokens), a 3-token budget (the first prompt is prefilled over two
# steps, one step mixes a decode row with a prefill chunk), 2 greedy tokens each
REAL_SHAPED_CB = dict(page_size=4, num_blocks=16, max_batch_tokens=3, allow_block_sharing=False)
REAL_SHAPED_NEW = 2


def real_shaped_prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 3)]


def compare_real_shaped(dtype):
    """(tokens whose engine log-prob bits differ from lockstep's trainer, from a stock-kernel trainer, total)."""
    from hal.integrations.transformers.testing import real_shaped_qwen3_5
    model = real_shaped_qwen3_5(dtype=dtype)
    prompts = real_shaped_prompts(model.config.vocab_size)
    with lt.patch(model):
        out, _, _ = run_engine(model, prompts, REAL_SHAPED_CB, gen=gen_config(new=REAL_SHAPED_NEW))
        trainer = {i: (out[i][0], teacher_forced(model, p, out[i][0])) for i, p in enumerate(prompts)}
    model.config._attn_implementation = "sdpa"
    stock = {i: (out[i][0], teacher_forced(model, p, out[i][0])) for i, p in enumerate(prompts)}
    return differing_tokens(out, trainer), differing_tokens(out, stock), REAL_SHAPED_NEW * len(prompts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["llama", "qwen3", *GDN_KINDS], action="append")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], action="append")
    ap.add_argument("--sampled", action="store_true", help="add the sampled top-p rows (Llama)")
    ap.add_argument("--real-shaped", action="store_true", help="add the real-shaped Qwen3.5 rows (minutes)")
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
    dtypes = args.dtype or ["float32", "bfloat16"]
    if args.sampled:
        for dt in dtypes:
            model = tiny_model("llama", dtype=getattr(torch, dt))
            stock = copy.deepcopy(model)
            stock.set_attn_implementation("sdpa")
            for name, settings in SAMPLED.items():
                with lt.patch(model):
                    d, n = compare_sampled(model, settings, lockstep=True)
                print(f"| llama, sampled {name} | {dt} | lockstep | | {d} / {n} |", flush=True)
                d, n = compare_sampled(stock, settings, lockstep=False)
                print(f"| llama, sampled {name} | {dt} | stock sdpa | | {d} / {n} |", flush=True)
    if args.real_shaped:
        for dt in dtypes:
            d, s_d, n = compare_real_shaped(getattr(torch, dt))
            print(f"| qwen3_5 real-shaped | {dt} | lockstep | | {d} / {n} |", flush=True)
            print(f"| qwen3_5 real-shaped | {dt} | lockstep engine, stock-kernel trainer | | {s_d} / {n} |", flush=True)


if __name__ == "__main__":
    main()
