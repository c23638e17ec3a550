"""Runs vLLM engines in this process and prints what they produced, as JSON (tests/vllm drive it in a subprocess).

    python tests/vllm/engine_run.py SPEC.json OUT.json

SPEC: {"model": dir, "dtype": "float32"|"bfloat16", "runs": [{"engine": {LLM kwargs}, "prompts": [[ids]],
"sampling": [{SamplingParams kwargs} per prompt], "import_hal": bool}]}. Each run builds one engine, generates,
records tokens, log-prob bits, num_cached_tokens (or the error's type and message), and shuts the engine down.
Whether lockstep's plugin is on is the environment's LOCKSTEP_VLLM (the test sets it)."""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(__file__))
from tiny import bits  # noqa: E402

BASE = dict(skip_tokenizer_init=True, gpu_memory_utilization=0.05, max_model_len=256, block_size=32, seed=0,
            enforce_eager=True)


def run_one(spec, run):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], dtype=spec["dtype"], **{**BASE, **run.get("engine", {})})
    try:
        outs = []
        for group in run.get("batches", [run["prompts"]]):
            sps = [SamplingParams(**s) for s in run.get("sampling", [{}] * len(group))][:len(group)]
            sps = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)] * len(group) if not run.get(
                "sampling") else sps
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], sps, use_tqdm=False)
            for r in res:
                o = r.outputs[0]
                outs.append(dict(tokens=list(o.token_ids),
                                 bits=[bits(d[t].logprob) for d, t in zip(o.logprobs or [], o.token_ids)],
                                 cached=r.num_cached_tokens))
        return dict(outputs=outs)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main():
    spec = json.load(open(sys.argv[1]))
    results = []
    for run in spec["runs"]:
        if run.get("import_hal"):
            import hal  # noqa: F401  (a trainer process: numba imported before the engine's worker starts)
        try:
            results.append(run_one(spec, run))
        except Exception as e:  # the test asserts on refusals by name
            results.append(dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:]))
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
