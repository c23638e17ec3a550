"""The names renamed by issue 22 item 4 ("family" meant both the spec families and the conformance suites)
keep working one release for out-of-tree code: the old name is the very same object as the new one, and
using it warns (DeprecationWarning)."""
from __future__ import annotations

import sys
import warnings

import pytest

import hal.conformance
from hal.conformance import suites

OLD_PACKAGE = "hal.conformance.families"
OLD_MODULE = "hal.conformance.family"


def _forget_old_names():
    for name in [m for m in sys.modules if m in (OLD_PACKAGE, OLD_MODULE) or m.startswith(OLD_PACKAGE + ".")]:
        del sys.modules[name]
    for attr in ("families", "family"):
        if hasattr(hal.conformance, attr):
            delattr(hal.conformance, attr)


@pytest.fixture
def old_package_unimported():
    """A first import of the alias modules (they warn on import), whatever imported them before."""
    _forget_old_names()
    yield
    _forget_old_names()


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_old_suites_package_gives_the_same_module_objects_and_warns_once(old_package_unimported):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import hal.conformance.families.matmul as old_matmul
        import hal.conformance.families.rms_norm  # noqa: F401
        from hal.conformance.families import softmax as old_softmax
        import hal.conformance.families as old
    import hal.conformance.suites.matmul as new_matmul
    import hal.conformance.suites.softmax as new_softmax

    assert old_matmul is new_matmul and old_softmax is new_softmax
    assert sys.modules[f"{OLD_PACKAGE}.rms_norm"] is sys.modules["hal.conformance.suites.rms_norm"]
    for name in suites.names():  # no second copy of any suite module (it would hold its own suite objects)
        assert sys.modules[f"{OLD_PACKAGE}.{name}"] is sys.modules[suites.MODULES[name]], name
        assert getattr(old, name) is sys.modules[suites.MODULES[name]], name
        assert old.get(name) is suites.get(name), name
    assert old.names() == suites.names()
    messages = _deprecations(caught)
    assert len(messages) == 1 and "hal.conformance.suites" in messages[0], messages


def test_old_suite_modules_read_as_family(old_package_unimported):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hal.conformance.families import attention, matmul
    from hal.conformance.families.matmul import FAMILY
    assert FAMILY is matmul.SUITE is suites.get("matmul") and attention.FAMILY is suites.get("attention")


def test_old_protocol_module_is_the_suite_module_and_warns_once(old_package_unimported):
    from hal.conformance import suite
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from hal.conformance.family import DTYPE_NAMES, Case, Family, rowwise_checks
        import hal.conformance.family  # noqa: F401 -- imported already: no second warning
    assert Family is suite.Suite and Case is suite.Case
    assert DTYPE_NAMES is suite.DTYPE_NAMES and rowwise_checks is suite.rowwise_checks
    assert isinstance(suites.get("rms_norm"), Family)
    messages = _deprecations(caught)
    assert len(messages) == 1 and "hal.conformance.suite" in messages[0], messages


def test_case_family_reads_the_suite_name_and_warns():
    case = suites.get("rms_norm").cases()[0]
    with pytest.warns(DeprecationWarning, match="Case.suite"):
        assert case.family == case.suite == "rms_norm"


def test_backend_families_and_the_table_read_as_suites():
    import hal.backend
    ref = hal.get_backend("reference")
    with pytest.warns(DeprecationWarning, match="CONFORMANCE_SUITES"):
        from hal.backend import CONFORMANCE_FAMILIES
    assert CONFORMANCE_FAMILIES is hal.backend.CONFORMANCE_SUITES
    with pytest.warns(DeprecationWarning, match="Backend.suites"):
        assert ref.families == ref.suites and "matmul_exact" in ref.suites
    with pytest.raises(AttributeError):
        hal.backend.NO_SUCH_NAME  # noqa: B018 -- the module __getattr__ answers only the old name


def test_a_backend_written_against_the_old_names_still_claims_its_suites():
    """Out-of-tree code from the previous docs: ``claimed_levels(self, family, spec)`` over ``self.families``."""
    import hal
    from hal.conformance import runner

    class OldStyle(type(hal.get_backend("reference"))):
        name = "old-style"

        def claimed_levels(self, family, spec):
            return frozenset(hal.LEVELS) if family in self.families else frozenset()

    with pytest.warns(DeprecationWarning, match="Backend.suites"):
        assert runner.claims(OldStyle(), "matmul_exact") == frozenset(hal.LEVELS)


