"""Wrong variants of the Triton kernels and launchers, made from the outside for the negative controls of the
check scripts (the production code carries no test switch). Each is a context manager that swaps a module
attribute for the duration, as _swapped_chain.py does for the chain helpers:

* ``kernel_variant(module, name, old, new)``: the ``@triton.jit`` kernel ``module.name`` recompiled from its
  own source with the one line ``old`` replaced by ``new`` (refused unless ``old`` occurs exactly once, so a
  kernel edit that moves the line fails the control loudly instead of testing nothing);
* ``dropped_last_work_item()``: persistent launches (kernels/triton/launch.py) skip their last work item;
* ``two_rounding_dot()``: the interpreter's strict tl.dot stand-in replaced by the fast kernels' (the product
  rounded, then added: two roundings per step), which a check of an FMA-dot kernel must catch.

Kernels and launchers are looked up as module attributes when a launch runs, so swapping the attribute
reaches every later call (in the interpreter and on a GPU alike)."""
from __future__ import annotations

import contextlib
import inspect
import linecache
import textwrap

from hal.kernels.triton import interpreter_dot as _interpreter_dot, launch as _launch

_counter = 0


@contextlib.contextmanager
def kernel_variant(module, name: str, old: str, new: str):
    global _counter
    real = getattr(module, name)
    source = textwrap.dedent(inspect.getsource(real.fn))
    if source.count(old) != 1:
        raise AssertionError(f"{module.__name__}.{name}: expected the line {old!r} exactly once, found "
                             f"{source.count(old)}: the negative control must be updated with the kernel")
    _counter += 1
    # a file name of its own in linecache: Triton (and inspect) read a kernel's source back from there
    filename = f"<negative control {_counter}: {module.__name__}.{name}>"
    text = source.replace(old, new)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = dict(vars(module))  # the kernel's helpers, constants and tl resolve as in the real module
    exec(compile(text, filename, "exec"), namespace)
    setattr(module, name, namespace[name])
    try:
        yield
    finally:
        setattr(module, name, real)


@contextlib.contextmanager
def dropped_last_work_item():
    real = _launch.persistent_args

    def short(grid):
        n_work, kwargs = real(grid)
        return (n_work - 1 if n_work > 1 else n_work), kwargs  # the grid shrinks with it: one item is never run

    _launch.persistent_args = short
    try:
        yield
    finally:
        _launch.persistent_args = real


@contextlib.contextmanager
def two_rounding_dot():
    strict = _interpreter_dot._fma_chain_dot
    _interpreter_dot._fma_chain_dot = _interpreter_dot._chain_dot
    try:
        yield
    finally:
        _interpreter_dot._fma_chain_dot = strict
