"""examples/rl_mismatch.py (small configuration): the DLC split of a stale-sampler GRPO loop.

lockstep: the engine mismatch e_t = log p_theta_old - log q has zero bits of difference on every
token of every step, and before any update the lag's ESS is the batch size. stock (negative
control): the same loop's e_t bits differ on some tokens.
"""
import pathlib
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package; run from a checkout
    sys.path.insert(0, str(ROOT))

from examples import rl_mismatch as ex  # noqa: E402
from hal.conformance.bits import raw_bits  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402

ARGS = ["--steps", "2", "--prompts", "2", "--group", "2", "--new-tokens", "4"]


@pytest.fixture(scope="module")
def results():
    lt.register()
    args = ex.parser().parse_args(ARGS)
    return {path: ex.run(path, args) for path in ex.PATHS}


def test_lockstep_engine_mismatch_is_zero_bits_on_every_token(results):
    for r in results["lockstep"]:
        assert r["tokens"] == 16 and r["batch"] == 4
        assert bool((raw_bits(r["p_old"]) == raw_bits(r["q"])).all()), f"step {r['step']}"
        assert r["e_bits_differ"] == 0 and r["max_abs_e"] == 0.0 and r["k3_e"] == 0.0


def test_lockstep_first_step_is_on_policy(results):
    first = results["lockstep"][0]
    assert bool((raw_bits(first["p"]) == raw_bits(first["p_old"])).all())  # no update yet: no lag
    assert first["ess_lag"] == first["batch"] and not first["resync"]


def test_stale_sampler_gives_a_lag_after_the_first_update(results):
    # the lag is not vacuous: after one Adam step the trainer's log-probs moved away from the sampler's
    for path in ex.PATHS:
        assert results[path][1]["max_abs_lag"] > 0.0 and results[path][1]["lag_bits_differ"] > 0


def test_stock_negative_control_has_nonzero_engine_mismatch(results):
    stock = results["stock"]
    assert sum(r["e_bits_differ"] for r in stock) > 0
    assert max(r["max_abs_e"] for r in stock) > 0.0


def test_plots_and_npz_written(results, tmp_path):
    import numpy as np
    pngs = ex.plot(results, str(tmp_path))
    assert all(pathlib.Path(p).stat().st_size > 1000 for p in pngs)
    for f in ex.save_npz(results, str(tmp_path)):
        data = np.load(f)
        assert data["sampler"].shape == data["trainer"].shape == (8, 4)
