"""The exact matmul Triton kernel under the CPU interpreter (TRITON_INTERPRET=1; numpy integer dot
products are exact, so the interpreter checks the kernel's integer logic faithfully): random tile
configs and split-K counts give the reference's bits. Runs in a subprocess so that the interpreter
setting (read when Triton decorates a kernel) cannot leak into other tests."""
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
        for _ in range(1 + trial % 2):
            block = (rng.choice([16, 32]), rng.choice([16, 32]), rng.choice([32, 64]))
            split = rng.randint(1, 5)
            d = first_divergence(f"{spec.id} {m}x{k}x{n} {dtype} block {block} split {split}", want,
                                 exact_linear_triton(x, w, bias, spec, block, split))
            print("ok" if d is None else d)
            bad += [] if d is None else [d]
    raise SystemExit(1 if bad else 0)
""")


def test_triton_kernel_any_tiling_and_split_gives_reference_bits():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split()
    assert lines.count("ok") == 6, r.stdout
