"""hal/integrations/transformers/mirrored.py: the per-release check that the transformers functions lockstep mirrors
are unchanged from a release the HF tests ran on (issue 51)."""
import re

import pytest

pytest.importorskip("transformers")

import hal  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations._versions import release  # noqa: E402
from hal.integrations.transformers import mirrored  # noqa: E402
from hal.integrations.transformers.mirrored_table import TABLE, TESTED  # noqa: E402

ATTENTION = "models/llama/modeling_llama.py:LlamaAttention.forward"


def _installed_text(path):
    import os
    with open(os.path.join(mirrored.transformers_dir(), path), encoding="utf-8") as f:
        return f.read()


def test_the_table_holds_for_the_installed_release():
    """Every mirrored function of the installed release hashes as its table entry says (CI's main env: 5.25, then
    5.18, 5.19, 5.21 and 5.23 swapped in; the vLLM env: 5.17), and check_version passes on it with no override."""
    import transformers  # (not at module level: transformers 5.25 replaces its sys.modules entry on some imports)
    rel = ".".join(map(str, release(transformers.__version__)))
    assert rel in TABLE, f"transformers {transformers.__version__} has no table entry (regenerate mirrored_table.py)"
    assert mirrored.installed_hashes() == TABLE[rel]["hashes"]
    newest = TABLE[TESTED["model"][-1]]["hashes"]  # defines all but the older releases' engine API
    assert [n for n, h in newest.items() if h == mirrored.MISSING] == sorted(mirrored.OLDER_ONLY)
    assert lt.check_version() == transformers.__version__


def test_every_mirrored_function_is_found_in_a_tested_release():
    assert set(TESTED) == set(mirrored.PARTS)
    for name in mirrored.MIRRORED:
        assert any(TABLE[r]["hashes"][name] != mirrored.MISSING for r in TESTED[mirrored.part_of(name)]), name
    assert {mirrored.part_of(n) for n in mirrored.MIRRORED} == set(mirrored.PARTS)


def test_hash_ignores_docstrings_comments_and_blank_lines_but_not_code():
    path, qualname = ATTENTION.split(":")
    text = _installed_text(path)
    base = mirrored.source_hash(text, qualname)
    head = "    def forward(\n"
    assert text.count(head) >= 1
    cls = text.index("class LlamaAttention")
    at = text.index(head, cls) + len(head)
    commented = text[:at] + "        # a comment\n\n" + text[at:]
    assert mirrored.source_hash(commented, qualname) == base
    body = text.index("    ) -> ", at)
    body = text.index("\n", body) + 1
    changed = text[:body] + "        hidden_states = hidden_states * 1\n" + text[body:]
    assert mirrored.source_hash(changed, qualname) != base  # the negative control: one line of code is caught


def test_a_changed_mirrored_function_is_refused_by_name():
    """The negative control of the whole check: the installed release's hashes with one function's source changed
    are refused, naming the release and that function; the unchanged hashes pass."""
    hashes = mirrored.installed_hashes()
    mirrored.check_sources("5.99.0", "model", hashes)
    engine_tested = not mirrored.differing(hashes, TABLE, TESTED, "engine")
    path, qualname = ATTENTION.split(":")
    text = _installed_text(path)
    at = text.index("\n", text.index("    ) -> ", text.index("class LlamaAttention"))) + 1
    hashes[ATTENTION] = mirrored.source_hash(text[:at] + "        hidden_states = -hidden_states\n" + text[at:],
                                             qualname)
    with pytest.raises(hal.UnsupportedError, match=r"^transformers 5\.99\.0: 1 function\(s\) of its model code "
                                                   r"that lockstep mirrors differ (.|\n)*\n  - models/llama/"
                                                   r"modeling_llama\.py:LlamaAttention\.forward$") as e:
        mirrored.check_sources("5.99.0", "model", hashes)
    assert e.value.reasons == [ATTENTION]
    assert (not mirrored.differing(hashes, TABLE, TESTED, "engine")) == engine_tested  # the engine: checked apart


# per part, the releases of the range whose every mirrored function of that part equals its source in a release
# that part was tested on (docs/integrations.md lists them)
COVERED = {"model": set(TABLE), "engine": set(TABLE)}  # every release 5.17 to 5.25, both parts


@pytest.mark.parametrize("part", mirrored.PARTS)
@pytest.mark.parametrize("rel", sorted(TABLE, key=lambda r: int(r.split(".")[1])))
def test_each_release_of_the_table_is_covered_or_refused_by_name(rel, part):
    names = mirrored.differing(TABLE[rel]["hashes"], TABLE, TESTED, part)
    assert (not names) == (rel in COVERED[part])
    if names:
        with pytest.raises(hal.UnsupportedError, match=rf"^transformers {TABLE[rel]['version']}: {len(names)} "
                                                       rf"function\(s\) (.|\n)*  - {re.escape(names[0])}(\n|$)"):
            mirrored.check_sources(TABLE[rel]["version"], part, TABLE[rel]["hashes"])
    else:
        mirrored.check_sources(TABLE[rel]["version"], part, TABLE[rel]["hashes"])


