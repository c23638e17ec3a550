"""One RL step across two codebases: transformers samples, TorchTitan trains, the same bits.

    python -m examples.torchtitan_parity                 # tiny Qwen3, float32 and bfloat16
    python -m examples.torchtitan_parity --model qwen3_5 # tiny Qwen3.5 (Gated DeltaNet hybrid)

For each dtype and each path (lockstep: the HF model under ``lt.patch`` and TorchTitan's Qwen3 built
through ``LockstepConverter``; stock: the same weights with sdpa and TorchTitan's own modules):

1. **sampler** (transformers): ``generate`` on a left-padded batch of prompts, sampling; the float32
   log-prob of every sampled token from the step's logits;
2. **trainer** (TorchTitan): the prompt+response documents packed into one row, positions restarting at
   0, TorchTitan's own varlen metadata (``get_attention_masks``), its forward with autograd, a
   policy-gradient-shaped loss, backward and an AdamW step;
3. **weight sync**: the trained weights back into the HF sampler (``Qwen3StateDictAdapter.to_hf``); the
   sampler generates again and TorchTitan recomputes: the bits must agree again;
4. ``hal.rl.mismatch_metrics`` on every token.

Stock TorchTitan cannot train its Qwen3 on CPU with either attention backend it allows for language models:
varlen calls torch's CUDA-only varlen kernel (and casts q/k/v to bf16), FlexAttention has no CPU backward
(and its CPU compile takes minutes here). The stock trainer therefore runs TorchTitan's SDPA attention
(which takes no document masks) on one right-padded row per document, forward only. Tiny model (2 layers, hidden 64, vocab
128, random weights, nothing downloaded).
"""
from __future__ import annotations

import argparse
import time

import torch

import hal
from hal.integrations import torchtitan as ltt
from hal.integrations import transformers as lt

from .hf_rollout import log_softmax, make_prompts, sample

VOCAB = 128


def hf_qwen3(dtype=torch.float32, seed: int = 0, attn: str = "lockstep", tied: bool = False):
    """A tiny HF Qwen3 (random weights under a fixed seed, eval mode) in ``dtype`` with a float32 RoPE table."""
    import transformers as tf
    lt.register()
    cfg = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.1, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # HF inits norms to 1: make them non-trivial
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
    return ltt.cast_hf(model, dtype).eval()


