"""Top-p's recorded log-prob: one LM-head row per token (hal.sampling.kept_logprobs today) vs one row per
kept token (its previous form, kept in tests/test_kept_logprobs_rows.py as the bit reference).

    python -m benchmarks.kept_logprobs_rows [--vocab 32000] [--hidden 256] [--rows 4]

Same bits (the test proves it); this prints the time of each and the ratio, cpu backend, bf16, flat rows
(a top-p 0.95 set of thousands of tokens: the case the old form paid V x H per kept token for).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import hal
from hal.sampling import Sampling, kept_logprobs, kept_set, renormalise_kept, sampling_scores


def per_kept_token(h, tokens, sampling, lp_one, scores):
    kept = kept_set(scores, sampling.top_k, sampling.top_p)
    rows, ids = kept.nonzero(as_tuple=True)
    return renormalise_kept(lp_one(h, tokens, sampling.temperature),
                            lp_one(h[rows], ids, sampling.temperature), kept.sum(-1).tolist())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--spread", type=float, default=0.02, help="LM-head scale: small = flat rows, big kept sets")
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(a.vocab, a.hidden, generator=g) * a.spread).to(torch.bfloat16)
    h = torch.randn(a.rows, a.hidden, generator=g).to(torch.bfloat16)
    s = Sampling(1.0, top_p=a.top_p)
    scores = sampling_scores(F.linear(h.float(), w.float()), 1.0)
    tokens = scores.argmax(-1)
    kept = int(kept_set(scores, None, a.top_p).sum())

    def lp(hh, tt, temp):
        return hal.token_logprobs(hh, w, tt, temp, backend="cpu")

    lp(h[:1], tokens[:1], 1.0)  # compile the kernels once, outside the timings
    t0 = time.perf_counter()
    new = kept_logprobs(None, h, tokens, s, lp, scores=scores)
    t_new = time.perf_counter() - t0
    t0 = time.perf_counter()
    old = per_kept_token(h, tokens, s, lp, scores)
    t_old = time.perf_counter() - t0
    same = torch.equal(new.view(torch.int32), old.view(torch.int32))
    print(f"vocab {a.vocab}, hidden {a.hidden}, {a.rows} rows, top_p {a.top_p}: {kept} kept tokens in all")
    print(f"one row per kept token: {t_old:.3f} s   one row per token: {t_new:.3f} s   "
          f"ratio {t_old / t_new:.1f}x   same bits: {same}")


if __name__ == "__main__":
    main()
