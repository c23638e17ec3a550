"""Runs vLLM engines in this process and writes what they produced as JSON (tests/vllm_engine drive it in a subprocess:
lockstep's plugin is process-wide, so plugin-on and stock engines never share a process).

    python tests/vllm_engine/engine_run.py SPEC.json OUT.json

SPEC: {"runs": [{"model": dir, "dtype": "float32"|"bfloat16", "engine": {LLM kwargs}, "batches": [[prompt ids]],
"sampling": [{SamplingParams kwargs}] per batch (one per prompt; default: 8 greedy tokens, logprobs=0),
"import_hal": bool, "record_steps": bool, "count_head_passes": bool, "record_threads": bool, "head_logits_off": bool, "between": [[batch index, action]], "during": [[batch index, action, step]]}]}.
Each run builds one engine and generates each batch in turn; per batch it records every request's tokens,
log-prob bits, num_cached_tokens, the logprobs=N / prompt_logprobs entries (:func:`_entries`), or the error's
type and message (refusals are asserted by name), and how often vLLM's compiler ran during the run ("compiles": its
nonzero compilation counters; empty for an eager engine). "count_head_passes": how often the LM head ran
("head_passes": the logits processor's calls, and the recorded values' own ``token_logprobs`` calls;
"head_logits_off": the logits processor keeps no float32 logits, a control). An engine that fails to start records the error for the
run. "record_threads": each of lockstep's cpu kernels launched, with the (lockstep pool's, torch's) thread counts, and
torch's count before the engine is built and after each batch (an in-process engine: hal.integrations.vllm.threads).
Whether the plugin is on is the environment's LOCKSTEP_VLLM.

"during" changes the weights while a batch runs (:func:`_midflight`): "raw" / "optimizer" / "collective" from a step
hook inside ``generate`` (the engine core's schedule of that step), "reload_weights" / "admission" between the steps
of a batch driven step by step through ``llm.llm_engine`` (an RPC, or a new request admitted after a raw write); it
records the outputs' finish and stop reasons and any error the action or the call raised.
"""
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
GREEDY = dict(max_tokens=8, temperature=0.0, logprobs=0)


def _error(e: BaseException) -> dict:
    return dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-4000:])


def _steps_recorder(steps: list):
    from hal.integrations.vllm import plugin
    fn = steps.append
    plugin.STEP_HOOKS.append(fn)
    return lambda: plugin.STEP_HOOKS.remove(fn)


def _head_pass_counter(reuse: bool = True):
    """Counts the passes over the LM head: the logits processor's (vLLM's logits) and ``hal.token_logprobs``'
    calls from the recorded-value path (each runs the head over its rows again). ``reuse=False`` (a negative
    control): the logits processor keeps no float32 logits, so the recorded values run the head again. Returns
    (counts, undo)."""
    from hal import sampling
    from hal.integrations.vllm import layers
    counts = dict(logits=0, recorded=0)
    forward, token_logprobs = layers.LockstepLogitsProcessor.forward, sampling.token_logprobs
    reusable = layers.head_logits_are_the_logprobs_dot
    if not reuse:
        layers.head_logits_are_the_logprobs_dot = lambda *a, **k: False

    def counted_forward(*a, **k):
        counts["logits"] += 1
        return forward(*a, **k)

    def counted_token_logprobs(*a, **k):
        counts["recorded"] += 1
        return token_logprobs(*a, **k)

    layers.LockstepLogitsProcessor.forward, sampling.token_logprobs = counted_forward, counted_token_logprobs

    def undo():
        layers.LockstepLogitsProcessor.forward, sampling.token_logprobs = forward, token_logprobs
        layers.head_logits_are_the_logprobs_dot = reusable
    return counts, undo


def _thread_recorder():
    """Records (kernel, lockstep pool's threads, torch's threads) at each cpu kernel launch. Returns (seen, undo)."""
    import torch
    from hal.kernels.cpu import pool
    seen, real = set(), pool.run

    def recorded(kernel, *args, **kwargs):
        seen.add((kernel.__name__, pool.threads(), torch.get_num_threads()))
        return real(kernel, *args, **kwargs)
    pool.run = recorded

    def undo():
        pool.run = real
    return seen, undo


def _step_summary(steps) -> dict:
    prefill_steps: dict = {}
    mixed = preempted = 0
    reached: dict = {}  # tokens each request had computed after its last scheduled step
    for s in steps:
        for rid, done, new, _ in s.rows:
            preempted += done < reached.get(rid, 0)  # it restarts below what it had: preempted, recomputed
            reached[rid] = done + new
        for rid, *_ in s.prefill:
            prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
        if s.prefill and s.decode and len(s.rows) >= 2:
            mixed += 1
    return dict(steps=len(steps), mixed_steps=mixed, max_prefill_steps=max(prefill_steps.values(), default=0),
                preempted=preempted)


