"""The Ascend launch layer: the same strict kernels, launched the way triton-ascend needs them.

* Physical core binding (triton-ascend migration guide): a program is bound to an AI core and the
  grid is capped at 65535 (``coreDim``); a grid larger than the core count runs in batches with
  extra device-side overhead. So a persistent launch uses ``min(work items, vector cores)``
  programs, each looping over work items ``w = pid, pid + P, pid + 2P, ...`` (the kernels' outer
  loop, see ``launch.launch(..., persistent=True)``). On CUDA the same loop runs exactly once per
  program (grid = work items), so there is one kernel source.
* ``NPU=True`` (a constexpr of those kernels) swaps the pieces triton-ascend does not document as
  usable for strict bits: correctly rounded division / square root from fma + exact int64 tests
  (strict_math.div_exact / sqrt_exact) and fp16 output rounding without shifts by a tensor amount.
* Block sizes come from the GPU layout (no 3-D register blocks): every live tile of a strict kernel
  stays well below the 192 KB unified buffer (96 KB with the default double buffering).

Nothing here imports torch_npu: the core count is asked from triton-ascend's driver only when a
persistent launch happens on an NPU tensor. Under ``TRITON_INTERPRET=1`` the variant runs on CPU
with a small fake core count (``INTERPRETER_CORES``), so every program loops over several items.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

INTERPRETER_CORES = 3          # odd and small: uneven, multi-item persistent loops in the interpreter
MAX_CORE_DIM = 65535           # triton-ascend: coreDim <= UINT16_MAX
UB_BYTES = 192 * 1024          # Atlas A2 unified buffer (docs: architecture_difference, programming_guide)
#: what a kernel's live float32 tiles may take: half of the 96 KB left by the default double buffering,
#: the rest for the compiler's temporaries (block sizes of the sequence kernels are chosen against it)
TILE_BUDGET = UB_BYTES // 4

_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("lockstep_ascend_variant", default=None)


def npu_layout() -> bool:
    """Whether the Ascend variant uses its NPU tiles (GPU layout, unified-buffer-sized blocks): always on
    an NPU; in the interpreter only with LOCKSTEP_ASCEND_NPU_LAYOUT=1 (slow: ~10 min for a 6x300 softmax
    on 2 busy cores), otherwise the interpreter's register layout, which gives the same bits (the
    triton tests compare both layouts) and leaves the persistent loop and NPU substitutes in place."""
    device = _ACTIVE.get()
    return device == "npu" or (device is not None and os.environ.get("LOCKSTEP_ASCEND_NPU_LAYOUT") == "1")


def active() -> bool:
    """True while kernels are launched as the Ascend variant (persistent grid, NPU substitutes)."""
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def variant(device_type: str):
    """Launch strict kernels as the Ascend variant inside this block (device_type 'npu' or 'cpu')."""
    token = _ACTIVE.set(device_type)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@functools.lru_cache(maxsize=None)
def _npu_vector_cores(index: int) -> int:
    import triton.runtime.driver as driver  # triton-ascend's NPU driver (only reached on an NPU)
    props = driver.active.utils.get_device_properties(index)
    return int(props["num_vectorcore"])


def core_count() -> int:
    """Programs of a persistent launch: vector cores on an NPU (the strict kernels have no tl.dot, so
    they are vector-only operators), INTERPRETER_CORES in the interpreter."""
    if _ACTIVE.get() == "npu":
        import torch
        return min(MAX_CORE_DIM, _npu_vector_cores(torch.npu.current_device()))
    return INTERPRETER_CORES


def persistent_grid(n_work: int) -> int:
    """Programs to launch for n_work work items."""
    if not active():
        return n_work
    return max(1, min(n_work, core_count()))


def fit_block(block: int, shapes) -> int:
    """The largest power-of-two block <= block whose live float32 tiles, ``shapes(block)`` (a list of
    shapes), fit TILE_BUDGET (1 if none does); block sizes of the strict kernels never change bits."""
    while block > 1 and tile_bytes(*shapes(block)) > TILE_BUDGET:
        block //= 2
    return block


def tile_bytes(*shapes_fp32) -> int:
    """Bytes of float32 tiles of the given shapes (for the unified-buffer budget checks)."""
    total = 0
    for shape in shapes_fp32:
        n = 1
        for d in shape:
            n *= d
        total += 4 * n
    return total
