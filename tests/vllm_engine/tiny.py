"""Tiny Llama / Qwen3 checkpoints built locally (nothing downloaded), the prompts, and the lockstep trainer's side.

Shared by the tests (the trainer: transformers + ``lt.patch``, never vLLM) and engine_run.py (vLLM, in its
own process: the plugin is process-wide, so plugin-on and stock engines never share a process)."""
from __future__ import annotations

import struct

import torch

KINDS = ("llama", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB = 160  # not a multiple of 64: vLLM pads its LM head to 192 rows, which lockstep must not read

# head_dim 32 (vLLM-CPU's metadata builder wants one of its kernel sizes), 4 query / 2 KV heads, 2 layers
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False)


def save_tiny(kind: str, dtype: str, path, seed: int = 0) -> str:
    """Build the tiny model (fixed seed), cast to ``dtype``, ``save_pretrained`` to ``path``; returns the path."""
    import transformers as tf
    cfg = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config}[kind](**_COMMON)
    cls = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    model.to(DTYPES[dtype]).save_pretrained(str(path))
    return str(path)


def prompts(n: int = 6, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of 5 to 70 tokens (ids 1..VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 70, 17, 33, 9, 48, 26, 61][:n]
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lens]


def bits(x: float) -> int:
    """The float32 bits of a log-prob vLLM returned (a Python float holding a float32 value exactly)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def trainer(path: str, dtype: str):
    """The lockstep trainer: the saved model in transformers with ``lt.patch`` (attention "lockstep")."""
    import transformers as tf
    from hal.integrations import transformers as lt
    lt.register()
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=lt.NAME).eval()
    return model, lt.apply(model)


def trainer_logprobs(model, prompt: list[int], generated: list[int], temperature: float = 1.0, top_k=None,
                     top_p=None) -> tuple[list[int], list[int]]:
    """(float32 bits of ``lt.token_logprobs`` of each generated token, teacher-forced; the argmax of the patched
    logits at each position): what a lockstep trainer recomputes for the rollout."""
    from hal.integrations import transformers as lt
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
        lp = lt.token_logprobs(model, hidden, torch.tensor(generated), temperature, top_k, top_p)
        greedy = model.lm_head(hidden).float().argmax(-1)
    return lp.view(torch.int32).tolist(), greedy.tolist()


def trainer_entries(model, prompt: list[int], generated: list[int], top: int, top_prompt: int | None = None,
                    temperature: float = 1.0, top_k=None, top_p=None) -> dict:
    """What a lockstep trainer recomputes for vLLM's ``logprobs=top`` / ``prompt_logprobs=top_prompt`` entries, from
    one teacher-forced forward of prompt + generated: per position, ``[token id, float32 bits, rank]`` in vLLM's dict
    order (the position's own token first, then the top-N not already listed). Every value is ``lt.token_logprobs``
    of that id (the generated positions under ``temperature`` / ``top_k`` / ``top_p``, -inf outside the kept set;
    prompt positions at temperature 1). The top-N order, written out here over the whole vocabulary: the
    patched LM head's score (``logits / temperature``, -inf outside the kept set) descending, then the
    recorded log-prob descending, then the id; the rank of a position's own token counts the logits >= its own
    (its position in the top-N if listed there, as vLLM's dict keeps the later rank)."""
    from hal.integrations import transformers as lt
    from hal.sampling import kept_set, sampling_scores
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        logits = model.lm_head(hidden).float()

    def entries(rows, targets, count, t, k, p):
        h, lg, tg = hidden[rows], logits[rows], torch.tensor(targets)
        scores = sampling_scores(lg, t)
        kept = kept_set(scores, k, p) if (k or p) else torch.ones_like(scores, dtype=torch.bool)
        every = torch.arange(VOCAB).expand(len(targets), VOCAB)
        with torch.no_grad():
            lp = lt.token_logprobs(model, h, torch.where(kept, every, tg.reshape(-1, 1)), t, k, p)
        lp = lp.masked_fill(~kept, float("-inf"))
        ranked = scores.masked_fill(~kept, float("-inf"))
        out = []
        for j, tok in enumerate(targets):
            order = sorted(range(VOCAB), key=lambda v: (-ranked[j, v].item(), -lp[j, v].item(), v))[:count]
            rank = {v: i + 1 for i, v in enumerate(order)}.get(tok, int((lg[j] >= lg[j, tok]).sum()))
            b = lp[j].view(torch.int32).tolist()
            out.append([[tok, b[tok], rank]] + [[v, b[v], i + 1] for i, v in enumerate(order) if v != tok])
        return out

    n = len(prompt)
    res = dict(top=entries(list(range(n - 1, n - 1 + len(generated))), generated, top, temperature, top_k, top_p))
    if top_prompt is not None:
        res["prompt"] = entries(list(range(n - 1)), prompt[1:], top_prompt, 1.0, None, None)
    return res
