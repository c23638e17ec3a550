"""``hal.aten_mode()``: make stock torch code batch-invariant on CPU by overriding aten kernels.

    with hal.aten_mode():
        y = torch.nn.Linear(64, 32)(x)      # aten::mm / addmm -> hal.matmul / hal.linear
    y = linear(x)                           # outside: torch's own kernels again

For code that is not an HF model lockstep knows (custom modules, other frameworks), in the spirit
of vLLM's and SGLang's batch-invariant modes. While the context is active the CPU kernels of

    aten::mm, addmm, bmm                  -> hal.matmul / hal.linear (fixed K tiling, float32 accumulation)
    aten::_softmax, _log_softmax          -> hal.softmax / hal.log_softmax
    aten::mean (all dims), mean.dim       -> a hal.matmul against ones, then / n
    aten::sigmoid, silu, softplus(beta=1) -> hal.sigmoid / hal.silu / hal.softplus

are replaced through ``torch.library`` (process-wide, all threads, while active), so a row's result
no longer depends on how many rows are in the call. Every overload of these ops with a CPU kernel
is overridden from one table (``OVERLOADS``): the functional form, the in-place form (``silu_``,
``sigmoid_``, ``addmm_``: computed by hal, then copied into ``self``) and the ``.out`` form (what
``out=`` and Inductor's extern kernels call). Arguments a route does not handle (float64, integer
tensors, ``beta != 1`` ...) and torch calls made while a lockstep op runs on the thread (lockstep's
own internals, ``hal.backend.kernel_running``) run torch's kernel, captured with
``torch.library.get_kernel`` before the override and called directly, so it cannot recurse.

``torch.compile``: while active, compiled functions run eagerly (``torch.compiler.set_stance
("force_eager")``). Inductor's generated code computes activations and softmax in its own fused
loops, which no aten override reaches, so a compiled graph would give torch's bits, not lockstep's.

What it cannot fix (see docs/integrations.md):
* attention written as matmul + softmax over a *padded* key axis (eager attention): the padded
  length changes the reduction's tile grid (left padding shifts it), so padded != unpadded even
  with batch-invariant matmuls -- use lockstep's attention function (varlen, per sequence);
* fused kernels that never reach these aten ops (``F.scaled_dot_product_attention``'s CPU flash
  kernel, ``F.rms_norm``, ``F.layer_norm``, conv, cumsum, ``torch.exp``/``rsqrt``/``cos`` ...),
  and ahead-of-time compiled code (AOTInductor) that calls aten kernels without the dispatcher;
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
from .backend import kernel_running
from .errors import InputError, UnsupportedError

__all__ = ["aten_mode", "OVERRIDDEN", "OVERLOADS"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

_state = threading.local()
_lock = threading.Lock()
_active = {"depth": 0, "lib": None, "stance": None}


def _inside() -> bool:
    return getattr(_state, "inside", False) or kernel_running()


@contextlib.contextmanager
def _guard():
    _state.inside = True
    try:
        with torch.no_grad():  # we run below autograd: the outer op's autograd node is already recorded
            yield
    finally:
        _state.inside = False


def _ok(*ts) -> bool:
    return all(t.dtype in _FLOATS and t.device.type == "cpu" for t in ts) and len({t.dtype for t in ts}) == 1


# ---------------------------------------------------------------- the routes
# Each takes the functional overload's arguments and returns lockstep's result, or None where it
# does not handle the arguments (then torch's own kernel runs).


def _mm(a, b):
    if not _ok(a, b):
        return None
    return ops.matmul(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    """``beta * bias + alpha * (a @ b)``. nn.Linear's case (a 1-D bias, beta = alpha = 1) is hal.linear; the
    others (a 2-D bias, ``addmm_``, other scalars) combine hal's float32 accumulator the same way, rounding
    once: hal.matmul of the float32 inputs is the accumulator a lower-precision matmul rounds."""
    if not _ok(bias, a, b):
        return None
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1]:
        return ops.linear(a, b.t(), bias)
    f32 = torch.float32
    acc = ops.matmul(a.to(f32), b.to(f32))
    if alpha != 1:
        acc = acc * alpha
    if beta != 0:  # torch's rule: beta = 0 ignores bias (NaN / inf in it included)
        acc = acc + (bias.to(f32) if beta == 1 else bias.to(f32) * beta)
    return acc.to(a.dtype).expand(a.shape[0], b.shape[1]).contiguous()


def _bmm(a, b):
    if not _ok(a, b) or a.shape[0] == 0:
        return None
    return torch.stack([ops.matmul(a[i], b[i]) for i in range(a.shape[0])])


def _softmax_like(name):
    def route(x, dim, half_to_float):
        if half_to_float or not _ok(x) or x.dim() == 0:
            return None
        return getattr(ops, name.lstrip("_"))(x, dim)
    return route


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    """Over ``dim`` (one or several dims; None or [] = all): the reduced dims, in order, are one row of a
    hal.matmul against ones."""
    xx = x if dtype is None else x.to(dtype)
    if not _ok(xx) or x.dim() == 0 or x.numel() == 0:
        return None
    dims = sorted({d % x.dim() for d in ([dim] if isinstance(dim, int) else (dim or range(x.dim())))})
    kept = [d for d in range(x.dim()) if d not in dims]
    n = 1
    for d in dims:
        n *= x.shape[d]
    moved = xx.permute(kept + dims)
    s = ops.matmul(moved.reshape(-1, n), torch.ones(n, 1, dtype=xx.dtype))
    out = (s.reshape(moved.shape[:len(kept)]) / n).to(xx.dtype)
    if keepdim:
        out = out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out


def _unary(name):
    def route(x, *extra):
        if not _ok(x) or (name == "softplus" and tuple(float(e) for e in extra[:1]) not in ((), (1.0,))):
            return None
        return getattr(elementwise, name)(x)
    return route


#: op -> its route; every overload of the op (and of its in-place op ``op_``) is overridden from this
ROUTES = {
    "mm": _mm, "addmm": _addmm, "bmm": _bmm,
    "_softmax": _softmax_like("_softmax"), "_log_softmax": _softmax_like("_log_softmax"),
    "mean": _mean,
    "sigmoid": _unary("sigmoid"), "silu": _unary("silu"), "softplus": _unary("softplus"),
}
OVERRIDDEN = tuple(ROUTES)


def _overloads():
    """(overload name, op, form) for every overload of the routed ops and their in-place ops that has a
    CPU kernel of its own, form in functional / inplace / out. The others either decompose into one of
    these (``mean``, ``mean.dtype_out``: CompositeExplicitAutograd) or have no CPU kernel at all (the
    ``out_dtype`` overloads: torch refuses them on CPU)."""
    found = []
    for op in ROUTES:
        for name in (op, op + "_"):
            packet = getattr(torch.ops.aten, name, None)
            for overload in packet.overloads() if packet is not None else ():
                qualified = name if overload == "default" else f"{name}.{overload}"
                if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{qualified}", "CPU"):
                    continue
                args = [a.name for a in getattr(packet, overload)._schema.arguments]
                form = "out" if "out" in args else "inplace" if name.endswith("_") else "functional"
                found.append((qualified, op, form))
    return tuple(found)


#: every overload overridden: (name as torch.library names it, routed op, form)
OVERLOADS = _overloads()


def _write(out: torch.Tensor, y: torch.Tensor, what: str) -> torch.Tensor:
    if out.dtype != y.dtype:
        raise InputError(f"hal.aten_mode(): {what}: out has dtype {out.dtype}, the result is {y.dtype}; "
                         f"pass an out tensor of dtype {y.dtype}")
    if out.shape != y.shape:
        out.resize_(y.shape)
    return out.copy_(y)


def _override(name: str, op: str, form: str, stock):
    """The CPU kernel of one overload: lockstep's route in this overload's form, else ``stock`` (torch's)."""
    route = ROUTES[op]

    def kernel(keyset, *args, **kwargs):
        if _inside():
            return stock.call_boxed(keyset, *args, **kwargs)
        fkwargs = dict(kwargs)
        out = fkwargs.pop("out", None)
        with _guard():
            y = route(*args, **fkwargs)
        if y is None:
            return stock.call_boxed(keyset, *args, **kwargs)
        if form == "inplace":
            return _write(args[0], y, f"aten::{name} (in place)")
        if out is not None:
            return _write(out, y, f"aten::{name}")
        return y
    return kernel


def _install():
    kernels = [(n, op, form, torch.library.get_kernel(f"aten::{n}", "CPU")) for n, op, form in OVERLOADS]
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for name, op, form, stock in kernels:
            lib.impl(name, _override(name, op, form, stock), "CPU", with_keyset=True)
    return lib


def _force_eager():
    """Make torch.compile'd functions run eagerly; the returned object's ``__exit__`` restores the stance."""
    try:
        return torch.compiler.set_stance("force_eager")  # sets it now (it is also a context manager)
    except RuntimeError as e:
        raise UnsupportedError("hal.aten_mode() cannot be entered inside a torch.compile'd function; "
                               "enter it around the call of the compiled function") from e


@contextlib.contextmanager
def aten_mode():
    """Opt-in context: CPU aten matmuls, softmaxes, means and sigmoid/silu/softplus go through hal.

    Re-entrant (nested contexts share one override). Process-wide while active: other threads'
    CPU matmuls are routed through hal too, and torch.compile'd functions run eagerly (their
    Inductor kernels would bypass the override). On exit torch's own kernels and the previous
    torch.compile stance are restored.
    """
    with _lock:
        if _active["depth"] == 0:
            stance = _force_eager()
            try:
                _active["lib"] = _install()
            except BaseException:
                stance.__exit__(None, None, None)
                raise
            _active["stance"] = stance
        _active["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["depth"] -= 1
            if _active["depth"] == 0:
                _active["lib"]._destroy()
                _active["lib"] = None
                _active["stance"].__exit__(None, None, None)
                _active["stance"] = None
