"""RMSNorm (+ fused residual) under RMSNormSpec (strict).

One program handles BR rows. The sum of squares is a sequential fma chain from +0.0 inside each hidden
tile of T; a [BR, NTB] register tile holds the running partials of NTB tiles (lanes = (row, tile)), all
advancing in parallel, and the partials are then added in tile order (common.add_columns_in_order).
Three layouts of the chains, the same operations in the same order, so the same bits:
* GPU: each step loads VEC consecutive elements (16 bytes) of every lane's tile with one vector load per
  thread and runs them through the chain in order (common.eight / four, no shuffle, no shared memory);
* Ascend (NPU): step j loads element j of every tile (its documented API subset has no tl.split);
* interpreter (REG): one [BR, NTB, T] block read back from registers in order (fewer interpreted operations).
Tests run the GPU and REG layouts in the interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, strict_math as sm
from .dtypes import tl_dtype
from .launch import cdiv, interpreter_layout, launch, next_power_of_2


@triton.jit
def _load_h(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr, OUT_DTYPE: tl.constexpr, NPU: tl.constexpr):
    """h as float32: x, or x + r rounded once to x's dtype (the value an unfused add would give)."""
    x = sm.widen(tl.load(x_ptr + offs, mask=mask, other=0.0))
    if HAS_RES:
        r = sm.widen(tl.load(r_ptr + offs, mask=mask, other=0.0))
        x = sm.widen(sm.round_out(x + r, OUT_DTYPE, NPU))
    return x


@triton.jit
def _square_chains(h, n, T: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr):
    """[BR, NTB] chains part = fma(h_j, h_j, part) from +0.0 over j of h [BR, NTB, T]. Elements past
    the end hold +0.0: fma(0, 0, part) = part exactly, as every partial is +0.0 or positive (or NaN)."""
    bits = h.to(tl.int32, bitcast=True)
    jidx = tl.arange(0, T)
    part = tl.zeros([BR, NTB], dtype=tl.float32)
    for j in range(0, tl.minimum(T, n)):
        hj = tl.sum(tl.where(jidx[None, None, :] == j, bits, 0), axis=2).to(tl.float32, bitcast=True)
        part = tl.fma(hj, hj, part)
    return part


@triton.jit
def _square_steps(part, h, ok, BR: tl.constexpr, NTB: tl.constexpr, VEC: tl.constexpr):
    """part = fma(h_i, h_i, part) in order i = 0..VEC-1 over the last axis of h [BR, NTB, VEC] (ok: [1, NTB,
    VEC]; a step whose ok is False keeps part)."""
    if VEC == 8:
        h0, h1, h2, h3, h4, h5, h6, h7 = common.eight(h, BR, NTB)
        v0, v1, v2, v3, v4, v5, v6, v7 = common.eight(ok, 1, NTB)
        part = common.fma_steps(part, h0, h1, h2, h3, h0, h1, h2, h3, v0, v1, v2, v3)
        part = common.fma_steps(part, h4, h5, h6, h7, h4, h5, h6, h7, v4, v5, v6, v7)
    else:
        h0, h1, h2, h3 = common.four(h, BR, NTB)
        v0, v1, v2, v3 = common.four(ok, 1, NTB)
        part = common.fma_steps(part, h0, h1, h2, h3, h0, h1, h2, h3, v0, v1, v2, v3)
    return part


@triton.jit
def _square_chains_vec(x_ptr, r_ptr, base, row_ok, start, H, HAS_RES: tl.constexpr, T: tl.constexpr,
                       OUT_DTYPE: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VEC: tl.constexpr,
                       NPU: tl.constexpr):
    """GPU layout: the [BR, NTB] chains of the tiles starting at start [NTB], VEC elements a step."""
    part = tl.zeros([BR, NTB], dtype=tl.float32)
    for c in tl.range(0, tl.minimum(T, H), VEC, num_stages=common.STAGES):
        col, ok = common.vec_step(start, c, H, T, VEC)  # [NTB, VEC]
        h = _load_h(x_ptr, r_ptr, base[:, None, None] + col[None, :, :], row_ok[:, None, None] & ok[None, :, :],
                    HAS_RES, OUT_DTYPE, NPU)
        part = _square_steps(part, h, ok[None, :, :], BR, NTB, VEC)
    return part


@triton.jit
def _load_w(w_ptr, col, ok, H, BR: tl.constexpr, BH: tl.constexpr, NPU: tl.constexpr):
    """The weights of columns col [BH] as float32, broadcastable to [BR, BH]."""
    if NPU:  # one [BH] load (every row of the block uses it)
        w = sm.widen(tl.load(w_ptr + col, mask=col < H, other=0.0))[None, :]
    else:  # a [BR, BH] block (each row reads the same w, from cache) lands in h's layout: 16-byte loads and no
        # layout conversion through shared memory (a [BH] load is spread 1-2 elements per thread, then moved)
        w = sm.widen(tl.load(w_ptr + col[None, :] + tl.zeros([BR, BH], dtype=tl.int32), mask=ok, other=0.0))
    return w


