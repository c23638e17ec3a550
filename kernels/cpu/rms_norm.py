"""RMSNorm (+ fused residual) under an RMSNormSpec: one row per task (rows are independent)."""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .host import F32, canonical_nan, finish, raw
from .reduce import tiled_dot
from .strict_math import ONE, canon, widen


@njit(parallel=True, cache=True)
def _rms_rows(h, w, eps, t, out):
    rows, n = h.shape
    hn = np.float32(n)  # exact for n < 2**24
    for r in prange(rows):
        x = np.empty(n, np.float32)
        for i in range(n):
            x[i] = widen(h[r, i])
        ss = tiled_dot(x, x, t)
        inv = ONE / np.sqrt(ss / hn + eps)
        o = out[r]
        for i in range(n):
            o[i] = canon((x[i] * inv) * widen(w[i]))


def rms_norm(x, weight, eps, residual, spec):
    if residual is not None:
        # the sum rounded to the activation dtype is both the new residual and the value normalised
        h = canonical_nan((x.to(F32) + residual.to(F32)).to(x.dtype))
    else:
        h = x
    hid = h.shape[-1]
    h2 = raw(h.reshape(math.prod(h.shape[:-1]), hid))
    out = torch.empty(h2.shape, dtype=F32)
    if out.numel():
        _rms_rows(h2, raw(weight), np.float32(eps), spec.hidden_tile, out.numpy())
    y = finish(out, x.dtype).reshape(h.shape)
    return (y, h) if residual is not None else y


