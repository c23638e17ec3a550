"""The content stamp of an exact weight: a 64-bit fingerprint of its raw bits, recomputed on each use.

A prepared weight's slices are valid only for the bits they were cut from. torch's version counter
does not see every write (fused optimizers, ``w.data.copy_``, a storage rebound twice that lands on
the old address) and inference tensors have none, so staleness is decided by the bits themselves.

The hash (one definition, two implementations with the same value): the weight [N, K] read as int16
lanes in row-major order (each float32 is two lanes, low half first), each lane sign-extended to
int64; ``h = sum_r b[r] * sum_j a[j] * lane[r, j]`` modulo 2**64, with ``a``, ``b`` fixed
pseudo-random int64 coefficients. For a given change of the bits (a nonzero difference ``D`` of
lane values, every ``|D| < 2**16``, so at most 15 trailing zero bits) a row sum misses it with
probability at most 2**-49 over the coefficients, and the sum over rows again: a change goes unseen
with probability about 2**-43 or less, whatever its pattern (sign flips, swaps, shifts, one ulp).

``hash_torch`` is the readable definition and runs on every device; CPU tensors use ``_hash_cpu``
(numba, one pass, no temporaries; rows on threads for large weights): tests/test_exact_fresh.py
checks that they give the same value. The hash reads every byte of the weight, as the exact
GEMV reads every byte of its slices: its cost per forward is measured in benchmarks/exact_stamp.py.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit, prange

_SEED_A, _SEED_B = 0x5EED_A, 0x5EED_B
_CHUNK = {"cpu": 1 << 18}  # lanes per torch pass: a CPU's chunk of int64 products stays in cache
_CHUNK_OTHER = 1 << 24  # an accelerator: few launches (a 128 MiB temporary)


@functools.lru_cache(maxsize=256)
def _coefficients(n: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g, dtype=torch.int64).to(device)


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The 2-D tensor's bits as int16 [N, lanes per row] in row-major element order (a view when the
    last axis is unit-stride, else a copy)."""
    t = t.detach()
    if t.stride(-1) != 1:
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t.view(torch.int16)


def hash_torch(lane: torch.Tensor) -> int:
    """The definition, in torch integer ops (int64 arithmetic wraps modulo 2**64)."""
    n, length = lane.shape
    a = _coefficients(length, _SEED_A, lane.device)
    b = _coefficients(n, _SEED_B, lane.device)
    rows = torch.empty(n, dtype=torch.int64, device=lane.device)
    step = max(1, _CHUNK.get(lane.device.type, _CHUNK_OTHER) // max(length, 1))
    for r in range(0, n, step):
        torch.sum(lane[r:r + step] * a, dim=1, out=rows[r:r + step])
    return int((rows * b).sum())


@njit(inline="always", cache=True)
def _row(lane, a, r):
    h = np.int64(0)
    for j in range(lane.shape[1]):
        h += np.int64(lane[r, j]) * a[j]
    return h


@njit(cache=True)
def _hash_cpu(lane, a, b):
    h = np.int64(0)
    for r in range(lane.shape[0]):
        h += _row(lane, a, r) * b[r]
    return h


@njit(parallel=True, cache=True)
def _hash_cpu_threads(lane, a, b):
    h = np.int64(0)
    for r in prange(lane.shape[0]):  # a sum modulo 2**64: the same value in any order
        h += _row(lane, a, r) * b[r]
    return h


_THREADS_FROM = 1 << 20  # lanes: below, starting numba's threads costs more than the pass


def content_hash(t: torch.Tensor) -> int:
    """The fingerprint of a 2-D float32/bfloat16/float16 tensor's bits (inference tensors included)."""
    lane = lanes(t)
    if lane.device.type != "cpu":
        return hash_torch(lane)
    n, length = lane.shape
    a = _coefficients(length, _SEED_A, lane.device).numpy()
    b = _coefficients(n, _SEED_B, lane.device).numpy()
    kernel = _hash_cpu_threads if lane.numel() >= _THREADS_FROM else _hash_cpu
    return int(kernel(lane.numpy(), a, b))
