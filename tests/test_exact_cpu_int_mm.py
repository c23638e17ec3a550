"""The cpu backend's two torch._int_mm ways to the exact policy's slice products (kernels/exact/cpu.py): the one GEMM
of all pairs and the GEMM per diagonal t + u. Same integers, hence the reference's raw bits; the diagonal GEMMs are
admitted only by the accumulation probe (kernels/exact/probe.py) at and past their int32 bound. Negative controls:
the planes of a diagonal mis-ordered, a path without K pieces, a float32 accumulator; the conformance suites with the
diagonal GEMMs forced (tests/scripts/exact_cpu_diagonal_conformance.py --quick), control: one unit off."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hal
from hal.conformance.bits import first_divergence
from hal.kernels.exact import core, probe
from hal.kernels.cpu import exact_slice as cpu_backend
from hal.kernels.exact import cpu as exact_cpu
from hal.kernels.reference import exact_matmul as ref
from hal.spec import ExactMatmulSpec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _digits(s, m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (s, m, k), generator=g, dtype=torch.int8),
            torch.randint(-127, 128, (s, n, k), generator=g, dtype=torch.int8))


def _planes_in_order(da, dw):
    """Control: the diagonal GEMMs with A's planes laid out in order instead of reversed (each window then pairs
    A_t with the wrong W_u)."""
    s, m, k = da.shape
    a = torch.cat(list(da), 1)
    w = torch.cat(list(dw), 1)
    q = torch.zeros((2 * s - 1, m, dw.shape[1]), dtype=torch.int64)
    for d in range(2 * s - 1):
        t_lo, t_hi = max(0, d - s + 1), min(d, s - 1)
        q[d] = torch._int_mm(a[:, (s - 1 - t_hi) * k:(s - t_lo) * k].contiguous(),
                             w[:, (d - t_hi) * k:(d - t_lo + 1) * k].contiguous().T).long()
    return q


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_diagonal_gemms_give_the_exact_diagonal_sums(s):
    """Random digits, M = 1 included, K pieces forced small (several pieces, a short last one): the int64 einsum's
    diagonal sums, and the one GEMM's; the mis-ordered planes are caught by the same comparison (s > 1)."""
    for m, n, k, piece in ((1, 5, 37, None), (9, 3, 300, 7), (4, 17, 1, None), (6, 2, 64, 64)):
        da, dw = _digits(s, m, n, k, 10 * s + m)
        want = core.diagonal_sums(torch.einsum("tmk,unk->tumn", da.long(), dw.long()))
        got = exact_cpu.diagonals_int_mm(da, dw, piece_k=piece)
        assert torch.equal(got, want), (s, m, n, k, piece)
        assert torch.equal(core.diagonal_sums(exact_cpu.products_int_mm(da, dw)), want)
        if s > 1 and m > 1:
            assert not torch.equal(_planes_in_order(da, dw), want), (s, m, n, k)


def test_combine_takes_pairs_or_diagonals_alike():
    da, dw = _digits(4, 3, 5, 200, 1)
    p = torch.einsum("tmk,unk->tumn", da.long(), dw.long())
    for got, want in zip(core.combine(core.diagonal_sums(p), 4), core.combine(p, 4)):
        assert torch.equal(got, want)
    # control: one pair dropped from a diagonal changes the limbs
    p2 = p.clone()
    p2[1, 2] = 0
    assert not all(map(torch.equal, core.combine(core.diagonal_sums(p2), 4), core.combine(p, 4)))


def _hostile(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-6, 6, shape, generator=g))  # fp16: no overflow
    x[torch.rand(shape, generator=g) < 0.1] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_backend_on_the_diagonal_gemms_gives_the_reference_bits(dtype, monkeypatch):
    """hal.linear / hal.matmul on the cpu backend with the diagonal GEMMs taken from one row on (counted, so the
    test cannot pass on the other path): the reference's raw bits, s = 3 and 4, a prepared weight, a bias, NaN and
    inf in x. The control: the mis-ordered planes put in their place are caught."""
    calls = []
    real = exact_cpu.diagonals_int_mm
    monkeypatch.setattr(cpu_backend, "diagonal_gemms_pay", lambda rows, k: True)
    monkeypatch.setattr(cpu_backend, "diagonal_path_admitted", lambda device: True)   # probed in its own test
    monkeypatch.setattr(exact_cpu, "diagonals_int_mm", lambda da, dw: calls.append(da.shape) or real(da, dw))
    x, w, b = _hostile((7, 300), dtype, 1), _hostile((11, 300), dtype, 2), _hostile((11,), dtype, 3)
    x[2, 5], x[4, 0], x[4, 9] = math.nan, math.inf, -math.inf
    for s in (3, 4):
        spec = ExactMatmulSpec(slices=s)
        want = ref.linear(x, w, b, spec)
        for weight in (w, hal.exact_weight(w, spec=spec, backend="cpu")):
            d = first_divergence(f"s{s} linear", want, hal.linear(x, weight, b, spec=spec, backend="cpu"))
            assert d is None, str(d)
        d = first_divergence(f"s{s} matmul", ref.matmul(x, w.T, spec), hal.matmul(x, w.T, spec=spec, backend="cpu"))
        assert d is None, str(d)
    assert len(calls) == 6
    monkeypatch.setattr(exact_cpu, "diagonals_int_mm", _planes_in_order)
    spec = ExactMatmulSpec(slices=4)
    assert first_divergence("control", ref.linear(x, w, b, spec), hal.linear(x, w, b, spec=spec, backend="cpu"))