def _act(llm, action):
    """Between batches: change the weights through one of vLLM's paths (tests of the prefix-cache eviction)."""
    kind, arg = action
    if kind == "reload_weights":  # vLLM's own path: the worker reloads from a checkpoint directory
        llm.collective_rpc("reload_weights", kwargs={"weights_path": arg})
    elif kind == "extension":  # a worker extension's own method (how verl / OpenRLHF sync weights)
        llm.collective_rpc("lockstep_test_load", args=(os.path.join(arg, "model.safetensors"),))
    elif kind == "colocated":  # a trainer in this process calls the in-process engine's model directly (TRL, verl)
        _load_raw(_model(llm), arg)
    elif kind == "reset_prefix_cache":
        llm.reset_prefix_cache()
    else:
        raise ValueError(kind)


def _model(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model


def _load_raw(model, path):
    """vLLM's own loader: its weight loaders write with ``param.data.copy_`` (no version counter moves)."""
    from safetensors.torch import load_file
    model.load_weights(load_file(os.path.join(path, "model.safetensors")).items())


def _optimizer_step(model, path):
    """An optimizer step that moves every weight without touching a version counter (as fused AdamW does): its
    step writes the new checkpoint's values, so the result is a checkpoint the trainer can load."""
    import torch

    class Load(torch.optim.Optimizer):
        def __init__(self):
            super().__init__(list(model.parameters()), {})

        def step(self, closure=None):
            _load_raw(model, path)

    Load().step()


def _collective_load(model, path):
    """New weights arriving through a collective into ``p.data`` (a broadcast from the trainer's rank, as verl's and
    OpenRLHF's syncs do; no version counter moves): each parameter's new value is scattered into it over vLLM's own
    one-rank process group."""
    import torch
    import torch.distributed as dist
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    _load_raw(model, path)  # the new values in vLLM's layout (merged QKV, gate-up), then the old ones back
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.data.copy_(old[n])
            dist.scatter(p.data, [new[n]], src=0)


def _summary(r) -> dict:
    o = r.outputs[0]
    return dict(id=r.request_id, tokens=list(o.token_ids), finish=str(o.finish_reason), stop=o.stop_reason,
                bits=[bits(d[t].logprob) for d, t in zip(o.logprobs or [], o.token_ids)], cached=r.num_cached_tokens)


def _midflight(llm, group, params, action, at_step) -> dict:
    """Change the weights while ``group`` runs (module docstring); every output and error of the batch."""
    from vllm.inputs import TokensPrompt
    kind, arg = action
    model = _model(llm)
    if kind in ("raw", "optimizer", "collective"):  # from a step hook inside generate (the engine core's schedule)
        from hal.integrations.vllm import plugin
        seen = []

        def hook(step):
            seen.append(step)
            if len(seen) == at_step:
                dict(raw=_load_raw, optimizer=_optimizer_step, collective=_collective_load)[kind](model, arg)

        plugin.STEP_HOOKS.append(hook)
        try:
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params, use_tqdm=False)
            return dict(outputs=[_summary(r) for r in res])
        except Exception as e:
            return dict(call_error=_error(e))
        finally:
            plugin.STEP_HOOKS.remove(hook)
    engine, done, out = llm.llm_engine, [], {}
    for i, (p, sp) in enumerate(zip(group, params)):
        engine.add_request(f"mid{i}", TokensPrompt(prompt_token_ids=p), sp)
    for _ in range(at_step):
        done += [r for r in engine.step() if r.finished]
    try:
        if kind == "reload_weights":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": arg})
        elif kind == "admission":  # a raw write while requests run, then a new request is admitted
            _load_raw(model, arg)
            engine.add_request("admitted", TokensPrompt(prompt_token_ids=group[0]), params[0])
        else:
            raise ValueError(kind)
    except Exception as e:
        out["action_error"] = _error(e)
    for _ in range(200):  # bounded: a request the core never admitted would keep the front end waiting forever
        if not engine.has_unfinished_requests():
            break
        done += [r for r in engine.step() if r.finished]
    else:
        out["stuck"] = engine.get_num_unfinished_requests()
    return dict(out, outputs=[_summary(r) for r in sorted(done, key=lambda r: r.request_id)])


