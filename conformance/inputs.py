"""Counter-based inputs: value i of a stream named ``key`` is a pure function of (key, i).

No library RNG is used (their streams change between versions and platforms). The hash is
SplitMix64's finaliser over ``seed(key) + i``; uniforms keep the top 24 bits, so they are exact
in every float format; "normal" values are an Irwin-Hall sum of four uniforms, computed in float64
(exact) and scaled once. Everything is integer or exactly rounded IEEE arithmetic in numpy.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _seed(key: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def hash64(key: str, n: int, offset: int = 0) -> np.ndarray:
    """n uint64 hashes of counters offset..offset+n-1 of stream ``key``."""
    with np.errstate(over="ignore"):
        z = _seed(key) + (np.arange(offset, offset + n, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniform(key: str, n: int) -> np.ndarray:
    """float64 values in [0, 1) with 24 significant bits."""
    return (hash64(key, n) >> np.uint64(40)).astype(np.float64) * 2.0 ** -24


def randn(key: str, shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Approximately standard-normal values (mean 0, variance 1) times ``scale``, rounded to dtype."""
    n = int(np.prod(shape)) if len(shape) else 1
    u = uniform(key, 4 * n).reshape(4, n)
    x = (u[0] + u[1] + u[2] + u[3] - 2.0) * (3.0 ** 0.5) * scale
    return torch.from_numpy(x.reshape(shape)).to(torch.float32).to(dtype)


def rand(key: str, shape, dtype=torch.float32, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    n = int(np.prod(shape)) if len(shape) else 1
    x = low + uniform(key, n) * (high - low)
    return torch.from_numpy(x.reshape(shape)).to(torch.float32).to(dtype)


def randint(key: str, shape, high: int) -> torch.Tensor:
    n = int(np.prod(shape)) if len(shape) else 1
    return torch.from_numpy((hash64(key, n) % np.uint64(high)).astype(np.int64).reshape(shape))


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes (bit patterns, so -0.0 and NaN payloads count)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def inputs_sha256(inputs: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(inputs):
        v = inputs[name]
        h.update(name.encode())
        h.update((tensor_sha256(v) if isinstance(v, torch.Tensor) else repr(v)).encode())
    return h.hexdigest()
