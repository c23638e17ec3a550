"""Forward time of a patched HF model under the strict spec vs the exact policy (prepared / sliced per call).

    python -m benchmarks.hf_exact --threads 1            # tiny (hidden 64) and small (hidden 512) Llama, cpu backend

One process, same inputs, same model per size; medians of repeated no-grad forwards of one
[1, T] prompt (no cache). Modes: ``stock`` (unpatched torch), ``strict`` (``lt.patch(model)``),
``exact prepared`` (``matmul_spec=ExactMatmulSpec(slices=4)``: each weight sliced once, on the
first forward, which is not timed), ``exact per call`` (the same patch with every weight
sliced in every call). Compare the ratios against ``strict`` of the same run.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.exact import median_time
from hal.spec import ExactMatmulSpec

SIZES = {"tiny": {}, "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)}


def model(size: str, dtype):
    import transformers as tf
    from hal.integrations.transformers.testing import tiny_config
    cfg = tiny_config("llama")
    for k, v in SIZES[size].items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(cfg).to(dtype).eval()


def rows(size: str, tokens: int, dtype):
    from hal.integrations import transformers as lt
    lt.register()
    m = model(size, dtype)
    x = torch.randint(1, m.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))

    def fwd():
        m(input_ids=x, use_cache=False)

    yield "stock (unpatched)", median_time(fwd, 3, 1.0)
    with lt.patch(m):
        yield "strict (default spec)", median_time(fwd, 3, 1.0)
    with lt.patch(m, matmul_spec=ExactMatmulSpec(slices=4)) as p:
        yield "exact s4, weights prepared once", median_time(fwd, 3, 1.0)
        p.matmul.weight = lambda w, key: w  # hal.linear gets the plain weight: sliced in every call
        yield "exact s4, weights sliced per call", median_time(fwd, 3, 1.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| model | mode | ms / forward | vs strict |")
    print("|---|---|---|---|")
    for size in args.sizes:
        out = list(rows(size, args.tokens, getattr(torch, args.dtype)))
        strict = dict(out)["strict (default spec)"]
        for mode, t in out:
            print(f"| {size} llama, [1, {args.tokens}] {args.dtype} | {mode} | {t * 1e3:.1f} | {t / strict:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
