"""hal.integrations.trl: TRL 1.16's GRPOTrainer keeps the continuous-batching engine's log-probs.

A two-step GRPO run on CPU (tiny Llama saved locally, word-level tokenizer, in-memory dataset, toy
reward, beta > 0 so TRL runs its reference model; examples/trl_grpo.py builds them):

* stock: the engine's log-probs reach TRL's importance-sampling correction and metrics
  (``sampling/*`` recomputed here from the kept pair, exactly), hal.rl's metrics are logged every
  step, and the sampler/trainer bits differ (the caught negative control); plain ``trl.GRPOTrainer``
  logs no ``sampling/*`` metric at all (what the hook fixes);
* lockstep: zero bits differ on every token of every step, TRL's logp difference is 0 and its IS
  ratio exactly 1 -- runs once hal.integrations.transformers.ENGINE_SUPPORTED says the engine runs on
  lockstep (skipped, not passed, before);
* the trainer's lockstep log-probs of TRL's padded rows equal each request's alone, bit for bit
  (positions per request; TRL's default positions as the negative control);
* refusals: other TRL versions, a sampler configuration whose log-probs would differ by construction.
"""
import pathlib
import sys

import pytest

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package; run from a checkout
    sys.path.insert(0, str(ROOT))

from examples import trl_grpo as ex  # noqa: E402
from hal import rl  # noqa: E402
from hal.conformance.bits import raw_bits  # noqa: E402
from hal.errors import InputError, UnsupportedError  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations import trl as lt_trl  # noqa: E402
from hal.integrations.transformers.modules import patch_owner  # noqa: E402
from hal.integrations.transformers.testing import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--steps", "2", "--batch", "4", "--group", "2", "--new-tokens", "6", "--temperature", "0.9"]
needs_engine = pytest.mark.skipif(not lt_trl.engine_supports_lockstep(),
                                  reason="transformers' continuous-batching engine does not run on lockstep in this "
                                         "build (no hal.integrations.transformers.engine, ENGINE_SUPPORTED unset)")


def _args(extra=()):
    return ex.parser().parse_args(ARGS + list(extra))


@pytest.fixture(scope="module")
def stock():
    return ex.run("stock", _args())


def _logs(result):
    return [h for h in result["history"] if "loss" in h and "reward" in h]


def test_hook_keeps_the_engine_logprobs_and_trl_uses_them(stock):
    recs, logs = stock["records"], _logs(stock)
    assert stock["ref_model"] and len(recs) == 2 and len(logs) == 2
    for rec, log in zip(recs, logs):
        q, p, mask = rec["sampler"], rec["trainer"], rec["mask"]
        assert q.dtype == p.dtype == torch.float32 and q.shape == p.shape == mask.shape and q.shape[0] == 4
        assert bool(mask.any()) and bool(torch.isfinite(q[mask]).all()) and bool((q[mask] <= 0).all())
        # TRL's own metrics are computed from the kept pair: recompute them exactly (float32, as TRL does)
        delta = (p - q).abs()[mask]
        assert log["sampling/sampling_logp_difference/max"] == float(delta.max())
        assert log["sampling/sampling_logp_difference/mean"] == float(delta.mean())
        # default vllm_importance_sampling_mode="sequence_mask": exp(sum of the row's differences), 0 outside [-, 3]
        ratio = torch.exp(((p - q) * mask).sum(-1, keepdim=True))
        ratio = ratio.masked_fill(ratio > 3.0, 0.0)
        assert torch.equal(rec["is_ratio"], ratio)
        assert log["sampling/importance_sampling_ratio/min"] == float(ratio.min())
        assert log["sampling/importance_sampling_ratio/max"] == float(ratio.max())
        # hal.rl's metrics of the same pair, logged every step
        m = rl.mismatch_metrics(p, q, mask=mask)
        for name in lt_trl.METRICS:
            assert log[f"lockstep/{name}"] == getattr(m, name), name
        assert log["lockstep/tokens"] == int(mask.sum())
        assert log["lockstep/bits_differ"] == int(((raw_bits(p) != raw_bits(q)) & mask).sum())
    assert logs[1]["kl"] > 0  # beta > 0: TRL ran its reference model, and the policy moved after step 0


def test_stock_sampler_and_trainer_bits_differ(stock):
    """The negative control: stock engine vs TRL's trainer at the same weights differ on raw bits."""
    differ = sum(int(((raw_bits(r["trainer"]) != raw_bits(r["sampler"])) & r["mask"]).sum()) for r in stock["records"])
    assert differ > 0
    assert max(h["sampling/sampling_logp_difference/max"] for h in _logs(stock)) > 0


