"""``hal.aten_mode()``: make stock torch code batch-invariant on CPU by overriding aten kernels.

    with hal.aten_mode():
        y = torch.nn.Linear(64, 32)(x)      # aten::mm / addmm -> hal.matmul / hal.linear
    y = linear(x)                           # outside: torch's own kernels again

For code that is not an HF model lockstep knows (custom modules, other frameworks), in the spirit
of vLLM's and SGLang's batch-invariant modes. While the context is active the CPU kernels of

    aten::mm, addmm, bmm                  -> hal.matmul / hal.linear (fixed K tiling, float32 accumulation)
    aten::_softmax, _log_softmax          -> hal.softmax / hal.log_softmax
    aten::mean.dim (one dim)              -> a hal.matmul against ones, then / n
    aten::sigmoid, silu, softplus(beta=1) -> hal.sigmoid / hal.silu / hal.softplus

are replaced through ``torch.library`` (process-wide, all threads, while active), so a row's result
no longer depends on how many rows are in the call. Arguments the override does not handle (float64,
integer tensors, ``beta != 1`` ...) and calls made from inside lockstep's own kernels run torch's
stock kernel (reached through the op's ``.out`` overload, which is not overridden).

What it cannot fix (see docs/integrations.md):
* attention written as matmul + softmax over a *padded* key axis (eager attention): the padded
  length changes the reduction's tile grid (left padding shifts it), so padded != unpadded even
  with batch-invariant matmuls -- use lockstep's attention function (varlen, per sequence);
* fused kernels that never reach these aten ops (``F.scaled_dot_product_attention``'s CPU flash
  kernel, ``F.rms_norm``, ``F.layer_norm``, conv, cumsum, ``torch.exp``/``rsqrt``/``cos`` ...);
* anything on a non-CPU device (only CPU kernels are overridden);
* backward passes keep their own order of work beyond the matmuls they dispatch (no claim).
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch

# The ops modules themselves, not the hal package (which imports this module: no import circle).
from . import elementwise, ops

__all__ = ["aten_mode", "OVERRIDDEN"]

OVERRIDDEN = ("mm", "addmm", "bmm", "_softmax", "_log_softmax", "mean.dim", "sigmoid", "silu", "softplus")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

_state = threading.local()
_lock = threading.Lock()
_active = {"depth": 0, "lib": None}


def _inside() -> bool:
    return getattr(_state, "inside", False)


@contextlib.contextmanager
def _guard():
    _state.inside = True
    try:
        with torch.no_grad():  # we run below autograd: the outer op's autograd node is already recorded
            yield
    finally:
        _state.inside = False


def _stock(packet, overload: str, *args, **kwargs):
    """torch's own kernel: shape from the meta kernel, then the ``.out`` overload (not overridden)."""
    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t
    ref = getattr(packet, overload)(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    out = torch.empty(ref.shape, dtype=ref.dtype, device=args[0].device)
    return packet.out(*args, **kwargs, out=out)


def _ok(*ts) -> bool:
    return not _inside() and all(t.dtype in _FLOATS and t.device.type == "cpu" for t in ts) and \
        len({t.dtype for t in ts}) == 1


def _mm(a, b):
    if not _ok(a, b):
        return _stock(torch.ops.aten.mm, "default", a, b)
    with _guard():
        return ops.matmul(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not (_ok(bias, a, b) and beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1]):
        return _stock(torch.ops.aten.addmm, "default", bias, a, b, beta=beta, alpha=alpha)
    with _guard():
        return ops.linear(a, b.t(), bias)


def _bmm(a, b):
    if not _ok(a, b):
        return _stock(torch.ops.aten.bmm, "default", a, b)
    with _guard():
        return torch.stack([ops.matmul(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else \
            _stock(torch.ops.aten.bmm, "default", a, b)


def _softmax_like(name):
    packet = getattr(torch.ops.aten, name)

    def fn(x, dim, half_to_float):
        if half_to_float or not _ok(x) or x.dim() == 0:
            return _stock(packet, "default", x, dim, half_to_float)
        with _guard():
            return getattr(ops, name.lstrip("_"))(x, dim)
    return fn


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    xx = x if dtype is None else x.to(dtype)
    if len(dims) != 1 or not _ok(xx) or x.dim() == 0 or x.shape[dims[0]] == 0:
        return _stock(torch.ops.aten.mean, "dim", x, dim, keepdim, dtype=dtype)
    d = dims[0] % x.dim()
    n = x.shape[d]
    with _guard():
        moved = xx.movedim(d, -1)
        s = ops.matmul(moved.reshape(-1, n), torch.ones(n, 1, dtype=xx.dtype))
        out = (s.reshape(moved.shape[:-1]) / n).to(xx.dtype)
        return out.unsqueeze(d) if keepdim else out


def _unary(name):
    packet = getattr(torch.ops.aten, name)

    def fn(x, *extra):
        if not _ok(x) or (name == "softplus" and tuple(float(e) for e in extra[:1]) not in ((), (1.0,))):
            return _stock(packet, "default", x, *extra)
        with _guard():
            return getattr(elementwise, name)(x)
    return fn


def _install():
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        lib.impl("mm", _mm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
        lib.impl("bmm", _bmm, "CPU")
        lib.impl("_softmax", _softmax_like("_softmax"), "CPU")
        lib.impl("_log_softmax", _softmax_like("_log_softmax"), "CPU")
        lib.impl("mean.dim", _mean_dim, "CPU")
        for name in ("sigmoid", "silu", "softplus"):
            lib.impl(name, _unary(name), "CPU")
    return lib


@contextlib.contextmanager
def aten_mode():
    """Opt-in context: CPU aten matmuls, softmaxes, mean.dim and sigmoid/silu/softplus go through hal.

    Re-entrant (nested contexts share one override). Process-wide while active: other threads'
    CPU matmuls are routed through hal too. On exit torch's own kernels are restored.
    """
    with _lock:
        if _active["depth"] == 0:
            _active["lib"] = _install()
        _active["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["depth"] -= 1
            if _active["depth"] == 0:
                _active["lib"]._destroy()
                _active["lib"] = None
