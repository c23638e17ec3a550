"""RMSNorm (+ fused residual) under an RMSNormSpec: one row per task (rows are independent)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import pool
from .host import F32, canonical_nan, empty, finish, raw
from .pool import parallel_worth
from .reduce import tiled_dot
from .strict_math import ONE, canon, widen


@njit(cache=True)  # not inlined (numba's inlining compiled slower than a call)
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


@njit(nogil=True, cache=True)
def _rms_tasks(h, w, eps, t, out, work):
    """Rows claimed from ``work`` (pool.run runs it on several threads)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            _rms_row(h, w, eps, t, out, r)
        lo, hi = pool.claim(work)


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
        pool.run(_rms_tasks, h2.shape[0], h2, raw(weight), np.float32(eps), spec.hidden_tile, out,
                 parallel=parallel_worth(h2.size * 4))
    y = finish(out_t.reshape(h.shape), x.dtype, nan_done=True)  # the kernel stores canon
    return (y, h) if residual is not None else y