# ---------------------------------------------------------------- hf_engine's engine-neutral names (issue 36 item 3)


HF_ENGINE_MOVED = {"EngineBatch": ("hal.serving", "ServingBatch"), "engine_attention": ("hal.serving", "varlen_attention"),
                   **{n: ("hal.sampling", n)
                      for n in ("Sampling", "sampling_scores", "kept_set", "renormalise_kept", "kept_logprobs")}}


@pytest.mark.parametrize("old", sorted(HF_ENGINE_MOVED))
def test_hf_engine_moved_names_are_the_new_objects_and_warn(old):
    import importlib

    from hal.integrations.transformers import engine as hf_engine
    module, new = HF_ENGINE_MOVED[old]
    with pytest.warns(DeprecationWarning, match=f"transformers.engine.{old} is deprecated: use {module}.{new}"):
        obj = getattr(hf_engine, old)
    assert obj is getattr(importlib.import_module(module), new)


def test_hf_engine_gather_paged_is_write_kv_then_request_kv():
    import torch

    from hal.integrations.transformers import engine as hf_engine
    from hal.serving import PagedKV, ServingBatch, request_kv, write_kv
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=g)  # keys / values [blocks, block_size, Hkv, D]
    k_new, v_new = torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g)
    batch = ServingBatch(torch.tensor([0, 1, 2]), torch.tensor([3, 6]), torch.tensor([[5, -1], [1, 0]]),
                         torch.tensor([22, 5]))
    old_cache, new_cache = cache.clone(), cache.clone()
    with pytest.warns(DeprecationWarning, match="gather_paged is deprecated"):
        got = hf_engine.gather_paged(old_cache[0], old_cache[1], k_new, v_new, batch)
    paged = PagedKV(new_cache[0], new_cache[1])
    write_kv(paged, k_new, v_new, batch.slot_mapping)
    want = request_kv(paged, batch)
    assert torch.equal(old_cache.view(torch.int32), new_cache.view(torch.int32))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    assert not torch.equal(new_cache.view(torch.int32), cache.view(torch.int32))  # the write really happened
    with pytest.raises(AttributeError):
        hf_engine.NO_SUCH_NAME  # noqa: B018 -- the module __getattr__ answers only the moved names


# ---------------------------------------------------------------- the layer ops' old home (issue 36 item 4)


@pytest.mark.parametrize("name", ["gdn_gating", "gdn_causal_conv1d"])
def test_gated_delta_rule_layer_ops_are_the_gdn_layer_objects_and_warn(name):
    import hal
    import hal.gated_delta_rule
    import hal.gdn_layer
    with pytest.warns(DeprecationWarning, match=f"hal.gated_delta_rule.{name} is deprecated: use hal.gdn_layer.{name}"):
        obj = getattr(hal.gated_delta_rule, name)
    assert obj is getattr(hal.gdn_layer, name) is getattr(hal, name)
    with pytest.raises(AttributeError):
        hal.gated_delta_rule.NO_SUCH_NAME  # noqa: B018 -- the module __getattr__ answers only the moved names


# ---------------------------------------------------------------- the release that removes them


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _old_name_uses():
    """Each deprecated name, used once: (what, a callable that uses it)."""
    import importlib

    import hal.backend
    case = suites.get("rms_norm").cases()[0]
    ref = hal.get_backend("reference")
    out = [("CONFORMANCE_FAMILIES", lambda: hal.backend.CONFORMANCE_FAMILIES),
           ("Backend.families", lambda: ref.families), ("Case.family", lambda: case.family),
           ("hal.conformance.families", lambda: importlib.import_module(OLD_PACKAGE)),
           ("hal.conformance.family", lambda: importlib.import_module(OLD_MODULE)),
           ("hal.gated_delta_rule.gdn_gating",
            lambda: getattr(importlib.import_module("hal.gated_delta_rule"), "gdn_gating"))]
    out += [(f"hf_engine.{n}", lambda n=n: getattr(importlib.import_module("hal.integrations.transformers.engine"), n))
            for n in (*HF_ENGINE_MOVED, "gather_paged")]
    return out


