"""matmul / linear under FastMatmulSpec: bf16/fp16 tensor cores (``tl.dot``), tiling fixed by the spec.

One program computes a [block_m, block_n] output tile with one float32 accumulator:
``acc = tl.dot(a_tile, b_tile, acc)`` over the K tiles of block_k in increasing order. Nothing here
looks at M (no split-K for small batches, no autotuner): a row's bits depend on its own row of A,
on B and on the spec, so any batch composition gives the same bits on one GPU model (L1). The
epilogue is the strict kernels' (bias added once in float32, integer round-to-nearest-even, canonical
NaN). This kernel is NOT a strict kernel: the strict lint rejects it (tensor cores), the fast lint
(kernels/checks/fast_lint.py) requires tensor cores instead. In the interpreter, ``tl.dot`` is the
deterministic stand-in of interpreter_dot.py.

How a launch is laid out is a :class:`Launch`: the tile, warps, stages, and two choices that move no value
between programs: a persistent grid (one program per SM walking the tiles) or one program per tile, and TMA
tensor-descriptor loads or pointer loads (cp.async when pipelined). The spec decides the launch (v2: its
fields); benchmarks/fast_bits_sweep.py runs the launches one factor at a time to find which change bits on a
GPU. A float32 ``out_dtype`` stores the accumulator itself (the rounding of ``round_out`` is then only the
canonical NaN): the sweep's debug view of what a bf16 output would hide, and the logits of token_logprobs under a
fast matmul spec (``logits``: divided by the temperature in the epilogue, kept in float32).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import strict_math as sm
from .dtypes import tl_dtype
from .interpreter_dot import sequential_dot
from .launch import STRICT_OPTIONS, cdiv, launch

#: program order only (neighbouring programs share B tiles in L2); it does not change any bits
GROUP_M = 8


@dataclass(frozen=True)
class Launch:
    """One launch of the fast matmul kernel: what a spec (or the bits sweep) chooses."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    persistent: bool = False   # one program per SM looping over the tiles, instead of one program per tile
    tma: bool = False          # tensor-descriptor (TMA) loads instead of pointer loads

    @property
    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"
                + ("-persistent" if self.persistent else "") + ("-tma" if self.tma else ""))


def launch_of_spec(spec) -> Launch:
    """The v2 spec's one launch: its fields."""
    return Launch(spec.block_m, spec.block_n, spec.block_k, spec.num_warps, spec.num_stages)


def table_launches() -> list[tuple[str, Launch]]:
    """(name, launch) of every launch FastMatmulV3Spec may run: its table's entries and the prefill entry's
    pointer-load twin (for operands TMA cannot describe)."""
    from hal.spec import FAST_MATMUL_V3_NO_TMA, FAST_MATMUL_V3_TABLE
    return [(f"v3 M<={top}" if top else "v3 prefill", Launch(*entry)) for top, *entry in FAST_MATMUL_V3_TABLE] + \
        [("v3 prefill, pointer loads", Launch(*FAST_MATMUL_V3_NO_TMA[1:]))]


