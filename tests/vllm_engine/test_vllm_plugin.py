"""lockstep's vLLM plugin on vLLM-CPU's real engine: the recorded log-probs are the lockstep trainer's, bit for bit.

The trainer is transformers 5.19 with ``lt.patch`` (this process; vLLM is never imported here). Engines run in
subprocesses (engine_run.py): the plugin is process-wide, so a stock engine (the negative control) and a
lockstep engine never share a process. Each subprocess builds its engines one after another in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless a test says multiprocess. Every comparison is on raw float32 bits.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tiny  # noqa: E402

CASES = [(k, d) for k in tiny.KINDS for d in tiny.DTYPES]
PROMPTS = tiny.prompts()


def run_engines(tmp_path, runs, plugin=True, multiprocess=False, env=None, name="spec"):
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}_out.json"
    spec.write_text(json.dumps(dict(runs=runs)))
    full_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
                    VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"), **(env or {}))
    if plugin is not None:
        full_env["LOCKSTEP_VLLM"] = "1" if plugin else "0"
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(spec), str(out)], env=full_env,
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), f"engine_run.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert len(results) == len(runs), f"engine_run.py stopped early:\n{proc.stderr[-6000:]}"
    return results


def outputs(result, batch=0):
    assert "error" not in result, result.get("trace", result.get("error"))
    b = result["batches"][batch]
    assert "error" not in b, b.get("trace", b.get("error"))
    return b["outputs"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {(k, d): tiny.save_tiny(k, d, root / f"{k}-{d}") for k, d in CASES}


_trainers: dict = {}


def trainer_bits(path, dtype, prompt, generated, **sampling):
    if path not in _trainers:
        _trainers[path] = tiny.trainer(path, dtype)[0]
    return tiny.trainer_logprobs(_trainers[path], prompt, generated, **sampling)


def differing(path, dtype, prompts, outs, per_prompt=None, **sampling):
    """(log-prob bits that differ from the trainer's, greedy tokens that differ from the trainer's argmax);
    the trainer recomputes with ``sampling`` (temperature, top_k, top_p), or ``per_prompt[i]`` for prompt i."""
    lp = tok = 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o["tokens"]) == 8 and len(o["bits"]) == 8
        b, g = trainer_bits(path, dtype, p, o["tokens"], **(per_prompt[i] if per_prompt else sampling))
        lp += sum(x != y for x, y in zip(b, o["bits"]))
        tok += sum(x != y for x, y in zip(g, o["tokens"]))
    return lp, tok


# One sampled batch, a different setting per row (temperature only, top-k, top-p, both), each with its own seed.
SAMPLED = [dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1.0), dict(temperature=0.6, top_k=5),
           dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=50, top_p=0.95), dict(temperature=0.7)]
SAMPLED_PARAMS = [dict(max_tokens=8, seed=200 + i, logprobs=0, **s) for i, s in enumerate(SAMPLED)]


# logprobs=N alternatives and prompt_logprobs, greedy and seeded sampled rows in one batch (N differs per row: vLLM
# computes the batch's largest and keeps each request's own; top_k=3 keeps fewer tokens than 5 alternatives)
ALTERNATIVES = [dict(max_tokens=8, temperature=0.0, logprobs=1, prompt_logprobs=0),
                dict(max_tokens=8, temperature=0.8, top_k=3, seed=301, logprobs=5, prompt_logprobs=2),
                dict(max_tokens=8, temperature=0.0, logprobs=5),
                dict(max_tokens=8, temperature=1.0, top_p=0.8, seed=303, logprobs=2, prompt_logprobs=5),
                dict(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=1),
                dict(max_tokens=8, temperature=0.7, seed=305, logprobs=4)]
GREEDY_ALTERNATIVES = [{k: v for k, v in a.items() if k not in ("temperature", "top_k", "top_p", "seed")}
                       | dict(temperature=0.0) for a in ALTERNATIVES]  # stock vLLM-CPU: no seeded requests


def entries_differing(path, dtype, prompts, outs, params, processed=False):
    """(positions whose entries differ in any way -- ids, their order, bits or ranks --, returned values whose bits
    differ from the trainer's value for the same id, values compared) against tiny.trainer_entries: logprobs=N
    under the engine's logprobs_mode (processed: each sampled row's settings), prompt_logprobs at temperature 1."""
    if path not in _trainers:
        _trainers[path] = tiny.trainer(path, dtype)[0]
    wrong = values = compared = 0
    for prompt, o, prm in zip(prompts, outs, params):
        sampled = processed and prm.get("temperature", 1.0) > 0
        setting = {k: prm[k] for k in ("temperature", "top_k", "top_p") if k in prm} if sampled else {}
        want = tiny.trainer_entries(_trainers[path], prompt, o["tokens"], prm["logprobs"], prm.get("prompt_logprobs"),
                                    **setting)
        for key in want:
            if key == "top" and not prm["logprobs"]:
                continue  # logprobs=0: the token's own value, which differing() compares
            got = o.get(key)
            assert got is not None and len(got) == len(want[key]), (key, prm)
            for w, g in zip(want[key], got):
                wrong += w != g
                wb = {t: b for t, b, _ in w}
                values += sum(t in wb and b != wb[t] for t, b, _ in g)
                compared += sum(t in wb for t, _, _ in g)
    return wrong, values, compared


def finite(outs) -> bool:
    """Every recorded log-prob is finite: under processed_logprobs a token outside the kept set records -inf."""
    return all(abs(struct.unpack("<f", struct.pack("<i", b))[0]) < float("inf") for o in outs for b in o["bits"])


@pytest.fixture(scope="module")
def greedy(models, tmp_path_factory):
    """Greedy rollouts of the 6 prompts (48 tokens) per model and dtype: lockstep's engines (one process building
    four in-process engines in a row) and stock vLLM's (the plugin off)."""
    tmp = tmp_path_factory.mktemp("greedy")
    runs = [dict(model=models[c], dtype=c[1], batches=[PROMPTS, PROMPTS], sampling=[None, GREEDY_ALTERNATIVES])
            for c in CASES]
    # lockstep's engines draw SAMPLED (batch 1; stock vLLM-CPU cannot run seeded requests on this machine), then the
    # logprobs=N / prompt_logprobs batch with seeded rows (batch 2)
    sampled = [dict(r, batches=[PROMPTS] * 3, sampling=[None, SAMPLED_PARAMS, ALTERNATIVES]) for r in runs]
    return dict(lockstep=dict(zip(CASES, run_engines(tmp, sampled, plugin=True, name="on"))),
                stock=dict(zip(CASES, run_engines(tmp, runs, plugin=False, name="off"))))


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_greedy_logprobs_equal_the_trainers(case, models, greedy):
    path, dtype = models[case], case[1]
    lp, tok = differing(path, dtype, PROMPTS, outputs(greedy["lockstep"][case]))
    assert (lp, tok) == (0, 0), f"{case}: {lp}/48 log-prob bits and {tok}/48 greedy tokens differ from the trainer"


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_sampled_raw_logprobs_equal_the_trainers(case, models, greedy):
    """Eager, seeded temperature / top-k / top-p rows in one batch, vLLM's default raw_logprobs: each drawn
    token's recorded bits are the trainer's temperature-1 full-vocabulary log-prob."""
    lp, _ = differing(models[case], case[1], PROMPTS, outputs(greedy["lockstep"][case], 1))
    assert lp == 0, f"{case}: {lp}/48 sampled tokens' log-prob bits differ from the trainer"


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_alternatives_and_prompt_logprobs_equal_the_trainers(case, models, greedy):
    """logprobs=N (1 to 5 per row) and prompt_logprobs (0 to 5), greedy and seeded temperature / top-k / top-p rows in
    one batch, vLLM's default raw_logprobs: at every generated and prompt position the ids vLLM returns, their order
    (lockstep's score, then the recorded value, then the id), each value's float32 bits (the trainer's lt.token_logprobs
    of that id from one teacher-forced forward) and the ranks are the trainer's."""
    outs = outputs(greedy["lockstep"][case], 2)
    wrong, values, compared = entries_differing(models[case], case[1], PROMPTS, outs, ALTERNATIVES)
    print(f"{case}: {compared} values compared")
    assert (wrong, values) == (0, 0) and compared > 500, (wrong, values, compared)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_stock_vllm_differs_negative_control(case, models, greedy):
    """The comparisons above catch stock vLLM: with the plugin off most recorded log-probs differ, and so do the
    logprobs=N / prompt_logprobs values (stock: log_softmax of its own logits)."""
    lp, _ = differing(models[case], case[1], PROMPTS, outputs(greedy["stock"][case]))
    wrong, values, compared = entries_differing(models[case], case[1], PROMPTS, outputs(greedy["stock"][case], 1),
                                                GREEDY_ALTERNATIVES)
    print(f"stock vLLM {case}: {lp}/48 log-prob bits differ from the lockstep trainer; logprobs=N / prompt_logprobs: "
          f"{values}/{compared} values, {wrong} positions")
    assert lp >= 40, f"{case}: only {lp}/48 differ with the plugin off"
    assert values >= compared // 2, (values, compared)