def test_every_deprecation_warning_states_the_release_that_removes_the_alias(old_package_unimported):
    from hal.deprecation import REMOVED_IN
    for what, use in _old_name_uses():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            use()
        messages = _deprecations(caught)
        assert len(messages) == 1 and f"removed in lockstep {REMOVED_IN}" in messages[0], (what, messages)


def test_the_removal_release_is_still_ahead_of_the_package_version():
    """When the package reaches REMOVED_IN (pyproject.toml's version), this fails until the aliases are removed."""
    import os
    import re

    import hal
    from hal.deprecation import REMOVED_IN
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as fh:
        version = re.search(r'^version = "([0-9.]+)"', fh.read(), re.M).group(1)
    assert version == hal.__version__
    assert _version(REMOVED_IN) > _version(version), (REMOVED_IN, version)
    assert not _version("0.2.0") > _version("0.2.0")  # the comparison itself: equal is not ahead


# ---------------------------------------------------------------- the flat integration modules (issue 47)


HF_MODULES_MOVED = {old: new for old, new in __import__("hal.integrations", fromlist=["MOVED"]).MOVED.items()
                    if old.startswith("hf_")}


def _forget(names):
    import hal.integrations
    for old in names:
        sys.modules.pop(f"hal.integrations.{old}", None)
        hal.integrations.__dict__.pop(old, None)


@pytest.fixture
def old_integration_paths_unimported():
    _forget(HF_MODULES_MOVED)
    yield
    _forget(HF_MODULES_MOVED)


def test_the_flat_layout_is_gone():
    from pathlib import Path

    import hal.integrations
    top = Path(hal.integrations.__file__).parent
    flat = sorted(p.name for p in top.glob("*.py") if p.name.startswith(("hf_", "titan_")))
    assert flat == []
    assert set(hal.integrations.MOVED) >= {"hf_attention", "hf_engine", "hf_engine_install", "hf_matmul", "hf_modules",
                                           "hf_testing", "hf_verify", "titan_modules", "titan_qwen35_modules"}


@pytest.mark.parametrize("old", sorted(HF_MODULES_MOVED))
def test_an_old_integration_path_is_the_new_module_and_warns_once(old, old_integration_paths_unimported):
    import importlib
    new = importlib.import_module(HF_MODULES_MOVED[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_import = importlib.import_module(f"hal.integrations.{old}")
        exec(f"from hal.integrations import {old} as by_from", {}, scope := {})
        again = importlib.import_module(f"hal.integrations.{old}")
    assert by_import is new and scope["by_from"] is new and again is new
    assert sys.modules[f"hal.integrations.{old}"] is new
    messages = _deprecations(caught)
    assert len(messages) == 1 and HF_MODULES_MOVED[old] in messages[0], messages


@pytest.mark.parametrize("how", ["from", "import"])
def test_a_monkeypatch_through_an_old_path_patches_the_real_module(how, old_integration_paths_unimported, monkeypatch):
    import importlib

    from hal.integrations.transformers import engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if how == "from":
            from hal.integrations import hf_engine as old
        else:
            old = importlib.import_module("hal.integrations.hf_engine")
    marker = object()
    monkeypatch.setattr(old, "ModelWeights", marker)
    assert engine.ModelWeights is marker


def test_an_unknown_old_name_is_still_an_attribute_error():
    import hal.integrations
    with pytest.raises(AttributeError, match="hf_nothing"):
        hal.integrations.hf_nothing  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        __import__("hal.integrations.hf_nothing")


def test_the_public_integration_names_stay():
    from hal.integrations import transformers as lt
    from hal.integrations import trl as lt_trl
    assert isinstance(lt_trl.GRPOTrainer, type)
    for name in ("patch", "register", "verify", "audit", "token_logprobs", "apply", "revert", "check_version"):
        assert callable(getattr(lt, name)), name
    import hal.integrations.torchtitan as ltt
    assert callable(ltt.convert) and callable(ltt.check_version)
    from importlib.metadata import entry_points
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("lockstep") == "hal.integrations.vllm:register"
