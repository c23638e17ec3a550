"""tests/titan run in their own virtual environment (.ci/run builds .venv-titan: TorchTitan 0.3 needs datasets<4.8,
the main test extra's TRL needs datasets 5.x). The main run does not collect them; in the titan run
(LOCKSTEP_TITAN_TESTS=1, set by .ci/run) a missing torchtitan is an error, never a skip."""
import importlib.util
import os

if importlib.util.find_spec("torchtitan") is None:
    if os.environ.get("LOCKSTEP_TITAN_TESTS") == "1":
        raise RuntimeError("LOCKSTEP_TITAN_TESTS=1 but torchtitan is not importable: install '.[test,torchtitan]'")
    collect_ignore_glob = ["test_*.py"]
