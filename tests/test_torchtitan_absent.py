"""hal.integrations.torchtitan imports without torchtitan and says clearly what is missing (the main test
environment has no torchtitan: its parity tests run in tests/titan, in .ci/run's second environment)."""
import importlib.util

import pytest

import hal
from hal.integrations import torchtitan as ltt


def test_missing_torchtitan_is_a_clear_error():
    if importlib.util.find_spec("torchtitan") is not None:
        assert ltt.check_version().startswith("0.3")
        return
    with pytest.raises(hal.UnsupportedError, match=r"torchtitan is not installed: pip install 'lockstep\[torchtitan\]'"):
        ltt.check_version()
    with pytest.raises(hal.UnsupportedError, match="torchtitan is not installed"):
        ltt.convert(object())