def _build(cfg, hf_model, lockstep: bool, stock, policy: str = "strict"):
    """TorchTitan's model for ``cfg`` (converted to lockstep under ``policy`` unless ``lockstep=False``, ``stock``
    modules left alone), in ``hf_model``'s dtype, its weights loaded from ``hf_model`` through TorchTitan's HF
    adapter."""
    if lockstep:
        cfg = ltt.LockstepConverter.Config(stock=tuple(stock), policy=policy).build().convert(cfg)
    dtype = next(hf_model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        model = cfg.build()
    model.to(dtype)
    ltt.load_from_hf(model, hf_model)
    return model


def titan_qwen3(hf_model, lockstep: bool = True, stock=(), attn_backend: str = "varlen"):
    """TorchTitan's Qwen3 for ``hf_model``'s config, weights loaded through TorchTitan's HF adapter."""
    cfg = ltt.qwen3_config_from_hf(hf_model.config)
    if attn_backend == "sdpa":  # stock only: TorchTitan's SDPA takes no document masks (one document per row)
        from torchtitan.models.common.attention import ScaledDotProductAttention
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return _build(cfg, hf_model, lockstep, stock)


def hf_qwen3_5(dtype=torch.float32, seed: int = 0, tied: bool = False):
    """A tiny text HF Qwen3.5 (one Gated DeltaNet layer, one gated full-attention layer; hal.integrations.transformers.testing's
    shapes, random weights) in ``dtype`` with a float32 RoPE table."""
    import transformers as tf
    from hal.integrations.transformers import testing as hf_testing
    lt.register()
    if not tied:
        return ltt.cast_hf(hf_testing.tiny_model("qwen3_5", seed, torch.float32), dtype).eval()
    cfg = hf_testing.tiny_config("qwen3_5")
    cfg.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ltt.cast_hf(tf.Qwen3_5ForCausalLM(cfg), dtype).eval()


def titan_qwen3_5(hf_model, lockstep: bool = True, stock=(), policy: str = "strict"):
    """TorchTitan's Qwen3.5 for ``hf_model``'s config, weights loaded through TorchTitan's Qwen3.5 HF adapter.

    One process, no device mesh: TorchTitan's ``partial_dtensor`` SPMD backend (its trainer's
    ``parallelism.spmd_backend``; the default ``spmd_types`` needs a mesh)."""
    from torchtitan.distributed.utils import set_spmd_backend
    set_spmd_backend("partial_dtensor")
    cfg = ltt.qwen3_5_config_from_hf(hf_model.config)
    return _build(cfg, hf_model, lockstep, stock, policy)


def pack(prompts, responses):
    """Prompt+response documents in one row: tokens [1, T], positions [1, T] restarting at 0, and the row of
    each response token's prediction (the token before it)."""
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    tokens = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    rows = torch.cat([torch.arange(starts[b] + len(p) - 1, starts[b] + len(s) - 1)
                      for b, (p, s) in enumerate(zip(prompts, seqs))])
    return tokens, positions, rows


def trainer_logprobs(model, path, prompts, responses):
    """TorchTitan's packed forward (its varlen metadata / flex block mask from the positions): float32 log-probs of
    every response token ``[n, new]``, differentiable when grad is on."""
    tokens, positions, rows = pack(prompts, responses)
    logits = ltt.forward(model, tokens, positions)[0].float()
    lp = log_softmax(path, logits[rows]).gather(-1, torch.cat(list(responses))[:, None])[:, 0]
    return lp.reshape(responses.shape)


def unpacked_logprobs(model, path, prompts, responses):
    """The same log-probs from one right-padded row per document, no attention masks (stock TorchTitan's SDPA
    attention: causal, so a row's real tokens never see its padding)."""
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    L = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    logits = model(tokens).float()
    rows = [logits[b, len(p) - 1:len(s) - 1] for b, (p, s) in enumerate(zip(prompts, seqs))]
    lp = log_softmax(path, torch.stack(rows)).gather(-1, responses[..., None])[..., 0]
    return lp


def train_step(model, lp, lr: float = 1e-2):
    """A policy-gradient-shaped loss, backward and one AdamW step on the TorchTitan model."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    advantages = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    (-(advantages * lp).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def differing(a, b) -> int:
    return int((a.reshape(-1).view(torch.int32) != b.reshape(-1).view(torch.int32)).sum())


MODELS = {"qwen3": ("Qwen3 (tiny)", hf_qwen3, titan_qwen3), "qwen3_5": ("Qwen3.5 (tiny)", hf_qwen3_5, titan_qwen3_5)}


def run_lockstep(dtype, args):
    _, hf_build, tt_build = MODELS[args.model]
    hf = hf_build(dtype, args.seed)
    tt = tt_build(hf)
    prompts = make_prompts(args.prompts, args.seed, VOCAB)
    rounds = []
    with lt.patch(hf):
        for step in range(2):  # sample, recompute, train, sync; then again on the synced weights
            resp, lp_s = sample(hf, "lockstep", prompts, args.new_tokens, args.seed + step)
            tt.train()
            lp_t = trainer_logprobs(tt, "lockstep", prompts, resp)
            rounds.append(dict(sampler=lp_s, trainer=lp_t.detach(), metrics=hal.rl.mismatch_metrics(lp_t.detach(),
                                                                                                   lp_s)))
            if step == 0:
                train_step(tt, lp_t)
                ltt.sync_to_hf(tt, hf)
    return rounds


def run_stock(dtype, args):
    hf = hf_qwen3(dtype, args.seed, attn="sdpa")
    tt = titan_qwen3(hf, lockstep=False, attn_backend="sdpa")
    prompts = make_prompts(args.prompts, args.seed, VOCAB)
    resp, lp_s = sample(hf, "stock", prompts, args.new_tokens, args.seed)
    with torch.no_grad():
        lp_t = unpacked_logprobs(tt, "stock", prompts, resp)
    return [dict(sampler=lp_s, trainer=lp_t, metrics=hal.rl.mismatch_metrics(lp_t, lp_s))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    lines = ["| model | dtype | tokens | lockstep: bits differ (before / after the step) | stock: bits differ |",
             "|---|---|---|---|---|"]
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16):
        lock = run_lockstep(dtype, args)
        n = lock[0]["sampler"].numel()
        d = [differing(r["sampler"], r["trainer"]) for r in lock]
        name = str(dtype).replace("torch.", "")
        print(f"{name}: lockstep round 1 {lock[0]['metrics']}")
        print(f"{name}: lockstep round 2 (after the TorchTitan step and the weight sync) {lock[1]['metrics']}")
        if args.model == "qwen3":
            stock = run_stock(dtype, args)
            s = str(differing(stock[0]["sampler"], stock[0]["trainer"]))
            print(f"{name}: stock {stock[0]['metrics']}")
        else:  # stock TorchTitan's Qwen3.5 calls FLA's Triton kernels: no CPU forward at all
            s = "cannot run on CPU (FLA Triton kernels)"
        lines.append(f"| {MODELS[args.model][0]} | {name} | {n} | {d[0]} / {d[1]} | {s} |")
    print("\n".join(lines))
    if args.model == "qwen3":
        print("stock TorchTitan's trainer: SDPA, one row per document, forward only (on CPU its varlen attention "
              "is CUDA-only and FlexAttention has no backward)")
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