def test_scheduler_invariance_with_hook_proof(models, tmp_path):
    """Prefills cut every 16 tokens beside decode rows, at most 2 sequences, prefix-cache hits, reversed order:
    each engine's bits are the trainer's, and the step hook proves the hard steps happened."""
    case = ("llama", "bfloat16")
    path = models[case]
    shared = PROMPTS[1][:64]  # two 32-token blocks: a second request with this prefix hits the cache
    hit_prompts = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    runs = [dict(model=path, dtype=case[1], batches=[PROMPTS], record_steps=True,
                 engine=dict(max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)),
            dict(model=path, dtype=case[1], batches=[PROMPTS], engine=dict(max_num_seqs=2)),
            dict(model=path, dtype=case[1], batches=[PROMPTS[::-1]]),
            dict(model=path, dtype=case[1], batches=[hit_prompts[:1], hit_prompts[1:], PROMPTS],
                 engine=dict(enable_prefix_caching=True))]
    chunked, two_seqs, reversed_, cached = run_engines(tmp_path, runs)
    assert chunked["steps"]["max_prefill_steps"] >= 3, chunked["steps"]  # a prompt prefilled over >= 3 steps
    assert chunked["steps"]["mixed_steps"] >= 1, chunked["steps"]  # prefill chunks beside decode rows
    for name, outs, prompts in (("chunked", outputs(chunked), PROMPTS), ("max_num_seqs=2", outputs(two_seqs), PROMPTS),
                                ("reversed", outputs(reversed_), PROMPTS[::-1]),
                                ("prefix hit", outputs(cached, 1), hit_prompts[1:])):
        assert differing(path, case[1], prompts, outs) == (0, 0), name
    assert outputs(cached, 1)[0]["cached"] >= 64  # the hit really happened (vLLM's own count)


