"""softmax / log_softmax / logsumexp under SoftmaxSpec (strict), rows of x [R, n].

Per program BR rows, three passes over each row:
1. M = row max (exact; NaN or +inf poisons the row; a fully -inf row shifts by 0), in blocks;
2. S = tiled sum of exp(x - M): a sequential sum from +0.0 inside each tile of T, tile partials
   added in tile order (common.add_columns_in_order). A [BR, NTB] register tile holds the running
   partials of NTB tiles (lanes = (row, tile)). Three layouts, the same operations in the same order,
   so the same bits: on the GPU each step loads VEC consecutive elements (16 bytes) of every lane's
   tile with one vector load per thread and adds their exps in order (common.eight / four, add_steps:
   no shuffle, no shared memory); on Ascend (NPU) step j loads element j of every tile (its documented
   API subset has no tl.split); in the interpreter (REG) a [BR, NTB, T] block whose exp is one
   operation, read back in order (common.nonneg_sums_in_order), ~7x fewer interpreted operations.
   Tests run the GPU and REG layouts in the interpreter;
3. outputs in blocks: logsumexp = M + log S; log_softmax = (x - M) - log S; softmax = exp(x - M) / S.

A few long rows (a vocabulary: 8-64 rows of 151,936) would give one program per BR rows, 2-16 on a GPU of 132 SMs.
They run split across the row instead (``split``), the passes token_logprobs runs over its kept logits:
(row x column chunk) maxima -> the row's M (:func:`chunk_stats_kernel`) -> (row x tile chunk) tile sums
(:func:`tile_sums_kernel`, the chains above) -> S = the tile sums added in tile order from +0.0
(:func:`tiles_in_order`) -> outputs per (row x column chunk). The same operations in the same order: the same bits.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, strict_math as sm
from .dtypes import tl_dtype
from .launch import cdiv, interpreter_layout, launch, next_power_of_2
from .workspace import workspace

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2


@triton.jit
def _add_steps(part, v, ok, BR: tl.constexpr, NTB: tl.constexpr, VEC: tl.constexpr):
    """part = part + v_i in order i = 0..VEC-1 over the last axis of v [BR, NTB, VEC] (ok: [1, NTB, VEC]; a
    step whose ok is False keeps part)."""
    if VEC == 8:
        v0, v1, v2, v3, v4, v5, v6, v7 = common.eight(v, BR, NTB)
        k0, k1, k2, k3, k4, k5, k6, k7 = common.eight(ok, 1, NTB)
        part = common.add_steps(part, v0, v1, v2, v3, k0, k1, k2, k3)
        part = common.add_steps(part, v4, v5, v6, v7, k4, k5, k6, k7)
    else:
        v0, v1, v2, v3 = common.four(v, BR, NTB)
        k0, k1, k2, k3 = common.four(ok, 1, NTB)
        part = common.add_steps(part, v0, v1, v2, v3, k0, k1, k2, k3)
    return part


@triton.jit
def _exp_sums_vec(x_ptr, base, row_ok, m_safe, start, n, T: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr,
                  VEC: tl.constexpr, ROW_PAD: tl.constexpr):
    """GPU layout: the [BR, NTB] sums of exp(x - m_safe) over the tiles starting at start [NTB], VEC
    elements a step. ROW_PAD: the rows are padded to a multiple of 16 elements (readable past n): a vector that
    starts before n is loaded whole (its mask the same for the VEC elements, so it stays one 16-byte load for
    any n), and its elements past n are skipped by the chain's mask as before."""
    part = tl.zeros([BR, NTB], dtype=tl.float32)
    for c in tl.range(0, tl.minimum(T, n), VEC, num_stages=common.STAGES):
        col, ok = common.vec_step(start, c, n, T, VEC)  # [NTB, VEC]
        if ROW_PAD and T % VEC == 0:
            load_ok = row_ok[:, None, None] & ((start + c) < n)[None, :, None]
        else:
            load_ok = row_ok[:, None, None] & ok[None, :, :]
        x = sm.widen(tl.load(x_ptr + base[:, None, None] + col[None, :, :], mask=load_ok, other=0.0))
        part = _add_steps(part, sm.exp(x - m_safe[:, None, None]), ok[None, :, :], BR, NTB, VEC)
    return part


