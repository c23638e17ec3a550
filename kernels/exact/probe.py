"""Admission probe of an int8 path for the exact policy: does it accumulate int8 x int8 exactly?

The exact policy's bits rest on one property of whatever computes the slice products: every sum of int8 x
int8 products over K is exact (int32 per piece of at most core.INT32_SAFE_K terms, pieces added in int64).
Some paths do not hold it: Triton's int8 mma is ``.satfinite`` (an overflow clamps instead of wrapping),
some vendor GEMMs scale the int32 accumulator in float32 in their epilogue (exact only below 2**24), some CPU
kernels saturate int16 intermediates (vpmaddubsw). The probe puts every digit at its extreme (127, and
-127 x 127 in a second row) over a full piece and just past it, and over two pieces and a bit (a sum no
int32 holds: the pieces must be added in int64), and wants exactly 127**2 x K in every output. A path is
admitted on a device only when the probe finds nothing (benchmarks/gpu_perf.py runs it there first).
"""
from __future__ import annotations

from typing import Callable

import torch

from .core import INT32_SAFE_K

#: K of each probe: a full int32 piece, just past it (two pieces), past 2**31 in total; multiples of 8
#: (torch._int_mm on CUDA needs K and N multiples of 8)
PROBE_K = (INT32_SAFE_K, INT32_SAFE_K + 8, 2 * INT32_SAFE_K + 8)
PROBE_ROWS, PROBE_COLS = 32, 8   # rows > 16: CUDA torch._int_mm's minimum

