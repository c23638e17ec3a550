"""Strict elementwise ops and rotary embedding (kernels/reference/elementwise.py), compiled.

The float32 cores (``sigmoid_f32``, ``silu_f32``, ``softplus_f32``) are the one numba definition of
these functions; the GDN layer pieces (``gdn_layer.py``) inline the same ones. Every value is
computed alone from its own input, so blocks of elements are independent tasks.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from hal.kernels.reference.elementwise import inv_freq as _inv_freq_table

from . import pool
from .host import F32, array, empty, finish, wide
from .pool import parallel_worth
from .strict_math import NEG_INF, ONE, ZERO, canon, exp, fma, log, sincos, widen

_BLOCK = 4096  # elements per task
_NEG_ZERO = np.float32(-0.0)
SIGMOID, SILU, SOFTPLUS = 0, 1, 2
_KIND = {"sigmoid": SIGMOID, "silu": SILU, "softplus": SOFTPLUS}


@njit(inline="always", cache=True)
def sigmoid_f32(x):
    return ONE / (ONE + exp(-x))


@njit(inline="always", cache=True)
def silu_f32(x):
    """x / (1 + exp(-x)); silu(-inf) = -0.0 (the limit, not NaN)."""
    return _NEG_ZERO if x == NEG_INF else x / (ONE + exp(-x))


@njit(inline="always", cache=True)
def softplus_f32(x):
    """max(x, 0) + log1p(exp(-|x|)), log1p(e) = log(w) * (e / (w - 1)), w = 1 + e; m + e when w == 1."""
    m = x if x > ZERO else ZERO
    e = exp(-abs(x))
    w = ONE + e
    if w == ONE:
        return m + e
    return fma(log(w), e / (w - ONE), m)


@njit(inline="always", cache=True)
def _unary(kind, x):
    if kind == SIGMOID:
        return sigmoid_f32(x)
    if kind == SILU:
        return silu_f32(x)
    return softplus_f32(x)


@njit(inline="always", cache=True)
def _unary_block(kind, x, out, blk):
    for i in range(blk * _BLOCK, min(x.shape[0], (blk + 1) * _BLOCK)):
        out[i] = _unary(kind, widen(x[i]))


@njit(nogil=True, cache=True)
def _map_unary(kind, x, out, work):
    """Blocks of _BLOCK elements claimed from ``work`` (pool.run runs it on several threads)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for blk in range(lo, hi):
            _unary_block(kind, x, out, blk)
        lo, hi = pool.claim(work)


@njit(inline="always", cache=True)
def _silu_mul_block(a, b, out, blk):
    for i in range(blk * _BLOCK, min(a.shape[0], (blk + 1) * _BLOCK)):
        out[i] = silu_f32(widen(a[i])) * widen(b[i])


@njit(nogil=True, cache=True)
def _map_silu_mul(a, b, out, work):
    lo, hi = pool.claim(work)
    while lo < hi:
        for blk in range(lo, hi):
            _silu_mul_block(a, b, out, blk)
        lo, hi = pool.claim(work)


#: up to this many elements one thread maps them all: handing blocks to other threads costs tens of microseconds
_SERIAL_MAX = 16384


def _blocks(n):
    return (n + _BLOCK - 1) // _BLOCK


def unary(name: str, x: torch.Tensor) -> torch.Tensor:
    """sigmoid / silu / softplus of x, rounded once to x's dtype."""
    out, o = empty(*x.shape)
    if x.numel():
        # float32: one compile for every dtype
        pool.run(_map_unary, _blocks(x.numel()), _KIND[name], wide(x).reshape(-1), o.reshape(-1),
                 parallel=x.numel() > _SERIAL_MAX)
    return finish(out, x.dtype)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out, o = empty(*a.shape)
    if a.numel():
        pool.run(_map_silu_mul, _blocks(a.numel()), wide(a).reshape(-1), wide(b).reshape(-1), o.reshape(-1),
                 parallel=a.numel() > _SERIAL_MAX)
    return finish(out, a.dtype)


# ---------------------------------------------------------------- rotary


@njit(nogil=True, cache=True)
def _cos_sin(pos, freq, cos, sin, work):
    half = cos.shape[1]
    lo, hi = pool.claim(work)
    while lo < hi:
        for p in range(lo, hi):
            fp = np.float32(pos[p])  # exact: |pos| < 2**24 is validated
            for i in range(half):
                s, c = sincos(fp * freq[i])
                cos[p, i] = canon(c)
                sin[p, i] = canon(s)
        lo, hi = pool.claim(work)


def rotary_cos_sin(positions, rotary_dim, base, inv_freq):
    """float32 (cos, sin) [..., R/2]; the R/2-entry inv_freq table is the reference's own (a few exp/log)."""
    f = _inv_freq_table(rotary_dim, base) if inv_freq is None else inv_freq.to(F32)
    half = rotary_dim // 2
    cos = torch.empty((*positions.shape, half), dtype=F32)
    sin = torch.empty_like(cos)
    if positions.numel():
        n = positions.numel()
        pool.run(_cos_sin, n, array(positions.reshape(-1).to(torch.int64)), array(f.contiguous()),
                 array(cos).reshape(-1, half), array(sin).reshape(-1, half), parallel=parallel_worth(n * half * 64))
    return cos, sin


@njit(nogil=True, cache=True)
def _rotate(x, cos, sin, interleaved, out, work):
    """Rows (claimed from ``work``) of x [rows, D], cos/sin [rows, half] float32 -> out [rows, D] float32."""
    d = x.shape[1]
    half = cos.shape[1]
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            for j in range(d):
                out[r, j] = widen(x[r, j])  # dims >= R pass through (exact)
            for i in range(half):
                i1, i2 = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                x1, x2 = widen(x[r, i1]), widen(x[r, i2])
                c, s = cos[r, i], sin[r, i]
                out[r, i1] = fma(x1, c, -(x2 * s))
                out[r, i2] = fma(x2, c, x1 * s)
        lo, hi = pool.claim(work)


def apply_rotary(x, cos, sin, interleaved):
    d = x.shape[-1]
    half = cos.shape[-1]
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    out = torch.empty(x.shape, dtype=F32)
    if x.numel():
        # the tables broadcast over x's leading dims (exact float32 copies)
        c = cos.to(F32).expand(*lead, half).reshape(rows, half).contiguous()
        s = sin.to(F32).expand(*lead, half).reshape(rows, half).contiguous()
        pool.run(_rotate, rows, wide(x).reshape(rows, d), array(c), array(s), interleaved, array(out).reshape(rows, d),
                 parallel=parallel_worth(rows * d * 4))
    return finish(out, x.dtype)