def test_preemption_changes_no_bit(models, tmp_path):
    """Six 30-token prompts fill six blocks of 32 tokens; decoding past token 32 needs a seventh: vLLM preempts
    and recomputes requests (the step hook sees a request restart below what it had computed); every bit is
    still the trainer's."""
    case = ("qwen3", "bfloat16")
    prompts = [PROMPTS[1][i:i + 30] for i in range(6)]
    runs = [dict(model=models[case], dtype=case[1], batches=[prompts], record_steps=True,
                 engine=dict(num_gpu_blocks_override=6, max_model_len=128, enable_prefix_caching=False))]
    (res,) = run_engines(tmp_path, runs)
    assert res.get("steps", {}).get("preempted", 0) >= 1, res.get("steps", res.get("error"))
    assert differing(models[case], case[1], prompts, outputs(res)) == (0, 0)


def test_seeded_sampling_logprobs_equal_the_trainers(models, tmp_path):
    """Seeded temperature / top-k / top-p rows under processed_logprobs: lt.token_logprobs with each row's
    settings; a seeded request draws the same tokens alone as beside others, and the same again when every
    prompt is prefilled in 16-token chunks beside decode rows (vLLM samples a chunk that does not end its prompt
    and throws the token away; stock vLLM-CPU then dies rewinding the request's CPU generator with set_offset)."""
    case = ("qwen3", "bfloat16")
    path = models[case]
    runs = [dict(model=path, dtype=case[1], batches=[PROMPTS, PROMPTS[1:2]],
                 sampling=[SAMPLED_PARAMS, SAMPLED_PARAMS[1:2]], engine=dict(logprobs_mode="processed_logprobs")),
            dict(model=path, dtype=case[1], batches=[PROMPTS], sampling=[SAMPLED_PARAMS], record_steps=True,
                 engine=dict(logprobs_mode="processed_logprobs", max_num_batched_tokens=16,
                             enable_prefix_caching=False))]
    processed, chunked = run_engines(tmp_path, runs)
    outs = outputs(processed)
    assert differing(path, case[1], PROMPTS, outs, per_prompt=SAMPLED)[0] == 0 and finite(outs)
    alone = outputs(processed, 1)[0]  # (a prefix-cache hit of the batched request's blocks)
    assert (alone["tokens"], alone["bits"]) == (outs[1]["tokens"], outs[1]["bits"])  # its own generator
    assert chunked["steps"]["max_prefill_steps"] >= 3, chunked  # the 70-token prompt: 5 chunks
    assert chunked["steps"]["mixed_steps"] >= 1, chunked["steps"]  # chunks beside other requests' decode rows
    assert [(o["tokens"], o["bits"]) for o in outputs(chunked)] == [(o["tokens"], o["bits"]) for o in outs]
    assert differing(path, case[1], PROMPTS, outputs(chunked), per_prompt=SAMPLED)[0] == 0