def test_the_shape_choice_lives_in_products(monkeypatch):
    """Where diagonal_gemms_pay says no the one GEMM, where it says yes the diagonal GEMMs once the probe admitted
    them; the rule: from 256 rows on, K up to 4096 (where it was measured)."""
    assert [cpu_backend.diagonal_gemms_pay(m, k) for m, k in ((255, 1024), (256, 1024), (4096, 4096), (4096, 4097),
                                                             (1, 1))] == [False, True, True, False, False]
    taken = []
    monkeypatch.setattr(cpu_backend, "DIAGONAL_MIN_ROWS", 4)

    monkeypatch.setattr(exact_cpu, "diagonals_int_mm", lambda da, dw: taken.append("diagonal") or 0)
    monkeypatch.setattr(exact_cpu, "products_int_mm", lambda da, dw: taken.append("one") or 0)
    monkeypatch.setattr(cpu_backend, "diagonal_path_admitted", lambda device: True)
    da3, dw = _digits(3, 3, 2, 8, 0)
    da4, _ = _digits(3, 4, 2, 8, 0)
    cpu_backend.products(da3, dw), cpu_backend.products(da4, dw)
    monkeypatch.setattr(cpu_backend, "diagonal_path_admitted", lambda device: False)
    cpu_backend.products(da4, dw)
    assert taken == ["one", "diagonal", "one"]


def test_probe_admits_the_int_mm_paths_here_and_catches_the_controls(monkeypatch):
    """This machine's torch._int_mm (oneDNN) accumulates both ways exactly at and past their int32 bounds, every
    pattern (127, -127, alternating, halves, random) and GEMM shape; the probe catches the diagonal GEMMs without
    K pieces (int32 wraps), the one GEMM without them, and a float32 accumulator (exact only below 2**24)."""
    cpu_backend.diagonal_path_admitted.cache_clear()
    assert cpu_backend.diagonal_path_admitted("cpu")      # diagonal_int_mm_problems(diagonals_int_mm) found nothing
    assert probe.one_gemm_int_mm_problems(exact_cpu.products_int_mm, "cpu") == []
    small = ((32, 8),)   # the controls on one shape: each is caught on every one
    assert probe.diagonal_int_mm_problems(lambda a, w: exact_cpu.diagonals_int_mm(a, w, piece_k=1 << 30), "cpu", small)
    assert probe.one_gemm_int_mm_problems(lambda a, w: torch._int_mm(a[0], w[0].T).long()[None, None], "cpu", small)
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (a.float() @ b.float()).to(torch.int32))
    assert probe.patterned_problems(exact_cpu.diagonals_int_mm, "cpu", 4, core.INT32_SAFE_K // 4, small)


def test_cpu_backend_takes_the_diagonal_gemms_by_itself_from_256_rows(monkeypatch):
    """No rule patched: 256 rows go through the diagonal GEMMs (after the admission probe), 255 rows through the one
    GEMM, both with the reference's raw bits."""
    calls = []
    real = exact_cpu.diagonals_int_mm
    x, w = _hostile((256, 64), torch.bfloat16, 5), _hostile((16, 64), torch.bfloat16, 6)
    spec = ExactMatmulSpec(slices=4)
    assert cpu_backend.diagonal_path_admitted("cpu")      # probed (once per process) before the counting starts
    monkeypatch.setattr(exact_cpu, "diagonals_int_mm", lambda da, dw: calls.append(da.shape[1]) or real(da, dw))
    for rows in (256, 255):
        d = first_divergence(f"{rows} rows", ref.linear(x[:rows], w, None, spec),
                             hal.linear(x[:rows], w, spec=spec, backend="cpu"))
        assert d is None, str(d)
    assert calls == [256]


FORCED = Path(__file__).resolve().parent / "scripts" / "exact_cpu_diagonal_conformance.py"


def _forced_conformance(mode, *args):
    """The script's quick run: the suites' quick cases, every level, the diagonal GEMMs forced (counted per level)."""
    return subprocess.run([sys.executable, str(FORCED), mode, *args, "--quick"], cwd=FORCED.parents[2],
                          capture_output=True, text=True, timeout=600)


def test_conformance_suites_hold_on_the_forced_diagonal_gemms():
    """matmul_exact and token_logprobs_exact on the cpu backend with the diagonal GEMMs taken for every shape: every
    claimed level holds with the goldens unchanged, and every level reached the diagonal GEMMs (the script fails a
    level that made no call). The full case sets: the script's first command line (~70 s)."""
    r = _forced_conformance("real", "matmul_exact", "token_logprobs_exact")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "OK: every claimed level holds" in r.stdout and "real: 0 diagonal" not in r.stdout, r.stdout[-4000:]


def test_forced_diagonal_gemms_one_unit_off_is_caught():
    """Control: the forced path with one unit added to the first output's most significant diagonal sum fails the
    matmul_exact goldens (L4) of the float32 cases, having reached the diagonal GEMMs on every level."""
    r = _forced_conformance("one-unit", "matmul_exact", "--dtypes", "fp32")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    assert re.search(r"^\[cpu matmul_exact fp32 \S+ L4\] \d+/\d+ cases fail", r.stdout, re.M), r.stdout[-4000:]
    assert "never reached the diagonal GEMMs" not in r.stdout, r.stdout[-4000:]
