"""The weight watch's hash (hal/weight_watch.py, where it is defined) of a CPU tensor's lanes: one pass, no
temporaries, blocks of rows on lockstep's threads (pool.py) for large tensors -- not numba's parallel layer,
which in vLLM-CPU's worker reset torch's thread count to one for the worker's life."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import pool

_ROWS_PER_TASK = 64  # rows of lanes each task sums
_THREADS_FROM = 1 << 20  # lanes: below, handing ranges to other threads costs more than the pass


@njit(inline="always", cache=True)
def _row(lane, a, r):
    h = np.int64(0)
    for j in range(lane.shape[1]):
        h += np.int64(lane[r, j]) * a[j]
    return h


@njit(nogil=True, cache=True)
def _hash_tasks(lane, a, b, partial, work):
    """partial[task] = the sum of the task's rows, for the tasks claimed from ``work`` (a sum modulo 2**64
    is the same in any order, so the partials add to the serial value)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            h = np.int64(0)
            for r in range(task * _ROWS_PER_TASK, min((task + 1) * _ROWS_PER_TASK, lane.shape[0])):
                h += _row(lane, a, r) * b[r]
            partial[task] = h
        lo, hi = pool.claim(work)


def lane_hash(lane: np.ndarray, a: np.ndarray, b: np.ndarray) -> int:
    """sum_r b[r] * sum_j a[j] * lane[r, j] modulo 2**64 (lane [rows, length] int8 / int16; a, b int64)."""
    partial = np.zeros(-(-lane.shape[0] // _ROWS_PER_TASK), np.int64)
    pool.run(_hash_tasks, partial.shape[0], lane, a, b, partial, parallel=lane.size >= _THREADS_FROM)
    return int(partial.sum())  # numpy's int64 sum wraps modulo 2**64, as the kernel's does