def test_refusals_by_name(models, tmp_path):
    """Each feature lockstep cannot make exact is refused by name (lockstep's UnsupportedError): engine features
    in the front end's create_engine_config, before any engine part is built (vLLM-CPU constructs every one of
    these configurations itself, tensor / pipeline parallel 2 included); sampling parameters at admission, after
    which the same engine still serves the trainer's bits (a refused request changes nothing)."""
    case = ("llama", "float32")
    path = models[case]
    mistral = tmp_path / "mistral"  # an architecture outside the tested list
    tiny.save_tiny("llama", "float32", mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (mistral / "config.json").write_text(json.dumps(cfg))
    window = tmp_path / "qwen3_window"  # Qwen3 (a tested architecture) with a sliding-window layer
    tiny.save_tiny("qwen3", "float32", window)
    cfg = json.loads((window / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=32, max_window_layers=1,
               layer_types=["full_attention", "sliding_attention"])
    (window / "config.json").write_text(json.dumps(cfg))
    refused_engines = {  # name in the error -> (model, dtype, engine arguments)
        "kv_cache_dtype='fp8'": (path, "float32", dict(kv_cache_dtype="fp8")),
        "logprobs_mode='raw_logits'": (path, "float32", dict(logprobs_mode="raw_logits")),
        "model_impl": (path, "float32", dict(model_impl="transformers")),
        "MistralForCausalLM": (str(mistral), "float32", {}),
        "quantization='fp8'": (models[("llama", "bfloat16")], "bfloat16", dict(quantization="fp8")),  # fp8: bf16 only
        "LoRA": (path, "float32", dict(enable_lora=True)),
        "speculative decoding": (path, "float32", dict(speculative_config=dict(
            method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1))),
        "tensor/pipeline/data parallel sizes 2/1/1": (path, "float32", dict(tensor_parallel_size=2)),
        "tensor/pipeline/data parallel sizes 1/2/1": (path, "float32", dict(pipeline_parallel_size=2)),
        "sliding-window attention": (str(window), "float32", {}),
        # an engine-level custom logits processor (stock applies it; lockstep's sampler would never run it)
        "logits_processors": (path, "float32", dict(logits_processors=["ban_token_processor:BanToken"])),
        "enable_prompt_embeds": (path, "float32", dict(enable_prompt_embeds=True)),
        # an engine argument declared "refused unless vLLM's default" (hal/integrations/vllm/engine_args.py)
        "use_fp64_gumbel=True": (path, "float32", dict(use_fp64_gumbel=True)),
    }
    refused_requests = {"min_p": dict(min_p=0.1), "penalties": dict(presence_penalty=0.5),
                        "penalties ": dict(frequency_penalty=0.5), "penalties  ": dict(repetition_penalty=1.2),
                        "logit_bias": dict(logit_bias={3: 1.0}), "logprobs=-1": dict(logprobs=-1),
                        "prompt_logprobs=-1": dict(prompt_logprobs=-1),
                        "skip_reading_prefix_cache=False": dict(prompt_logprobs=1, skip_reading_prefix_cache=False),
                        "min_tokens": dict(min_tokens=2),
                        "allowed_token_ids": dict(allowed_token_ids=[1, 2, 3]), "bad_words": dict(bad_words=["a"]),
                        "structured outputs": dict(structured_outputs=dict(choice=["a", "b"])),
                        # vLLM raises it to 0.01 when the SamplingParams is built: the asked value is lost
                        "temperature=0.01": dict(temperature=0.005), "temperature=0.01 ": dict(temperature=0.01)}
    # prompt token ids outside the vocabulary (160): in vLLM's padded embedding rows (192), and past them; the first
    # with prompt_logprobs (its targets are the prompt's own ids)
    bad_prompts = {"(2, 170)": ([1, 2, 170, 4], dict(prompt_logprobs=1)), "(1, 300)": ([5, 300, 6], {})}
    runs = [dict(model=m, dtype=d, engine=e, batches=[]) for m, d, e in refused_engines.values()]
    runs.append(dict(model=path, dtype=case[1],
                     batches=[PROMPTS[:1]] * len(refused_requests) + [[p] for p, _ in bad_prompts.values()]
                     + [PROMPTS[:1]],
                     sampling=[[{**dict(max_tokens=4, logprobs=0), **r}] for r in refused_requests.values()]
                     + [[dict(max_tokens=4, logprobs=0, **r)] for _, r in bad_prompts.values()] + [None]))
    *engines, requests = run_engines(tmp_path, runs)
    for res, name in zip(engines, refused_engines):
        assert "UnsupportedError" in res.get("error", "") and name in res["error"], (name, res)
        assert "batches" not in res, name  # the engine never started
    for b, name in zip(requests["batches"], refused_requests):
        assert "UnsupportedError" in b.get("error", "") and name.strip() in b["error"], (name, b)
    for b, name in zip(requests["batches"][len(refused_requests):], bad_prompts):
        assert "InputError" in b.get("error", "") and "prompt_token_ids" in b["error"] and name in b["error"], (name, b)
    assert differing(path, case[1], PROMPTS[:1], requests["batches"][-1]["outputs"]) == (0, 0)
    # vLLM's second-generation model runner (its own switch): refused by lockstep's name before vLLM builds anything
    (v2,) = run_engines(tmp_path, [dict(model=path, dtype=case[1], batches=[])],
                        env=dict(VLLM_USE_V2_MODEL_RUNNER="1"), name="v2")
    assert "UnsupportedError" in v2.get("error", "") and "VLLM_USE_V2_MODEL_RUNNER" in v2["error"], v2


def test_entry_point_logits_processor_is_refused(models, tmp_path):
    """A logits processor installed through vLLM's ``vllm.logits_processors`` entry points (no engine argument names
    it): stock vLLM loads and applies it (every greedy token is the one it forces: the negative control), lockstep's
    plugin stops the engine at model load naming it (plugin.audit_logits_processors)."""
    from ban_token_processor import FORCED
    site = tmp_path / "entry_point_site"  # a distribution's metadata on the path: what `pip install` leaves
    dist = site / "lockstep_test_force-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lockstep-test-force\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vllm.logits_processors]\nforce = ban_token_processor:ForceToken\n")
    env = dict(PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(HERE), os.environ.get("PYTHONPATH")])))
    run = [dict(model=models[("llama", "float32")], dtype="float32", batches=[PROMPTS[:2]])]
    (on,) = run_engines(tmp_path, run, env=env, name="entry_point_on")
    assert "UnsupportedError" in on.get("error", "") and "ForceToken" in on["error"], on
    (off,) = run_engines(tmp_path, run, plugin=False, env=env, name="entry_point_off")
    tokens = [t for o in outputs(off) for t in o["tokens"]]
    assert tokens and set(tokens) == {FORCED}, tokens