@triton.jit
def row_stats(x_ptr, base, row_ok, n, n_tiles, T: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr,
              BC: tl.constexpr, VEC: tl.constexpr, REG: tl.constexpr, NPU: tl.constexpr):
    """(m_safe, S, empty) of rows x[base : base + n] (float32 widened): see the module docstring."""
    cols = tl.arange(0, BC)
    m = tl.full([BR], float("-inf"), tl.float32)
    poisoned = tl.zeros([BR], dtype=tl.int32)
    pos_zero = tl.zeros([BR], dtype=tl.int32)
    for c0 in tl.range(0, n, BC, num_stages=common.STAGES):
        ok = row_ok[:, None] & ((c0 + cols) < n)[None, :]
        x = sm.widen(tl.load(x_ptr + base[:, None] + (c0 + cols)[None, :], mask=ok, other=0.0))
        bm, bp, bz = common.row_max(x, ok)
        m = tl.maximum(m, bm)
        poisoned = tl.maximum(poisoned, bp)
        pos_zero = tl.maximum(pos_zero, bz)
    m = common.finish_max(m, poisoned, pos_zero)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    tiles = tl.arange(0, NTB)
    s = tl.zeros([BR], dtype=tl.float32)
    for t0 in range(0, n_tiles, NTB):
        start = (t0 + tiles) * T
        if REG:  # one 3-D block, exp once, then the in-tile order from registers (few, large operations)
            col3 = start[:, None] + tl.arange(0, T)[None, :]
            ok3 = row_ok[:, None, None] & (col3 < n)[None, :, :]
            x = sm.widen(tl.load(x_ptr + base[:, None, None] + col3[None, :, :], mask=ok3, other=0.0))
            e = tl.where(ok3, sm.exp(x - m_safe[:, None, None]), 0.0)
            part = common.nonneg_sums_in_order(e, n, T, BR, NTB)
        elif NPU:  # Ascend: step j loads element j of every tile (loads do the indexing)
            part = tl.zeros([BR, NTB], dtype=tl.float32)
            for j in range(0, tl.minimum(T, n)):
                col = start + j
                ok = row_ok[:, None] & (col < n)[None, :]
                x = sm.widen(tl.load(x_ptr + base[:, None] + col[None, :], mask=ok, other=0.0))
                part = tl.where(ok, part + sm.exp(x - m_safe[:, None]), part)
        else:  # GPU layout: 16-byte vector loads
            part = _exp_sums_vec(x_ptr, base, row_ok, m_safe, start, n, T, BR, NTB, VEC, False)
        s = common.add_columns_in_order(s, part, tiles, tl.minimum(NTB, n_tiles - t0))
    return m_safe, s, empty


@triton.jit
def write_outputs(x_ptr, out_ptr, base, row_ok, n, start, stop, m_safe, s, empty, MODE: tl.constexpr,
                  OUT_DTYPE: tl.constexpr, BC: tl.constexpr, NPU: tl.constexpr):
    """Columns [start, stop) of rows x[base : base + n], BC a step: softmax (MODE 0) = exp(x - M) / S or log_softmax
    (MODE 1) = (x - M) - log S from the row's shift m_safe, S and empty flag (an empty row: 0 / -inf), rounded once
    to OUT_DTYPE. The one output loop of the row-per-program kernel and of the split passes."""
    log_s = sm.log(s, NPU)
    cols = tl.arange(0, BC)
    for c0 in tl.range(start, stop, BC, num_stages=common.STAGES):
        ok = row_ok[:, None] & ((c0 + cols) < n)[None, :]
        offs = base[:, None] + (c0 + cols)[None, :]
        shifted = sm.widen(tl.load(x_ptr + offs, mask=ok, other=0.0)) - m_safe[:, None]
        if MODE == 1:
            out = tl.where(empty[:, None], float("-inf"), shifted - log_s[:, None])
        else:
            out = tl.where(empty[:, None], 0.0, sm.div(sm.exp(shifted), s[:, None], NPU))
        tl.store(out_ptr + offs, sm.round_out(out, OUT_DTYPE, NPU), mask=ok)


@triton.jit(do_not_specialize=["R", "n_work"])  # counts that change per call: no recompiles
def _softmax_kernel(x_ptr, out_ptr, R, n, n_tiles, n_work, MODE: tl.constexpr, T: tl.constexpr,
                    OUT_DTYPE: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, BC: tl.constexpr,
                    VEC: tl.constexpr, REG: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        base = rows.to(tl.int64) * n
        m_safe, s, empty = row_stats(x_ptr, base, row_ok, n, n_tiles, T, BR, NTB, BC, VEC, REG, NPU)
        if MODE == 2:
            out = tl.where(empty, float("-inf"), m_safe + sm.log(s, NPU))
            tl.store(out_ptr + rows, sm.round_out(out, OUT_DTYPE, NPU), mask=row_ok)
        else:
            write_outputs(x_ptr, out_ptr, base, row_ok, n, 0, n, m_safe, s, empty, MODE, OUT_DTYPE, BC, NPU)


@triton.jit(do_not_specialize=["R", "n_work", "n1"])
def _chunk_max_kernel(x_ptr, m_ptr, p_ptr, z_ptr, R, n, sx, n_chunks, n_work, n1, CH: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, NPU: tl.constexpr):
    """Per (row block, column chunk of CH): (max, poisoned, has +0.0) of the chunk (common.row_max) of rows
    x_ptr[row * sx : row * sx + n] -> [R, n_chunks] (max is exact in any grouping; chunk_stats_kernel combines them).
    Shared with token_logprobs (its exact logits, kept)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)  # row block fastest: the row blocks of one chunk run together
        row_ok = rows < R
        c = item // n1
        base = rows.to(tl.int64) * sx
        cols = tl.arange(0, BC)
        # elementwise across the loop, one reduction after it (no cross-warp reduction per block); common.row_max's
        # rules: NaN ignored by the max, NaN / +inf poison, +0.0 noted
        m2 = tl.full([BR, BC], float("-inf"), tl.float32)
        p2 = tl.zeros([BR, BC], dtype=tl.int32)
        z2 = tl.zeros([BR, BC], dtype=tl.int32)
        for c0 in tl.range(c * CH, tl.minimum(c * CH + CH, n), BC, num_stages=common.STAGES):
            ok = row_ok[:, None] & ((c0 + cols) < n)[None, :]
            x = sm.widen(tl.load(x_ptr + base[:, None] + (c0 + cols)[None, :], mask=ok, other=0.0))
            m2 = tl.maximum(m2, tl.where(ok & (x == x), x, float("-inf")))
            p2 = tl.maximum(p2, (ok & ((x != x) | (x == float("inf")))).to(tl.int32))
            z2 = tl.maximum(z2, (ok & (x.to(tl.int32, bitcast=True) == 0)).to(tl.int32))
        m = tl.max(m2, axis=1)
        poisoned = tl.max(p2, axis=1)
        pos_zero = tl.max(z2, axis=1)
        out = rows.to(tl.int64) * n_chunks + c
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(p_ptr + out, poisoned, mask=row_ok)
        tl.store(z_ptr + out, pos_zero, mask=row_ok)


@triton.jit
def chunk_stats_kernel(m_ptr, p_ptr, z_ptr, shift_ptr, empty_ptr, R, n_chunks, n_work, BR: tl.constexpr,
                       BC: tl.constexpr, NPU: tl.constexpr):
    """Per row: M from the chunk maxima [R, n_chunks] (exact, common.finish_max), the shift m_safe (0 for an empty
    row) and the empty flag. Shared with token_logprobs."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        cols = tl.arange(0, BC)
        # elementwise maxima across the loop, one reduction after it: max is exact in any order, and a
        # reduction inside the loop trips Triton 3.6's OptimizeThreadLocality pass (assertion) at large V
        m2 = tl.full([BR, BC], float("-inf"), tl.float32)
        p2 = tl.zeros([BR, BC], dtype=tl.int32)
        z2 = tl.zeros([BR, BC], dtype=tl.int32)
        for c0 in tl.range(0, n_chunks, BC, num_stages=common.STAGES):
            ok = row_ok[:, None] & ((c0 + cols) < n_chunks)[None, :]
            offs = rows.to(tl.int64)[:, None] * n_chunks + (c0 + cols)[None, :]
            m2 = tl.maximum(m2, tl.load(m_ptr + offs, mask=ok, other=float("-inf")))
            p2 = tl.maximum(p2, tl.load(p_ptr + offs, mask=ok, other=0))
            z2 = tl.maximum(z2, tl.load(z_ptr + offs, mask=ok, other=0))
        m = tl.max(m2, axis=1)
        poisoned = tl.max(p2, axis=1)
        pos_zero = tl.max(z2, axis=1)
        m = common.finish_max(m, poisoned, pos_zero)
        empty = m == float("-inf")
        tl.store(shift_ptr + rows, tl.where(empty, 0.0, m), mask=row_ok)
        tl.store(empty_ptr + rows, empty.to(tl.int32), mask=row_ok)


@triton.jit
def _block_sums(lg_ptr, base, row_ok, shift, tiles, V, VT: tl.constexpr, VTP: tl.constexpr, BR: tl.constexpr,
                NTB: tl.constexpr):
    """[BR, NTB] tile sums read from one [BR, NTB, VTP] block in place (the interpreter's and the Ascend layout);
    lanes past the tile or the row add +0.0, an exact identity in a sum of non-negative terms (= skipped)."""
    lane = tl.arange(0, VTP)
    vidx = tiles[:, None] * VT + lane[None, :]
    ok = row_ok[:, None, None] & ((vidx < V) & (lane < VT)[None, :])[None, :, :]
    x = sm.widen(tl.load(lg_ptr + base[:, None, None] + vidx[None, :, :], mask=ok, other=0.0))
    e = tl.where(ok, sm.exp(x - shift[:, None, None]), 0.0)
    return common.nonneg_sums_in_order(e, V, VTP, BR, NTB)


@triton.jit(do_not_specialize=["R", "n_work", "n1"])
def tile_sums_kernel(lg_ptr, shift_ptr, part_ptr, R, V, sl, sp, n_tiles, n_work, n1, VT: tl.constexpr,
                     VTP: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VEC: tl.constexpr, ROW_PAD: tl.constexpr,
                     REG: tl.constexpr, NPU: tl.constexpr):
    """Per (row block, chunk of NTB tiles of VT): each tile's sequential sum from +0.0 of exp(x - shift) over rows
    x = lg_ptr[row * sl : row * sl + V] (float32, bfloat16 or float16) -> part_ptr[row * sp + tile]. ROW_PAD: see
    _exp_sums_vec. Shared with token_logprobs (its kept logits)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)
        row_ok = rows < R
        tiles = (item // n1) * NTB + tl.arange(0, NTB)
        shift = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
        base = rows.to(tl.int64) * sl
        if NPU:  # the Ascend variant (no tl.split): read back in place
            s = _block_sums(lg_ptr, base, row_ok, shift, tiles, V, VT, VTP, BR, NTB)
        elif REG:  # the interpreter: few, large operations
            s = _block_sums(lg_ptr, base, row_ok, shift, tiles, V, VT, VTP, BR, NTB)
        else:  # GPU: each (row, tile) lane's chain in one thread, VEC consecutive elements per 16-byte load, pipelined
            s = _exp_sums_vec(lg_ptr, base, row_ok, shift, tiles * VT, V, VT, BR, NTB, VEC, ROW_PAD)
        out = rows.to(tl.int64)[:, None] * sp + tiles[None, :]
        tl.store(part_ptr + out, s, mask=row_ok[:, None] & (tiles < n_tiles)[None, :])


@triton.jit
def tiles_in_order(part_ptr, rows, row_ok, sp, n_tiles, BR: tl.constexpr, NPU: tl.constexpr):
    """[BR] S = the tile sums part_ptr[row * sp + t] added in tile order from +0.0. On the GPU 4 consecutive tile sums
    per 16-byte load, added in order in the row's thread: rows padded to sp (a multiple of 16), so a vector is loaded
    whole and its entries past n_tiles skipped by the chain. Shared with token_logprobs."""
    prow = part_ptr + rows.to(tl.int64) * sp
    if NPU:  # the Ascend variant: one tile sum per step
        s = tl.zeros([BR], dtype=tl.float32)
        for t in range(0, n_tiles):
            s = s + tl.load(prow + t, mask=row_ok, other=0.0)
    else:
        s2 = tl.zeros([BR, 1], dtype=tl.float32)
        for c in tl.range(0, n_tiles, 4, num_stages=common.STAGES):
            t, ok = common.vec_step(tl.zeros([1], dtype=tl.int32), c, n_tiles, 4, 4)  # [1, 4]
            v = tl.load(prow[:, None, None] + t[None, :, :], mask=row_ok[:, None, None], other=0.0)
            v0, v1, v2, v3 = common.four(v, BR, 1)
            k0, k1, k2, k3 = common.four(ok[None, :, :], 1, 1)
            s2 = common.add_steps(s2, v0, v1, v2, v3, k0, k1, k2, k3)  # past n_tiles: skipped
        s = tl.reshape(s2, [BR])
    return s


@triton.jit(do_not_specialize=["R", "n_work"])
def _split_finish_kernel(part_ptr, shift_ptr, empty_ptr, s_ptr, out_ptr, R, sp, n_tiles, n_work, MODE: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, BR: tl.constexpr, NPU: tl.constexpr):
    """Per row: S from the tile sums (tiles_in_order) -> s_ptr; logsumexp (MODE 2) = M + log S -> out_ptr."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        s = tiles_in_order(part_ptr, rows, row_ok, sp, n_tiles, BR, NPU)
        tl.store(s_ptr + rows, s, mask=row_ok)
        if MODE == 2:
            m_safe = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
            empty = tl.load(empty_ptr + rows, mask=row_ok, other=0) > 0
            out = tl.where(empty, float("-inf"), m_safe + sm.log(s, NPU))
            tl.store(out_ptr + rows, sm.round_out(out, OUT_DTYPE, NPU), mask=row_ok)


@triton.jit(do_not_specialize=["R", "n_work", "n1"])
def _split_out_kernel(x_ptr, out_ptr, shift_ptr, empty_ptr, s_ptr, R, n, n_work, n1, MODE: tl.constexpr,
                      OUT_DTYPE: tl.constexpr, CH: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                      NPU: tl.constexpr):
    """Per (row block, column chunk of CH): softmax (MODE 0) or log_softmax (MODE 1) from the row's M and S, the
    formulas of _softmax_kernel (write_outputs)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)
        row_ok = rows < R
        c = item // n1
        base = rows.to(tl.int64) * n
        m_safe = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
        empty = tl.load(empty_ptr + rows, mask=row_ok, other=0) > 0
        s = tl.load(s_ptr + rows, mask=row_ok, other=1.0)
        write_outputs(x_ptr, out_ptr, base, row_ok, n, c * CH, tl.minimum(c * CH + CH, n), m_safe, s, empty, MODE,
                      OUT_DTYPE, BC, NPU)


def _blocks(rows: int, n_tiles: int, reg: bool, vec: int):
    """(BR, NTB, BC): rows per program, tiles per chain block, columns per max / output block."""
    if reg:
        return next_power_of_2(min(rows, 16)), min(64, next_power_of_2(n_tiles)), 4096
    if ascend_launch.active():  # unified-buffer-sized blocks
        return 4, min(64, next_power_of_2(n_tiles)), 512
    # a row's 32 tile lanes / 32 vectors fit in one warp: the row max and the tile-order column reads reduce
    # within a warp (no shared memory, no barrier); short rows get more rows, so every thread gets a whole vector
    ntb = min(32, next_power_of_2(n_tiles))
    br = max(4, common.VECTOR_LANES // ntb)
    return br, ntb, min(32 * vec, 2048 // br)


#: a GPU this size keeps busy: rows whose one-program-per-row-block launch has fewer programs than this (and whose
#: rows are long, _SPLIT_MIN_COLUMNS) run split across the row; the H200 has 132 SMs
_BUSY_PROGRAMS = 264
_SPLIT_MIN_COLUMNS = 8192


def _split_by_default(rows: int, n: int, br: int) -> bool:
    """Whether rows of n run split across the row: few row programs, long rows (a vocabulary); not on Ascend, whose
    persistent grid is its vector cores anyway."""
    return not ascend_launch.active() and n >= _SPLIT_MIN_COLUMNS and cdiv(rows, br) < _BUSY_PROGRAMS


def _split_blocks(rows: int, n_tiles: int, reg: bool, vec: int):
    """(BR, BC, CH) of the chunk max / output passes, (SBR, NTB, warps) of the tile-sum pass. GPU: one row per
    program, chunks of CH columns in BC blocks (16 bytes per thread of 4 warps); the tile sums one (row, tile) lane per
    thread of one warp, 32 tiles of a row per program (hundreds of programs at 8 rows of a 151,936 vocabulary).
    Interpreter: few, large programs (small chunks, so short test rows still cross several)."""
    if reg:
        br = next_power_of_2(min(rows, 16))
        return br, 256, 512, br, min(64, next_power_of_2(n_tiles)), 4
    if ascend_launch.active():
        return 4, 512, 1024, 4, min(64, next_power_of_2(n_tiles)), 4
    bc = 128 * vec
    ntb = min(32, next_power_of_2(n_tiles))
    return 1, bc, 2 * bc, max(1, 32 // ntb), ntb, 1


class SplitScratch(NamedTuple):
    """The scratch of the split passes (a row across programs): per (row, chunk) max, poisoned and has-+0.0 flags, per
    row the shift m_safe and the empty flag, per (row, tile) sums (rows padded to sp)."""
    m: torch.Tensor
    bad: torch.Tensor
    pz: torch.Tensor
    shift: torch.Tensor
    empty: torch.Tensor
    parts: torch.Tensor


def split_scratch(owner: str, rows: int, n_chunks: int, sp: int, device) -> SplitScratch:
    """The split passes' workspaces (workspace.py: reused across calls, CUDA-graph safe), named after their owner
    ("softmax", "token_logprobs"): one home for the split statistics of softmax.py and token_logprobs.py."""
    f32, i32 = torch.float32, torch.int32
    return SplitScratch(workspace(f"{owner} chunk max", (rows, n_chunks), f32, device),
                        workspace(f"{owner} chunk bad", (rows, n_chunks), i32, device),
                        workspace(f"{owner} chunk pz", (rows, n_chunks), i32, device),
                        workspace(f"{owner} shift", (rows,), f32, device),
                        workspace(f"{owner} empty", (rows,), i32, device),
                        workspace(f"{owner} tile sums", (rows, sp), f32, device))


#: chunk_stats_kernel's [rows, chunks] block on the GPU: at most this many elements (8 a thread of 4 warps for each of
#: the three running maxima). A [8, 1024] block (token_logprobs at 256 rows of a 151,936 vocabulary: 2,374 chunks)
#: spilled 224 bytes on the H200 (Triton 3.6, 2026-12-04b)
_STATS_BLOCK = 1024


def run_chunk_stats(scratch: SplitScratch, rows: int, n_chunks: int) -> None:
    """The row max (shift, empty) from the chunk maxima in scratch: chunk_stats_kernel with its blocks (the
    interpreter: few, large programs; the GPU: at most _STATS_BLOCK elements, more programs for long rows)."""
    bc = min(1024, next_power_of_2(n_chunks))
    br = min(16, next_power_of_2(rows))
    if not interpreter_layout() and not ascend_launch.active():
        br = max(1, min(br, _STATS_BLOCK // bc))
    launch(chunk_stats_kernel, (cdiv(rows, br),), scratch.m, scratch.bad, scratch.pz, scratch.shift, scratch.empty,
           rows, n_chunks, BR=br, BC=bc, persistent=True)


def _run_split(x2: torch.Tensor, out: torch.Tensor, spec, mode: int, reg: bool) -> None:
    """The passes over rows split across chunks (module docstring)."""
    rows, n = x2.shape
    dev = x2.device
    t = spec.tile
    n_tiles = max(1, cdiv(n, t))
    vec = 16 // x2.element_size()
    br, bc, ch, sbr, ntb, warps = _split_blocks(rows, n_tiles, reg, vec)
    n_chunks = cdiv(n, ch)
    sp = cdiv(n_tiles, 16) * 16  # tile-sum rows padded: tiles_in_order reads them 16 bytes at a time
    ws = split_scratch("softmax", rows, n_chunks, sp, dev)
    m, bad, pz, shift, empty, parts = ws
    s = workspace("softmax sum", (rows,), torch.float32, dev)
    out_dtype = tl_dtype(x2.dtype)
    launch(_chunk_max_kernel, (n_chunks, cdiv(rows, br)), x2, m, bad, pz, rows, n, n, n_chunks, CH=ch, BR=br, BC=bc,
           persistent=True)
    run_chunk_stats(ws, rows, n_chunks)
    launch(tile_sums_kernel, (cdiv(n_tiles, ntb), cdiv(rows, sbr)), x2, shift, parts, rows, n, n, sp, n_tiles,
           VT=t, VTP=next_power_of_2(t), BR=sbr, NTB=ntb, VEC=vec, ROW_PAD=False, REG=reg, num_warps=warps,
           persistent=True)
    fbr, fwarps = (br, 4) if reg or ascend_launch.active() else (32, 1)
    launch(_split_finish_kernel, (cdiv(rows, fbr),), parts, shift, empty, s, out, rows, sp, n_tiles, MODE=mode,
           OUT_DTYPE=out_dtype, BR=fbr, num_warps=fwarps, persistent=True)
    if mode != LOGSUMEXP:
        launch(_split_out_kernel, (n_chunks, cdiv(rows, br)), x2, out, shift, empty, s, rows, n, MODE=mode,
               OUT_DTYPE=out_dtype, CH=ch, BR=br, BC=bc, persistent=True)


def _run(x: torch.Tensor, spec, mode: int, reg: bool | None = None, split: bool | None = None) -> torch.Tensor:
    """reg: the register layout of the tile sums (default: in the interpreter only; same bits). split: the rows split
    across programs (default: _split_by_default; same bits)."""
    n = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), n).contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows,) if mode == LOGSUMEXP else (rows, n), dtype=x.dtype, device=x.device)
    n_tiles = max(1, cdiv(n, spec.tile))
    if rows:
        if reg is None:  # the interpreter's register layout needs a power-of-two tile (tl.arange)
            reg = interpreter_layout() and spec.tile == next_power_of_2(spec.tile)
        vec = 16 // x.element_size()
        br, ntb, bc = _blocks(rows, n_tiles, reg, vec)
        if split is None:
            split = _split_by_default(rows, n, br)
        if split:
            _run_split(x2, out, spec, mode, reg)
        else:
            launch(_softmax_kernel, (cdiv(rows, br),), x2, out, rows, n, n_tiles, MODE=mode, T=spec.tile,
                   OUT_DTYPE=tl_dtype(x.dtype), BR=br, NTB=ntb, BC=bc, VEC=vec, REG=reg, persistent=True)
    return out.reshape(x.shape[:-1]) if mode == LOGSUMEXP else out.reshape(x.shape)


def softmax(x, spec, reg=None, split=None):
    return _run(x, spec, SOFTMAX, reg, split)


def log_softmax(x, spec, reg=None, split=None):
    return _run(x, spec, LOG_SOFTMAX, reg, split)


def logsumexp(x, spec, reg=None, split=None):
    return _run(x, spec, LOGSUMEXP, reg, split)