def _from_json(kwargs: dict) -> dict:
    """SamplingParams kwargs from JSON: a ``structured_outputs`` dict becomes vLLM's ``StructuredOutputsParams``."""
    from vllm.sampling_params import StructuredOutputsParams
    if isinstance(kwargs.get("structured_outputs"), dict):
        kwargs = dict(kwargs, structured_outputs=StructuredOutputsParams(**kwargs["structured_outputs"]))
    return kwargs


def _entries(r) -> dict:
    """Every (token id, log-prob bits, rank) vLLM returned per position, in its dict's order (the sampled or prompt
    token first, then the top-N not already listed): "top" for generated positions, "prompt" for prompt positions
    1.. when prompt_logprobs was asked (position 0 has none)."""
    def rows(dicts):
        return [[[t, bits(lp.logprob), lp.rank] for t, lp in d.items()] for d in dicts]
    out = {}
    if r.outputs[0].logprobs:
        out["top"] = rows(r.outputs[0].logprobs)
    if r.prompt_logprobs is not None:
        assert r.prompt_logprobs[0] is None
        out["prompt"] = rows(r.prompt_logprobs[1:])
    return out


def run_one(run) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter
    from vllm.inputs import TokensPrompt
    for counter in vars(compilation_counter):  # this engine's counts (vLLM resets them only when it compiles)
        setattr(compilation_counter, counter, 0)
    steps: list = []
    stop = _steps_recorder(steps) if run.get("record_steps") else None
    head, uncount = (_head_pass_counter(not run.get("head_logits_off")) if run.get("count_head_passes")
                     else (None, None))
    import torch
    threads_seen, unrecord = _thread_recorder() if run.get("record_threads") else (None, None)
    torch_threads = [torch.get_num_threads()]
    llm = LLM(model=run["model"], dtype=run["dtype"], **{**BASE, **run.get("engine", {})})
    between = {int(i): a for i, a in run.get("between", [])}
    during = {int(i): (a, k) for i, a, k in run.get("during", [])}
    try:
        batches = []
        for b, group in enumerate(run["batches"]):
            if b in between:
                _act(llm, between[b])
            sampling = (run.get("sampling") or [None] * len(run["batches"]))[b] or [GREEDY] * len(group)
            if b in during:
                batches.append(_midflight(llm, group, [SamplingParams(**_from_json(s)) for s in sampling], *during[b]))
                continue
            try:
                res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group],
                                   [SamplingParams(**_from_json(s)) for s in sampling], use_tqdm=False)
            except Exception as e:  # a refusal at admission: the engine lives on
                batches.append(_error(e))
                continue
            batches.append(dict(outputs=[dict(tokens=list(r.outputs[0].token_ids),
                                              bits=[bits(d[t].logprob) for d, t in
                                                    zip(r.outputs[0].logprobs or [], r.outputs[0].token_ids)],
                                              cached=r.num_cached_tokens, **_entries(r)) for r in res]))
            torch_threads.append(torch.get_num_threads())
        out = dict(batches=batches, compiles={k: v for k, v in vars(compilation_counter).items() if v})
        if stop is not None:
            out["steps"] = _step_summary(steps)
        if head is not None:
            out["head_passes"] = dict(head)
        if threads_seen is not None:
            out["threads"] = dict(launches=sorted(threads_seen), torch=torch_threads)
        return out
    finally:
        if unrecord is not None:
            unrecord()
        if stop is not None:
            stop()
        if uncount is not None:
            uncount()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def run_async(run) -> dict:
    """One batch through ``AsyncLLM`` (what verl's async rollout and ``vllm serve`` use), requests concurrent."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    async def go():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=run["model"], dtype=run["dtype"],
                                                           **{**BASE, **run.get("engine", {})}))
        try:
            async def one(i, p):
                final = None
                async for out in engine.generate(TokensPrompt(prompt_token_ids=p), SamplingParams(**GREEDY),
                                                 request_id=f"r{i}"):
                    final = out
                o = final.outputs[0]
                return dict(tokens=list(o.token_ids), cached=final.num_cached_tokens,
                            bits=[bits(d[t].logprob) for d, t in zip(o.logprobs, o.token_ids)])
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(run["batches"][0])))
        finally:
            engine.shutdown()

    return dict(batches=[dict(outputs=asyncio.run(go()))])


def main():
    spec = json.load(open(sys.argv[1]))
    results = []
    for run in spec["runs"]:
        if run.get("import_hal"):
            # a trainer process: it ran a cpu-backend op (numba loaded) before the engine's worker starts. (``import
            # hal`` alone no longer loads numba.)
            import hal
            import torch
            hal.softmax(torch.randn(2, 4), backend="cpu")
        try:
            results.append(run_async(run) if run.get("async") else run_one(run))
        except Exception as e:
            results.append(_error(e))
        json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
