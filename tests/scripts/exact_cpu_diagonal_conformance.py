"""The cpu backend's conformance suites with the diagonal GEMMs (kernels/exact/cpu.py) forced for every shape.

    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py real matmul_exact token_logprobs_exact  # ~30 s CPU
    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py real matmul_exact token_logprobs_exact --quick
    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py control matmul_exact  # must FAIL (L4, A)
    .venv/bin/python tests/scripts/exact_cpu_diagonal_conformance.py one-unit matmul_exact --quick --dtypes fp32  # FAIL

The suites' shapes are below the rows where the backend takes the diagonal GEMMs by itself, so this puts them on
that path (the admission probe is tests/test_exact_cpu_int_mm.py's): the goldens must hold unchanged. Each level runs
on its own (its own base call), so the diagonal-GEMM calls are counted per suite and level: the run fails when a
level reached none. The options after the suites go on to ``hal conformance run``; tests/test_exact_cpu_int_mm.py
runs ``--quick`` (the suites' quick cases, every level). Controls, which the goldens catch: ``control`` puts the
diagonal GEMMs with A's planes in order instead of reversed in their place; ``one-unit`` adds one to the first
output's most significant diagonal sum (L4 in the float32 cases).
"""
import collections
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal.cli  # noqa: E402
from hal.conformance import runner, suites  # noqa: E402
from hal.kernels.cpu import exact_slice as cpu_backend  # noqa: E402
from hal.kernels.exact import cpu as exact_cpu  # noqa: E402
from test_exact_cpu_int_mm import _planes_in_order  # noqa: E402


diagonals_int_mm = exact_cpu.diagonals_int_mm  # the real path, before the counting wrapper below replaces it


def _one_unit_off(da, dw):
    q = diagonals_int_mm(da, dw)
    q[0, 0, 0] += 1  # diagonal t + u = 0: the largest weight, 2**(7 (2s - 2)) of S
    return q


mode, args = sys.argv[1], sys.argv[2:]
path = {"real": diagonals_int_mm, "control": _planes_in_order, "one-unit": _one_unit_off}[mode]
calls = []
per_level = collections.Counter()  # (suite, level): diagonal-GEMM calls while that level ran, its base call included
cpu_backend.diagonal_gemms_pay = lambda rows, k: True
cpu_backend.diagonal_path_admitted = lambda device: True
exact_cpu.diagonals_int_mm = lambda da, dw: calls.append(da.shape) or path(da, dw)
run_case = runner.run_case


def _run_case_by_level(suite, backend, case, device, levels, outcomes, golden_root=None):
    """runner.run_case one level at a time, so that the calls a level made are known (L4 and A judge the base call)."""
    for lvl in levels:
        before = len(calls)
        run_case(suite, backend, case, device, (lvl,), outcomes, golden_root)
        per_level[suite.name, lvl] += len(calls) - before


runner.run_case = _run_case_by_level
rc = hal.cli.main(["conformance", "run", "--backend", "cpu", "--ops", *args, "--quiet"])
names = list(itertools.takewhile(lambda a: not a.startswith("-"), args))  # the suites, then CLI options
unreached = [f"{s} {lvl}" for s in names for lvl in suites.get(s).levels if not per_level[s, lvl]]
print(f"{mode}: {len(calls)} diagonal-GEMM calls ({', '.join(f'{s} {lvl} {n}' for (s, lvl), n in per_level.items())})"
      f"; exit {rc}")
if unreached:
    print(f"{mode}: FAIL levels that never reached the diagonal GEMMs: {unreached}")
sys.exit(rc or (1 if unreached else 0))