def test_temperatures_vllm_raises_are_refused():
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 when it is built (a log line only), so a
    request at 0.01 may have asked any smaller value: (0, 0.01] is refused at admission by name, also when set after
    the params were built; 0 (greedy) and the values above are served (check_request, in this process: no engine)."""
    import vllm.sampling_params as vsp
    from vllm.sampling_params import SamplingParams

    from hal.errors import UnsupportedError
    from hal.integrations.vllm import plugin
    assert vsp._MAX_TEMP == plugin.RAISED_TEMPERATURE  # the bound this refusal mirrors is vLLM's own
    for asked in (1e-6, 0.005, 0.01):
        p = SamplingParams(temperature=asked)
        assert p.temperature == 0.01  # what vLLM did with it
        with pytest.raises(UnsupportedError, match="temperature=0.01"):
            plugin.check_request(p)
    later = SamplingParams(temperature=0.5)
    later.temperature = 0.003  # set after __post_init__: never raised, still refused
    with pytest.raises(UnsupportedError, match="temperature=0.003"):
        plugin.check_request(later)
    for served in (0.0, 0.0101, 0.7, 1.0):
        plugin.check_request(SamplingParams(temperature=served))  # negative control: served values pass


def test_every_engine_argument_is_declared():
    """vLLM's EngineArgs and AsyncEngineArgs fields (AsyncLLM's adds its own), walked in a vLLM process, against the
    plugin's declaration (engine_args.py: checked, scheduling, no bits, refused unless default): none is left
    unnamed, none declared twice, none declared that vLLM does not have (a stale entry)."""
    from hal.integrations.vllm import engine_args as ea
    code = "import dataclasses; from vllm.engine.arg_utils import AsyncEngineArgs as A, EngineArgs as E\n" \
           "print(' '.join({f.name for c in (E, A) for f in dataclasses.fields(c)}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    fields = set(out.stdout.split())
    groups = (ea.CHECKED, ea.SCHEDULING, ea.NO_BITS, ea.REFUSED_UNLESS_DEFAULT)
    assert sum(map(len, groups)) == len(ea.DECLARED), "a field declared in two groups"
    assert len(fields) > 200 and fields - ea.DECLARED == set() and ea.DECLARED - fields == set(), \
        (sorted(fields - ea.DECLARED), sorted(ea.DECLARED - fields))


def test_each_argument_refused_unless_default_is_refused_by_name():
    """engine_args.check on EngineArgs and AsyncEngineArgs (in this process: no engine is built): at vLLM's
    defaults it passes; each REFUSED_UNLESS_DEFAULT field set to another value, alone, is refused naming that field
    (so none of them is declared but unchecked); a NO_BITS field changed passes (negative control)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from hal.errors import UnsupportedError
    from hal.integrations.vllm import engine_args as ea

    class Other:  # equal to no default
        def __repr__(self):
            return "<other>"

    for cls in (EngineArgs, AsyncEngineArgs):
        args = cls(model="/no/such/model")
        ea.check(args)
        refused = [f.name for f in dataclasses.fields(args) if f.name in ea.REFUSED_UNLESS_DEFAULT]
        assert len(refused) == len(ea.REFUSED_UNLESS_DEFAULT), cls  # every declared one is a field of both
        for name in refused:
            default = getattr(args, name)
            setattr(args, name, Other())
            with pytest.raises(UnsupportedError, match=f"{name}=<other>") as err:
                ea.check(args)
            assert len(err.value.reasons) == 1, (name, err.value.reasons)
            setattr(args, name, default)
        args.served_model_name = "another-name"
        ea.check(args)


def test_switch_values_other_than_documented_are_refused(monkeypatch):
    """LOCKSTEP_VLLM: 1 on, 0 or unset off; any other value ("true", "yes", "on", "2") raises naming the variable and
    the accepted values, so a user who meant "on" never gets stock vLLM without a word (this process: no vLLM)."""
    from hal.errors import InputError
    from hal.integrations import vllm as plugin_switch
    monkeypatch.setattr(plugin_switch, "_forced", None)
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("LOCKSTEP_VLLM", value)
        assert plugin_switch.enabled() is on, value
    monkeypatch.delenv("LOCKSTEP_VLLM")
    assert plugin_switch.enabled() is False
    for value in ("true", "yes", "on", "2", "True"):
        monkeypatch.setenv("LOCKSTEP_VLLM", value)
        with pytest.raises(InputError, match=f"LOCKSTEP_VLLM='{value}'"):
            plugin_switch.enabled()


def test_colocated_engines_after_import_hal(models, tmp_path):
    """A trainer process that ran a lockstep cpu op (numba loaded) builds in-process engines one after another, the plugin off;
    without lockstep's llvmlite guard (its entry point not loaded: VLLM_PLUGINS names another plugin) vLLM's
    worker start crashes on llvmlite's ffi object -- the negative control."""
    path, dtype = models[("qwen3", "float32")], "float32"
    runs = [dict(model=path, dtype=dtype, batches=[PROMPTS[:2]], import_hal=True) for _ in range(2)]
    ok = run_engines(tmp_path, runs, plugin=False, name="guarded")
    assert all(len(outputs(r)) == 2 for r in ok)
    crashed = run_engines(tmp_path, runs[:1], plugin=False, env=dict(VLLM_PLUGINS="lora_filesystem_resolver"),
                          name="unguarded")
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in crashed[0].get("error", ""), crashed


