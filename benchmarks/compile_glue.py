"""Compiled vs eager forward time of the patched tiny Llama on CPU (issue 23): what Inductor's fused glue
between the lockstep ops buys (or costs) on a model where the ops themselves dominate.

    python -m benchmarks.compile_glue [--batch 2 --seq 32 --repeats 7]

Columns (ms per forward, best of ``--repeats`` runs of ``--calls`` forwards; lower is better):
``eager_ms`` (the patched model as called eagerly), ``compiled_ms`` (``torch.compile(model, fullgraph=True)``,
Inductor, after one warm-up call), ``ratio`` = compiled / eager, ``same_bits`` (the compiled logits equal
the eager ones bit for bit, the condition for the row to count), ``compile_s`` (the first call's time).
"""
from __future__ import annotations

import argparse
import time
import timeit

import torch

from hal.integrations import transformers as lt
from hal.integrations.transformers.testing import VOCAB, tiny_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    lt.register()
    model = tiny_model("llama", dtype=getattr(torch, args.dtype))
    ids = torch.arange(args.batch * args.seq).reshape(args.batch, args.seq) * 7 % VOCAB
    mask = torch.ones_like(ids)
    mask[-1, : args.seq // 4] = 0  # one left-padded row: the mask plan is real work
    kw = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    with lt.patch(model), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        t0 = time.perf_counter()
        got = compiled(**kw).logits
        compile_s = time.perf_counter() - t0
        want = model(**kw).logits
        view = torch.int16 if want.element_size() == 2 else torch.int32
        same = torch.equal(got.view(view), want.view(view))
        eager_ms = min(timeit.repeat(lambda: model(**kw), number=args.calls, repeat=args.repeats)) / args.calls * 1e3
        comp_ms = min(timeit.repeat(lambda: compiled(**kw), number=args.calls, repeat=args.repeats)) / args.calls * 1e3
    print("model,dtype,batch,seq,eager_ms,compiled_ms,ratio,same_bits,compile_s")
    print(f"llama-tiny,{args.dtype},{args.batch},{args.seq},{eager_ms:.2f},{comp_ms:.2f},{comp_ms / eager_ms:.3f},"
          f"{same},{compile_s:.1f}")


if __name__ == "__main__":
    main()
