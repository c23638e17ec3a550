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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, strict_math as sm
from .dtypes import tl_dtype
from .launch import cdiv, interpreter_layout, launch, next_power_of_2

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
            log_s = sm.log(s, NPU)
            cols = tl.arange(0, BC)
            for c0 in tl.range(0, n, BC, num_stages=common.STAGES):
                ok = row_ok[:, None] & ((c0 + cols) < n)[None, :]
                offs = base[:, None] + (c0 + cols)[None, :]
                shifted = sm.widen(tl.load(x_ptr + offs, mask=ok, other=0.0)) - m_safe[:, None]
                if MODE == 1:
                    out = tl.where(empty[:, None], float("-inf"), shifted - log_s[:, None])
                else:
                    out = tl.where(empty[:, None], 0.0, sm.div(sm.exp(shifted), s[:, None], NPU))
                tl.store(out_ptr + offs, sm.round_out(out, OUT_DTYPE, NPU), mask=ok)


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


def _run(x: torch.Tensor, spec, mode: int, reg: bool | None = None) -> torch.Tensor:
    """reg: the register layout of the tile sums (default: in the interpreter only; same bits)."""
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
        launch(_softmax_kernel, (cdiv(rows, br),), x2, out, rows, n, n_tiles, MODE=mode, T=spec.tile,
               OUT_DTYPE=tl_dtype(x.dtype), BR=br, NTB=ntb, BC=bc, VEC=vec, REG=reg, persistent=True)
    return out.reshape(x.shape[:-1]) if mode == LOGSUMEXP else out.reshape(x.shape)


def softmax(x, spec, reg=None):
    return _run(x, spec, SOFTMAX, reg)


def log_softmax(x, spec, reg=None):
    return _run(x, spec, LOG_SOFTMAX, reg)


def logsumexp(x, spec, reg=None):
    return _run(x, spec, LOGSUMEXP, reg)
