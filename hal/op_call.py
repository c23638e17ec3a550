"""What every public op module does around its backend call, in one place: resolve the spec and the backend for
validated tensors, ask whether autograd must record the call, and pick the precision its backward computes in.

hal/ops.py, hal/elementwise.py, hal/attention.py, hal/gated_delta_rule.py and hal/gdn_layer.py import these; they are
lockstep's internal API for op modules (an out-of-tree op may use them too), not part of ``hal``'s public namespace.
"""
from __future__ import annotations

import torch

from . import dispatch

__all__ = ["resolve", "needs_grad", "backward_dtype"]


def resolve(op: str, spec, backend, dtype: torch.dtype, **tensors):
    """``(spec, backend)`` for a call of ``op`` whose ``tensors`` were validated: the spec resolved against the op's
    family (no spec: the family's spec under the policy in force, ``hal.use(policy=...)``), the backend chosen for the
    tensors' common device (hal/dispatch.py)."""
    s = dispatch.call_spec(op, spec)
    device = dispatch.common_device(tensors)
    return s, dispatch.select(op, s, dtype, device, backend)


def needs_grad(*ts) -> bool:
    """True when autograd is on and any tensor among ``ts`` requires a gradient (non-tensors are skipped)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def backward_dtype(t: torch.Tensor) -> torch.dtype:
    """The precision a backward computes in: float64 for float64 (the oracle) inputs, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
