"""The exact matmul Triton kernel under the CPU interpreter (TRITON_INTERPRET=1; numpy integer dot
products are exact, so the interpreter checks the kernel's integer logic faithfully): random tile
configs and split-K counts give the reference's bits, and a lost-update variant of the kernel is
caught. Runs in a subprocess so that the interpreter setting (read when Triton decorates a kernel)
cannot leak into other tests."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import random, torch
    from hal.conformance.bits import first_divergence
    from hal.kernels.exact.triton_matmul import exact_linear_triton
    from hal.kernels.reference import exact_matmul as ref
    from hal.spec import ExactMatmulSpec
    rng = random.Random(3)
    bad = []
    for trial, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]):
        m, k, n = rng.randint(1, 20), rng.randint(1, 200), rng.randint(1, 20)
        spec = ExactMatmulSpec(slices=rng.choice([2, 3, 4]))
        g = torch.Generator().manual_seed(trial)
        x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, k), generator=g))).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        x[0, k // 2] = float("inf") if trial == 3 else x[0, k // 2]
        bias = torch.randn(n, generator=g).to(dtype) if trial % 2 else None
        want = ref.linear(x, w, bias, spec)
        block = (rng.choice([16, 32]), rng.choice([16, 32]), rng.choice([32, 64]))
        split = rng.randint(1, 5)
        d = first_divergence(f"{spec.id} {m}x{k}x{n} {dtype} block {block} split {split}", want,
                             exact_linear_triton(x, w, bias, spec, block, split))
        print("ok" if d is None else d)
        bad += [] if d is None else [d]
    # negative control: the same kernel with split-K partials stored instead of added (a lost
    # update) must be caught by the same comparison
    from hal.kernels.exact import core, triton_matmul as tx
    x, w = torch.randn(5, 300), torch.randn(7, 300)
    spec = ExactMatmulSpec(slices=3)
    sa, sw = core.slice_rows(x, 3), core.slice_rows(w, 3)
    hi, lo = torch.zeros(5, 7, dtype=torch.int64), torch.zeros(5, 7, dtype=torch.int64)
    tx._limbs_kernel[(1, 1, 3)](sa.digits, sw.digits, hi, lo, 5, 7, 300, 100, *sa.digits.stride(),
                               *sw.digits.stride(), S=3, DIGIT=core.DIGIT, LIMB=core.LIMB, BM=16, BN=16,
                               BK=32, ATOMIC=False)
    lost = core.finish(core.to_f64_odd(hi, lo, core.scale_exponent(sa.exp, sw.exp, 3)), None, None, x.dtype)
    caught = first_divergence("lost update", ref.linear(x, w, None, spec), lost) is not None
    print("control-caught" if caught else "control-missed")
    raise SystemExit(1 if bad else 0)
""")


def test_triton_kernel_any_tiling_and_split_gives_reference_bits():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split()
    assert lines.count("ok") == 4 and "control-caught" in lines, r.stdout


@pytest.mark.parametrize("check", ["diagonal", "slicer", "bits", "fused", "source", "nosync", "replay", "probe"])
def test_device_side_path(check):
    """The backend's exact path (slicing kernel; the fused kernel -- diagonal int32 sums, K pieces, integer epilogue
    with per-tile special values -- or the two-kernel path; no host read) and the int8 accumulation probe, under the
    interpreter (tests/scripts/exact_triton_path_check.py, each check with its negative control)."""
    from _triton_seq_run import run_checks
    run_checks(check, script=os.path.join(ROOT, "tests", "scripts", "exact_triton_path_check.py"))