def test_plain_trl_drops_the_engine_logprobs():
    """Without the hook TRL computes no sampler/trainer pair in this mode (what hal.integrations.trl fixes)."""
    import os
    import tempfile
    args = _args(["--steps", "1"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ex.save_tiny_model("stock", os.path.join(tmp, "model"), args.seed)
        t = trl.GRPOTrainer(model=model_dir, args=ex.grpo_config(os.path.join(tmp, "out"), args),
                            processing_class=ex.make_tokenizer(), reward_funcs=ex.reward_even_share,
                            train_dataset=ex.make_dataset(16, args.seed))
        t.train()
    logged = {k for h in t.state.log_history for k in h}
    assert "loss" in logged and not any(k.startswith("sampling/") for k in logged)


@needs_engine
def test_lockstep_sampler_equals_trainer_on_every_token_of_every_step():
    res = ex.run("lockstep", _args())
    assert len(res["records"]) == 2
    for rec, log in zip(res["records"], _logs(res)):
        mask = rec["mask"]
        assert torch.equal(raw_bits(rec["trainer"])[mask], raw_bits(rec["sampler"])[mask]), f"step {rec['step']}"
        assert log["sampling/sampling_logp_difference/max"] == 0.0 and log["lockstep/share_bits_differ"] == 0.0
        assert log["sampling/importance_sampling_ratio/min"] == log["sampling/importance_sampling_ratio/max"] == 1.0
        assert log["lockstep/ess_sequences"] == 4.0


def _padded_rows(seed=0):
    """TRL's trainer rows: left-padded prompts + right-padded completions, mask; prompt lengths differ."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 128, (n,), generator=g) for n in (3, 7, 5)]
    comps = [torch.randint(2, 128, (n,), generator=g) for n in (4, 2, 4)]
    P, C = max(map(len, prompts)), max(map(len, comps))
    ids = torch.zeros(3, P + C, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, (pr, c) in enumerate(zip(prompts, comps)):
        ids[b, P - len(pr):P], am[b, P - len(pr):P] = pr, 1
        ids[b, P:P + len(c)], am[b, P:P + len(c)] = c, 1
    return prompts, comps, ids, am, C


def test_lockstep_trainer_logprobs_of_padded_rows_equal_each_request_alone():
    lt.register()
    model = tiny_model("llama")
    prompts, comps, ids, am, C = _padded_rows()
    with lt.patch(model), torch.no_grad():
        lp, ent = lt_trl.teacher_forced_logprobs(model, ids, am, C, temperature=0.9, compute_entropy=True)
        assert lp.dtype == torch.float32 and lp.shape == ent.shape == (3, C)
        for b, (pr, c) in enumerate(zip(prompts, comps)):
            h = model.base_model(input_ids=torch.cat([pr, c])[None], use_cache=False).last_hidden_state
            alone = lt.token_logprobs(model, h[:, len(pr) - 1:-1], c[None], temperature=0.9)[0]
            assert torch.equal(raw_bits(alone), raw_bits(lp[b, :len(c)])), f"request {b}"
        # negative control: TRL's default positions (0 .. L-1 over the padded row) move a padded prompt's bits
        h = model.base_model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        shifted = lt.token_logprobs(model, h[:, -C - 1:-1], ids[:, -C:], temperature=0.9)
        assert not torch.equal(raw_bits(shifted[0, :4]), raw_bits(lp[0, :4]))


def test_lockstep_trainer_patches_policy_and_reference_model(tmp_path):
    lt.register()
    args = _args()
    model_dir = ex.save_tiny_model("lockstep", str(tmp_path / "model"), args.seed)
    t = lt_trl.GRPOTrainer(model=model_dir, args=ex.grpo_config(str(tmp_path / "out"), args),
                           processing_class=ex.make_tokenizer(), reward_funcs=ex.reward_even_share,
                           train_dataset=ex.make_dataset(8, 0), lockstep=True)
    try:
        assert patch_owner(t.model) is not None and patch_owner(t.ref_model) is not None
        assert t.args.transformers_continuous_batching_config["return_logprobs"] is True
        # a wrapper around the patched policy (PEFT-like) would be scored with TRL's stock log-probs: refused
        wrapper = torch.nn.Module()
        wrapper.inner = t.model
        ids = torch.randint(2, 128, (2, 6))
        with pytest.raises(UnsupportedError, match="wraps a lockstep-patched model"):
            t._get_per_token_logps_and_entropies(wrapper, ids, torch.ones_like(ids), 3)
    finally:
        t.revert_patches()
    assert patch_owner(t.model) is None and patch_owner(t.ref_model) is None


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "0.26.0"])
def test_other_trl_versions_are_refused_by_name(monkeypatch, version, tmp_path):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(UnsupportedError, match=f"TRL {version} is not supported"):
        lt_trl.check_version()
    with pytest.raises(UnsupportedError, match=f"TRL {version}"):
        lt_trl.GRPOTrainer(model="unused", args=ex.grpo_config(str(tmp_path), _args()))
    assert lt_trl.check_version(allow_untested=True) == version


@pytest.mark.parametrize("field, value, match", [
    ("use_transformers_continuous_batching", False, "use_transformers_continuous_batching=True"),
    ("top_k", 5, "top_k=5"), ("top_p", 0.9, "top_p=0.9"), ("min_p", 0.1, "min_p=0.1"),
    ("repetition_penalty", 1.1, "repetition_penalty=1.1"), ("generation_kwargs", {"top_k": 3}, "generation_kwargs"),
    ("vllm_importance_sampling_correction", False, "vllm_importance_sampling_correction=False"),
    ("transformers_continuous_batching_config", {"return_logprobs": False}, "return_logprobs=False"),
])
def test_configurations_whose_logprobs_would_differ_are_refused(tmp_path, field, value, match):
    cfg = ex.grpo_config(str(tmp_path), _args())
    before = dict(cfg.transformers_continuous_batching_config or {})
    setattr(cfg, field, value)
    with pytest.raises(InputError, match=match):
        lt_trl.GRPOTrainer(model="unused", args=cfg)
    # nothing changed: the engine's configuration is as it was
    assert cfg.transformers_continuous_batching_config == (value if field == "transformers_continuous_batching_config"
                                                           else before)