def test_multiprocess_engine_two_threads(models, tmp_path):
    """vLLM's default: scheduler in the engine-core process, the model in a worker process (the plugin loads in
    each), two OpenMP threads with chunked prefill; bits still the trainer's."""
    case = ("llama", "bfloat16")
    runs = [dict(model=models[case], dtype=case[1], batches=[PROMPTS], engine=dict(max_num_batched_tokens=32))]
    env = dict(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    (res,) = run_engines(tmp_path, runs, multiprocess=True, env=env)
    assert differing(models[case], case[1], PROMPTS, outputs(res)) == (0, 0)


def test_engine_steps_run_lockstep_on_torchs_threads(models, tmp_path):
    """hal.integrations.vllm.threads in a real in-process engine: every lockstep kernel of its model calls
    (warm-up, steps, sampling) launches with torch on one thread and lockstep's pool on the two threads torch had;
    between batches torch has its two threads back (the weight watch's hashes outside the model calls see them);
    the bits are the trainer's."""
    case = ("llama", "bfloat16")
    runs = [dict(model=models[case], dtype=case[1], batches=[PROMPTS, PROMPTS[:2]], record_threads=True)]
    (res,) = run_engines(tmp_path, runs, env=dict(OMP_NUM_THREADS="2"))
    model = {(n, pool, torch) for n, pool, torch in res["threads"]["launches"] if n != "_hash_tasks"}
    assert model and {(pool, torch) for _, pool, torch in model} == {(2, 1)}, res["threads"]
    # the weight watch's hashes run outside the model calls (load, the engine core's checks): torch's threads
    assert {(p, t) for n, p, t in res["threads"]["launches"] if n == "_hash_tasks"} == {(2, 2)}, res["threads"]
    assert res["threads"]["torch"] == [2, 2, 2], res["threads"]
    assert differing(models[case], case[1], PROMPTS, outputs(res)) == (0, 0)


def test_async_llm_equals_trainer(models, tmp_path):
    """AsyncLLM (verl's async rollout, ``vllm serve``), six concurrent requests: the trainer's bits."""
    case = ("qwen3", "float32")
    (res,) = run_engines(tmp_path, [dict(model=models[case], dtype=case[1], batches=[PROMPTS], **{"async": True})],
                         multiprocess=True)
    assert differing(models[case], case[1], PROMPTS, outputs(res)) == (0, 0)


@pytest.fixture(scope="module")
def compiled(models, tmp_path_factory):
    """vLLM's default execution mode (torch.compile, enforce_eager=False; a fresh compile cache), one engine per
    model and dtype in one process: the greedy prompts, then SAMPLED, then ALTERNATIVES, under processed_logprobs."""
    runs = [dict(model=models[c], dtype=c[1], batches=[PROMPTS] * 3, sampling=[None, SAMPLED_PARAMS, ALTERNATIVES],
                 engine=dict(enforce_eager=False, logprobs_mode="processed_logprobs")) for c in CASES]
    return dict(zip(CASES, run_engines(tmp_path_factory.mktemp("compiled"), runs)))


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_compiled_engine_equals_trainer(case, models, compiled, greedy):
    """The compiled engine gives the trainer's bits: greedy (a greedy row's processed value is its
    temperature-1 value), and sampled under processed_logprobs (lt.token_logprobs with each row's temperature,
    top-k, top-p; all finite: every drawn token is in the kept set); its sampled tokens are the eager engine's
    (same seeds: the draw does not depend on the execution mode or the log-prob mode)."""
    path, dtype = models[case], case[1]
    assert differing(path, dtype, PROMPTS, outputs(compiled[case])) == (0, 0)
    sampled = outputs(compiled[case], 1)
    assert differing(path, dtype, PROMPTS, sampled, per_prompt=SAMPLED)[0] == 0
    assert finite(sampled)
    assert [o["tokens"] for o in sampled] == [o["tokens"] for o in outputs(greedy["lockstep"][case], 1)]


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_compiled_processed_alternatives_equal_the_trainers(case, models, compiled, greedy):
    """ALTERNATIVES in the compiled engine under processed_logprobs: each sampled row's alternatives and values
    under its own temperature / top-k / top-p (top_k=3 with 5 alternatives: the last two -inf, as the trainer
    says); prompt positions at temperature 1 (vLLM's prompt tokens skip the sampling settings); the eager engine's
    tokens."""
    outs = outputs(compiled[case], 2)
    wrong, values, compared = entries_differing(models[case], case[1], PROMPTS, outs, ALTERNATIVES, processed=True)
    assert (wrong, values) == (0, 0) and compared > 500, (wrong, values, compared)
    assert sum(b == tiny.bits(float("-inf")) for e in outs[1]["top"] for _, b, _ in e) >= 8  # 5 asked, top_k=3 kept
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in outputs(greedy["lockstep"][case], 2)]


def test_prompt_logprobs_chunked_and_with_prefix_caching(models, tmp_path):
    """prompt_logprobs with the prompt prefilled in 16-token chunks beside another request's decode rows, prefix
    caching on: vLLM does not read cached blocks for such a request (its skip_reading_prefix_cache, so every prompt
    position is computed; 0 cached tokens), while the same prompt without prompt_logprobs does hit (>= 64 cached:
    the cache was there to read); and prefix caching off, whole prefills. Every entry is the trainer's."""
    case = ("llama", "bfloat16")
    path = models[case]
    shared = PROMPTS[1][:64]
    hit = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    asks = [dict(max_tokens=8, temperature=0.0, logprobs=0), dict(max_tokens=8, temperature=0.0, logprobs=2,
                                                                 prompt_logprobs=3)]
    batch = [PROMPTS[0], hit[1]]  # the 5-token prompt decodes while the 69-token one is prefilled in chunks
    runs = [dict(model=path, dtype=case[1], batches=[hit[:1], batch, hit[1:]], sampling=[None, asks, None],
                 record_steps=True, engine=dict(enable_prefix_caching=True, max_num_batched_tokens=16)),
            dict(model=path, dtype=case[1], batches=[batch], sampling=[asks], engine=dict(enable_prefix_caching=False))]
    cached, uncached = run_engines(tmp_path, runs)
    steps = cached["steps"]
    assert steps["max_prefill_steps"] >= 3 and steps["mixed_steps"] >= 1, steps  # chunks beside decode rows
    for name, res in (("prefix caching on, chunked", outputs(cached, 1)), ("prefix caching off", outputs(uncached))):
        assert res[1]["cached"] == 0, (name, res[1]["cached"])
        assert entries_differing(path, case[1], batch, res, asks)[:2] == (0, 0), name
        assert differing(path, case[1], batch, res) == (0, 0), name
    assert outputs(cached, 2)[0]["cached"] >= 64  # the same prompt, no prompt_logprobs: a hit


