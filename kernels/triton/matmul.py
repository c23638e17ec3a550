"""matmul / linear under MatmulSpec (strict): one program computes a [BM, BN] tile of outputs.

Every output is its own sequential fma chain (common.dot_k_tiled), so the bits do not depend on
BM/BN, the grid or the batch: block sizes are chosen for speed only. Up to 16 rows (decode) a
second kernel pair also runs the K tiles of each output in parallel (independent chains, partials
combined in tile order by a second kernel): the same operations in the same order, so the same
bits; the conformance L1 row-subset checks compare the two paths (33 rows vs 1 / 16 of them). When K is the
contiguous axis of b (a linear layer's weight), the decode kernel gives each thread one (column, K tile)
chain and feeds it 8 consecutive weights per 16-byte vector load (common.eight), so the weight streams
through coalesced vector loads exactly once; otherwise step j loads element j of every K tile.

Above 16 rows on NVIDIA (and in the interpreter) each K tile is a float32 ``ieee`` ``tl.dot`` from a zero
accumulator (common.dot_k_tiled_fma): NVIDIA lowers it to one fma chain per output over k in order, the spec's
in-tile chain, on 16-byte pipelined operand tiles instead of one scalar load per step. bf16/fp16 operands are
widened first (a bf16 dot would be a tensor-core tree), and the tile partials are added by ``tl.fma(part, 1.0,
total)`` (an ``addf`` after a dot can be folded into the next dot's accumulator: one chain across K tiles). AMD and
Ascend keep the explicit chains (launch.fma_dot).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, strict_math as sm
from .interpreter_dot import strict_dot
from .launch import cdiv, fma_dot, interpreter_layout, launch, next_power_of_2, triton_version, warps_and_stages
from .dtypes import tl_dtype
from .workspace import workspace


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K,
                   sa_m, sa_k, sb_k, sb_n, so_m, so_n, n_work, n1,
                   HAS_BIAS: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, FMA_DOT: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item // n1) * BM + tl.arange(0, BM)
        cols = (item % n1) * BN + tl.arange(0, BN)
        row_ok = rows < M
        col_ok = cols < N
        if NPU:  # Ascend: the explicit chains (a dot would run on the cube unit)
            acc = common.dot_k_tiled(a_ptr, sa_m, sa_k, b_ptr, sb_k, sb_n, rows, cols, row_ok, col_ok, K, KT, BM, BN)
        elif FMA_DOT:  # NVIDIA (and the interpreter's strict stand-in): fp32 ieee dots, an fma chain each
            acc = common.dot_k_tiled_fma(a_ptr, sa_m, sa_k, b_ptr, sb_k, sb_n, rows, cols, row_ok, col_ok, K, KT, KTP,
                                         BM, BN)
        else:  # AMD: the explicit chains (native fp32 matrix instructions would not chain)
            acc = common.dot_k_tiled(a_ptr, sa_m, sa_k, b_ptr, sb_k, sb_n, rows, cols, row_ok, col_ok, K, KT, BM, BN)
        if HAS_BIAS:  # added once, after the K reduction
            acc = acc + sm.widen(tl.load(bias_ptr + cols, mask=col_ok, other=0.0))[None, :]
        out = sm.round_out(acc, OUT_DTYPE, NPU)
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
        tl.store(ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv_partials_kernel(a_ptr, b_ptr, part_ptr, M, N, K, n_kt, sa_m, sa_k, sb_k, sb_n, n_work, n1,
                          KT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NKT: tl.constexpr,
                          NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        """Few rows (decode): the K tiles are independent chains, so they run in parallel too.

        [BM, BN, NKT] partials: step j does element j of every K tile (fma chain from +0.0; a step past
        K keeps the partial as it is), then each tile's partial goes to scratch [n_kt, M, N].
        """
        rows = tl.arange(0, BM)
        row_ok = rows < M
        cols = (item // n1) * BN + tl.arange(0, BN)
        col_ok = cols < N
        tiles = (item % n1) * NKT + tl.arange(0, NKT)
        k0 = tiles.to(tl.int64) * KT
        a_p = a_ptr + rows.to(tl.int64)[:, None] * sa_m + k0[None, :] * sa_k
        b_p = b_ptr + cols.to(tl.int64)[:, None] * sb_n + k0[None, :] * sb_k
        part = tl.zeros([BM, BN, NKT], dtype=tl.float32)
        for j in range(0, tl.minimum(KT, K)):
            kv = (k0 + j) < K
            a = sm.widen(tl.load(a_p, mask=row_ok[:, None] & kv[None, :], other=0.0))
            b = sm.widen(tl.load(b_p, mask=col_ok[:, None] & kv[None, :], other=0.0))
            part = tl.where(kv[None, None, :], tl.fma(a[:, None, :], b[None, :, :], part), part)
            a_p += sa_k
            b_p += sb_k
        offs = tiles.to(tl.int64)[None, None, :] * M * N + rows[:, None, None] * N + cols[None, :, None]
        ok = row_ok[:, None, None] & col_ok[None, :, None] & (tiles < n_kt)[None, None, :]
        tl.store(part_ptr + offs, part, mask=ok)


@triton.jit(do_not_specialize=["M", "n_work"])  # row counts change per call: no recompiles
def _gemv_vec_kernel(a_ptr, b_ptr, part_ptr, M, N, K, n_kt, n_tb, sa_m, sb_n, n_work, n1,
                     KT: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NKT: tl.constexpr,
                     WORDS: tl.constexpr, COLS_FAST: tl.constexpr, EVEN: tl.constexpr, NPU: tl.constexpr):
    """Decode GEMV with K contiguous in a and b: [BM, BN x NKT] chains, lane j = (column j // NKT, K tile
    j % NKT); each step loads VEC consecutive k (16 bytes) of every lane's tile (one vector load per
    thread; a's rows are shared by all columns, so their loads broadcast) and runs them through the chains
    in k order (common.dot_tile_vec); a step past K or past the tile keeps the partial. Tile partials go to
    scratch [n_kt, M, N] for _gemv_combine_kernel. Logical grid (column block x tile block, row block), row
    block fastest, so the programs that share a weight tile run together.

    COLS_FAST: lane j = (K tile j // BN, column j % BN), so a warp's 32 lanes are 32 columns of one K tile: its load
    of a row of a is one address (a broadcast: one L1 wavefront instead of one per tile), and its partials store
    is 32 consecutive floats. Otherwise lane j = (column j // NKT, K tile j % NKT): 8 tiles a warp (GEMV_LANES).
    EVEN (K % KT == 0, KT % VEC == 0; GEMV_EVEN_K): no select on the chains (common.dot_tile_vec)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        wb = item // n1
        rows = (item % n1) * BM + tl.arange(0, BM)
        row_ok = rows < M
        L: tl.constexpr = BN * NKT
        lane = tl.arange(0, L)
        if COLS_FAST:
            cols = (wb // n_tb) * BN + lane % BN
            tiles = (wb % n_tb) * NKT + lane // BN
        else:
            cols = (wb // n_tb) * BN + lane // NKT
            tiles = (wb % n_tb) * NKT + lane % NKT
        col_ok = cols < N
        a_rows = a_ptr + rows.to(tl.int64) * sa_m
        b_cols = b_ptr + cols.to(tl.int64) * sb_n
        if WORDS:  # whole 16-byte vectors: read as int64 words, no reshape / split (Triton 3.6: no conversions)
            part = common.dot_tile_words(a_rows, b_cols, row_ok, col_ok, tiles * KT, K, KT, VEC, BM, L, EVEN)
        else:
            part = common.dot_tile_vec(a_rows, b_cols, row_ok, col_ok, tiles * KT, K, KT, VEC, BM, L, EVEN)
        offs = tiles.to(tl.int64)[None, :] * M * N + rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + offs, part, mask=row_ok[:, None] & (col_ok & (tiles < n_kt))[None, :])


@triton.jit
def _gemv_combine_kernel(part_ptr, bias_ptr, out_ptr, M, N, n_kt, so_m, so_n, n_work, n1, HAS_BIAS: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UNROLL: tl.constexpr,
                         NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        """K-tile partials added in tile order from +0.0, bias once, one rounding to the output dtype.

        UNROLL > 1: each step loads UNROLL tiles' partials (independent loads, all in flight at once) and adds them
        in tile order; a tile past n_kt is skipped by select (exact). total starts at +0.0 and a sum of two zeros
        is -0.0 only when both are, so total is never -0.0 and the rows / columns masked off (loaded as +0.0)
        do not matter either. UNROLL = 1 is one tile a step, pipelined."""
        rows = (item % n1) * BM + tl.arange(0, BM)  # logical grid (column block, row block)
        cols = (item // n1) * BN + tl.arange(0, BN)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        p = part_ptr + rows[:, None] * N + cols[None, :]
        total = tl.zeros([BM, BN], dtype=tl.float32)
        if UNROLL == 1:
            for t in tl.range(0, n_kt, num_stages=common.STAGES):
                total = total + tl.load(p + t * M * N, mask=ok, other=0.0)
        else:
            for t0 in tl.range(0, n_kt, UNROLL, num_stages=common.STAGES):
                for u in tl.static_range(UNROLL):  # the loads do not depend on total: issued together
                    t = t0 + u
                    t_ok = ((rows * 0 + t) < n_kt)[:, None]  # a tensor, as the interpreter's masks need
                    total = tl.where(t_ok, total + tl.load(p + t * M * N, mask=ok & t_ok, other=0.0), total)
        if HAS_BIAS:
            total = total + sm.widen(tl.load(bias_ptr + cols, mask=cols < N, other=0.0))[None, :]
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
        tl.store(ptrs, sm.round_out(total, OUT_DTYPE, NPU), mask=ok)


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """An env var read once at import, one of allowed; anything else is refused by name (no silent default)."""
    value = os.environ.get(name, default).strip() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: the strict GEMV's selector takes one of {', '.join(allowed)}")
    return value


# Decode-GEMV variants kept selectable so one H200 run can decide (benchmarks/gpu_perf.py's linear row pairs set
# these module constants per row; the env vars set them for a process). Every variant runs the same chains in the
# same order: the bits never depend on them (tests/scripts/triton_vector_chain_check.py gemv_variants).
#: rows up to which linear / matmul take the split-K GEMV (partials + in-order combine) instead of the 64 x 32
#: FMA-dot tiles (LOCKSTEP_GEMV_MAX_ROWS, 16, 32 or 64). At 17-64 rows the dot tiles run 128 programs of 4 warps at
#: N = 4096 (one warp a scheduler: latency-bound); the GEMV runs 2048 a row block of 8. Measured (H200, Triton 3.6,
#: 2026-12-04, linear/strict/M64 vs linear/strict-gemv/M64): dot tiles 338.8 us, GEMV 239.5 us, so 64
GEMV_MAX_ROWS = int(_env_choice("LOCKSTEP_GEMV_MAX_ROWS", "64", ("16", "32", "64")))
#: lanes of the vector GEMV (LOCKSTEP_GEMV_LANES): "cols" (32 columns of one K tile a warp: a's loads broadcast,
#: the partials store coalesced) or "tiles" (the layout measured on 2026-12-04: 4 columns x 8 K tiles a warp)
GEMV_LANES = _env_choice("LOCKSTEP_GEMV_LANES", "cols", ("cols", "tiles"))
#: chains without a select per step where K is whole K tiles of whole vectors (LOCKSTEP_GEMV_EVEN, "1" or "0": the
#: select after each FFMA, as measured on 2026-12-04; sm_90 gemv_vec: 64 FFMA + 57 FSEL a row, in the chain)
GEMV_EVEN_K = _env_choice("LOCKSTEP_GEMV_EVEN", "1", ("1", "0")) == "1"
#: tiles' partials the combine loads per step (LOCKSTEP_GEMV_COMBINE): "8" (8 loads in flight, 32-column programs:
#: 128 programs at N = 4096) or "1" (one a step, 128-column programs: 32 at N = 4096, as measured on 2026-12-04)
COMBINE_UNROLL = int(_env_choice("LOCKSTEP_GEMV_COMBINE", "8", ("1", "8")))
#: warps of the FMA-dot matmul tile. hal.kernels.checks.sass_profile, sm_90, a 64 x 32 tile on 4 warps: 128-152
#: registers, no spill under Triton 3.6 and 3.9, 16-byte cp.async operand tiles; 64 x 64 spills float32 operands
#: (24 bytes on 4 warps under 3.9, 8 bytes on 8 warps under 3.6)
_DOT_WARPS = 4
#: The FMA-dot tile: 64 x 32 outputs (16 fma chains a thread of 4 warps; sm_90: 128-152 registers, 1024 FFMA per ~150
#: shared loads, no spill) at every row count. Smaller tiles for more programs at 17-512 rows (32 x 32, 16 x 32 to
#: reach 264 programs) measured slower on the H200 (2026-12-04, Triton 3.6, N = K = 4096): M = 64 took 610 us on
#: 512 programs of 16 x 32 against 334 us on 128 programs of 64 x 32 (the loop is bound by shared loads per fma)
_DOT_TILE = (64, 32)
#: software-pipeline stages of the FMA-dot tile's K loop (None: Triton's default, 3 on sm_90). Like the tile and the
#: warps, speed only: each output's chains and their order are the same (benchmarks/gpu_sweep.sh times the choices)
_DOT_STAGES = None


#: the vector chains read as int64 words (common.dot_tile_words) on Triton 3.6 (the H200 machine's), where the
#: reshape / split of dot_tile_vec converts layouts through shared memory in the loop; 3.8 / 3.9 fold those and
#: convert the words path's transpose instead (sass_profile: 8-row GEMV 392 / 144 vs 4 / 2 shared / barriers on 3.6,
#: 0 / 0 vs 256 / 128 on 3.9). 3.7 is unprofiled and keeps dot_tile_vec
WORDS_LAYOUT = triton_version() < (3, 7)


def whole_vectors(a: torch.Tensor, b: torch.Tensor, k_tile: int) -> bool:
    """Whether the chains over rows of a and b (K contiguous) take common.dot_tile_words: WORDS_LAYOUT, K and the K
    tile multiples of a 16-byte vector, rows 8-byte aligned."""
    vec = 16 // a.element_size()
    return (WORDS_LAYOUT and a.shape[-1] % vec == 0 and k_tile % vec == 0 and all(
        t.data_ptr() % 8 == 0 and (t.stride(0) * t.element_size()) % 8 == 0 for t in (a, b)))


def _vector_gemv(a2, b_kn) -> bool:
    """Whether the GEMV runs the vector chains (_gemv_vec_kernel): K contiguous in both operands, not Ascend."""
    return a2.stride(1) == 1 and b_kn.stride(0) == 1 and not ascend_launch.active()


def _gemv(a2, b_kn, bias, k_tile, out):
    m, k = a2.shape
    n = b_kn.shape[1]
    n_kt = max(1, cdiv(k, k_tile))
    bm = max(2, next_power_of_2(m))
    if interpreter_layout():
        bn, nkt = max(2, next_power_of_2(min(n, 256))), next_power_of_2(n_kt)
    else:
        bn, nkt = 32, min(8, next_power_of_2(n_kt))
    part = workspace("gemv partials", (n_kt, m, n), torch.float32, a2.device)
    if _vector_gemv(a2, b_kn):  # K contiguous: vector loads
        if interpreter_layout():
            vm, vn, vkt = next_power_of_2(m), next_power_of_2(min(n, 64)), next_power_of_2(min(n_kt, 16))
        else:  # 128 chains per row; up to 8 rows share each weight load (8 x 8 a values stay in registers)
            # one row keeps dot_tile_vec: on the H200 (Triton 3.6) the words path took 39 us at M = 1 against 31
            # (and 119 against 135 us at M = 8)
            vm, vn, vkt = (min(8, next_power_of_2(m)),) + ((32, 4) if GEMV_LANES == "cols" else (16, 8))
        n_tb = cdiv(n_kt, vkt)
        launch(_gemv_vec_kernel, (cdiv(n, vn) * n_tb, cdiv(m, vm)), a2, b_kn, part, m, n, k, n_kt, n_tb,
               a2.stride(0), b_kn.stride(1), KT=k_tile, VEC=16 // a2.element_size(), BM=vm, BN=vn, NKT=vkt,
               WORDS=m > 1 and whole_vectors(a2, b_kn.t(), k_tile), COLS_FAST=GEMV_LANES == "cols",
               EVEN=GEMV_EVEN_K and k % k_tile == 0 and k_tile % (16 // a2.element_size()) == 0, persistent=True)
    else:
        launch(_gemv_partials_kernel, (cdiv(n, bn), cdiv(n_kt, nkt)), a2, b_kn, part, m, n, k, n_kt,
               a2.stride(0), a2.stride(1), b_kn.stride(0), b_kn.stride(1), KT=k_tile, BM=bm, BN=bn, NKT=nkt,
               persistent=True)
    unroll = 1 if ascend_launch.active() else COMBINE_UNROLL
    bn2 = max(2, next_power_of_2(min(n, 1024 if interpreter_layout() else 128 if unroll == 1 else 32)))
    bm2 = bm if unroll == 1 else min(bm, 16)
    launch(_gemv_combine_kernel, (cdiv(n, bn2), cdiv(m, bm2)), part, bias if bias is not None else part, out, m, n, n_kt,
           out.stride(0), out.stride(1), HAS_BIAS=bias is not None, OUT_DTYPE=tl_dtype(out.dtype), BM=bm2, BN=bn2,
           UNROLL=unroll, persistent=True)
    return out


def _blocks(m: int, n: int) -> tuple[int, int]:
    if interpreter_layout():  # the interpreter pays per operation, not per element: few large programs
        return max(16, next_power_of_2(min(m, 128))), max(16, next_power_of_2(min(n, 256)))
    if ascend_launch.active():  # acc + K-tile partial: 2 x 8 KB of the unified buffer
        return 32, 64
    if fma_dot():  # fp32 dot tiles on _DOT_WARPS warps
        return _DOT_TILE
    bm = 16 if m <= 16 else 64
    return bm, 64 if m <= 16 else 128


def _mm2d(a2: torch.Tensor, b_kn: torch.Tensor, bias, k_tile: int, out_dtype) -> torch.Tensor:
    """a2 [M, K] @ b_kn [K, N] (+ bias) -> [M, N] (b_kn may be a transposed view)."""
    m, k = a2.shape
    n = b_kn.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a2.device)
    if m == 0 or n == 0:
        return out
    if m <= 16 or (m <= GEMV_MAX_ROWS and _vector_gemv(a2, b_kn)):
        return _gemv(a2, b_kn, bias, k_tile, out)
    bm, bn = _blocks(m, n)
    grid = (cdiv(m, bm), cdiv(n, bn))
    dot = fma_dot()
    with strict_dot() if dot else contextlib.nullcontext():
        launch(_matmul_kernel, grid, a2, b_kn, bias if bias is not None else a2, out, m, n, k,
               a2.stride(0), a2.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1),
               HAS_BIAS=bias is not None, KT=k_tile, KTP=max(16, next_power_of_2(k_tile)),
               OUT_DTYPE=tl_dtype(out_dtype), BM=bm, BN=bn, FMA_DOT=dot,
               **(warps_and_stages(_DOT_WARPS, _DOT_STAGES) if dot and not interpreter_layout() else {}), persistent=True)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    """a [..., M, K] @ b [K, N] -> [..., M, N] in a's dtype."""
    lead, k = a.shape[:-1], a.shape[-1]
    out = _mm2d(a.reshape(lead.numel(), k), b, None, spec.k_tile, a.dtype)
    return out.reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias, spec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias[N] -> [..., N] in x's dtype; bias added once in float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = _mm2d(x.reshape(lead.numel(), k), weight.t(), bias, spec.k_tile, x.dtype)
    return out.reshape(*lead, weight.shape[0])
