"""hal/integrations/vllm/numba_guard.py without vLLM: after the guard, llvmlite's ffi ``lib`` no longer answers
dunder names, so vLLM's module scan (``hasattr(v, "__dict__")`` then ``vars(v).get``) skips it; numba still works."""
import numba
from llvmlite.binding import ffi

from hal.integrations.vllm.numba_guard import guard_llvmlite


def vllm_like_scan(value):
    """What vLLM 0.32's ``_rebind_kernels`` does with every module attribute."""
    if hasattr(value, "__dict__"):
        return vars(value).get("kernel")
    return None


def test_guard_lets_the_scan_pass_and_numba_still_compiles():
    assert guard_llvmlite() and guard_llvmlite()  # idempotent
    assert not hasattr(ffi.lib, "__dict__")
    assert vllm_like_scan(ffi.lib) is None

    @numba.njit
    def add(a, b):
        return a + b

    assert add(2, 3) == 5


def test_without_the_guard_the_scan_crashes():
    """Negative control: llvmlite's own __getattr__ (the one the guard wraps) answers __dict__ with a wrapper."""
    cls = ffi._lib_wrapper
    assert guard_llvmlite()
    guarded = cls.__getattr__
    original = guarded.__closure__[0].cell_contents  # the wrapped llvmlite __getattr__
    cls.__getattr__ = original
    try:
        ffi.lib._fntab.pop("__dict__", None)
        try:
            vllm_like_scan(ffi.lib)
        except AttributeError as e:
            assert "'_lib_fn_wrapper' object has no attribute 'get'" in str(e)
        else:
            raise AssertionError("the unguarded scan did not crash")
    finally:
        ffi.lib._fntab.pop("__dict__", None)
        cls.__getattr__ = guarded
