"""A process that imported numba (``import hal`` does) crashes when vLLM's CPU worker starts; this fixes it.

Root cause, for vLLM (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``, 0.32): right after loading its
plugins the CPU platform registers its Triton-kernel overrides, and that scans every module in ``sys.modules``
and every attribute value with ``hasattr(value, "__dict__")`` then ``vars(value).get("kernel")``. llvmlite's
``llvmlite.binding.ffi.lib`` (a ``_lib_wrapper``, ``__slots__`` only) answers *every* attribute through its
``__getattr__`` -- ``__dict__`` included, with a wrapped ctypes function -- so ``vars(lib)`` is not a dict and the
scan raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. The scan should not assume that
``vars(x)`` of any object is a dict (``isinstance(..., dict)``, or ``inspect.getattr_static``); llvmlite's wrapper
should not answer dunder names. Until either changes, :func:`guard_llvmlite` makes the wrapper refuse dunder names
(numba only ever asks it for ``LLVMPY_*`` functions), so the scan skips it. Plugin on or off, in every process
vLLM loads its plugins in (the front end, the engine core, each worker, an in-process engine's process).
"""
from __future__ import annotations


def guard_llvmlite() -> bool:
    """Make ``llvmlite.binding.ffi._lib_wrapper`` raise AttributeError for dunder names (idempotent).
    Returns False when llvmlite is not installed (then nothing can trip the scan)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return False
    cls = ffi._lib_wrapper
    if getattr(cls, "_lockstep_guarded", False):
        return True
    answer = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return answer(self, name)

    cls.__getattr__ = __getattr__
    cls._lockstep_guarded = True
    return True
