"""The cost of the weight-change detector (hal/weight_watch.py): full check and cheap check, per tensor and per model.

    python -m benchmarks.weight_watch --threads 1

Medians of repeated calls, one process:

* one 4096 x 4096 weight (bfloat16, float32): the full check (``TensorStamp.same_bits``: shape, dtype,
  hash of every byte), cold (each call another of 8 such weights: a model check reads each weight once)
  and hot (the same weight again, from cache), and the cheap check (``TensorStamp.same_tensor``: the
  quick stamp, no data read);
* a whole small Llama built locally (hidden 1024, 8 layers, 32k vocabulary, untied head: 0.1 B parameters),
  bfloat16 and float32: ``ModelWeights.stamp()`` (what the engine runs on a step that admits requests) and
  ``ModelWeights.quick_changed`` (its check on every other step), next to one decode-shaped forward of the same model
  ([8 requests, 1 token], no KV cache) stock and lockstep-patched (the default strict spec): the check's
  share of a step.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.exact import median_time

SMALL_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)


def small_llama(dtype):
    import transformers as tf
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_config
    lt.register()  # the tiny config names lockstep's attention
    cfg = tiny_config("llama")
    for k, v in SMALL_LLAMA.items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(cfg).to(dtype).eval()


def tensor_rows(dtypes, copies=8):
    """Per weight: the full check cold (each call hashes the next of ``copies`` distinct weights, more than a
    cache holds, as a model check reads each weight once) and hot (the same weight again), the cheap check."""
    from hal import weight_watch as ww
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        ws = [(torch.randn(4096, 4096, generator=g) * 4096 ** -0.5).to(dtype) for _ in range(copies)]
        stamps = [ww.TensorStamp.of(w) for w in ws]
        turn = iter(range(10 ** 9))

        def next_check():
            i = next(turn) % copies
            assert stamps[i].same_bits(ws[i])
        cold = median_time(next_check, 2 * copies, 0.5)
        hot = median_time(lambda: stamps[0].same_bits(ws[0]), 5, 0.5)
        cheap = median_time(lambda: stamps[0].same_tensor(ws[0]), 20, 0.2)
        yield f"4096 x 4096 {str(dtype)[6:]} ({ws[0].numel() * ws[0].element_size() / 2 ** 20:.0f} MiB)", cold, hot, cheap


def model_rows(dtypes, forwards=True):
    from hal import weight_watch as ww
    from hal.integrations import transformers as lt
    for dtype in dtypes:
        m = small_llama(dtype)
        n = sum(p.numel() for p in m.parameters())
        mib = sum(p.numel() * p.element_size() for p in m.parameters()) / 2 ** 20
        watch = ww.ModelWeights(m)
        seen = watch.stamp()
        full = median_time(lambda: watch.stamp().same_bits(seen), 3, 1.0)
        cheap = median_time(lambda: watch.quick_changed(seen), 20, 0.2)
        stock = patched = float("nan")
        if forwards:
            x = torch.randint(1, m.config.vocab_size, (8, 1), generator=torch.Generator().manual_seed(0))

            def fwd():
                m(input_ids=x, use_cache=False)
            stock = median_time(fwd, 3, 1.0)
            with lt.patch(m):
                patched = median_time(fwd, 3, 1.0)
        yield f"small Llama {str(dtype)[6:]} ({n / 1e6:.0f} M params, {mib:.0f} MiB)", full, cheap, stock, patched


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-forward", action="store_true", help="skip the model forwards (check costs only)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = (torch.bfloat16, torch.float32)
    print(f"torch threads: {torch.get_num_threads()}")
    print("| tensor | full check ms (cold) | full check ms (hot) | cheap check µs |")
    print("|---|---|---|---|")
    for name, cold, hot, cheap in tensor_rows(dtypes):
        print(f"| {name} | {cold * 1e3:.2f} | {hot * 1e3:.2f} | {cheap * 1e6:.1f} |", flush=True)
    print()
    print("| model | full check ms (ModelWeights.stamp) | cheap check µs (quick) | stock forward [8, 1] ms | "
          "patched forward [8, 1] ms | full check / patched forward |")
    print("|---|---|---|---|---|---|")
    for name, full, cheap, stock, patched in model_rows(dtypes, not args.no_forward):
        print(f"| {name} | {full * 1e3:.1f} | {cheap * 1e6:.0f} | {stock * 1e3:.1f} | {patched * 1e3:.1f} | "
              f"{full / patched:.0%} |", flush=True)


if __name__ == "__main__":
    main()