def _tma_describes(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can hold this 2-D operand (unit last stride, 16-byte aligned rows and base)."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def launch_for(spec, a2: torch.Tensor, b_kn: torch.Tensor) -> tuple[Launch, int | None]:
    """(the launch, the interpreter stand-in's K step) of a2 @ b_kn: v2, the spec's fields (its stand-in chains per
    K tile); v3, the table's entry for a2's rows (its stand-in chains per k16 step, v3's rule), with pointer loads
    where TMA cannot describe an operand (table_launches: that launch is in the table too)."""
    if getattr(spec, "version", 2) != 3:
        return launch_of_spec(spec), None
    lt = Launch(*spec.launch_entry(a2.shape[0]))
    b_view = b_kn.t() if b_kn.stride(0) == 1 and b_kn.stride(1) != 1 else b_kn
    if lt.tma and not (_tma_describes(a2) and _tma_describes(b_view)):
        lt = replace(lt, tma=False)
    return lt, spec.k_step


@triton.jit
def _tile_of(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(row tile, column tile) of the tile-th program in the grouped order (L2 reuse; no bits depend on it)."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first_m = (tile // per_group) * GROUP
    group_rows = tl.minimum(n_m - first_m, GROUP)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tile_acc(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, K, sa_m, sa_k, sb_k, sb_n,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, B_NK: tl.constexpr):
    """The tile's float32 accumulator: one chain over the K tiles in increasing order from +0.0; the part of a
    tile past K (and past M / N) is zero, whether masked (pointer loads) or filled by the TMA unit."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if TMA:
        for k0 in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k0])
            if B_NK:  # linear: the descriptor is over weight [N, K]
                b = tl.trans(b_desc.load([pid_n * BN, k0]))
            else:
                b = b_desc.load([k0, pid_n * BN])
            acc = tl.dot(a, b, acc)
    else:
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < M
        col_ok = cols < N
        a_p = a_ptr + rows.to(tl.int64)[:, None] * sa_m + ks[None, :] * sa_k
        b_p = b_ptr + ks[:, None] * sb_k + cols.to(tl.int64)[None, :] * sb_n
        for k0 in range(0, K, BK):
            k_ok = (k0 + ks) < K
            a = tl.load(a_p, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_p, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_p += BK * sa_k
            b_p += BK * sb_k
    return acc


@triton.jit
def _epilogue(acc, bias_ptr, out_ptr, pid_m, pid_n, M, N, so_m, so_n, temp, HAS_BIAS: tl.constexpr,
              HAS_TEMP: tl.constexpr, OUT_DTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    if HAS_BIAS:  # added once, after the K reduction
        acc = acc + sm.widen(tl.load(bias_ptr + cols, mask=col_ok, other=0.0))[None, :]
    if HAS_TEMP:  # token_logprobs' temperature: one correctly rounded division of the float32 logit
        acc = sm.div(acc, temp)
    out = sm.round_out(acc, OUT_DTYPE)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n, out,
             mask=row_ok[:, None] & col_ok[None, :])


# M (the batch) is never specialised on: one compiled kernel for every batch size (Triton would otherwise
# compile separate variants for M == 1 and M % 16 == 0), so the batch cannot even pick the binary.
@triton.jit(do_not_specialize=["M", "n_programs"])
def _fast_matmul_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K, sa_m, sa_k, sb_k, sb_n, so_m, so_n, temp,
                        HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                        a_desc=None, b_desc=None, n_programs=1, PERSISTENT: tl.constexpr = False,
                        TMA: tl.constexpr = False, B_NK: tl.constexpr = False):
    if PERSISTENT:  # program p computes tiles p, p + n_programs, ...: each tile whole, as one program would
        n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in range(tl.program_id(0), n_tiles, n_programs):
            pid_m, pid_n = _tile_of(tile, M, N, BM, BN, GROUP)
            acc = _tile_acc(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, K, sa_m, sa_k, sb_k, sb_n,
                            BM, BN, BK, TMA, B_NK)
            _epilogue(acc, bias_ptr, out_ptr, pid_m, pid_n, M, N, so_m, so_n, temp, HAS_BIAS, HAS_TEMP, OUT_DTYPE,
                      BM, BN)
    else:
        pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP)
        acc = _tile_acc(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, K, sa_m, sa_k, sb_k, sb_n,
                        BM, BN, BK, TMA, B_NK)
        _epilogue(acc, bias_ptr, out_ptr, pid_m, pid_n, M, N, so_m, so_n, temp, HAS_BIAS, HAS_TEMP, OUT_DTYPE,
                      BM, BN)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so the persistent loop runs more than one tile each


def _descriptors(a2: torch.Tensor, b_kn: torch.Tensor, lt: Launch):
    """(a_desc, b_desc, b is [N, K]) tensor descriptors of a [M, K] and b (TMA needs a unit last stride and
    16-byte aligned rows: refused by name otherwise)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from hal.errors import UnsupportedError
    b_nk = b_kn.stride(0) == 1 and b_kn.stride(1) != 1
    b_view = b_kn.t() if b_nk else b_kn
    for name, t in (("a", a2), ("b", b_view)):
        if not _tma_describes(t):
            raise UnsupportedError(f"fast matmul launch {lt.label}: TMA loads need {name} with unit last stride and "
                                   f"16-byte aligned rows (strides {tuple(t.stride())})")
    a_desc = TensorDescriptor.from_tensor(a2, [lt.block_m, lt.block_k])
    b_desc = TensorDescriptor.from_tensor(b_view, [lt.block_n, lt.block_k] if b_nk else [lt.block_k, lt.block_n])
    return a_desc, b_desc, b_nk


def run_launch(a2: torch.Tensor, b_kn: torch.Tensor, bias, lt: Launch, out_dtype, warmup: bool = False,
               k_step: int | None = None, out: torch.Tensor | None = None, temperature: float = 1.0):
    """a2 [M, K] @ b_kn [K, N] (+ bias) -> [M, N] (b_kn may be a transposed view) under the launch ``lt``.
    ``warmup``: compile only (on a GPU; the compiled kernel is returned), for compiling many launches at once.
    ``k_step``: the interpreter's stand-in rule (None: v2's chain per K tile; 16: v3's); nothing on a GPU.
    ``out``: an [M, N] tensor of ``out_dtype`` to write (any row stride: token_logprobs' kept logits); ``temperature``
    (!= 1): the result divided by it, correctly rounded, before the output rounding (token_logprobs' logits)."""
    m, k = a2.shape
    n = b_kn.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a2.device)
    if m == 0 or n == 0:
        return out
    tiles = cdiv(m, lt.block_m) * cdiv(n, lt.block_n)
    n_programs = min(tiles, _sm_count(a2.device)) if lt.persistent else tiles
    a_desc, b_desc, b_nk = _descriptors(a2, b_kn, lt) if lt.tma else (None, None, False)
    args = (a2, b_kn, bias if bias is not None else a2, out, m, n, k,
            a2.stride(0), a2.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1),
            float(temperature))
    kwargs = dict(HAS_BIAS=bias is not None, HAS_TEMP=temperature != 1.0, OUT_DTYPE=tl_dtype(out_dtype),
                  BM=lt.block_m, BN=lt.block_n,
                  BK=lt.block_k, GROUP=GROUP_M, a_desc=a_desc, b_desc=b_desc, n_programs=n_programs,
                  PERSISTENT=lt.persistent, TMA=lt.tma, B_NK=b_nk, num_warps=lt.num_warps, num_stages=lt.num_stages)
    if warmup:
        return _fast_matmul_kernel.warmup(*args, grid=(n_programs,), **kwargs, **STRICT_OPTIONS)
    with sequential_dot(k_step):
        launch(_fast_matmul_kernel, (n_programs,), *args, **kwargs)
    return out


