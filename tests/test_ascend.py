"""The ascend backend without an NPU: registration, selection, lazy imports, every "unavailable"
reason, and its kernel variant in the Triton interpreter against the reference bits.

Interpreter runs (subprocesses, TRITON_INTERPRET=1):
* the NPU substitutes (division, sqrt, fp16 rounding, log through the substituted division) over
  the strict-math inputs, launched on the plain Triton path with NPU=True (tests/scripts/triton_math_check.py
  --npu), with a negative control (the seed without the exact correction);
* the Ascend variant with its NPU tiles (more work items than the 3 fake cores, so every program
  loops), tests/scripts/ascend_variant_check.py, with a negative control (one work item left out);
* the conformance quick set per suite through `hal conformance run --backend ascend --device cpu`.

* attention and the gated delta rule on the Ascend variant (one short case each, NPU block sizes) with
  a negative control (the last work item of each persistent launch dropped), tests/scripts/triton_seq_check.py
  --ascend.

CI runs the quick sets of rms_norm and softmax (the suites using the division / sqrt / log
substitutes); LOCKSTEP_FULL=1 adds matmul, token_logprobs, attention, gated_delta_rule and gdn_layer
(their Ascend variant is also covered by the two scripts above). Full run of every conformance case (slow):
    TRITON_INTERPRET=1 python -m hal.cli conformance run --backend ascend --device cpu \
        --ops matmul rms_norm softmax token_logprobs attention gated_delta_rule gdn_layer
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import hal
from hal.backends import ascend
from hal.spec import DEFAULTS

from _triton_seq_run import ROOT, interpreter_env, interpreter_ok, needs_interpreter, run_quick_conformance

NPU = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only once torch_npu is imported


# ---- registration, selection, lazy import ----------------------------------------------------------

def test_importing_hal_and_the_backend_imports_neither_torch_npu_nor_triton():
    code = ("import sys, hal, hal.backends.ascend; b = hal.get_backend('ascend'); why = b.unavailable_reason(); "
            "b.ops(); hal.info() if hasattr(hal, 'info') else None; "
            "print(sorted(m for m in ('torch_npu', 'triton') if m in sys.modules)); print(why)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr
    mods, why = r.stdout.strip().split("\n")[:2]
    assert mods == "[]", r.stdout
    assert why  # this machine has no NPU: some reason is given


def test_registered_claims_the_triton_suites():
    b = hal.get_backend("ascend")
    assert b.device_types == ("npu",)
    for suite in ("matmul", "rms_norm", "softmax", "token_logprobs", "elementwise", "rotary", "attention",
                  "gated_delta_rule", "gdn_layer"):  # gdn_layer cases run under the gated delta rule's spec
        spec = DEFAULTS["gated_delta_rule" if suite == "gdn_layer" else suite]
        assert b.claimed_levels(suite, spec) == frozenset(hal.LEVELS)
    assert set(b.ops()) >= {"matmul", "linear", "rms_norm", "softmax", "log_softmax", "logsumexp", "token_logprobs",
                            "flash_attn_varlen_func", "flash_attn_with_kvcache", "chunk_gated_delta_rule",
                            "fused_recurrent_gated_delta_rule", "gdn_gating", "gdn_causal_conv1d"}


def test_chosen_for_npu_tensors_when_available(monkeypatch):
    monkeypatch.setattr(ascend.AscendBackend, "unavailable_reason", lambda self: None)
    for fam, op in (("matmul", "matmul"), ("softmax", "softmax"), ("token_logprobs", "token_logprobs"),
                    ("attention", "flash_attn_varlen_func"), ("gated_delta_rule", "chunk_gated_delta_rule")):
        assert hal.select(op, DEFAULTS[fam], torch.bfloat16, NPU).name == "ascend"


def test_npu_without_the_backend_says_why(monkeypatch):
    monkeypatch.setattr(ascend.AscendBackend, "unavailable_reason", lambda self: "no Ascend NPU device (test)")
    with pytest.raises(hal.UnsupportedError) as exc:
        hal.select("matmul", DEFAULTS["matmul"], torch.float32, NPU)
    assert "no Ascend NPU device (test)" in str(exc.value)


def test_never_chosen_automatically_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ascend.AscendBackend, "unavailable_reason", lambda self: None)
    assert hal.select("softmax", DEFAULTS["softmax"], torch.float32, torch.device("cpu")).name != "ascend"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # outside the interpreter not even by name
    with pytest.raises(hal.UnsupportedError, match="serves devices"):
        hal.select("softmax", DEFAULTS["softmax"], torch.float32, torch.device("cpu"), backend="ascend")


# ---- every unavailable reason ---------------------------------------------------------------------

@pytest.fixture
def npu_machine(monkeypatch, tmp_path):
    """A simulated machine where everything is in place; each test removes one piece."""
    real_find_spec = ascend.importlib.util.find_spec
    state = types.SimpleNamespace(torch_npu=True)
    monkeypatch.setattr(ascend.importlib.util, "find_spec",
                        lambda name, *a: (object() if state.torch_npu else None) if name == "torch_npu"
                        else real_find_spec(name, *a))
    cann = tmp_path / "ascend-toolkit" / "latest"
    cann.mkdir(parents=True)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(cann))
    monkeypatch.setattr(ascend, "triton_owners", lambda: ["triton-ascend"])
    (tmp_path / "davinci0").write_text("")
    monkeypatch.setattr(ascend, "DEVICE_GLOB", str(tmp_path / "davinci[0-9]*"))
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    state.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
    monkeypatch.setattr(torch, "npu", state.npu, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    state.tmp = tmp_path
    return state


def _reason():
    return hal.get_backend("ascend").unavailable_reason()


def test_all_in_place_is_available(npu_machine):
    assert _reason() is None


def test_reason_no_torch_npu(npu_machine):
    npu_machine.torch_npu = False
    assert "torch_npu is not installed" in _reason()


def test_reason_no_cann(npu_machine, monkeypatch):
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    why = _reason()
    assert "CANN toolkit not found" in why and "set_env.sh" in why and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in why
    monkeypatch.setenv("ASCEND_HOME_PATH", str(npu_machine.tmp / "missing"))
    assert "CANN toolkit not found" in _reason()


def test_reason_community_triton_shadows_triton_ascend(npu_machine, monkeypatch):
    monkeypatch.setattr(ascend, "triton_owners", lambda: ["triton"])
    assert "community triton" in _reason() and "pip install triton-ascend" in _reason()
    monkeypatch.setattr(ascend, "triton_owners", lambda: ["triton", "triton-ascend"])
    assert "both community triton and triton-ascend" in _reason()
    monkeypatch.setattr(ascend, "triton_owners", lambda: [])
    assert "triton-ascend is not installed" in _reason()


def test_reason_no_device_and_torch_npu_not_imported(npu_machine, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(ascend, "DEVICE_GLOB", str(npu_machine.tmp / "nothing[0-9]*"))
    assert "no Ascend NPU device" in _reason()
    assert "torch_npu" not in sys.modules  # never imported without a device


def test_reason_torch_npu_import_fails(npu_machine, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    assert "import torch_npu failed" in _reason()


def test_reason_torch_npu_sees_no_device(npu_machine):
    npu_machine.npu.is_available = lambda: False
    assert "torch_npu sees no NPU" in _reason()


def test_reason_in_the_interpreter():
    # TRITON_INTERPRET only takes effect for kernels created after it is set: a fresh process
    code = "import hal; print(repr(hal.get_backend('ascend').unavailable_reason()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr
    why = r.stdout.strip()
    assert why == "None" if interpreter_ok() else "triton" in why, why


def test_triton_owner_detection_reads_distribution_metadata():
    owners = ascend.triton_owners()
    if interpreter_ok():
        assert "triton" in owners  # this venv: community triton


def test_cli_device_npu_fails_cleanly_without_an_npu(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hal.cli", "conformance", "run", "--backend", "ascend", "--device",
                        "npu", "--ops", "softmax", "--json", str(tmp_path / "r.json")],
                       cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert r.returncode == 2 and "--device npu: ascend:" in r.stderr, r.stderr


# ---- the kernel variant in the interpreter ----------------------------------------------------------

def test_persistent_grid_is_capped_only_in_the_variant():
    from hal.kernels.triton import ascend_launch
    assert ascend_launch.persistent_grid(100) == 100
    with ascend_launch.variant("cpu"):
        assert ascend_launch.persistent_grid(100) == ascend_launch.INTERPRETER_CORES
        assert ascend_launch.persistent_grid(2) == 2
    assert not ascend_launch.active()


@needs_interpreter
def test_npu_substitutes_match_reference_bits():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "triton_math_check.py"), "--npu"], cwd=ROOT,
                       env=interpreter_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if " inputs, " in ln}
    for name in ("log", "log(|x|)", "div", "div(subnormal results)", "sqrt", "fp16"):
        assert lines[name].endswith(" 0 differ"), lines[name]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "triton_math_check.py"), "--npu", "--variant",
                        "div_seed"], cwd=ROOT, env=interpreter_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and int(r.stdout.split(" inputs, ")[1].split()[0]) > 0, r.stdout + r.stderr


@needs_interpreter
def test_variant_with_npu_tiles_and_persistent_loops_gives_reference_bits():
    script = os.path.join(ROOT, "tests", "scripts", "ascend_variant_check.py")
    r = subprocess.run([sys.executable, script], cwd=ROOT, env=interpreter_env(LOCKSTEP_ASCEND_NPU_LAYOUT="1"),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("same bits"), r.stdout + r.stderr
    neg = subprocess.run([sys.executable, script, "--short-work"], cwd=ROOT,
                         env=interpreter_env(LOCKSTEP_ASCEND_NPU_LAYOUT="1"), capture_output=True, text=True,
                         timeout=900)
    assert neg.returncode == 1 and "outputs differ" in neg.stdout, neg.stdout + neg.stderr


@needs_interpreter
def test_sequence_kernels_ascend_variant_give_reference_bits():
    # one varlen attention case and one chunked GDN case (two calls, open rows carried) on the Ascend
    # variant with its NPU block sizes, and the negative control: the last work item of every persistent
    # launch dropped must be caught (tests/scripts/triton_seq_check.py --ascend)
    script = os.path.join(ROOT, "tests", "scripts", "triton_seq_check.py")
    r = subprocess.run([sys.executable, script, "--ascend", "attn-varlen", "gdn-chunked", "persistent-negative"],
                       cwd=ROOT, env=interpreter_env(LOCKSTEP_ASCEND_NPU_LAYOUT="1"), capture_output=True, text=True,
                       timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ": ok" in ln or ": FAIL" in ln]
    assert r.returncode == 0 and len(lines) == 6 and all(": ok" in ln for ln in lines), r.stdout + r.stderr
    assert sum("wrong variant caught" in ln for ln in lines) == 2, r.stdout


QUICK_SUITES = ["rms_norm", "softmax"] + (["matmul", "token_logprobs", "attention", "gated_delta_rule", "gdn_layer"]
                                          if os.environ.get("LOCKSTEP_FULL") == "1" else [])


@needs_interpreter
@pytest.mark.parametrize("suite", QUICK_SUITES)
def test_quick_conformance_in_interpreter(suite, tmp_path):
    run_quick_conformance("ascend", suite, tmp_path)
