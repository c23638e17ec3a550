"""Issue 47: the TorchTitan integration is one folder (hal/integrations/torchtitan/); the flat module paths before it
keep working one release as the very same module objects, with a DeprecationWarning."""
import importlib
import sys
import warnings

import pytest

import hal.integrations

TITAN_MOVED = {old: new for old, new in hal.integrations.MOVED.items() if old.startswith("titan_")}


@pytest.mark.parametrize("old", sorted(TITAN_MOVED))
def test_an_old_torchtitan_path_is_the_new_module_and_warns(old):
    sys.modules.pop(f"hal.integrations.{old}", None)
    hal.integrations.__dict__.pop(old, None)
    new = importlib.import_module(TITAN_MOVED[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"hal.integrations.{old}")
    assert module is new and sys.modules[f"hal.integrations.{old}"] is new
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1 and TITAN_MOVED[old] in messages[0], messages


def test_the_converter_keeps_its_public_path():

    from hal.integrations import torchtitan as ltt
    assert ltt.LockstepConverter.__module__ == "hal.integrations.torchtitan"
