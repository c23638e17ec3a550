"""Stand-ins for ``tl.dot`` in the Triton interpreter (TRITON_INTERPRET=1): :func:`sequential_dot` for the fast
kernels, :func:`strict_dot` for the strict kernels' fp32 ``ieee`` dots.

The interpreter's own ``tl.dot`` is ``np.matmul`` (BLAS: its summation order may follow the shapes and
the thread count) and reads bfloat16 tiles as their raw uint16 bits. On the GPU, a tensor-core dot's
output element depends only on its row of A, its column of B, the accumulator and the K tile; the
stand-in has exactly that property and nothing more: per output element, a sequential float32 chain
from +0.0 over the tile's K in increasing order (products of bfloat16/float16 values are exact in
float32), then added to the accumulator. So a fast kernel's *structure* (which tiles, in what order,
what decides them) is testable on CPU: L0-L3 checks fail when a tile size, a split or the K order
follows the batch. The hardware's own in-tile arithmetic is only measured on a GPU.

Under FastMatmulV3Spec (``sequential_dot(k_step=16)``) the chain follows v3's rule instead: per output element,
one chain of ``k_step`` products from +0.0 per step of ``k_step`` K values (one bf16 / fp16 ``wgmma`` k16
instruction), each step's sum added to the accumulator in increasing K order. Then the tile's block_k decides
nothing (a tile of 256 is 16 steps, one of 64 is 4 steps of the same chain), which is what v3 frees: the
interpreter gives every v3 launch the same bits, as v3 claims the GPU does (the claim the device sweep checks).

The strict kernels' dots (float32 operands, ``input_precision="ieee"``, NVIDIA) lower to one fma chain per output
over k in order, from the accumulator given; :func:`strict_dot` makes the interpreter do exactly that: acc =
fma(a_k, b_k, acc) for k in order, one rounding per step (the interpreter's own correctly rounded float32 fma).
The fast stand-in (chain from +0.0 with the product rounded first, then the accumulator added) is exact only for
bf16 / fp16 operands, whose products float32 holds exactly.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

_lock = threading.Lock()


def _as_float32(handle) -> np.ndarray:
    import triton.language as tl
    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:  # stored as uint16 bits
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _chain_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle
    a32, b32 = _as_float32(a), _as_float32(b)
    part = np.zeros(d.data.shape, dtype=np.float32)
    with np.errstate(all="ignore"):  # NaN/inf inputs propagate as IEEE says; no warnings
        for k in range(a32.shape[-1]):
            part = part + a32[..., :, k:k + 1] * b32[..., k:k + 1, :]
        out = d.data.astype(np.float32) + part
    return TensorHandle(out, d.dtype.scalar)


def _stepped_chain_dot(k_step):
    """The v3 stand-in: the chain of _chain_dot per k_step K values, each step's sum added to the accumulator."""
    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        from triton.runtime.interpreter import TensorHandle
        a32, b32 = _as_float32(a), _as_float32(b)
        acc = d.data.astype(np.float32)
        with np.errstate(all="ignore"):
            for k0 in range(0, a32.shape[-1], k_step):
                part = np.zeros(d.data.shape, dtype=np.float32)
                for k in range(k0, min(k0 + k_step, a32.shape[-1])):
                    part = part + a32[..., :, k:k + 1] * b32[..., k:k + 1, :]
                acc = acc + part
        return TensorHandle(acc, d.dtype.scalar)
    return dot


def _fma_chain_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle, _interpreter
    a32, b32 = _as_float32(a), _as_float32(b)
    acc = np.array(d.data, dtype=np.float32)
    for k in range(a32.shape[-1]):
        x, y, z = np.broadcast_arrays(a32[..., :, k:k + 1], b32[..., k:k + 1, :], acc)
        acc = np.asarray(_interpreter.fma_fp32(np.ascontiguousarray(x), np.ascontiguousarray(y),
                                               np.ascontiguousarray(z)), dtype=np.float32)
    return TensorHandle(acc, d.dtype.scalar)


@contextlib.contextmanager
def _patched_dot(dot):
    from .launch import interpreting
    if not interpreting():
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder
    with _lock:
        saved = InterpreterBuilder.create_dot
        InterpreterBuilder.create_dot = dot
        try:
            yield
        finally:
            InterpreterBuilder.create_dot = saved


def strict_dot():
    """Inside: the interpreter's ``tl.dot`` is NVIDIA's fp32 FMA dot (an fma chain over k in order from the
    accumulator); no-op outside the interpreter."""
    return _patched_dot(_fma_chain_dot)


def sequential_dot(k_step: int | None = None):
    """Inside: the interpreter's ``tl.dot`` is the sequential chain above (no-op outside the interpreter); with
    ``k_step``, v3's chain of one step per ``k_step`` K values."""
    return _patched_dot(_chain_dot if k_step is None else _stepped_chain_dot(k_step))