def test_lm_head_runs_once_per_token(models, tmp_path):
    """The LM head's pass keeps token_logprobs' own float32 logits (a float32 head: its logits; bf16: the float32
    result hal.ops.linear_with_float32 rounds once for vLLM): each step runs the head once (the logits processor)
    and the recorded values -- sampled rows, logprobs=N, prompt_logprobs -- come from those logits, the trainer's
    bits. Control: a bf16 head that keeps no float32 logits runs the head again for its recorded values (the
    counter sees those passes): once per step for all its rows, the same bits."""
    f32, bf16 = models[("llama", "float32")], models[("llama", "bfloat16")]
    runs = [dict(model=f32, dtype="float32", batches=[PROMPTS], sampling=[SAMPLED_PARAMS], record_steps=True,
                 count_head_passes=True),
            dict(model=f32, dtype="float32", batches=[PROMPTS], sampling=[ALTERNATIVES], count_head_passes=True),
            dict(model=bf16, dtype="bfloat16", batches=[PROMPTS], sampling=[SAMPLED_PARAMS], record_steps=True,
                 count_head_passes=True),
            dict(model=bf16, dtype="bfloat16", batches=[PROMPTS], sampling=[ALTERNATIVES], count_head_passes=True),
            dict(model=bf16, dtype="bfloat16", batches=[PROMPTS], sampling=[SAMPLED_PARAMS], record_steps=True,
                 count_head_passes=True, head_logits_off=True)]
    sampled, alternatives, sampled16, alternatives16, rerun = run_engines(tmp_path, runs)
    for model, dtype, one, alt in ((f32, "float32", sampled, alternatives), (bf16, "bfloat16", sampled16,
                                                                            alternatives16)):
        assert one["head_passes"] == dict(logits=one["steps"]["steps"], recorded=0), (dtype, one["head_passes"])
        assert differing(model, dtype, PROMPTS, outputs(one))[0] == 0  # raw_logprobs: temperature 1
        assert alt["head_passes"]["recorded"] == 0, (dtype, alt["head_passes"])
        assert entries_differing(model, dtype, PROMPTS, outputs(alt), ALTERNATIVES)[:2] == (0, 0)
    # raw_logprobs: every row of a step recorded in one pass (not one pass per row)
    assert rerun["head_passes"] == dict(logits=rerun["steps"]["steps"], recorded=rerun["steps"]["steps"])
    assert differing(bf16, "bfloat16", PROMPTS, outputs(rerun))[0] == 0
    assert outputs(rerun) == outputs(sampled16)


@pytest.mark.parametrize("path_kind", ["reload_weights", "extension", "colocated"])
def test_weight_paths_evict_the_prefix_cache(path_kind, models, tmp_path):
    """New weights through vLLM's reload_weights RPC, a worker extension's own method, or a colocated trainer
    calling the in-process engine's model.load_weights, then the same prompts: no stale prefix block (the bits
    are the new weights' trainer's), without reset_prefix_cache()."""
    case = ("llama", "bfloat16")
    other = tiny.save_tiny("llama", "bfloat16", tmp_path / "other", seed=1)
    long_prompts = [p for p in PROMPTS if len(p) > 32]
    runs = [dict(model=models[case], dtype=case[1], batches=[long_prompts, long_prompts],
                 between=[[1, [path_kind, other]]],
                 engine=dict(enable_prefix_caching=True, worker_extension_cls="weight_sync_extension.WeightSyncExtension"))]
    (res,) = run_engines(tmp_path, runs)
    after = outputs(res, 1)
    assert all(o["cached"] == 0 for o in after), [o["cached"] for o in after]
    assert differing(other, case[1], long_prompts, after) == (0, 0)
    if path_kind == "reload_weights":  # negative control: stock vLLM serves blocks computed with the old weights
        (stock,) = run_engines(tmp_path, runs, plugin=False, name="stock")
        assert sum(o["cached"] for o in outputs(stock, 1)) >= 32 * len(long_prompts)


def test_weight_change_while_requests_run_is_refused_and_leaves_the_engine_consistent(models, tmp_path):
    """A weight change while requests run, through each path (from a step hook inside generate's steps: a raw
    ``param.data.copy_`` load, an optimizer step that moves no version counter, a collective into ``p.data``;
    between the steps of a batch driven step by step: ``collective_rpc("reload_weights")``, a new request admitted
    after a raw write): every request that ran across the change is finished with an error the caller sees (generate
    raises; step by step, finish reason "error" with lockstep's stop reason), none goes on; the admitted request
    finishes on the new weights (the front end never waits for it); the next generate of the same prompts reads no
    prefix block of the old weights (0 cached tokens) and gives the new weights' trainer's bits. Without the fix: the
    requests go on (tokens of two weights), the old weights' blocks are served after a refused step or RPC, and the
    request admitted after the write is never run (stuck). One engine, the weights going A -> B -> A -> ..."""
    from hal.integrations.vllm.weights import WEIGHTS_CHANGED
    case = ("llama", "bfloat16")
    a, b = models[case], tiny.save_tiny("llama", "bfloat16", tmp_path / "other", seed=1)
    long_prompts = [p for p in PROMPTS if len(p) > 32]
    changes = [("raw", b), ("optimizer", a), ("reload_weights", b), ("admission", a), ("collective", b)]
    during = [[2 * i + 1, [kind, path], 3] for i, (kind, path) in enumerate(changes)]
    runs = [dict(model=a, dtype=case[1], batches=[long_prompts] * (2 * len(changes) + 1), during=during,
                 engine=dict(enable_prefix_caching=True))]
    (res,) = run_engines(tmp_path, runs)
    assert "error" not in res, res.get("trace", res.get("error"))
    assert differing(a, case[1], long_prompts, outputs(res, 0)) == (0, 0)
    for i, (kind, path) in enumerate(changes):
        mid, after = res["batches"][2 * i + 1], outputs(res, 2 * i + 2)
        assert "stuck" not in mid, (kind, mid)
        if kind in ("raw", "optimizer", "collective"):  # generate itself raises, naming the refusal
            err = mid.get("call_error", {}).get("error", "")
            assert "UnsupportedError" in err and "weights changed while they ran" in err, (kind, mid)
        else:
            ran = [o for o in mid["outputs"] if o["id"].startswith("mid")]
            assert len(ran) == len(long_prompts), (kind, mid)
            assert all(o["finish"] == "error" and o["stop"] == WEIGHTS_CHANGED for o in ran), (kind, ran)
            if kind == "reload_weights":  # the RPC that changed the weights under running requests says so
                assert "UnsupportedError" in mid.get("action_error", {}).get("error", ""), mid
            else:  # the admission never raises; the admitted request runs on the new weights
                assert "action_error" not in mid, mid
                (admitted,) = [o for o in mid["outputs"] if o["id"] == "admitted"]
                assert admitted["finish"] == "length" and admitted["cached"] == 0, admitted
                assert differing(path, case[1], long_prompts[:1], [admitted]) == (0, 0), kind
        # no block of the old weights is read (after "admission", the admitted request's own blocks, computed on the
        # new weights, may be: the bits below say they are the new weights')
        fresh = after[1:] if kind == "admission" else after
        assert all(o["cached"] == 0 for o in fresh), (kind, [o["cached"] for o in after])
        assert differing(path, case[1], long_prompts, after) == (0, 0), kind


_ROTARY_PROGRAM = r"""
import json, sys, torch, hal
from vllm.config import VllmConfig, set_current_vllm_config
from hal.integrations.vllm import layers
with set_current_vllm_config(VllmConfig()):
    rope = layers.LockstepRotaryEmbedding(64, 64, 1024, 10000.0, True, torch.bfloat16)
built, real = [], hal.rotary_cos_sin
def counted(*a, **k):
    built.append(1)
    return real(*a, **k)
hal.rotary_cos_sin = counted
g = torch.Generator().manual_seed(0)
q = torch.randn(8, 4 * 64, generator=g).bfloat16()
k = torch.randn(8, 2 * 64, generator=g).bfloat16()
def fresh(pos):
    cos, sin = real(pos, 64, inv_freq=layers.hf_default_inv_freq(10000.0, 64))
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return [hal.apply_rotary(x.reshape(8, -1, 64), c, s).reshape(x.shape) for x in (q, k)]
def bits(ts):
    return [t.view(torch.int16).tolist() for t in ts]
with torch.inference_mode():
    pos = torch.arange(40, 48)
    first = bits(rope.forward(pos, q, k))
    again = bits(rope.forward(pos.clone(), q, k))  # another layer: equal positions, another tensor
    tables_built = len(built)
    pos += 1  # the engine's next step: its positions buffer rewritten in place
    moved = bits(rope.forward(pos, q, k))
    print(json.dumps(dict(first=first == bits(fresh(torch.arange(40, 48))), again=again == first, built=tables_built,
                          moved=moved == bits(fresh(torch.arange(41, 49))), stale_differs=moved != first,
                          built_after=len(built))))
"""


def test_rotary_tables_are_reused_across_layers_only_for_equal_positions(tmp_path):
    """The plugin's rotary module (one per model in vLLM) keeps the last tables and reuses them when a layer passes
    equal positions: the second layer builds none, its bits the first's. The engine's next step rewrites the
    positions buffer in place: new tables, the fresh computation's bits -- and not the first step's (the control:
    tables kept by the tensor's identity would have returned those)."""
    env = dict(os.environ, LOCKSTEP_VLLM="1")
    proc = subprocess.run([sys.executable, "-c", _ROTARY_PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == dict(first=True, again=True, built=1, moved=True, stale_differs=True, built_after=2), res