#: a path: digits a [1, M, K], w [1, N, K] (int8) -> the exact sums [M, N] (int64)
Sums = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def probe_inputs(k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits a [1, 32, k] (127; row 1 all -127) and w [1, 8, k] (127): every product at its extreme."""
    a = torch.full((1, PROBE_ROWS, k), 127, dtype=torch.int8, device=device)
    a[0, 1] = -127
    return a, torch.full((1, PROBE_COLS, k), 127, dtype=torch.int8, device=device)


def probe_want(k: int, device) -> torch.Tensor:
    want = torch.full((PROBE_ROWS, PROBE_COLS), 127 * 127 * k, dtype=torch.int64, device=device)
    want[1] = -127 * 127 * k
    return want


def accumulation_problems(sums: Sums, device, ks=PROBE_K) -> list[str]:
    """What the path got wrong at each probe K (empty: it accumulates exactly)."""
    problems = []
    for k in ks:
        a, w = probe_inputs(k, device)
        got = sums(a, w).to(torch.int64)
        want = probe_want(k, device)
        if not torch.equal(got, want):
            wrong = (got != want).nonzero()[0].tolist()
            problems.append(f"K = {k}: output {wrong} is {int(got[tuple(wrong)])}, exactly {int(want[tuple(wrong)])} "
                            f"(127**2 x K{', negated' if wrong[0] == 1 else ''})")
    return problems


def int_mm_sums(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch._int_mm, K cut into pieces (kernels/exact/cpu.py products_int_mm): the cpu backend's path."""
    from .cpu import products_int_mm
    return products_int_mm(a, w)[0, 0]


def triton_sums(a: torch.Tensor, w: torch.Tensor, block=None, split_k: int = 1) -> torch.Tensor:
    """The Triton products kernel (kernels/exact/triton_matmul.py): with one slice S = hi * 2**28 + lo is the sum."""
    from . import triton_matmul
    hi, lo = triton_matmul.limbs(a, w, block, split_k)
    return (hi << 28) + lo


#: K of the diagonal probe: past the one-pass kernel's piece at s = 4 (INT32_SAFE_K // 4: a diagonal adds 4 products
#: a term), so it runs as two pieces, the first at the int32 bound
DIAGONAL_K = INT32_SAFE_K // 4 + 8


def diagonal_problems(limbs, device, s: int = 4) -> list[str]:
    """``limbs(da [s, M, K], dw [s, N, K]) -> (hi, lo)`` (core.combine's layout) with every digit at its extreme over
    DIAGONAL_K: the exact limbs, or what differs. Every diagonal of the one-pass kernel reaches s x 127**2 x K per
    piece."""
    from .core import combine
    a, w = probe_inputs(DIAGONAL_K, device)
    da, dw = a.expand(s, -1, -1).contiguous(), w.expand(s, -1, -1).contiguous()
    p = probe_want(DIAGONAL_K, device).expand(s, s, -1, -1)
    want = combine(p, s)
    got = limbs(da, dw)
    return [f"s{s} K = {DIAGONAL_K}: {name} limb differs ({int((g != e).sum())} outputs)"
            for name, g, e in zip(("hi", "lo"), got, want) if not torch.equal(g, e)]


#: K of the fused kernel's probe (s = 4, pieces of INT32_SAFE_K // 4): one full piece (every diagonal at the int32
#: bound), just past it and a multiple of no block, and three pieces and a bit (the halves row's partial sums climb
#: for 1.5 pieces, past what an int32 holds, before they fall back)
FUSED_K = (INT32_SAFE_K // 4, INT32_SAFE_K // 4 + 13, 3 * (INT32_SAFE_K // 4) + 13)


def triton_fused_linear(da: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """The Triton fused kernel (kernels/exact/triton_matmul.py: products, K pieces, integer epilogue) over digit
    planes da [s, M, K], dw [s, N, K] with exponents 0, every input finite: float32 [M, N]."""
    from . import core, triton_matmul
    s, m, k = da.shape
    n, dev = dw.shape[1], da.device
    source = lambda rows: torch.zeros(1, device=dev).expand(rows, k)  # noqa: E731 (read only for non-finite inputs)
    flags = lambda rows: torch.zeros(rows, dtype=torch.int8, device=dev)  # noqa: E731
    exps = lambda rows: torch.zeros(rows, dtype=torch.int64, device=dev)  # noqa: E731
    out = torch.empty(m, n, device=dev)
    return triton_matmul.linear_from_slices(source(m), core.Sliced(da, exps(m), True), flags(m), source(n),
                                            core.Sliced(dw, exps(n), True), flags(n), None, s, out,
                                            weight_source=False)  # the planes are no slicing of the zero source


def fused_problems(linear, device, s: int = 4, ks=FUSED_K) -> list[str]:
    """``linear(da [s, M, K], dw [s, N, K]) -> float32 [M, N]``: the exact linear of digit planes (exponents 0) through
    its rounding (triton_fused_linear). Every plane holds the patterns of :func:`_patterns` (5 rows x 4 columns), so
    every diagonal is at its extreme, and the rows that swing (alternating, halves) end far below their partial sums:
    an accumulator that saturates or rounds on the way shows there. Empty: the rounded exact values, bit for bit."""
    from .core import F32, combine, round_from_f64_odd, scale_exponent, to_f64_odd
    problems = []
    for k in ks:
        pa, pw = _patterns(k, device)
        diagonals = torch.tensor([min(d, 2 * s - 2 - d) + 1 for d in range(2 * s - 1)], device=device)
        hi, lo = combine(diagonals[:, None, None] * (pa.long() @ pw.long().T), s)
        zero = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        want = round_from_f64_odd(to_f64_odd(hi, lo, scale_exponent(zero(5), zero(4), s)), F32)
        got = linear(pa.expand(s, -1, -1).contiguous(), pw.expand(s, -1, -1).contiguous())
        differ = got.view(torch.int32) != want.view(torch.int32)
        if differ.any():
            r, c = differ.nonzero()[0].tolist()
            problems.append(f"s{s} K = {k}: output [{r}, {c}] is {float(got[r, c])!r}, exactly rounded "
                            f"{float(want[r, c])!r} (A pattern {r}, W pattern {c})")
    return problems


#: (rows, columns) of the patterned probes: oneDNN picks its int8 kernel by shape (a matrix-vector kernel for one
#: row, blocked ones for more), so each kind is probed
PATTERN_SHAPES = ((1, 8), (32, 8), (256, 64))


def _patterns(k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit rows for A (127; -127; +-127 alternating along K; 127 then -127; uniform in [-127, 127]) and for W
    (127; -127; +-127 alternating; uniform): every extreme product, of either sign, and sums that swing."""
    g = torch.Generator().manual_seed(k)
    alt = torch.where(torch.arange(k) % 2 == 0, 127, -127)
    half = torch.where(torch.arange(k) < k // 2, 127, -127)
    rand = lambda: torch.randint(-127, 128, (k,), generator=g)
    a = torch.stack([torch.full((k,), 127), torch.full((k,), -127), alt, half, rand()])
    w = torch.stack([torch.full((k,), 127), torch.full((k,), -127), alt, rand()])
    return a.to(torch.int8).to(device), w.to(torch.int8).to(device)


def patterned_problems(sums, device, s: int, k: int, shapes=PATTERN_SHAPES) -> list[str]:
    """``sums(da [s, M, K], dw [s, N, K])`` -> the slice products [s, s, M, N] or their diagonal sums [2s - 1, M, N]
    (int64), with every plane holding the same pattern digits (so every diagonal term is at its extreme): the
    exact sums, or what differs. The rows and columns repeat the patterns of :func:`_patterns`."""
    from .core import diagonal_sums
    pa, pw = _patterns(k, device)
    base = pa.long() @ pw.long().T            # [5, 4]: 20 exact int64 dot products
    terms = torch.tensor([min(d, 2 * s - 2 - d) + 1 for d in range(2 * s - 1)], device=device)
    problems = []
    for rows, cols in shapes:
        ia, iw = torch.arange(rows) % pa.shape[0], torch.arange(cols) % pw.shape[0]
        da = pa[ia].expand(s, -1, -1).contiguous()
        dw = pw[iw].expand(s, -1, -1).contiguous()
        want = terms[:, None, None] * base[ia][:, iw]
        got = sums(da, dw).to(torch.int64)
        got = got if got.dim() == 3 else diagonal_sums(got)
        if not torch.equal(got, want):
            d, r, c = (got != want).nonzero()[0].tolist()
            problems.append(f"s{s} K = {k} {rows}x{cols}: diagonal {d} output [{r}, {c}] is {int(got[d, r, c])}, "
                            f"exactly {int(want[d, r, c])} (A pattern {int(ia[r])}, W pattern {int(iw[c])})")
    return problems


def diagonal_int_mm_problems(diagonals, device, shapes=PATTERN_SHAPES) -> list[str]:
    """kernels/exact/cpu.py's diagonal GEMMs (or a stand-in with their signature): at s = 3 and 4, one full K piece
    (a diagonal of s terms sums s x (INT32_SAFE_K // s) <= INT32_SAFE_K products: the int32 bound), just past it
    (two pieces) and past twice it (a diagonal's sum no int32 holds: the pieces must be added in int64), every
    pattern of :func:`patterned_problems`. Empty: admitted."""
    return [p for s in (3, 4) for k in (INT32_SAFE_K // s, INT32_SAFE_K // s + 8, 2 * (INT32_SAFE_K // s) + 8)
            for p in patterned_problems(diagonals, device, s, k, shapes)]


def one_gemm_int_mm_problems(pairs, device, shapes=PATTERN_SHAPES) -> list[str]:
    """kernels/exact/cpu.py's one GEMM (all pairs) as PROBE_K probes it (one slice: a full piece, just past it,
    past 2**31 in total), every pattern of :func:`patterned_problems`."""
    return [p for k in PROBE_K for p in patterned_problems(pairs, device, 1, k, shapes)]
