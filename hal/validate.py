"""Argument checks shared by the public ops. Each error names the argument, what it got and what
it needs. Checks run before any backend is touched, so a bad call changes nothing."""
from __future__ import annotations

import math

import torch

from .backend import FLOAT_DTYPES
from .errors import InputError

_ACCEPTED = FLOAT_DTYPES + (torch.float64,)


def tensor(name: str, t, *, ndim_min: int | None = None, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if ndim_min is not None and t.dim() < ndim_min:
        raise InputError(f"{name} must have at least {ndim_min} dims, got shape {tuple(t.shape)}")
    return t


def floating(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _ACCEPTED:
        raise InputError(f"{name} has dtype {t.dtype}; lockstep ops take float32, bfloat16 or float16 "
                         "(float64 runs the float64 oracle, for gradient checks) -- cast it with .to(torch.float32)")
    return t


def integer(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in (torch.int64, torch.int32):
        raise InputError(f"{name} must be an int64 or int32 tensor, got {t.dtype}")
    return t


def same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    dtypes = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise InputError(f"dtypes differ ({listing}); cast them to one dtype")
    return next(iter(dtypes.values()))


def dim_eq(what: str, got: int, want: int, fix: str = "") -> None:
    if got != want:
        raise InputError(f"{what}: {got} != {want}" + (f"; {fix}" if fix else ""))


def positive_finite(name: str, v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {v!r}") from None
    if not (math.isfinite(f) and f > 0):
        raise InputError(f"{name} must be a finite number > 0, got {v!r}")
    return f


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise InputError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim
