"""Shared pieces of the Hugging Face examples: a sampler (``generate``) and a packed trainer forward.

Both record float32 log-probs of the sampled tokens the same way (from float32 logits, with
``hal.log_softmax`` on the lockstep path and ``torch.log_softmax`` on the stock path), so any
difference between them comes from the engines, not from how the log-probs were taken.
Used by examples/hf_parity.py and examples/rl_mismatch.py.
"""
from __future__ import annotations

import torch

import hal


def make_prompts(n: int, seed: int, vocab: int, min_len: int = 3, max_len: int = 12):
    """``n`` random prompts (token ids 1..vocab-1; 0 is the pad id) of ``min_len``-``max_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g) for L in lens]


def log_softmax(path: str, x):
    return hal.log_softmax(x, -1) if path == "lockstep" else torch.log_softmax(x, -1)


def sample(model, path, prompts, new_tokens, seed):
    """Left-padded batched ``generate`` (sampling, temperature 1, no top-k), as a batching engine pads.

    Returns the responses ``[n, new_tokens]`` and the sampler's float32 log-probs of them, taken
    from each step's raw logits (``output_logits``).
    """
    n, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(n, P, dtype=torch.long)
    mask = torch.zeros(n, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    resp = out.sequences[:, P:]
    logits = torch.stack(out.logits, 1).float()  # raw logits of each step [n, new, V]
    lp = log_softmax(path, logits).gather(-1, resp[..., None])[..., 0]
    return resp, lp


def packed_logprobs(model, path, prompts, responses):
    """The trainer's forward: all prompt+response sequences packed into one row (position_ids restart
    at 0), train mode, autograd as the caller's grad mode allows. Returns the float32 log-probs of
    every response token, ``[n, new_tokens]`` (differentiable when grad is enabled)."""
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    was_training = model.training
    model.train()
    try:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()[0]
    finally:
        model.train(was_training)
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    rows = torch.cat([torch.arange(starts[b] + len(p) - 1, starts[b] + len(s) - 1)
                      for b, (p, s) in enumerate(zip(prompts, seqs))])
    tgt = torch.cat(list(responses))
    lp = log_softmax(path, logits[rows]).gather(-1, tgt[:, None])[:, 0]
    return lp.reshape(responses.shape)
