"""End to end: a sampler and a trainer that compute the same log-prob bits, on a tiny Llama.

    python -m examples.rl_parity                  # fp32 weights
    python -m examples.rl_parity --dtype bf16     # bf16 weights and activations
    python -m examples.rl_parity --greedy
    python -m examples.rl_parity --per-op         # + which stock op breaks the bits (one at a time)

What it does:

1. builds a tiny Hugging Face ``LlamaForCausalLM`` from a config with a fixed seed (nothing is
   downloaded) and takes its weights;
2. runs that model's forward pass written out by hand, twice over:

   * **sampler**: a small continuous-batching engine. Requests arrive at different steps, their
     prompts are prefilled in chunks cut at arbitrary points into a paged KV cache, and every step
     runs one forward over all scheduled tokens (prefill chunks of some requests and decode tokens
     of others, flattened together for the linear layers). Each emitted token's log-prob is
     recorded at decode time;
   * **trainer**: one packed forward over the finished sequences (varlen attention with
     ``cu_seqlens``, autograd on) that recomputes the log-probs of the sampled tokens;

3. does it once with lockstep's ops and once with stock torch ops (the negative control), and
   prints how far the trainer's log-probs are from the sampler's: max |diff|, whether the raw bits
   are equal, and the per-sequence log importance ratio sum(logp_trainer - logp_sampler), which
   is exactly 0 only when the run is really on-policy.

The same hand-written forward is checked against the HF model's own ``model(input_ids).logits``
(fp32), so the comparison is about a real Llama, not a toy of our own.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import hal

# ---------------------------------------------------------------------------------------- model

#: Where the engine and the trainer run (``--device``); weights are built on the CPU and moved there.
DEVICE = torch.device("cpu")

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def build_hf_model(seed: int = 0, initializer_range: float = 0.1):
    """A tiny randomly initialised ``LlamaForCausalLM`` (fp32, eval mode). Nothing is downloaded.

    ``initializer_range`` is raised from HF's 0.02 so the next-token distributions are not
    almost uniform (with 0.02 every log-prob is close to -log(vocab)).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIG, initializer_range=initializer_range)
    with torch.random.fork_rng(devices=[]):  # a fixed seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


@dataclass
class LlamaWeights:
    """The weights of a HF Llama as plain tensors, plus the RoPE cos/sin table."""
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor
    eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, model, dtype=torch.float32) -> "LlamaWeights":
        cfg = model.config
        m = model.model

        def t(p):
            return p.detach().to(dtype).clone()

        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            layers.append(dict(q=t(a.q_proj.weight), k=t(a.k_proj.weight), v=t(a.v_proj.weight),
                               o=t(a.o_proj.weight), gate=t(mlp.gate_proj.weight), up=t(mlp.up_proj.weight),
                               down=t(mlp.down_proj.weight), ln_in=t(layer.input_layernorm.weight),
                               ln_post=t(layer.post_attention_layernorm.weight)))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # RoPE: one cos/sin table for absolute positions 0..max-1, computed once (as vLLM's
        # cos_sin_cache) and gathered by position afterwards. Gathering is a copy, so a position
        # gets the same cos/sin bits whatever call it is in. Computing cos/sin per call instead
        # would not be safe on CPU: torch runs transcendental functions through a vectorised
        # kernel for the bulk of a tensor and a scalar one for the tail, which may round
        # differently, so the bits could depend on where the element sits in the call.
        inv_freq = m.rotary_emb.inv_freq.detach().to(torch.float32)
        scaling = float(getattr(m.rotary_emb, "attention_scaling", 1.0))
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(embed=t(m.embed_tokens.weight), layers=layers, norm=t(m.norm.weight),
                   lm_head=t(model.lm_head.weight), cos=emb.cos() * scaling, sin=emb.sin() * scaling,
                   eps=float(cfg.rms_norm_eps), n_heads=cfg.num_attention_heads,
                   n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def trainable(self) -> "LlamaWeights":
        """Copies of every weight (same bits) that require grad, as a trainer holds them."""
        def g(x):
            return x.detach().clone().requires_grad_(True)
        return LlamaWeights(embed=g(self.embed), layers=[{k: g(v) for k, v in L.items()} for L in self.layers],
                            norm=g(self.norm), lm_head=g(self.lm_head), cos=self.cos, sin=self.sin, eps=self.eps,
                            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)

    def parameters(self) -> list[torch.Tensor]:
        return [self.embed, self.norm, self.lm_head] + [v for L in self.layers for v in L.values()]

    def to(self, device) -> "LlamaWeights":
        """The same weights (same bits) on ``device``."""
        def d(x):
            return x.to(device)
        return LlamaWeights(embed=d(self.embed), layers=[{k: d(v) for k, v in L.items()} for L in self.layers],
                            norm=d(self.norm), lm_head=d(self.lm_head), cos=d(self.cos), sin=d(self.sin),
                            eps=self.eps, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)


# Elementwise ops (RoPE's multiply/add, SiLU * up) act on each element on its own, so an element's
# result cannot depend on the batch it is in or on how its sequence was cut into calls: they are
# batch- and split-invariant as they stand, and both paths run them as plain torch float32 ops.
# (The only caveat is a transcendental like SiLU's exp, which torch's CPU kernels may evaluate with
# vectorised code for most elements and scalar code for a tail; here the MLP width, 128, is a multiple
# of every vector width, and RoPE's cos/sin come from a precomputed table, see above.) The ops that
# *reduce* -- matmuls, norms, attention, the LM head's log-softmax -- are the ones lockstep fixes.

def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate-half RoPE in float32: x [N, H, D], cos/sin [N, D] (already gathered)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def forward_hidden(W: LlamaWeights, ops, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """The Llama body over N flattened tokens: returns the final-normed hidden states [N, hidden].

    ``positions`` are absolute positions in each token's own sequence; ``attend(layer, q, k, v)``
    does the attention for q [N, Hq, D], k, v [N, Hkv, D] (packed varlen for the trainer, the KV
    cache for the sampler) and returns [N, Hq, D].
    """
    n = tokens.shape[0]
    cos, sin = W.cos[positions], W.sin[positions]
    h = W.embed[tokens]
    res = None
    for i, L in enumerate(W.layers):
        if res is None:
            x, res = ops.rms_norm(h, L["ln_in"], W.eps), h
        else:
            x, res = ops.rms_norm(h, L["ln_in"], W.eps, residual=res)  # res <- h + res, x = norm(res)
        q = rope(ops.linear(x, L["q"]).reshape(n, W.n_heads, W.head_dim), cos, sin)
        k = rope(ops.linear(x, L["k"]).reshape(n, W.n_kv_heads, W.head_dim), cos, sin)
        v = ops.linear(x, L["v"]).reshape(n, W.n_kv_heads, W.head_dim)
        h = ops.linear(attend(i, q, k, v).reshape(n, W.n_heads * W.head_dim), L["o"])
        x, res = ops.rms_norm(h, L["ln_post"], W.eps, residual=res)
        h = ops.linear(silu_mul(ops.linear(x, L["gate"]), ops.linear(x, L["up"])), L["down"])
    x, _ = ops.rms_norm(h, W.norm, W.eps, residual=res)
    return x


# ---------------------------------------------------------------------------------------- ops


class LockstepOps:
    """lockstep's ops: every reduction under a fixed spec, so the bits do not depend on the call."""
    name = "lockstep"

    @staticmethod
    def linear(x, w):
        return hal.linear(x, w)

    @staticmethod
    def rms_norm(x, w, eps, residual=None):
        return hal.rms_norm(x, w, eps, residual=residual)

    @staticmethod
    def attn_packed(q, k, v, cu_seqlens, max_len):
        return hal.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)

    @staticmethod
    def new_caches(n_layers, batch, capacity, n_kv, head_dim, dtype, seed=0):
        page = 8
        n_pages = batch * -(-capacity // page)
        g = torch.Generator().manual_seed(seed)
        # physical pages handed out in a shuffled order, as a long-running engine's free list would be
        return [hal.KVCache.paged(batch, capacity, n_kv, head_dim, page_size=page, dtype=dtype,
                                  page_order=torch.randperm(n_pages, generator=g).tolist(),
                                  device=DEVICE)
                for _ in range(n_layers)]

    @staticmethod
    def attn_cached(cache, rows, q, k, v):
        return cache.attend(q, k, v, rows=rows)

    @staticmethod
    def logits(h, lm_head):
        return hal.linear(h, lm_head).float()

    @staticmethod
    def token_logprobs(h, lm_head, tokens, temperature):
        return hal.token_logprobs(h, lm_head, tokens, temperature)


class StockCache:
    """A contiguous KV cache [batch, capacity, Hkv, D] with per-sequence lengths (stock path)."""

    def __init__(self, batch, capacity, n_kv, head_dim, dtype):
        self.k = torch.zeros(batch, capacity, n_kv, head_dim, dtype=dtype, device=DEVICE)
        self.v = torch.zeros_like(self.k)
        self.seqlens = torch.zeros(batch, dtype=torch.int64, device=DEVICE)


class StockOps:
    """torch's own ops (F.linear, F.rms_norm, SDPA, log_softmax): the negative control."""
    name = "stock torch"

    @staticmethod
    def linear(x, w):
        return F.linear(x, w)

    @staticmethod
    def rms_norm(x, w, eps, residual=None):
        if residual is None:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), w, eps), h

    @staticmethod
    def attn_packed(q, k, v, cu_seqlens, max_len):
        """SDPA sequence by sequence (torch has no varlen SDPA), causal."""
        group = q.shape[1] // k.shape[1]
        outs = []
        cu = cu_seqlens.tolist()
        for b in range(len(cu) - 1):
            s, e = cu[b], cu[b + 1]
            qb = q[s:e].transpose(0, 1)[None]
            kb = k[s:e].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            vb = v[s:e].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    @staticmethod
    def new_caches(n_layers, batch, capacity, n_kv, head_dim, dtype, seed=0):
        return [StockCache(batch, capacity, n_kv, head_dim, dtype) for _ in range(n_layers)]

    @staticmethod
    def attn_cached(cache, rows, q, k, v):
        """Append k, v for ``rows``, then SDPA of q [g, n, Hq, D] against each row's cached keys."""
        n = q.shape[1]
        group = q.shape[2] // k.shape[2]
        idx = torch.tensor(rows, dtype=torch.long, device=DEVICE)
        before = cache.seqlens[idx]
        pos = before[:, None] + torch.arange(n, device=DEVICE)[None, :]
        cache.k[idx[:, None], pos] = k
        cache.v[idx[:, None], pos] = v
        after = before + n
        kmax = int(after.max())
        keys = cache.k[idx, :kmax].repeat_interleave(group, dim=2).transpose(1, 2)  # [g, Hq, kmax, D]
        vals = cache.v[idx, :kmax].repeat_interleave(group, dim=2).transpose(1, 2)
        j = torch.arange(kmax, device=DEVICE)[None, None, :]
        qpos = (before[:, None] + torch.arange(n, device=DEVICE)[None, :])[:, :, None]
        mask = (j <= qpos) & (j < after[:, None, None])  # [g, n, kmax]: causal, bottom-right
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask[:, None])
        cache.seqlens[idx] = after
        return out.transpose(1, 2)

    @staticmethod
    def logits(h, lm_head):
        return F.linear(h.float(), lm_head.float())

    @staticmethod
    def token_logprobs(h, lm_head, tokens, temperature):
        lp = torch.log_softmax(F.linear(h.float(), lm_head.float()) / temperature, dim=-1)
        return lp.gather(-1, tokens[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------- trainer


def trainer_logprobs(W: LlamaWeights, ops, sequences: list[torch.Tensor], prompt_lens: list[int],
                     temperature: float = 1.0) -> list[torch.Tensor]:
    """One packed forward over all sequences; the float32 log-probs of each sequence's response tokens.

    Autograd stays on (pass ``W.trainable()`` weights to get gradients), as in a trainer.
    """
    lens = [int(s.shape[0]) for s in sequences]
    cu = torch.tensor([0] + lens, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)
    tokens = torch.cat(sequences)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    hid = forward_hidden(W, ops, tokens, positions,
                         lambda i, q, k, v: ops.attn_packed(q, k, v, cu, max(lens)))
    # the hidden state at position t predicts token t + 1: keep the rows that predict response tokens
    rows = torch.cat([torch.arange(int(cu[b]) + p - 1, int(cu[b]) + n - 1, device=DEVICE)
                      for b, (p, n) in enumerate(zip(prompt_lens, lens))])
    targets = torch.cat([s[p:] for s, p in zip(sequences, prompt_lens)])
    lp = ops.token_logprobs(hid[rows], W.lm_head, targets, temperature)
    return list(lp.split([n - p for p, n in zip(prompt_lens, lens)]))


# ---------------------------------------------------------------------------------------- sampler


@dataclass
class Request:
    prompt: torch.Tensor        # int64 [prompt_len]
    chunks: list[int]           # prefill chunk sizes, summing to prompt_len (cut points are arbitrary)
    arrival: int                # engine step at which the request is admitted
    max_new: int                # tokens to generate
    generated: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # float32 scalars recorded at decode time
    fed: int = 0                # tokens already written to the KV cache
    chunk_i: int = 0

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new


def sample(W: LlamaWeights, ops, requests: list[Request], temperature: float = 1.0, greedy: bool = False,
           seed: int = 0, log=None) -> list[Request]:
    """A toy continuous-batching engine; fills each request's ``generated`` and ``logprobs``.

    Each step schedules, for every admitted unfinished request, either its next prefill chunk or
    its last sampled token, and runs ONE forward over all those tokens. Attention goes to the
    request's rows of a per-layer KV cache: all decode tokens of the step in one batched call
    (sequences of different lengths), each prefill chunk in its own call. A request that finishes
    its prompt or decodes a token emits one token: sampled (Gumbel-max with the request's own
    torch.Generator, so the draws do not depend on the schedule) or greedy, and its log-prob is
    recorded with the sampler's LM head op right then.
    """
    capacity = max(int(r.prompt.shape[0]) + r.max_new for r in requests)
    caches = ops.new_caches(len(W.layers), len(requests), capacity, W.n_kv_heads, W.head_dim, W.dtype, seed)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + 17 * b + 1) for b in range(len(requests))]
    step = 0
    with torch.no_grad():
        while not all(r.done for r in requests):
            items = []  # (row, tokens, first position, emits a token, is a decode)
            for b, r in enumerate(requests):
                if r.arrival > step or r.done:
                    continue
                if r.chunk_i < len(r.chunks):
                    n = r.chunks[r.chunk_i]
                    items.append((b, r.prompt[r.fed:r.fed + n], r.fed, r.chunk_i == len(r.chunks) - 1, False))
                else:
                    items.append((b, torch.tensor([r.generated[-1]], device=DEVICE), r.fed, True, True))
            step += 1
            if not items:
                continue
            tokens = torch.cat([it[1] for it in items])
            positions = torch.cat([torch.arange(it[2], it[2] + it[1].shape[0], device=DEVICE) for it in items])
            offsets = [0]
            for it in items:
                offsets.append(offsets[-1] + int(it[1].shape[0]))
            decode_ix = [i for i, it in enumerate(items) if it[4]]
            groups = [decode_ix] if decode_ix else []
            groups += [[i] for i, it in enumerate(items) if not it[4]]

            def attend(layer, q, k, v):
                out = torch.empty_like(q)
                for grp in groups:
                    sl = [slice(offsets[i], offsets[i + 1]) for i in grp]
                    o = ops.attn_cached(caches[layer], [items[i][0] for i in grp],
                                        torch.stack([q[s] for s in sl]), torch.stack([k[s] for s in sl]),
                                        torch.stack([v[s] for s in sl]))
                    for j, s in enumerate(sl):
                        out[s] = o[j]
                return out

            hid = forward_hidden(W, ops, tokens, positions, attend)
            emit = [i for i, it in enumerate(items) if it[3]]
            if log is not None:
                log(f"  step {step - 1:2d}: {len(tokens):2d} tokens "
                    + " ".join(f"[seq{it[0]} {'decode' if it[4] else 'prefill'} {it[1].shape[0]}@{it[2]}]"
                               for it in items))
            for i, it in enumerate(items):
                r = requests[it[0]]
                r.fed += int(it[1].shape[0])
                if not it[4]:
                    r.chunk_i += 1
            if not emit:
                continue
            h_last = hid[[offsets[i + 1] - 1 for i in emit]]
            logits = ops.logits(h_last, W.lm_head)
            chosen = []
            for j, i in enumerate(emit):
                b = items[i][0]
                if greedy:
                    chosen.append(int(logits[j].argmax()))
                else:
                    # the draws come from the request's CPU generator on every device
                    u = torch.rand(logits.shape[-1], generator=gens[b], dtype=torch.float64)
                    u = u.clamp_(1e-300, 1.0).to(logits.device)
                    chosen.append(int((logits[j].double() / temperature - torch.log(-torch.log(u))).argmax()))
            chosen_t = torch.tensor(chosen, dtype=torch.long, device=DEVICE)
            lp = ops.token_logprobs(h_last, W.lm_head, chosen_t, temperature)
            for j, i in enumerate(emit):
                r = requests[items[i][0]]
                r.generated.append(chosen[j])
                r.logprobs.append(lp[j])
    return requests


