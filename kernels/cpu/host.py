"""Host-side glue for the numba kernels: float32 views in, exact conversions and canonical NaN out
(the threads they run on: pool.py)."""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

F32 = torch.float32


def array(t: torch.Tensor) -> np.ndarray:
    """The numpy array sharing t's memory: the one way a tensor reaches a kernel.

    ``np.from_dlpack``, never ``t.numpy()``: ``.numpy()`` marks t's storage non-resizable for good,
    and FSDP2 then fails to free an unsharded parameter ("Trying to resize storage that is not
    resizable"); a DLPack view leaves the storage as it was."""
    return np.from_dlpack(t.detach())


def raw(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array of t's stored values for the kernels' ``widen``: float32 as is,
    bfloat16 as its int16 bits, float16 as its uint16 bits (no widened copy)."""
    if t.dtype is F32 and t.is_contiguous():
        return array(t)  # the common case, without the conversions below (each costs a microsecond)
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return array(t.view(torch.int16))
    if t.dtype == torch.float16:
        return array(t.view(torch.int16)).view(np.uint16)
    return array(t.to(F32))


def wide(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous float32 numpy array of t's values, bf16 / fp16 widened exactly (as ``widen``
    does inside a kernel). The kernel then compiles once for all three dtypes instead of once per
    dtype (seconds per kernel, 20 s and more for a large one), for the price of one copy: for inputs
    far smaller than the kernel's work (attention's queries, the gated delta rule's tokens) and for
    row-wise kernels (softmax, elementwise, the GDN layer pieces). Not for large operands
    read in place (matmul weights, the LM head): those go through :func:`raw`."""
    return raw(t if t.dtype is F32 else t.to(F32))


def empty(*shape: int) -> tuple[torch.Tensor, np.ndarray]:
    """A new float32 output, as (tensor, the numpy array sharing its memory). torch allocates it, so
    its storage stays resizable (``torch.from_numpy``'s memory belongs to numpy and is not)."""
    t = torch.empty(shape, dtype=F32)
    return t, array(t)


def zeros(*shape: int) -> tuple[torch.Tensor, np.ndarray]:
    """As :func:`empty`, filled with +0.0 (the start of the spec's tile-partial sums)."""
    t = torch.zeros(shape, dtype=F32)
    return t, array(t)


def tensor(a: np.ndarray) -> torch.Tensor:
    """A kernel's own numpy result as a tensor with torch's (resizable) storage: a copy, as
    ``torch.from_numpy`` would hand out numpy's memory, which torch cannot resize."""
    t = torch.empty(a.shape, dtype=torch.from_numpy(a[:0].reshape(-1)).dtype)
    array(t)[...] = a
    return t


#: per dtype: (mask of the bits below the sign, +inf's bits, canonical NaN); NaN <=> (bits & mask) > inf
_NAN_WORDS = {torch.float32: (0x7FFFFFFF, 0x7F800000, 0x7FC00000), torch.bfloat16: (0x7FFF, 0x7F80, 0x7FC0),
              torch.float16: (0x7FFF, 0x7C00, 0x7E00)}
_NP_INT = {torch.float32: np.int32, torch.bfloat16: np.int16, torch.float16: np.int16}


@njit(cache=True)
def _canon_bits(v, mask, inf, nan):
    for i in range(v.shape[0]):  # a select, not a branch: the loop vectorises
        v[i] = nan if (v[i] & mask) > inf else v[i]


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN replaced by its dtype's canonical pattern (in place when t is ours).
    One compiled pass over the bits of a contiguous t (torch's isnan + mask allocate and cost more
    than most kernels here)."""
    if not t.is_contiguous():
        return t.copy_(canonical_nan(t.contiguous()))
    dt = t.dtype
    a = array(t if dt is F32 else t.view(torch.int16))  # numpy's reshape / view cost a fraction of torch's
    _canon_bits(a.reshape(-1).view(_NP_INT[dt]), *_NAN_WORDS[dt])
    return t


def finish(out32: torch.Tensor | np.ndarray, dtype: torch.dtype, nan_done: bool = False) -> torch.Tensor:
    """Round a float32 result once to ``dtype`` (torch's conversion is round-to-nearest-even, with
    subnormals) and make its NaNs canonical (torch's vectorised bf16 conversion writes 0xFFFF).
    ``nan_done``: the kernel already stored canonical NaNs (a float32 result is then returned as is).
    A kernel's own numpy result is returned in torch's storage (see :func:`tensor`)."""
    if isinstance(out32, np.ndarray):
        out32 = tensor(out32) if dtype is F32 else torch.from_numpy(out32)  # .to(dtype) below copies anyway
    if dtype is F32:
        return out32 if nan_done else canonical_nan(out32)
    return canonical_nan(out32.to(dtype))
