"""Host-side glue for the numba kernels: float32 views in, exact conversions and canonical NaN out,
and the floating-point environment check."""
from __future__ import annotations

import numpy as np
import torch

from hal.errors import UnsupportedError

from . import strict_math as sm

F32 = torch.float32
_CANON = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_TINY = np.float32(2.0 ** -126)


def raw(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array of t's stored values for the kernels' ``widen``: float32 as is,
    bfloat16 as its int16 bits, float16 as its uint16 bits (no widened copy)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.to(F32).numpy()


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN replaced by its dtype's canonical pattern (in place when t is ours)."""
    nan = torch.isnan(t)
    if bool(nan.any()):
        t.view(_INT_VIEW[t.dtype])[nan] = _to_signed(_CANON[t.dtype], t.dtype)
    return t


def _to_signed(v: int, dtype) -> int:
    bits = 32 if dtype == torch.float32 else 16
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def finish(out32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float32 result once to ``dtype`` (torch's conversion is round-to-nearest-even, with
    subnormals) and make its NaNs canonical (torch's vectorised bf16 conversion writes 0xFFFF)."""
    out = out32 if dtype == F32 else out32.to(dtype)
    return canonical_nan(out)


_workers_ok = False


def check_fp_environment() -> None:
    """Refuse to run under flush-to-zero / denormals-are-zero (e.g. after
    ``torch.set_flush_denormal(True)``): compiled code would flush subnormals and break the spec.

    The calling thread is probed on every call (cheap). numba's worker threads take the state of
    the thread that started them and only numba kernels run on them afterwards, so they are probed
    until they pass once (a parallel launch per call would cost more than a small op)."""
    global _workers_ok
    ok = sm._probe_one(_TINY)
    if ok and not _workers_ok:
        ok = _workers_ok = bool(sm._probe_par(_TINY, 64).all())
    if not ok:
        raise UnsupportedError(
            "backend 'cpu': the floating-point unit flushes subnormals to zero (FTZ/DAZ is set, e.g. by "
            "torch.set_flush_denormal(True)); the strict specs forbid flushing. Call "
            "torch.set_flush_denormal(False) (in the thread that set it) or use backend='reference'.")
