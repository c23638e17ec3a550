"""RMSNorm and softmax sums on the triton backend: the reference's bits in the interpreter, vector loads in the
machine code.

* tests/scripts/triton_norm_softmax_check.py (a subprocess with TRITON_INTERPRET=1): the GPU layout (reg=False) and the
  interpreter's register layout give the reference's raw bits on edge shapes, softmax also split across the row; a chain with two neighbours swapped
  is caught in both kernels, through both splits (common.eight and four).
* the compiled kernels (sm_90, aligned launch; hal.kernels.checks.sass_profile and the TTGIR): every global load
  is a 16-byte vector load, and the chain loop (the loop that splits the vectors with tl.split) loads VEC
  elements per thread and converts no layout. Negative controls: the Ascend variant (NPU=True, element per step)
  has narrow loads; the GPU variant with too few (row, tile) lanes for the threads (64 for 128) splits each
  vector over threads and converts layouts inside the chain loop, which the same checks flag.
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_norm_softmax_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")

GPU_CASES = ["rms_norm[bf16,residual]", "rms_norm[fp32,residual]", "rms_norm[fp16,residual]",
             "softmax[bf16,mode0]", "softmax[fp32,mode1]", "softmax[fp16,mode2]"]


@needs_interpreter
def test_both_layouts_give_reference_bits():
    out = run_checks("bits", script=SCRIPT)
    assert out.count(": ok") == 22  # 14 cases on the GPU layout, 8 (power-of-2 tiles) on the register layout


@needs_interpreter
def test_split_rows_give_reference_bits():
    """A few long rows split across programs (chunk maxima, tile sums, tile order, outputs per chunk)."""
    out = run_checks("split", script=SCRIPT)
    assert out.count(": ok") == 16  # 10 cases on the GPU layout, 6 (power-of-2 tiles) on the register layout


@needs_interpreter
def test_swapped_chain_order_is_caught():
    out = run_checks("negative", script=SCRIPT)
    for op in ("rms_norm", "softmax", "softmax split"):
        for split in ("eight", "four"):
            assert f"swapped neighbours in the {op} chain ({split}) are caught: ok" in out


def _case(name, npu=False):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True, npu=npu) if c.name == name)


def _chain_loop(ttgir: str) -> str:
    """The text of the innermost scf.for that holds the tl.split of the chain steps ('' if none)."""
    lines = ttgir.splitlines()
    split = next((i for i, ln in enumerate(lines) if "tt.split" in ln), None)
    if split is None:
        return ""
    depth, start = 0, split
    for start in range(split, -1, -1):  # walk up to the scf.for whose body is still open at the split
        depth += lines[start].count("}") - lines[start].count("{")
        if "scf.for" in lines[start] and depth < 0:
            break
    depth, end = 0, start
    for end in range(start, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        if depth == 0:
            break
    return "\n".join(lines[start:end + 1])


def _chain_loop_problems(ttgir: str, vec: int) -> list[str]:
    """Why the chain loop is not 'VEC elements per thread, no layout conversion' (empty: it is)."""
    loop = _chain_loop(ttgir)
    if not loop:
        return ["no chain loop (no tt.split)"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    # a pipelined loop (tl.range num_stages) loads through cp.async into shared memory and reads it back in the
    # registers' layout (local_load): those are its loads, not layout conversions
    loads = re.findall(r"(?:tt\.load|ttg\.async_copy_global_to_local) .*: tensor<[^,]*, (#\w+)>", loop)
    loads += re.findall(r"ttg\.local_load .*-> tensor<[^,]*, (#\w+)>", loop)
    per_thread = {layouts.get(ly, ly).split("sizePerThread = ")[1].split("]")[0] + "]" for ly in loads}
    moves = re.findall(r"ttg\.(convert_layout|local_alloc|local_store)", loop)
    found = []
    if not loads or per_thread != {f"[1, 1, {vec}]"}:
        found.append(f"chain loop loads {len(loads)} blocks with sizePerThread {per_thread}, want [1, 1, {vec}]")
    if moves:
        found.append(f"chain loop converts layouts: {moves}")
    return found


def _load_problem(p) -> str | None:
    """Why not every global load of a profile is a 16-byte vector load, or None."""
    other = {op: n for op, n in p.global_loads.items() if ".128" not in op}
    return f"global loads {p.global_loads}" if other or not p.vector_loads else None


def _problems(case) -> list[str]:
    from hal.kernels.checks.lint import compile_case
    from hal.kernels.checks.sass_profile import profile
    compiled = compile_case(case, "sm90", aligned=True)
    loads = _load_problem(profile(compiled))
    return ([loads] if loads else []) + _chain_loop_problems(compiled.asm["ttgir"], case.constexprs["VEC"])


@needs_compiler
@pytest.mark.parametrize("name", GPU_CASES)
def test_chains_stream_16_byte_loads(name):
    assert _problems(_case(name)) == []


@needs_compiler
def test_rms_norm_converts_no_layout():
    # weights are loaded in h's layout and the chain partials stay where the splits leave them (fp32 still moves
    # the per-row inverse once per row block, outside the loops)
    from hal.kernels.checks.sass_profile import profile_case
    for name in ("rms_norm[bf16,residual]", "rms_norm[fp16,residual]"):
        p = profile_case(_case(name))
        # no store to shared memory (its loop's pipelined loads land there by cp.async and are read back, with
        # the barriers of the pipeline)
        assert (p.shared_stores, p.stack) == (0, 0) and p.async_copies, (name, p)


@needs_compiler
@pytest.mark.parametrize("name", ["rms_norm[bf16,residual]", "softmax[bf16,mode0]", "softmax[fp32,mode0]"])
def test_element_per_step_variant_is_flagged(name):
    from hal.kernels.checks.sass_profile import profile_case
    p = profile_case(_case(name, npu=True))  # the Ascend variant: step j loads element j of every tile
    assert _load_problem(p) is not None, p


@needs_compiler
@pytest.mark.parametrize("name", ["rms_norm[bf16,residual]", "softmax[bf16,mode0]"])
def test_too_few_lanes_is_flagged(name):
    case = _case(name)
    lanes = case.constexprs["BR"] * case.constexprs["NTB"]
    short = dataclasses.replace(case, name=name + " 64 lanes",
                                constexprs={**case.constexprs, "NTB": case.constexprs["NTB"] * 64 // lanes})
    problems = _problems(short)
    starts = ("global loads", "chain loop loads", "chain loop converts")  # split vectors, and moves to join them
    assert len(problems) == 3 and all(p.startswith(s) for p, s in zip(problems, starts)), problems
