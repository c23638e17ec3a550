"""hal/integrations/_versions.py: the one version check the transformers, torchtitan and TRL integrations call."""
import pytest

from hal.errors import UnsupportedError
from hal.integrations._versions import check_supported, release

RANGE = ((1, 16), (1, 17))


def test_release_is_major_minor():
    assert release("5.24.0.dev0") == (5, 24) and release("1.16.0rc1") == (1, 16) and release("0.3") == (0, 3)


@pytest.mark.parametrize("version", ["1.16.0", "1.16.9"])
def test_versions_in_range_pass(version):
    assert check_supported("TRL", version, RANGE, "hal.integrations.trl", ": why") == version


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "0.26.0", "2.16.0"])
def test_versions_outside_are_refused_by_name_unless_allowed(version):
    with pytest.raises(UnsupportedError, match=rf"^TRL {version} is not supported by hal.integrations.trl "
                                               r"\(tested: >=1.16,<1.17\): why$"):
        check_supported("TRL", version, RANGE, "hal.integrations.trl", ": why")
    assert check_supported("TRL", version, RANGE, "hal.integrations.trl", ": why", allow_untested=True) == version


EXACT = frozenset({(5, 19), (5, 24)})  # the exact-release form: tested releases, none between


@pytest.mark.parametrize("version", ["5.19.0", "5.19.3", "5.24.0"])
def test_exact_releases_pass(version):
    assert check_supported("transformers", version, EXACT, "x", ": why") == version


@pytest.mark.parametrize("version", ["5.18.0", "5.20.0", "5.23.1", "5.25.0"])
def test_releases_between_exact_ones_are_refused(version):
    with pytest.raises(UnsupportedError, match=rf"^transformers {version} is not supported by x "
                                               r"\(tested: 5.19, 5.24\): why$"):
        check_supported("transformers", version, EXACT, "x", ": why")


def test_transformers_supports_a_range_checked_by_source_hashes():
    """hal.integrations.transformers names a range; which releases in it pass is its source-hash check's
    (tests/test_hf_mirrored.py)."""
    from hal.integrations import transformers as lt
    assert lt.SUPPORTED == ((5, 17), (5, 26))
