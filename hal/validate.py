"""Argument checks shared by the public ops. Each error names the argument, what it got and what
it needs. Checks run before any backend is touched, so a bad call changes nothing."""
from __future__ import annotations

import math
import numbers
import operator
import struct

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
    return real_device(name, t)  # integer arguments (tokens, offsets, tables) are read before dispatch


def same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    first = None
    for t in tensors.values():  # the common case (one dtype) in a plain loop: this runs on every call
        if t is not None:
            if first is None:
                first = t.dtype
            elif t.dtype is not first:  # torch dtypes are singletons
                break
    else:
        return first
    dtypes = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise InputError(f"dtypes differ ({listing}); cast them to one dtype")
    return next(iter(dtypes.values()))


def dim_eq(what: str, got: int, want: int, fix: str = "") -> None:
    if got != want:
        raise InputError(f"{what}: {got} != {want}" + (f"; {fix}" if fix else ""))


_F32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


def as_float32(f: float) -> float:
    """``f`` rounded to the nearest float32 (ties to even: the conversion the kernels' float32 arguments go
    through), infinite where that overflows. Plain Python (``struct``): a torch scalar tensor costs microseconds,
    and every norm and softmax call checks its scalars."""
    try:
        return struct.unpack("f", struct.pack("f", f))[0]
    except OverflowError:  # finite, but past float32's largest value once rounded
        return math.copysign(math.inf, f)


def scalar(name: str, value, *, positive: bool = False, reciprocal: bool = False) -> float:
    """A real-number argument, checked as the float32 number the kernels use (they round it to float32).

    Rejects bool and str (not numbers), non-finite values and values that overflow float32;
    ``positive``: the float32 value must be > 0 (else >= 0); ``reciprocal``: the op divides by it,
    so it must be a normal float32 (its reciprocal is then finite). Returns ``float(value)``.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and (value.dtype.is_floating_point or
                                                                 value.dtype in (torch.int32, torch.int64)):
        value = value.item()
    f = _real_number(name, value)
    f32 = as_float32(f)
    if not math.isfinite(f32):
        raise InputError(f"{name} must be finite as the float32 number the op uses, got {value!r} "
                         f"(float32: {f32})")
    if f32 < 0 or (positive and f32 == 0):
        raise InputError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}"
                         + (f" (float32: {f32})" if f32 != f else ""))
    if reciprocal and f32 < _F32_TINY:
        raise InputError(f"{name} = {value!r} is {f32!r} in float32, below the smallest normal float32 "
                         f"({_F32_TINY!r}): dividing by it overflows; use a larger {name}")
    return f


def index_scalar(name: str, value, *, minimum: int | None = None) -> int:
    """An integer argument: an int (or integer tensor of 0 dims), never a bool or a float to truncate."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype in (torch.int32, torch.int64):
        value = value.item()
    if isinstance(value, bool):
        raise InputError(f"{name} must be an int, got bool {value!r}")
    try:
        i = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and i < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {i}")
    return i


def positive_finite(name: str, v) -> float:
    """A finite number > 0 (see :func:`scalar`)."""
    return scalar(name, v, positive=True)


def nonempty_axis(name: str, t: torch.Tensor, dim: int, what: str) -> None:
    if t.shape[dim] == 0:
        raise InputError(f"{name} has an empty axis {dim} (shape {tuple(t.shape)}): {what} over no elements is "
                         "undefined; pass at least one element")


def real_device(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        raise InputError(f"{name} is on the meta device (no data), but its values are read to check the "
                         "call; pass a real tensor")
    return t


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise InputError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def _real_number(name: str, value) -> float:
    """``float(value)`` of an int or float (never a bool or a str), as an InputError naming ``name`` if not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{name} must be a real number (int or float), got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise InputError(f"{name} = {value!r} does not fit a float") from None


def real(name: str, value, *, allow_inf: bool = False) -> float:
    """A real-number parameter used in float64 math (not rounded to float32, unlike :func:`scalar`): an
    int, float or 0-dim real tensor, never a bool, a str or NaN; +-inf only with ``allow_inf``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex and value.dtype != torch.bool:
        value = value.item()
    f = _real_number(name, value)
    if math.isnan(f) or (math.isinf(f) and not allow_inf):
        raise InputError(f"{name} must be a {'non-NaN' if allow_inf else 'finite'} number, got {value!r}")
    return f


def broadcasts_to(shape, want) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``want`` (numpy's rule, right-aligned: each dim of
    ``shape`` is want's or 1, and it has no more dims). Plain Python: torch.broadcast_shapes costs ~30 us a call,
    about the whole kernel of a decode step's rotary."""
    shape, want = tuple(shape), tuple(want)
    return len(shape) <= len(want) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(want)))


def mask01(name: str, t, shape) -> torch.Tensor:
    """A token mask of ``shape``: bool, or integer / float values that are all exactly 0 or 1 (never a
    0.5 that would silently count as True). Returns it as bool."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a tensor of shape {tuple(shape)} (True/1 = counts), got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {tuple(shape)} (True/1 = counts), got {tuple(t.shape)}")
    if t.dtype == torch.bool:
        return t
    if t.dtype.is_complex:
        raise InputError(f"{name} must be bool or 0/1 numbers, got {t.dtype}")
    real_device(name, t)
    if not bool(((t == 0) | (t == 1)).all()):
        bad = t[(t != 0) & (t != 1)].reshape(-1)[0].item()
        raise InputError(f"{name} must be bool or hold only 0 and 1, got the value {bad!r}")
    return t != 0


def offsets(name: str, t, total: int) -> torch.Tensor:
    """Sequence offsets (cu_seqlens): a 1-D integer tensor, non-decreasing from 0 to ``total``; never
    floats (they would be truncated). Returns int64 on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be an int64/int32 tensor of offsets, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor of offsets, got {t.dtype} (floats would be truncated); "
                         f"cast whole numbers with .to(torch.int64)")
    cu = real_device(name, t).to(torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise InputError(f"{name} must be non-decreasing offsets from 0 to {total}, got "
                         f"{cu.tolist() if cu.dim() <= 1 else tuple(cu.shape)}")
    return cu


def packed_offsets(cu_seqlens, x) -> list[int] | None:
    """The sequence offsets of a packed ``x [1, total_tokens, ...]`` as ints (None without ``cu_seqlens``): N+1
    strictly increasing offsets from 0 to ``total_tokens``, every sequence at least one token (the gated delta
    rule's and the GDN conv's packing, as FLA's)."""
    if cu_seqlens is None:
        return None
    tensor("cu_seqlens", cu_seqlens, ndim=1)
    integer("cu_seqlens", cu_seqlens)
    if x.shape[0] != 1:
        raise InputError(f"with cu_seqlens the inputs must be packed as [1, total_tokens, heads, dim]; got batch "
                         f"{x.shape[0]} (flatten the batch into the token axis)")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != x.shape[1]:
        raise InputError(f"cu_seqlens must start at 0 and end at the total token count {x.shape[1]} "
                         f"(N sequences -> N+1 offsets); got {cu}")
    bad = [i for i in range(len(cu) - 1) if cu[i + 1] <= cu[i]]
    if bad:
        i = bad[0]
        raise InputError(f"cu_seqlens must be strictly increasing (every sequence has >= 1 token); "
                         f"cu_seqlens[{i}] = {cu[i]} >= cu_seqlens[{i + 1}] = {cu[i + 1]}")
    return cu
