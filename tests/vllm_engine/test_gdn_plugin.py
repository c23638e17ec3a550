"""The Gated DeltaNet hybrids (Qwen3.5 text, Qwen3-Next with its MoE) under lockstep's vLLM plugin, on vLLM-CPU's
real engine: recorded log-probs are the lockstep trainer's (transformers 5.19 + ``lt.patch``), bit for bit,
whatever the scheduler does.

Qwen3.5's vLLM model file needs the text-only stand-in for transformers' torchvision image processor
(``LOCKSTEP_VLLM_QWEN3_5_TEXT_ONLY=1``, hal/integrations/vllm/gdn.py), set for every engine subprocess here (stock
engines too: the stand-in computes nothing). Stock vLLM-CPU runs GDN models in bf16 only (its C++ kernels refuse
fp32), so the stock negative controls are bf16.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tiny  # noqa: E402
import tiny_gdn  # noqa: E402
from test_vllm_plugin import ALTERNATIVES, PROMPTS, differing, entries_differing, outputs, run_engines  # noqa: E402

TEXT_ONLY = dict(LOCKSTEP_VLLM_QWEN3_5_TEXT_ONLY="1")
DTYPES = ("float32", "bfloat16")
CASES = [(k, d) for k in tiny_gdn.KINDS for d in DTYPES]
CHUNKED = dict(max_num_batched_tokens=13, max_num_seqs=4)  # cuts every 13 tokens: never a multiple of 64
COMPILED = dict(max_num_batched_tokens=29, max_num_seqs=4, enforce_eager=False)  # vLLM's default mode, cut every 29


def gdn_engines(tmp, runs, **kw):
    return run_engines(tmp, runs, env={**TEXT_ONLY, **kw.pop("env", {})}, **kw)


@pytest.fixture(scope="module")
def gdn_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gdn")
    return {(k, d): tiny_gdn.save_tiny_gdn(k, d, root / f"{k}-{d}") for k, d in CASES}


@pytest.fixture(scope="module")
def lockstep_runs(gdn_models, tmp_path_factory):
    """Per model and dtype, prefills cut beside decode rows: eager (cut every 13 tokens; then the logprobs=N /
    prompt_logprobs batch) and compiled (vLLM's default mode, a fresh compile cache; cut every 29), one process
    building the eight engines in a row. Whole prefills run in the sampling and prefix-caching tests below."""
    tmp = tmp_path_factory.mktemp("gdn_on")
    runs = []
    for c in CASES:
        runs.append(dict(model=gdn_models[c], dtype=c[1], batches=[PROMPTS, PROMPTS], sampling=[None, ALTERNATIVES],
                         engine=CHUNKED, record_steps=True))
        runs.append(dict(model=gdn_models[c], dtype=c[1], batches=[PROMPTS], engine=COMPILED, record_steps=True))
    res = gdn_engines(tmp, runs)
    return {c: dict(eager=res[2 * i], compiled=res[2 * i + 1]) for i, c in enumerate(CASES)}


def compiled_graphs(run) -> int:
    """How many graphs vLLM's compiler built for the engine (engine_run.py's counters)."""
    compiles = run.get("compiles", {})
    return compiles.get("num_aot_compiles", 0) + compiles.get("num_inductor_compiles", 0)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_greedy_equals_trainer_at_any_cut_eager_and_compiled(case, gdn_models, lockstep_runs):
    (kind, dtype), path, runs = case, gdn_models[case], lockstep_runs[case]
    for name in ("eager", "compiled"):
        steps = runs[name].get("steps", runs[name].get("error"))
        print(f"{kind} {dtype} {name}: {steps}, compiles {runs[name].get('compiles')}")
        assert steps["max_prefill_steps"] >= 3 and steps["mixed_steps"] >= 1, (name, steps)  # the hard steps happened
        lp, tok = differing(path, dtype, PROMPTS, outputs(runs[name]))
        assert (lp, tok) == (0, 0), f"{kind} {dtype} {name}: {lp}/48 log-prob bits, {tok}/48 tokens differ"
    assert compiled_graphs(runs["eager"]) == 0 and compiled_graphs(runs["compiled"]) >= 1, \
        (runs["eager"]["compiles"], runs["compiled"]["compiles"])


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_alternatives_and_prompt_logprobs_equal_the_trainers(case, gdn_models, lockstep_runs):
    """logprobs=N and prompt_logprobs (test_vllm_plugin's ALTERNATIVES: greedy and seeded rows) with prompts cut every
    13 tokens: every prompt position's hidden row comes out of a GDN prefill chunk; ids, order, bits and ranks are
    the trainer's."""
    outs = outputs(lockstep_runs[case]["eager"], 1)
    wrong, values, compared = entries_differing(gdn_models[case], case[1], PROMPTS, outs, ALTERNATIVES)
    assert (wrong, values) == (0, 0) and compared > 500, (wrong, values, compared)


def test_opaque_norm_keeps_the_bf16_residual_rounding_under_inductor():
    """Why the (1 + w) norm with its residual is one opaque op: compiled with Inductor, the same Python inline
    (add, then the float32 upcast the norm needs) feeds the unrounded float32 sum to the norm (the negative control:
    caught), while the op gives eager's raw bits for both outputs."""
    import torch

    from hal.integrations.vllm.gdn import _one_plus_norm, _register_ops
    _register_ops()
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(64, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    w = (0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    eps = 1e-6
    y, h = _one_plus_norm(x, r, w, eps)
    torch._dynamo.reset()
    y_op, h_op = torch.compile(lambda *a: torch.ops.lockstep.vllm_one_plus_rms_norm_residual(*a, eps),
                               backend="inductor", fullgraph=True)(x, r, w)
    y_inline, _ = torch.compile(lambda *a: _one_plus_norm(*a, eps), backend="inductor", fullgraph=True)(x, r, w)
    as_int = (lambda t: t.view(torch.int16))
    assert torch.equal(as_int(y_op), as_int(y)) and torch.equal(as_int(h_op), as_int(h))
    moved = (as_int(y_inline) != as_int(y)).any(-1).sum().item()
    print(f"inline norm under Inductor: {moved}/64 rows differ from eager")
    assert moved >= 8, moved


@pytest.mark.parametrize("kind", tiny_gdn.KINDS)
def test_stock_vllm_scheduler_dependence_negative_control(kind, gdn_models, tmp_path):
    """Plugin off (bf16: stock's only GDN dtype on CPU): the same comparisons catch stock vLLM -- its recorded
    log-probs differ from the trainer's, and change when the prefill is cut differently."""
    d = "bfloat16"
    path = gdn_models[(kind, d)]
    runs = [dict(model=path, dtype=d, batches=[PROMPTS]), dict(model=path, dtype=d, batches=[PROMPTS], engine=CHUNKED)]
    whole, chunked = (outputs(r) for r in gdn_engines(tmp_path, runs, plugin=False, name="stock"))
    vs_trainer, _ = differing(path, d, PROMPTS, whole)
    moved = sum(ta != tb or ba != bb for a, b in zip(whole, chunked)
                for ta, tb, ba, bb in zip(a["tokens"], b["tokens"], a["bits"], b["bits"]))
    print(f"stock vLLM {kind} bf16: {vs_trainer}/48 differ from the trainer; {moved}/48 moved by chunked prefill")
    assert vs_trainer >= 24, vs_trainer
    assert moved >= 8, moved


@pytest.mark.parametrize("kind", tiny_gdn.KINDS)
def test_preemption_and_sampling(kind, gdn_models, tmp_path):
    """Preemption with prefills cut every 13 tokens (recomputed requests: their GDN states dropped and rebuilt from
    token 0; a small-state model so that vLLM's hybrid blocks are small enough to run out), eager, and seeded
    top-k/top-p sampling in compiled mode (processed log-probs == lt.token_logprobs with the same settings): every bit
    the trainer's. (Seeded sampling with chunked prefill, which kills stock vLLM-CPU -- its runner rewinds a seeded
    generator with ``set_offset`` -- is tested on the dense models: test_vllm_plugin's seeded test.)"""
    d = "bfloat16"
    path = gdn_models[(kind, d)]
    small = tiny_gdn.save_tiny_gdn(kind, d, tmp_path / "small_state", small_state=True)
    short = [PROMPTS[1][i:i + 30] for i in range(6)]
    params = [dict(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, logprobs=0)
              for i in range(len(PROMPTS))]
    runs = [dict(model=small, dtype=d, batches=[short], record_steps=True,
                 engine=dict(num_gpu_blocks_override=8, max_model_len=128, max_num_batched_tokens=13)),
            dict(model=path, dtype=d, batches=[PROMPTS], sampling=[params],
                 engine=dict(logprobs_mode="processed_logprobs", enforce_eager=False))]
    preempted, sampled = gdn_engines(tmp_path, runs)
    steps = preempted.get("steps", preempted.get("error"))
    assert steps["preempted"] >= 1 and steps["max_prefill_steps"] >= 3, steps  # preempted, prefills cut at 13
    assert differing(small, d, short, outputs(preempted)) == (0, 0)
    assert differing(path, d, PROMPTS, outputs(sampled), temperature=0.8, top_k=20, top_p=0.9)[0] == 0
    assert compiled_graphs(sampled) >= 1, sampled["compiles"]


def test_prefix_caching_policy_and_refusals(gdn_models, tmp_path):
    """vLLM 0.32 turns prefix caching on by default for hybrids: left at the default, lockstep switches it off
    (no cached tokens on a repeated 64-token prefix, the bits still the trainer's); asked for explicitly, the
    engine is refused naming it. The multimodal Qwen3.5 class is refused by name."""
    d = "float32"
    path = gdn_models[("qwen3_5", d)]
    mm = tmp_path / "multimodal"
    mm.mkdir()
    for f in Path(path).iterdir():
        (mm / f.name).symlink_to(f)
    (mm / "config.json").unlink()
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    (mm / "config.json").write_text(json.dumps(cfg))
    shared = PROMPTS[1][:64]
    hit = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    runs = [dict(model=path, dtype=d, batches=[hit[:1], hit[1:]]),
            dict(model=path, dtype=d, batches=[], engine=dict(enable_prefix_caching=True)),
            dict(model=str(mm), dtype=d, batches=[])]
    default, explicit, multimodal = gdn_engines(tmp_path, runs)
    assert outputs(default, 1)[0]["cached"] == 0
    assert differing(path, d, hit[1:], outputs(default, 1)) == (0, 0)
    assert "UnsupportedError" in explicit.get("error", "") and "enable_prefix_caching=True" in explicit["error"]
    assert "Qwen3_5ForConditionalGeneration" in multimodal.get("error", ""), multimodal


def test_text_only_stand_in_serves_no_vision():
    """The stand-in gives qwen3_vl.py its ``smart_resize`` (transformers' PIL geometry) and nothing else."""
    import subprocess
    code = ("from hal.integrations.vllm.gdn import install_text_only_stand_in as i; assert i()\n"
            "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n"
            "assert smart_resize(56, 56) == (56, 56)\n"
            "try:\n from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
            "except ImportError as e:\n print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "torchvision is not installed" in out.stdout, out.stdout


def test_checkpoint_saved_in_another_dtype_than_the_engine_runs(tmp_path):
    """A checkpoint stored in another dtype than the engine runs, every covered architecture: float32 checkpoints
    served in bfloat16 (RL trainers' float32 master weights) and bfloat16 ones served in float32, each against the
    lt.patch trainer loaded the way a user loads it (``from_pretrained(checkpoint, dtype=<engine dtype>)``: every
    parameter rounded to the model dtype); then a float32 sync (``reload_weights``) into the bf16 Qwen3.5 engine.
    vLLM creates the GDN layers' ``A_log`` in float32 whatever the model dtype: without lockstep's rounding through
    the model dtype, the float32 checkpoints' hybrids record other log-probs than the trainer on most tokens."""
    prompts = PROMPTS[:3]
    cases = [(k, ckpt, run) for k in tiny.KINDS + tiny_gdn.KINDS for ckpt, run in (("float32", "bfloat16"),
                                                                                    ("bfloat16", "float32"))]

    def save(kind, dtype, path, seed=0):
        return (tiny.save_tiny if kind in tiny.KINDS else tiny_gdn.save_tiny_gdn)(kind, dtype, path, seed=seed)

    paths = {c: save(c[0], c[1], tmp_path / "-".join(c)) for c in cases}
    synced = save("qwen3_5", "float32", tmp_path / "qwen3_5-sync", seed=1)
    runs = [dict(model=paths[c], dtype=c[2], batches=[prompts] * (2 if c == ("qwen3_5", "float32", "bfloat16") else 1))
            for c in cases]
    runs[cases.index(("qwen3_5", "float32", "bfloat16"))]["between"] = [[1, ["reload_weights", synced]]]
    results = gdn_engines(tmp_path, runs)
    wrong = {}
    for c, res in zip(cases, results):
        wrong[c] = differing(paths[c], c[2], prompts, outputs(res))
        if c == ("qwen3_5", "float32", "bfloat16"):
            wrong["float32 sync into bfloat16"] = differing(synced, c[2], prompts, outputs(res, 1))
    print(wrong)
    assert all(v == (0, 0) for v in wrong.values()), wrong
