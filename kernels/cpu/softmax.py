"""softmax / log_softmax / logsumexp and token log-probs (strict): one row per task.

Per row (SoftmaxSpec): M = row max (exact); a NaN or +inf anywhere poisons the row (M = NaN);
a row of -inf only is empty (shift 0, fixed up at the output); S = canonical tiled sum of
exp(x - M); outputs from (x - M), S and log S exactly as kernels/reference/softmax.py.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from . import pool
from .host import F32, array, empty, finish, raw, wide
from .matmul import dot_rows_nk
from .pool import parallel_worth
from .reduce import tiled_sum
from .simd import LANES, vkeep_nan, vlane, vload_wide, vmax, vsplat, vzero
from .strict_math import NAN, NEG_INF, POS_INF, ZERO, canon, exp, log, widen

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2


@njit(inline="always", cache=True)
def _row_max(x):
    """(max, poisoned) of a unit-stride row x (every caller's rows are C-contiguous float32): the
    max ignoring NaN, on eight-float vectors (the max is order-free, so lanes and the final fold may
    take any order; a NaN lane of a vector is kept aside, never compared); poisoned when a NaN or
    +inf is present. One path only: a strided twin doubled the compile of every row kernel."""
    n = x.shape[0]
    n8 = n - n % LANES
    m = vsplat(NEG_INF)
    nan = vzero()
    for i in range(0, n8, LANES):
        v = vload_wide(x, i)
        m = vmax(m, v)
        nan = vkeep_nan(nan, v)
    mx = NEG_INF
    poisoned = False
    for lane in range(LANES):
        ml = vlane(m, lane)
        mx = ml if ml > mx else mx
        nl = vlane(nan, lane)
        poisoned = poisoned or nl != nl
    for i in range(n8, n):
        v = widen(x[i])
        mx = v if v > mx else mx
        poisoned = poisoned or v != v
    return mx, poisoned or mx == POS_INF


@njit(inline="always", cache=True)
def _row_shift(x):
    """(shift, empty) of row x: its max; NaN when poisoned; 0 for a row of -inf only (empty)."""
    m, poisoned = _row_max(x)
    empty = (not poisoned) and m == NEG_INF
    if poisoned:
        m = NAN
    elif empty:
        m = ZERO
    return m, empty


@njit(inline="always", cache=True)
def _row_stats(x, t, e):
    """(shift, S, empty) of row x; fills e with exp(x - shift) (e must not be x: see _logprob_row)."""
    m, empty = _row_shift(x)
    _exp_shifted(x, m, e)
    return m, tiled_sum(e, t), empty


@njit(cache=True)
def _exp_shifted(x, m, e):
    """e[i] = exp(x[i] - m): a call of its own, where e is one array (inlined into _softmax_row, e
    is `o` or a fresh buffer, and LLVM's vectoriser leaves the loop scalar)."""
    for i in range(x.shape[0]):
        e[i] = exp(widen(x[i]) - m)


@njit(cache=True)  # not inlined (numba's inlining compiled slower than a call)
def _softmax_row(x, t, kind, out, r):
    n = x.shape[1]
    o = out[r]
    # exp(x - shift) goes straight into the output row (overwritten below) unless it is one wide
    e = np.empty(n, np.float32) if kind == LOGSUMEXP else o
    xr = x[r]
    m, s, empty = _row_stats(xr, t, e)
    if kind == LOGSUMEXP:
        o[0] = NEG_INF if empty else canon(m + log(s))
    elif empty:  # a row of -inf only
        o[:] = NEG_INF if kind == LOG_SOFTMAX else ZERO
    elif kind == LOG_SOFTMAX:
        ls = log(s)
        for i in range(n):
            o[i] = canon((widen(xr[i]) - m) - ls)
    else:
        for i in range(n):  # o holds exp(x - shift); read and written through one name so it vectorises
            o[i] = canon(o[i] / s)


@njit(nogil=True, cache=True)
def _softmax_tasks(x, t, kind, out, work):
    """Rows claimed from ``work`` (pool.run runs it on several threads)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            _softmax_row(x, t, kind, out, r)
        lo, hi = pool.claim(work)


def _softmax_rows(x, t, kind, out):
    pool.run(_softmax_tasks, x.shape[0], x, t, kind, out, parallel=parallel_worth(x.size * 8))


def _run(x, spec, kind):
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    # float32 (exact): one compile of the row body and both drivers for every dtype (8-10 s each per dtype)
    x2 = wide(x).reshape(rows, n)  # numpy's reshape: torch's costs microseconds
    out_t, out = empty(rows, 1 if kind == LOGSUMEXP else n)
    if rows and (n or kind == LOGSUMEXP):
        _softmax_rows(x2, spec.tile, kind, out)
    return finish(out_t.reshape(x.shape[:-1] if kind == LOGSUMEXP else x.shape), x.dtype, nan_done=True)  # every output goes through canon


def softmax(x, spec):
    return _run(x, spec, SOFTMAX)


def log_softmax(x, spec):
    return _run(x, spec, LOG_SOFTMAX)


def logsumexp(x, spec):
    return _run(x, spec, LOGSUMEXP)


@njit(cache=True)  # not inlined, as _softmax_row
def _logprob_row(logits, row0, tokens, temp, scale, t, out, r):
    """out[row0 + r, :] = log p of tokens[row0 + r, :] (K tokens of one row) from row r of logits [C, V]
    (our scratch: divided by the temperature in place when scale, then overwritten by exp(logit - shift)
    once the tokens' logits are read into out: no V-wide buffer per row)."""
    v = logits.shape[1]
    row = logits[r]
    if scale:
        for i in range(v):
            row[i] = row[i] / temp
    for j in range(tokens.shape[1]):
        out[row0 + r, j] = row[tokens[row0 + r, j]]
    m, empty = _row_shift(row)
    for i in range(v):  # in place, through one name: two names for one array fail the vectoriser's overlap check
        row[i] = exp(row[i] - m)
    lse = log(tiled_sum(row, t))
    for j in range(tokens.shape[1]):
        out[row0 + r, j] = NEG_INF if empty else canon((out[row0 + r, j] - m) - lse)


@njit(nogil=True, cache=True)
def _logprob_tasks(logits, row0, tokens, temp, scale, t, out, work):
    lo, hi = pool.claim(work)
    while lo < hi:
        for r in range(lo, hi):
            _logprob_row(logits, row0, tokens, temp, scale, t, out, r)
        lo, hi = pool.claim(work)


def logprob_rows(logits, row0, tokens, temp, scale, t, out):
    """out[row0 + r, :] = log p(tokens[row0 + r, :]) from logits [C, V] (float32; tokens, out [N, K])."""
    pool.run(_logprob_tasks, logits.shape[0], logits, row0, tokens, temp, scale, t, out,
             parallel=parallel_worth(logits.size * 8))


_ROW_CHUNK = 64  # rows per chunk: at most 64 x V float32 logits exist at a time


def candidate_rows(hidden, tokens) -> tuple[int, int]:
    """(rows, tokens per row): tokens [...] is one per row of hidden [..., H]; tokens [N, K] with
    hidden [N, H] is K per row (hal.ops passes candidates flattened so)."""
    if tokens.ndim == hidden.ndim:
        return tokens.shape[0], tokens.shape[1]
    return tokens.numel(), 1


def token_logprobs(hidden, weight, tokens, temperature, spec):
    """float32 log p(tokens | hidden) for hidden [..., H], weight [V, H], tokens [...] (hidden's lead shape)
    or [N, K] for hidden [N, H] (K tokens of each row)."""
    n, k = candidate_rows(hidden, tokens)
    w = raw(weight)
    # logits [chunk, V] = hidden_chunk [chunk, H] . W [V, H]^T: each logit is the spec's tiled dot of
    # hidden[n] and W[v]; the LM head is read as stored (packed per tile panel inside the kernel).
    h2 = raw(hidden.reshape(n, hidden.shape[-1]))
    tok = array(tokens.reshape(n, k).to(torch.int64).contiguous())
    out = torch.empty((n, k), dtype=F32)
    temp = np.float32(temperature)
    for c0 in range(0, n, _ROW_CHUNK):
        c1 = min(n, c0 + _ROW_CHUNK)
        logits = dot_rows_nk(h2[c0:c1], w, spec.hidden_tile)
        logprob_rows(logits, c0, tok, temp, temperature != 1.0, spec.vocab_tile, array(out))
    return out.reshape(tokens.shape)