def test_an_untested_engine_is_refused_by_name_and_a_patched_model_still_runs():
    """On a release whose engine functions were not tested (5.17's with its forward step changed), lt.patch works,
    and building the engine for a patched model is refused with the engine's check's message; an unpatched model's
    engine is HF's own."""
    from hal.integrations.transformers import engine_install
    from hal.integrations.transformers.testing import tiny_model
    mirrored.check_sources("5.17.0", "engine", TABLE["5.17"]["hashes"])  # tested: passes
    step = "generation/continuous_batching/model_runner.py:ModelRunner._forward_process_and_sample"
    refusal = None
    try:
        mirrored.check_sources("5.99.0", "engine", dict(TABLE["5.17"]["hashes"], **{step: "0" * 16}))
    except hal.UnsupportedError as e:
        refusal = e
    assert refusal is not None and "continuous-batching engine" in str(refusal)
    lt.register()

    class Manager:
        def __init__(self, model, *args, **kwargs):
            self.model = model
    engine_install._install_refusal(Manager, refusal)
    model, other = tiny_model("llama"), tiny_model("llama")
    with lt.patch(model):
        with pytest.raises(hal.UnsupportedError, match=r"^transformers 5\.99\.0: .* continuous-batching engine"):
            Manager(model)
        assert Manager(other).model is other


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "6.0.0", "4.57.1"])
def test_a_release_outside_the_range_is_refused_by_name(monkeypatch, version):
    import transformers
    monkeypatch.delenv("LOCKSTEP_HF_ANY_VERSION", raising=False)
    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(hal.UnsupportedError, match=rf"^transformers {version} is not supported by lockstep's "
                                                   r"integration \(tested: >=5\.17,<5\.26\)"):
        lt.check_version()
    assert lt.check_version(allow_untested=True) == version
    monkeypatch.setenv("LOCKSTEP_HF_ANY_VERSION", "1")
    assert lt.check_version() == version


def test_the_override_skips_the_source_check(monkeypatch):
    import transformers
    monkeypatch.delenv("LOCKSTEP_HF_ANY_VERSION", raising=False)
    changed = dict(mirrored.installed_hashes(), **{ATTENTION: "0" * 16})
    monkeypatch.setattr(mirrored, "_installed_hashes_cached", lambda root: changed)
    with pytest.raises(hal.UnsupportedError, match="LlamaAttention.forward"):
        lt.check_version()
    with pytest.raises(hal.UnsupportedError, match="LlamaAttention.forward"):
        lt.register()
    assert lt.check_version(allow_untested=True) == transformers.__version__
    monkeypatch.setenv("LOCKSTEP_HF_ANY_VERSION", "1")
    assert lt.check_version() == transformers.__version__


def test_the_table_regenerates_from_dumps(tmp_path):
    """The tool's round trip: a dump of the installed release written into a table reads back as that table."""
    import json
    import runpy

    import transformers
    dump = tmp_path / "x.json"
    dump.write_text(json.dumps({"version": transformers.__version__, "hashes": mirrored.installed_hashes()}))
    rel = ".".join(map(str, release(transformers.__version__)))
    text = mirrored._write_table([str(dump)], {"model": (rel,), "engine": (rel,)})
    out = tmp_path / "table.py"
    out.write_text(text)
    ns = runpy.run_path(str(out))
    assert ns["TESTED"] == {"model": (rel,), "engine": (rel,)} and ns["TABLE"][rel]["hashes"] == TABLE[rel]["hashes"]


# ---------------------------------------------------------------- the mirror computes the installed release's math
# The source hashes say a release's mirrored functions are ones a test ran on; this says lockstep's forwards compute
# what the installed release's own HF forwards compute, on every architecture: a prompt batch with a left-padded
# row, then one cached decode step (HF's cache contract: the attention's and the Gated DeltaNet's). Not a bit check:
# lockstep's kernels round differently from torch's (float32 logits of magnitude ~3 differ by ~2e-6), so the bound
# sits well above rounding and far below what a wrong mirror gives (the negative controls below: >= 1e-2).

MATH_ATOL = 1e-4
ALL_KINDS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_next", "qwen3_5", "qwen3_5_moe")


def _prompt_and_step_logits(model):
    """Logits at the prompt batch's real tokens and at one cached decode step after it."""
    import torch
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # row 1 left-padded
    nxt = torch.randint(1, 128, (2, 1), generator=g)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                     past_key_values=first.past_key_values, use_cache=True)
    return first.logits[mask.bool()], step.logits


def _gap_to_stock(kind):
    """Largest |patched - stock| logit over the prompt and the decode step (the same weights, stock on sdpa)."""
    from hal.integrations.transformers.testing import tiny_model
    lt.register()
    patched = tiny_model(kind)
    with lt.patch(patched):
        ours = _prompt_and_step_logits(patched)
    theirs = _prompt_and_step_logits(tiny_model(kind, attn_implementation="sdpa"))
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_the_patched_model_computes_the_installed_releases_math(kind):
    assert _gap_to_stock(kind) < MATH_ATOL


def test_negative_control_a_wrong_rotary_or_gdn_mirror_is_caught(monkeypatch):
    """A rotary mirror at twice the frequencies (an inv_freq read wrong; a shift of every position would be
    invisible: attention sees relative positions), and a Gated DeltaNet mirror that misses the cache it is handed
    (what a renamed kwarg would do), are both caught by the bound above."""
    from hal.integrations.transformers import modules as M
    monkeypatch.setitem(lt._FORWARDS, "rotary", lambda mod, x, position_ids: M.rotary(mod, x, 2 * position_ids))
    assert _gap_to_stock("llama") > 100 * MATH_ATOL
    monkeypatch.setitem(lt._FORWARDS, "gdn", lambda mod, hidden_states, cache=None, cache_params=None, **kw:
                        M.gated_delta_net(mod, hidden_states, **kw))
    assert _gap_to_stock("qwen3_5") > 100 * MATH_ATOL
