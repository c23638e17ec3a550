"""The cpu backend's conformance suites with the diagonal GEMMs (kernels/exact/cpu.py) forced for every shape.

    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py real matmul_exact token_logprobs_exact
    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py control matmul_exact   # must FAIL (L4, A)

The suites' shapes are below the rows where the backend takes the diagonal GEMMs by itself, so this puts them on
that path (the admission probe is tests/test_exact_cpu_int_mm.py's): the goldens must hold unchanged. ``control``
puts the diagonal GEMMs with A's planes in order instead of reversed in their place, which the goldens catch.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal.cli  # noqa: E402
from hal.kernels.cpu import exact_slice as cpu_backend  # noqa: E402
from hal.kernels.exact import cpu as exact_cpu  # noqa: E402
from test_exact_cpu_int_mm import _planes_in_order  # noqa: E402

calls = []
path = _planes_in_order if sys.argv[1] == "control" else exact_cpu.diagonals_int_mm
cpu_backend.diagonal_gemms_pay = lambda rows, k: True
cpu_backend.diagonal_path_admitted = lambda device: True
exact_cpu.diagonals_int_mm = lambda da, dw: calls.append(da.shape) or path(da, dw)
rc = hal.cli.main(["conformance", "run", "--backend", "cpu", "--ops", *sys.argv[2:], "--quiet"])
print(f"{sys.argv[1]}: {len(calls)} diagonal-GEMM calls; exit {rc}")
sys.exit(rc)
