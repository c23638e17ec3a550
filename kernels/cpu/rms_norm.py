"""RMSNorm (+ fused residual) under an RMSNormSpec: one row per task (rows are independent)."""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .host import F32, canonical_nan, empty, finish, parallel_worth, raw
from .reduce import tiled_dot
from .strict_math import ONE, canon, widen


@njit(cache=True)  # compiled once, called by both drivers (inlined, each compiled its own copy)
def _rms_row(h, w, eps, t, out, r):
    n = h.shape[1]
    x = np.empty(n, np.float32)
    for i in range(n):
        x[i] = widen(h[r, i])
    ss = tiled_dot(x, x, t)
    inv = ONE / np.sqrt(ss / np.float32(n) + eps)  # float32(n) is exact for n < 2**24
    o = out[r]
    for i in range(n):
        o[i] = canon((x[i] * inv) * widen(w[i]))


@njit(parallel=True, cache=True)
def _rms_par(h, w, eps, t, out):
    for r in prange(h.shape[0]):
        _rms_row(h, w, eps, t, out, np.int64(r))  # np.int64: prange's index is unsigned (one compile, not two)


@njit(cache=True)
def _rms_ser(h, w, eps, t, out):
    for r in range(h.shape[0]):
        _rms_row(h, w, eps, t, out, r)


def rms_norm(x, weight, eps, residual, spec):
    if residual is not None:
        # the sum rounded to the activation dtype is both the new residual and the value normalised
        h = canonical_nan((x.to(F32) + residual.to(F32)).to(x.dtype))
    else:
        h = x
    hid = h.shape[-1]
    h2 = raw(h).reshape(math.prod(h.shape[:-1]), hid)  # numpy's reshape: torch's costs microseconds
    out_t, out = empty(*h2.shape)
    if out.size:
        (_rms_par if parallel_worth(h2.size * 4) else _rms_ser)(h2, raw(weight), np.float32(eps), spec.hidden_tile,
                                                               out)
    y = finish(out_t.reshape(h.shape), x.dtype, nan_done=True)  # the kernel stores canon
    return (y, h) if residual is not None else y