@triton.jit(do_not_specialize=["R", "n_work"])  # counts that change per call: no recompiles
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, R, H, h_float, eps, n_tiles, n_work,
                     HAS_RES: tl.constexpr, T: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     BR: tl.constexpr, NTB: tl.constexpr, BH: tl.constexpr, VEC: tl.constexpr, REG: tl.constexpr,
                     NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        base = rows.to(tl.int64) * H
        tiles = tl.arange(0, NTB)
        ss = tl.zeros([BR], dtype=tl.float32)
        for t0 in range(0, n_tiles, NTB):
            start = (t0 + tiles) * T
            if REG:  # interpreter layout: one [BR, NTB, T] block, the chain read back in order
                col3 = start[:, None] + tl.arange(0, T)[None, :]
                ok3 = row_ok[:, None, None] & (col3 < H)[None, :, :]
                h = _load_h(x_ptr, r_ptr, base[:, None, None] + col3[None, :, :], ok3, HAS_RES, OUT_DTYPE, NPU)
                part = _square_chains(h, H, T, BR, NTB)
            elif NPU:  # Ascend: step j loads element j of every tile
                part = tl.zeros([BR, NTB], dtype=tl.float32)
                for j in range(0, tl.minimum(T, H)):
                    col = start + j
                    ok = row_ok[:, None] & (col < H)[None, :]
                    h = _load_h(x_ptr, r_ptr, base[:, None] + col[None, :], ok, HAS_RES, OUT_DTYPE, NPU)
                    part = tl.where(ok, tl.fma(h, h, part), part)  # past the end: kept, not padded
            else:  # GPU layout: 16-byte vector loads
                part = _square_chains_vec(x_ptr, r_ptr, base, row_ok, start, H, HAS_RES, T, OUT_DTYPE, BR, NTB, VEC,
                                          NPU)
            ss = common.add_columns_in_order(ss, part, tiles, tl.minimum(NTB, n_tiles - t0))
        ms = sm.div(ss, h_float, NPU)  # H as a float32 argument: Triton turns an int argument equal to 1 into a constexpr
        inv = sm.div(1.0, sm.sqrt(ms + eps, NPU), NPU)
        cols = tl.arange(0, BH)
        for c0 in tl.range(0, H, BH, num_stages=common.STAGES):
            col = c0 + cols
            ok = row_ok[:, None] & (col < H)[None, :]
            offs = base[:, None] + col[None, :]
            h = _load_h(x_ptr, r_ptr, offs, ok, HAS_RES, OUT_DTYPE, NPU)
            w = _load_w(w_ptr, col, ok, H, BR, BH, NPU)
            y = (h * inv[:, None]) * w
            tl.store(y_ptr + offs, sm.round_out(y, OUT_DTYPE, NPU), mask=ok)
            if HAS_RES:
                tl.store(h_ptr + offs, sm.round_out(h, OUT_DTYPE, NPU), mask=ok)


def _blocks(rows: int, n_tiles: int, reg: bool):
    """(BR, NTB, BH): rows per program, tiles per chain block, columns per output block."""
    if reg:
        return next_power_of_2(min(rows, 16)), min(64, next_power_of_2(n_tiles)), 1024
    ntb = min(32, next_power_of_2(n_tiles))
    if ascend_launch.active():  # unified-buffer-sized blocks
        return 4, ntb, 256
    br = max(4, common.VECTOR_LANES // ntb)  # short rows: more rows, so every thread gets a whole vector
    return br, ntb, 1024 // br


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual, spec, reg: bool | None = None):
    """Returns y, or (y, new_residual) when a residual is given. Shapes [..., H]; weight [H].

    reg: the register layout of the sum of squares (default: in the interpreter only; same bits)."""
    hdim = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), hdim).contiguous()
    r2 = residual.reshape(x2.shape).contiguous() if residual is not None else x2
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else y
    t = spec.hidden_tile
    n_tiles = max(1, cdiv(hdim, t))
    if rows and hdim:
        if reg is None:  # the interpreter's register layout needs a power-of-two tile (tl.arange)
            reg = interpreter_layout() and t == next_power_of_2(t)
        br, ntb, bh = _blocks(rows, n_tiles, reg)
        launch(_rms_norm_kernel, (cdiv(rows, br),), x2, r2, weight.contiguous(), y, h, rows, hdim,
               float(hdim), float(eps), n_tiles, HAS_RES=residual is not None, T=t, OUT_DTYPE=tl_dtype(x.dtype),
               BR=br, NTB=ntb, BH=bh, VEC=16 // x.element_size(), REG=reg, persistent=True)
    y = y.reshape(x.shape)
    return (y, h.reshape(x.shape)) if residual is not None else y