def make_requests(seed: int = 0, vocab: int = CONFIG["vocab_size"],
                  plan=((13, [5, 8], 0, 10), (7, [7], 0, 12), (19, [11, 1, 7], 3, 9))) -> list[Request]:
    """Requests with random prompts: (prompt_len, prefill chunks, arrival step, max_new) each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for plen, chunks, arrival, max_new in plan:
        assert sum(chunks) == plen
        prompt = torch.randint(0, vocab, (plen,), generator=g).to(DEVICE)
        out.append(Request(prompt=prompt, chunks=list(chunks),
                           arrival=arrival, max_new=max_new))
    return out


# ---------------------------------------------------------------------------------------- run


@dataclass
class PairResult:
    name: str
    sampler: list[torch.Tensor]   # per sequence, float32 log-probs recorded by the sampler
    trainer: list[torch.Tensor]   # per sequence, float32 log-probs recomputed by the trainer
    sequences: list[torch.Tensor]
    prompt_lens: list[int]
    grad_norm: float | None = None

    @property
    def max_abs_diff(self) -> float:
        return float((torch.cat(self.sampler) - torch.cat(self.trainer)).abs().max())

    @property
    def bitwise_equal(self) -> bool:
        return torch.equal(torch.cat(self.sampler).view(torch.int32), torch.cat(self.trainer).view(torch.int32))

    @property
    def n_tokens_differing(self) -> int:
        return int((torch.cat(self.sampler).view(torch.int32) != torch.cat(self.trainer).view(torch.int32)).sum())

    @property
    def log_ratio_sums(self) -> list[float]:
        """Per sequence sum(logp_trainer - logp_sampler) = log pi_train(y) / pi_sampler(y), in float64."""
        return [float((t.double() - s.double()).sum()) for s, t in zip(self.sampler, self.trainer)]


def run_pair(W: LlamaWeights, ops, temperature=1.0, greedy=False, seed=0, backward=True, log=None) -> PairResult:
    reqs = sample(W, ops, make_requests(seed), temperature=temperature, greedy=greedy, seed=seed, log=log)
    seqs = [torch.cat([r.prompt, torch.tensor(r.generated, dtype=torch.long, device=DEVICE)]) for r in reqs]
    plens = [int(r.prompt.shape[0]) for r in reqs]
    Wt = W.trainable()
    with torch.enable_grad():
        tr = trainer_logprobs(Wt, ops, seqs, plens, temperature)
        grad_norm = None
        if backward:  # a policy-gradient-shaped loss, to show the trainer's forward is the autograd one
            torch.cat(tr).sum().backward()
            grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in Wt.parameters()
                                             if p.grad is not None)))
    return PairResult(ops.name, [torch.stack(r.logprobs) for r in reqs], [t.detach() for t in tr], seqs, plens,
                      grad_norm)


def hybrid_ops(stock_part: str):
    """lockstep's ops with one part swapped for stock torch's: which op breaks the bits."""
    parts = {"linear": ["linear"], "rms_norm": ["rms_norm"],
             "attention": ["attn_packed", "attn_cached", "new_caches"], "lm_head": ["logits", "token_logprobs"]}
    attrs = {k: staticmethod(getattr(StockOps, k)) for k in parts[stock_part]}
    return type(f"Stock_{stock_part}", (LockstepOps,), dict(attrs, name=f"stock {stock_part} only"))


def hf_logprobs(model, sequences, prompt_lens) -> list[torch.Tensor]:
    """The HF model's own float32 log_softmax(logits) at the response tokens, one sequence at a time."""
    out = []
    with torch.no_grad():
        for s, p in zip(sequences, prompt_lens):
            s = s.to(model.device)
            logits = model(s[None]).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append(lp[p - 1:-1].gather(-1, s[p:, None]).squeeze(-1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", "-v", action="store_true", help="print the engine's schedule")
    ap.add_argument("--device", default="cpu", help="run the sampler and trainer on this device (e.g. cuda)")
    ap.add_argument("--per-op", action="store_true",
                    help="also run lockstep with one op family at a time replaced by stock torch's")
    args = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    model = build_hf_model(args.seed)  # built on the CPU from a seed: the same weights for every device
    global DEVICE
    DEVICE = torch.device(args.device)
    W = LlamaWeights.from_hf(model, dtype).to(DEVICE)
    print(f"tiny Llama: {CONFIG}  weights {args.dtype}, "
          f"{'greedy' if args.greedy else f'sampled T={args.temperature}'}, seed {args.seed}, "
          f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    results = []
    for ops in (LockstepOps, StockOps):
        t0 = time.perf_counter()
        log = print if args.verbose else None
        if log:
            print(f"{ops.name} engine schedule:")
        results.append(run_pair(W, ops, args.temperature, args.greedy, args.seed, log=log))
        print(f"  {ops.name}: sampler + trainer (+ backward) in {time.perf_counter() - t0:.1f} s")

    lock = results[0]
    print("\nsequences (prompt | response), lockstep run:")
    for b, (s, p) in enumerate(zip(lock.sequences, lock.prompt_lens)):
        print(f"  seq{b}: {s[:p].tolist()} | {s[p:].tolist()}")

    print("\nsampler vs trainer log-probs of the sampled tokens:")
    print(f"  {'path':<22} {'tokens':>6} {'max |diff|':>11} {'bitwise':>8} {'differing':>9}   "
          f"per-sequence log-ratio sum  sum(logp_train - logp_sample)")
    for r in results:
        n = sum(int(t.numel()) for t in r.sampler)
        print(f"  {r.name:<22} {n:>6} {r.max_abs_diff:>11.3e} {'yes' if r.bitwise_equal else 'NO':>8} "
              f"{r.n_tokens_differing:>9}   " + "  ".join(f"{x:+.3e}" for x in r.log_ratio_sums))
    if args.per_op:
        for part in ("linear", "rms_norm", "attention", "lm_head"):
            r = run_pair(W, hybrid_ops(part), args.temperature, args.greedy, args.seed, backward=False)
            n = sum(int(t.numel()) for t in r.sampler)
            print(f"  {r.name:<22} {n:>6} {r.max_abs_diff:>11.3e} {'yes' if r.bitwise_equal else 'NO':>8} "
                  f"{r.n_tokens_differing:>9}   " + "  ".join(f"{x:+.3e}" for x in r.log_ratio_sums))
    for r in results:
        if r.grad_norm is not None:
            print(f"  ({r.name} trainer backward ran: |grad| = {r.grad_norm:.4e})")

    if dtype == torch.float32:
        ref = hf_logprobs(model, lock.sequences, lock.prompt_lens)
        d = float((torch.cat(ref) - torch.cat(lock.trainer).cpu()).abs().max())
        print(f"\nhand-written lockstep forward vs HF LlamaForCausalLM log_softmax(model(ids).logits), fp32: "
              f"max |diff| = {d:.3e} over {sum(int(t.numel()) for t in ref)} tokens")
    else:
        print("\n(the check against HF's own logits runs with --dtype fp32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
