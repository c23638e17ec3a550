"""The negative control of the vector-load chains, shared by the interpreter check scripts: while
``swapped_neighbours()`` is active, kernels/triton/common.py's ``eight`` / ``four`` (and ``halves`` / ``floats32``,
the int64-word chains') hand back two neighbouring elements swapped, so every chain fed through them adds element i+1 before element i. A bit check that does
not catch it cannot see the chain order. (The kernels look ``common.eight`` up when they run in the
interpreter, so patching the module attribute reaches them.)"""
from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from hal.kernels.triton import common

_REAL_EIGHT, _REAL_FOUR = common.eight, common.four
_REAL_HALVES, _REAL_FLOATS32 = common.halves, common.floats32


@triton.jit
def _swapped_eight(x, D0: tl.constexpr, D1: tl.constexpr):
    x0, x1, x2, x3, x4, x5, x6, x7 = _REAL_EIGHT(x, D0, D1)
    return x0, x1, x2, x3, x5, x4, x6, x7


@triton.jit
def _swapped_four(x, D0: tl.constexpr, D1: tl.constexpr):
    x0, x1, x2, x3 = _REAL_FOUR(x, D0, D1)
    return x0, x2, x1, x3


@triton.jit
def _swapped_halves(w, DT: tl.constexpr):
    x0, x1 = _REAL_HALVES(w, DT)
    return x1, x0


@triton.jit
def _swapped_floats32(w):
    x0, x1 = _REAL_FLOATS32(w)
    return x1, x0


@contextlib.contextmanager
def swapped_neighbours():
    common.eight, common.four = _swapped_eight, _swapped_four
    common.halves, common.floats32 = _swapped_halves, _swapped_floats32  # the int64-word chains (dot_tile_words)
    try:
        yield
    finally:
        common.eight, common.four = _REAL_EIGHT, _REAL_FOUR
        common.halves, common.floats32 = _REAL_HALVES, _REAL_FLOATS32
