"""The one way a strict Triton kernel is launched.

* fp fusion OFF (``enable_fp_fusion=False``, a launch option since Triton 2.2, still in 3.6 and 3.9):
  Triton turns fusion on by default and would contract the spec's separate ``a*b`` and ``+ c``
  into one fma, changing bits (lsm1 log: 81 of 2.1 M outputs).
* under ``TRITON_INTERPRET=1`` the interpreter must be Triton >= 3.9 and its ``tl.fma`` must round
  once; older interpreters computed ``a*b + c`` in two roundings. A crafted case decides it once per
  process: (1 + 2**-12)**2 - 1 is 2**-11 + 2**-24 exactly, but 2**-11 when rounded twice.

Also the host helpers the launchers share: sizes (``cdiv``, ``next_power_of_2``), scalars (``float32_value``)
and the int32 row starts and lengths the attention launchers pass (``int32_tensor``, ``int32_starts``).
"""
from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from .versions import MIN_INTERPRETER, interpreting, parse_version, version_text  # noqa: F401  (re-exported)

STRICT_OPTIONS = {"enable_fp_fusion": False}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side: ``triton.cdiv`` is a constexpr function in Triton 3.9, ~3 us per host call
    (a decode GEMV made a dozen such calls)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as ``triton.next_power_of_2``), without its per-call wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def int32_tensor(x, device) -> torch.Tensor:
    """x (a tensor, or values torch.as_tensor takes) as an int32 tensor on ``device``: the launchers' row starts
    and lengths."""
    return torch.as_tensor(x, device=device).to(torch.int32)


def int32_starts(n: int, step: int, device) -> torch.Tensor:
    """int32 [0, step, 2 step, ...] (n values), made on the device: no host tensor, no copy."""
    return torch.arange(0, n * step, step, dtype=torch.int32, device=device) if step else \
        torch.zeros(n, dtype=torch.int32, device=device)


def float32_value(x: float) -> float:
    """x rounded to float32 (nearest even), as a Python float: what ``float(torch.tensor(x, dtype=float32))``
    gives, without making a tensor and reading it back (a launch path reads no tensor values)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: rounds to an infinity, as torch does
        return math.copysign(math.inf, x)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the triton module imported (the one whose interpreter runs), not of a distribution."""
    return parse_version(triton.__version__)


@triton.jit
def _fma_probe(a_ptr, out_ptr):
    a = tl.load(a_ptr)
    tl.store(out_ptr, tl.fma(a, a, -1.0))


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why the interpreter cannot run strict kernels, or None when it can (checked once)."""
    if triton_version() < MIN_INTERPRETER:
        return (f"the Triton interpreter before {version_text(MIN_INTERPRETER)} rounds tl.fma twice; "
                f"installed: triton {triton.__version__}")
    a = torch.tensor([1.0 + 2.0 ** -12], dtype=torch.float32)
    out = torch.empty(1, dtype=torch.float32)
    try:
        _fma_probe[(1,)](a, out, **STRICT_OPTIONS)
    except RuntimeError as e:  # e.g. TRITON_INTERPRET set after this process created its Triton kernels
        return (f"the Triton interpreter could not run a probe kernel ({e}); set TRITON_INTERPRET=1 before "
                "triton is imported")
    want = 2.0 ** -11 + 2.0 ** -24
    if float(out[0]) != want:
        return (f"the Triton interpreter's tl.fma rounds twice ((1+2**-12)**2 - 1 gave {float(out[0])!r}, "
                f"a single rounding gives {want!r})")
    return None


def fma_dot() -> bool:
    """Strict tiles may run as float32 ``ieee`` ``tl.dot``: on NVIDIA, whose FMA dot lowering is one fma chain per
    output over k in order from the accumulator (read in the PTX: ``fma.rn.f32`` chains from ``0f00000000``, no
    ``mma``), and in the interpreter (interpreter_dot.strict_dot, the same chain). Not on AMD (torch reports "cuda"
    there; native fp32 matrix instructions) nor Ascend (dots run on the cube unit): they keep the explicit chains."""
    from . import ascend_launch
    return torch.version.hip is None and not ascend_launch.active()


def warps_and_stages(warps: int, stages: int | None) -> dict:
    """The launch options of a tile's warps and its K loop's software-pipeline stages (None: Triton's default)."""
    return {"num_warps": warps, **({"num_stages": stages} if stages else {})}


def interpreter_layout() -> bool:
    """The interpreter's layouts and block sizes (few large operations; REG 3-D register blocks), except for the Ascend
    variant, which runs the GPU layout (small tiles that fit the unified buffer)."""
    from . import ascend_launch
    return interpreting() and not ascend_launch.npu_layout()


def persistent_args(grid) -> tuple[int, dict]:
    """(n_work, kwargs) of a persistent launch over a logical grid of up to three dims: n_work items,
    flattened in row-major order; the kernel recovers its indices from n1 (2-D: w -> (w // n1, w % n1))
    or n1, n2 (3-D: w -> (w // (n1 n2), (w // n2) % n1, w % n2))."""
    n_work = 1
    for g in grid:
        n_work *= g
    kwargs = {}
    if len(grid) >= 2:
        kwargs["n1"] = grid[1]
    if len(grid) == 3:
        kwargs["n2"] = grid[2]
    return n_work, kwargs


def program_count(n_work: int, max_programs: int | None = None) -> int:
    """Programs a persistent launch of n_work items runs on (see :func:`launch`)."""
    from . import ascend_launch
    n = ascend_launch.persistent_grid(n_work)
    return n if max_programs is None else max(1, min(n, max_programs))


def launch(kernel, grid, *args, persistent: bool = False, strict: bool = True, max_programs: int | None = None,
           **kwargs) -> None:
    """kernel[grid](*args, **kwargs) with fp fusion off; refuses a double-rounding interpreter.

    strict=False: a kernel whose bits no spec fixes (the attention backward): Triton's default options
    (fp fusion on), and any interpreter.

    persistent: the kernel loops ``for w in range(program_id(0), n_work, num_programs(0))`` over
    work items (a 2-D / 3-D logical grid is flattened, see :func:`persistent_args`) and takes ``NPU``;
    it gets n_work / n1 / n2 / NPU here and runs on min(work, cores) programs for the Ascend variant,
    else on one program per work item (the loop then runs once); at most ``max_programs`` programs (for a
    kernel with per-program scratch: :func:`program_count`)."""
    if strict and interpreting():
        problem = interpreter_problem()
        if problem is not None:
            raise RuntimeError(problem)
    if persistent:
        from . import ascend_launch
        n_work, extra = persistent_args(grid)
        kwargs.update(extra)
        grid = (program_count(n_work, max_programs),)
        kwargs.update(n_work=n_work, NPU=ascend_launch.active())
    kernel[grid](*args, **kwargs, **(STRICT_OPTIONS if strict else {}))
