"""The exact policy on the cpu backend: ``core.slice_rows`` compiled, products by ``torch._int_mm`` (one GEMM of all
slice pairs, or a GEMM per diagonal t + u where that measured faster: ``products``).

Slicing is the exact policy's host-side cost: with torch's int64 tensor ops it took ~3.8 s for a
4096 x 4096 weight here (twenty passes over int64 temporaries), 86 % of an exact linear. This is
the same integer recipe (hal/kernels/exact/core.py says every step) in one pass per row: the same
digits, exponents and finite flag, bit for bit (tests/test_exact_cpu_slice.py).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import njit

from hal.errors import InputError
from hal.kernels.exact import core
from hal.kernels.exact import cpu as _int_mm_path
from hal.kernels.exact import probe

from . import pool
from .host import array
from .pool import parallel_worth

_NO_EXP = core._NO_EXP


@njit(inline="always", cache=True)
def _fields(b):
    """float32 bits -> (finite, integer mantissa m, scale exponent q, floor(log2|x|) or _NO_EXP)."""
    field = (b >> 23) & 0xFF
    frac = b & 0x7FFFFF
    finite = field != 0xFF
    normal = finite and field != 0
    m = (frac | 0x800000) if normal else (frac if finite else 0)
    q = (field if normal else 1) - 150
    e = q + math.frexp(float(m))[1] - 1 if m != 0 else _NO_EXP  # frexp: m = f * 2**k, 0.5 <= f < 1
    return finite, m, q, e


@njit(nogil=True, cache=True)
def _slice(bits, s, e_in, have_e, digits, e_out, finite_rows, work):
    """Rows claimed from ``work`` (pool.run runs it on several threads)."""
    k = bits.shape[1]
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            big = _NO_EXP
            fin = True
            for i in range(k):
                f, m, q, e = _fields(bits[r, i])
                fin = fin and f
                big = max(big, e)
            E = e_in[r] if have_e else (0 if big == _NO_EXP else big)
            e_out[r] = E
            finite_rows[r] = fin
            for i in range(k):
                b = bits[r, i]
                f, m, q, e = _fields(b)
                d = min(max(np.int64(q) + (7 * s - 1) - E, -40), 7 * s)
                mag = (np.int64(m) << d) if d >= 0 else (np.int64(m) >> -d)
                neg = b < 0 and mag != 0
                for t in range(s):
                    dg = (mag >> (7 * (s - 1 - t))) & 127
                    digits[t, r, i] = -dg if neg else dg
        lo, hi = pool.claim(work)


def slice_rows(x: torch.Tensor, s: int, e: torch.Tensor | None = None) -> core.Sliced:
    """``core.slice_rows`` for CPU tensors, compiled (same arguments, same bits)."""
    if x.dtype not in core.DTYPES:
        raise InputError(f"the exact policy takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    if x.device.type != "cpu" or x.dim() != 2 or 0 in x.shape:
        return core.slice_rows(x, s, e)
    bits = array(x.to(torch.float32).contiguous().view(torch.int32))
    rows = x.shape[0]
    digits = torch.empty((s, rows, x.shape[1]), dtype=torch.int8)
    e_out = torch.empty(rows, dtype=torch.int64)
    finite_rows = np.empty(rows, dtype=np.bool_)
    e_in = np.zeros(rows, np.int64) if e is None else array(e.to(torch.int64).contiguous())
    pool.run(_slice, rows, bits, s, e_in, e is not None, array(digits), array(e_out), finite_rows,
             parallel=parallel_worth(x.numel() * (s + 2)))
    return core.Sliced(digits, e_out, bool(finite_rows.all()))


#: the diagonal GEMMs from this many rows on, up to this K: they save s² - (2s - 1) int32 outputs per row to widen
#: and combine, and cost a copy of the weight's planes plus s - 1 more reads of each per call; measured faster or
#: equal from 256 rows at K = N = 1024-4096, mixed at 128 rows, slower below (benchmarks/exact.py --int-mm,
#: docs/exact_matmul.md, *Speed*); longer K was not measured, so it keeps the one GEMM
DIAGONAL_MIN_ROWS = 256
DIAGONAL_MAX_K = 4096


def diagonal_gemms_pay(rows: int, k: int) -> bool:
    """Where the diagonal GEMMs measured faster than the one GEMM on this CPU (the one place that choice lives)."""
    return rows >= DIAGONAL_MIN_ROWS and k <= DIAGONAL_MAX_K


@functools.cache
def diagonal_path_admitted(device: str = "cpu") -> bool:
    """The diagonal GEMMs accumulate exactly on this device: kernels/exact/probe.py at and just past their int32
    bound (every digit +-127 over a full piece), mixed signs, several GEMM shapes. Probed once per process."""
    return not probe.diagonal_int_mm_problems(_int_mm_path.diagonals_int_mm, device)


def products(da: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """The cpu backend's slice products: the diagonal GEMMs where they pay (:func:`diagonal_gemms_pay`) and the probe
    admitted them, else the one GEMM. Same integers either way."""
    if diagonal_gemms_pay(da.shape[1], da.shape[2]) and diagonal_path_admitted(da.device.type):
        return _int_mm_path.diagonals_int_mm(da, dw)
    return _int_mm_path.products_int_mm(da, dw)


def linear(x, weight, bias, spec, out_dtype=None):
    return _int_mm_path.linear(x, weight, bias, spec, out_dtype, slicer=slice_rows, products=products)


def matmul(a, b, spec):
    return linear(a, b.transpose(0, 1), None, spec)
