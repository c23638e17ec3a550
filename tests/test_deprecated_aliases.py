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


def _forget_old_package():
    for name in [m for m in sys.modules if m == OLD_PACKAGE or m.startswith(OLD_PACKAGE + ".")]:
        del sys.modules[name]
    if hasattr(hal.conformance, "families"):
        delattr(hal.conformance, "families")


@pytest.fixture
def old_package_unimported():
    """A first import of the alias package (it warns on import), whatever imported it before."""
    _forget_old_package()
    yield
    _forget_old_package()


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
