"""What the patch's lifecycle machinery costs: steady forwards, the walk after an attachment, a deep copy.

    python -m benchmarks.hf_patch_lifecycle --threads 1 --layers 32

A Llama of ``--layers`` layers with tiny widths (hidden 64), so that the module count is a real
model's (~11 modules per layer) and the per-module Python overhead is what is timed. Medians of
repeated no-grad forwards of one [1, T] prompt (no cache), one process, same inputs:
``stock`` (unpatched), ``patched`` (steady state: no module attached since the last walk, so no
walk), ``refresh`` (Patch.refresh() alone: the tree walk the first forward after an attachment
does), ``deepcopy`` (copy.deepcopy of the patched model). Compare ratios against ``stock`` of the same run.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers as tf
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_config
    lt.register()
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = a.layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = tf.LlamaForCausalLM(cfg).eval()
    x = torch.randint(1, cfg.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))

    def fwd():
        with torch.no_grad():
            m(input_ids=x, use_cache=False)

    fwd()
    stock = median_time(fwd, a.reps)
    p = lt.apply(m)
    fwd()
    patched = median_time(fwd, a.reps)

    def walk():
        p.stale = True  # what an attachment does; nothing new is found, so this is the walk alone
        p.refresh()
    refresh = median_time(walk, a.reps)
    dc = median_time(lambda: copy.deepcopy(m), max(3, a.reps // 5))
    n = sum(1 for _ in m.modules())
    print(f"llama, {a.layers} layers ({n} modules), hidden 64, T={a.tokens}, threads={a.threads}")
    print(f"  stock forward     {stock * 1e3:9.2f} ms   1.00x")
    print(f"  patched forward   {patched * 1e3:9.2f} ms   {patched / stock:.2f}x  (steady: no walk)")
    print(f"  refresh walk      {refresh * 1e3:9.2f} ms   {refresh / stock:.3f}x  (once, after an attachment)")
    print(f"  deepcopy(patched) {dc * 1e3:9.2f} ms   {dc / stock:.2f}x")
    p.revert()


if __name__ == "__main__":
    main()