def _mm2d(a2: torch.Tensor, b_kn: torch.Tensor, bias, spec, out_dtype, out=None, temperature: float = 1.0):
    """a2 [M, K] @ b_kn [K, N] (+ bias) -> [M, N] under the spec's launch (``out``, ``temperature``: run_launch's)."""
    lt, k_step = launch_for(spec, a2, b_kn)
    return run_launch(a2, b_kn, bias, lt, out_dtype, k_step=k_step, out=out, temperature=temperature)


def logits(hidden2: torch.Tensor, weight: torch.Tensor, spec, out: torch.Tensor, temperature: float) -> None:
    """token_logprobs' logits under a fast matmul spec: hidden2 [M, H] @ weight [V, H]^T written to out [M, V]
    (float32, any row stride) as the float32 accumulator itself (no output rounding but the canonical NaN), divided
    by the temperature when it is not 1; the launch is the spec's, as a linear of the same rows would run."""
    _mm2d(hidden2, weight.t(), None, spec, torch.float32, out=out, temperature=temperature)


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype."""
    lead, k = a.shape[:-1], a.shape[-1]
    out = _mm2d(a.reshape(lead.numel(), k), b, None, spec, a.dtype)
    return out.reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = _mm2d(x.reshape(lead.numel(), k), weight.t(), bias, spec, x.dtype)
    return out.reshape(*lead, weight.shape[0])
