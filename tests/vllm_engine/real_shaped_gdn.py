"""The real-shaped Qwen3.5 stack through vLLM-CPU + lockstep's plugin against the lockstep trainer (slow: not in CI).

    .venv-vllm/bin/python tests/vllm_engine/real_shaped_gdn.py [--dtype bfloat16|float32] [--no-compiled]

``hf_testing.real_shaped_qwen3_5`` (two layers, one GDN and one full attention, hidden 2048, attention head dim 256,
GDN head dims 128 with 16 key / 32 value heads, MLP 6144, the 248,320-token tied LM head, random weights) saved
locally; three prompts (70, 33 and 9 tokens, ids across the whole vocabulary), 8 greedy tokens each, through vLLM's
real engine with the plugin: eager with prefills cut every 29 tokens beside decode rows, and (unless
``--no-compiled``) vLLM's compiled mode with whole prefills. Each engine's recorded log-probs are compared on raw
float32 bits with the lockstep trainer's (transformers + ``lt.patch``, teacher-forced ``lt.token_logprobs``), and
its greedy tokens with the trainer's argmax; with the plugin off (bf16 only: stock vLLM-CPU refuses fp32 GDN) the
same comparison on stock vLLM is the negative control. Prints one line per engine and the minutes taken.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled engine")
    args = ap.parse_args(argv)

    import torch

    from hal.integrations.transformers.testing import real_shaped_qwen3_5
    from test_gdn_plugin import gdn_engines
    from test_vllm_plugin import differing, outputs

    start = time.time()
    with tempfile.TemporaryDirectory(prefix="lockstep_real_shaped_") as tmp:
        tmp = Path(tmp)
        model = real_shaped_qwen3_5(dtype=getattr(torch, args.dtype), attn_implementation="eager")  # only saved
        vocab = model.config.vocab_size
        path = str(tmp / "model")
        model.save_pretrained(path)
        del model
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (70, 33, 9)]
        engine = dict(max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.2)  # vLLM-CPU: weights + KV share
        runs = [("lockstep eager, cut every 29", dict(engine, max_num_batched_tokens=29), True)]
        if not args.no_compiled:
            runs.append(("lockstep compiled", dict(engine, enforce_eager=False), True))
        if args.dtype == "bfloat16":
            runs.append(("stock vLLM (plugin off)", dict(engine), False))
        failed = False
        for name, kw, plugin in runs:
            t = time.time()
            (res,) = gdn_engines(tmp, [dict(model=path, dtype=args.dtype, batches=[prompts], engine=kw,
                                            record_steps=plugin)], plugin=plugin, name=name.split()[0])
            engine_s = time.time() - t
            lp, tok = differing(path, args.dtype, prompts, outputs(res))
            n = 8 * len(prompts)
            print(f"real-shaped Qwen3.5 {args.dtype}, {name}: {lp}/{n} log-prob bits and {tok}/{n} greedy tokens "
                  f"differ from the lockstep trainer (engine {engine_s / 60:.1f} min; steps {res.get('steps')}; "
                  f"compiles {res.get('compiles')})", flush=True)
            failed |= plugin and (lp, tok) != (0, 0)
            failed |= not plugin and lp == 0  # the control must be caught
    print(f"total {(time.time() - start) / 60:.1f} min")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
