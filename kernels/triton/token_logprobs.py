"""token_logprobs under TokenLogprobsSpec (strict): the LM head never materialises [N, V] logits.

The spec's log-softmax needs the row max M before any exp, so logits are computed twice, a vocab
tile of VT at a time, in register tiles [BR rows, NTB vocab tiles, VT]:

1. ``_max_kernel``   (rows x vocab chunks): logits -> per chunk (max, poisoned, has +0.0) -> scratch;
2. ``_stats_kernel`` (rows): M from the chunk maxima (exact), the shift m_safe and the empty flag;
3. ``_sum_kernel``   (rows x vocab chunks): logits again -> exp(logit - m_safe) -> each vocab tile's
   sequential sum from +0.0 in vocab order -> scratch [N, n_tiles];
4. ``_finish_kernel`` (rows): S = tile sums added in tile order from +0.0; the token's logit by the
   same fma chain; out = (logit - m_safe) - log(S) in float32.

Scratch is O(N * V / VT) floats. Each logit is the hidden-tiled fma chain of common.dot_k_tiled,
written for a 3-D tile; temperature (when != 1) is one correctly rounded division.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, strict_math as sm
from .launch import cdiv, interpreter_layout, launch, next_power_of_2, program_count
from .workspace import workspace


@triton.jit
def _logits(h_ptr, w_ptr, rows, row_ok, vidx, v_ok, H, sh, sw_v, temp, HAS_TEMP: tl.constexpr,
            KT: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VTP: tl.constexpr, VEC: tl.constexpr,
            NPU: tl.constexpr):
    """[BR, NTB, VTP] float32 logits hidden[row] . W[v] (v = vidx [NTB, VTP], VTP lanes per vocab tile) in the
    canonical order.

    Each vocab entry's chain takes VEC consecutive hidden elements per 16-byte load (common.dot_tile_vec);
    the Ascend variant takes one element per step. Same chains, same bits."""
    a_rows = h_ptr + rows.to(tl.int64) * sh
    if NPU:  # the Ascend variant: one element per step (tl.split is outside its documented API subset)
        total = tl.zeros([BR, NTB, VTP], dtype=tl.float32)
        a_p = a_rows
        b_p = w_ptr + vidx.to(tl.int64) * sw_v
        for k0 in range(0, H, KT):
            part = tl.zeros([BR, NTB, VTP], dtype=tl.float32)
            for _ in range(k0, tl.minimum(k0 + KT, H)):
                a = sm.widen(tl.load(a_p, mask=row_ok, other=0.0))
                b = sm.widen(tl.load(b_p, mask=v_ok, other=0.0))
                part = tl.fma(a[:, None, None], b[None, :, :], part)
                a_p += 1
                b_p += 1
            total = total + part
    else:
        L: tl.constexpr = NTB * VTP
        b_lanes = w_ptr + tl.reshape(vidx, [L]).to(tl.int64) * sw_v
        lane_ok = tl.reshape(v_ok, [L])
        flat = tl.zeros([BR, L], dtype=tl.float32)
        for k0 in range(0, H, KT):  # not pipelined: a stage of the unrolled tile's loads would not fit in shared memory
            start = tl.zeros([L], dtype=tl.int32) + k0
            flat = flat + common.dot_tile_vec(a_rows, b_lanes, row_ok, lane_ok, start, H, KT, VEC, BR, L)
        total = tl.reshape(flat, [BR, NTB, VTP])
    if HAS_TEMP:
        total = sm.div(total, temp, NPU)
    return total


@triton.jit
def _vocab_block(c, V, NTB: tl.constexpr, VT: tl.constexpr, VTP: tl.constexpr):
    """(tiles, vocab index [NTB, VTP], valid) of vocab chunk c: VTP = VT rounded up to a power of two (the
    lanes of a tile; lanes past VT are not valid, and add +0.0 to the tile sums: an exact identity)."""
    tiles = c * NTB + tl.arange(0, NTB)
    lane = tl.arange(0, VTP)
    vidx = tiles[:, None] * VT + lane[None, :]
    return tiles, vidx, (vidx < V) & (lane < VT)[None, :]


@triton.jit
def _max_kernel(h_ptr, w_ptr, m_ptr, p_ptr, z_ptr, R, V, H, sh, sw_v, temp, n_chunks, n_work, n1,
                HAS_TEMP: tl.constexpr, KT: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VT: tl.constexpr,
                VTP: tl.constexpr, VEC: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)  # row block fastest: row blocks of one vocab chunk run together
        row_ok = rows < R
        c = item // n1
        tiles, vidx, v_ok = _vocab_block(c, V, NTB, VT, VTP)
        x = _logits(h_ptr, w_ptr, rows, row_ok, vidx, v_ok, H, sh, sw_v, temp, HAS_TEMP, KT, BR, NTB, VTP, VEC, NPU)
        ok = row_ok[:, None, None] & v_ok[None, :, :]
        m, bad, pz = common.row_max(tl.reshape(x, [BR, NTB * VTP]), tl.reshape(ok, [BR, NTB * VTP]))
        out = rows.to(tl.int64) * n_chunks + c
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(p_ptr + out, bad, mask=row_ok)
        tl.store(z_ptr + out, pz, mask=row_ok)


@triton.jit
def _stats_kernel(m_ptr, p_ptr, z_ptr, shift_ptr, empty_ptr, R, n_chunks, n_work, BR: tl.constexpr,
                  BC: tl.constexpr, NPU: tl.constexpr):
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
def _tile_sums(e, slot, BR: tl.constexpr, NTB: tl.constexpr, VTP: tl.constexpr):
    """[BR, NTB] sequential sums from +0.0 over the last axis of e [BR, NTB, VTP] (terms >= +0.0 or NaN, lanes
    past the vocab +0.0: adding them is an exact identity). e's lanes sit in different threads, so reading
    them back in order one by one costs a reduction across the program per element; instead e goes to this
    program's scratch slot and comes back 8 consecutive elements per thread (common.eight), and each
    (row, tile) sum runs inside one thread. The barriers order the slot's reuse: the previous item's reads
    before these stores, these stores before the reads."""
    lane = (tl.arange(0, BR)[:, None] * NTB + tl.arange(0, NTB)[None, :]) * VTP  # [BR, NTB]: first element
    tl.debug_barrier()
    tl.store(slot + lane[:, :, None] + tl.arange(0, VTP)[None, None, :], e)
    tl.debug_barrier()
    e8 = tl.arange(0, 8)
    s = tl.zeros([BR, NTB], dtype=tl.float32)
    for c in range(0, VTP, 8):  # unrolled (VTP constexpr): its 16-byte loads are issued ahead already
        v0, v1, v2, v3, v4, v5, v6, v7 = common.eight(tl.load(slot + lane[:, :, None] + c + e8[None, None, :]), BR, NTB)
        s = ((((((((s + v0) + v1) + v2) + v3) + v4) + v5) + v6) + v7)
    return s


@triton.jit
def _sum_kernel(h_ptr, w_ptr, shift_ptr, part_ptr, scr_ptr, R, V, H, sh, sw_v, temp, n_tiles, n_work, n1,
                HAS_TEMP: tl.constexpr, KT: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VT: tl.constexpr,
                VTP: tl.constexpr, VEC: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)  # row block fastest (see _max_kernel)
        row_ok = rows < R
        tiles, vidx, v_ok = _vocab_block(item // n1, V, NTB, VT, VTP)
        x = _logits(h_ptr, w_ptr, rows, row_ok, vidx, v_ok, H, sh, sw_v, temp, HAS_TEMP, KT, BR, NTB, VTP, VEC, NPU)
        shift = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
        # past the vocab end: +0.0, an exact identity in a sum of non-negative terms (= skipped)
        e = tl.where(v_ok[None, :, :], sm.exp(x - shift[:, None, None]), 0.0)
        if NPU:  # the Ascend variant (no tl.split): read back in place
            s = common.nonneg_sums_in_order(e, V, VTP, BR, NTB)
        elif VTP < 8:  # a tile smaller than one 8-element step
            s = common.nonneg_sums_in_order(e, V, VTP, BR, NTB)
        else:
            s = _tile_sums(e, scr_ptr + tl.program_id(0).to(tl.int64) * (BR * NTB * VTP), BR, NTB, VTP)
        out = rows.to(tl.int64)[:, None] * n_tiles + tiles[None, :]
        tl.store(part_ptr + out, s, mask=row_ok[:, None] & (tiles < n_tiles)[None, :])


@triton.jit
def _finish_kernel(h_ptr, w_ptr, tok_ptr, shift_ptr, empty_ptr, part_ptr, out_ptr, R, H, sh, sw_v, temp,
                   n_tiles, n_work, HAS_TEMP: tl.constexpr, KT: tl.constexpr, BR: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        s = tl.zeros([BR], dtype=tl.float32)
        for t in tl.range(0, n_tiles, num_stages=common.STAGES):
            s = s + tl.load(part_ptr + rows.to(tl.int64) * n_tiles + t, mask=row_ok, other=0.0)
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0)
        # the token's logit: the same chain as _logits, for one vocab entry per row
        total = tl.zeros([BR], dtype=tl.float32)
        a_p = h_ptr + rows.to(tl.int64) * sh
        b_p = w_ptr + tok.to(tl.int64) * sw_v
        for k0 in range(0, H, KT):
            part = tl.zeros([BR], dtype=tl.float32)
            for _ in tl.range(k0, tl.minimum(k0 + KT, H), num_stages=common.STAGES):
                a = sm.widen(tl.load(a_p, mask=row_ok, other=0.0))
                b = sm.widen(tl.load(b_p, mask=row_ok, other=0.0))
                part = tl.fma(a, b, part)
                a_p += 1
                b_p += 1
            total = total + part
        if HAS_TEMP:
            total = sm.div(total, temp, NPU)
        shift = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
        empty = tl.load(empty_ptr + rows, mask=row_ok, other=0) > 0
        out = tl.where(empty, float("-inf"), (total - shift) - sm.log(s, NPU))
        tl.store(out_ptr + rows, sm.canonical_nan(out), mask=row_ok)


#: programs of the tile-sum pass per multiprocessor (the kernel keeps one 8-warp program per SM resident)
_SUM_PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 2 elsewhere (the interpreter: programs then loop over several work
    items, as on the GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _blocks(rows: int, n_tiles: int):
    """(rows per program, vocab tiles per program, warps of the two logits kernels)."""
    if interpreter_layout():  # few, large programs: the interpreter pays per operation
        return next_power_of_2(min(rows, 16)), next_power_of_2(n_tiles), 4
    if ascend_launch.active():
        return (16 if rows > 8 else next_power_of_2(rows)), 1, 4
    # one vocab entry (of a 256 tile) per thread; 8 rows keep the 8 x 8 hidden values of a step in registers
    # (sm_90 machine code, hal.kernels.checks.sass_profile: 152 registers, no spills; 16 rows need 254)
    return min(8, next_power_of_2(rows)), 1, 8


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   spec) -> torch.Tensor:
    """float32 log p(tokens[n] | hidden[n]) for hidden [..., H], weight [V, H], tokens [...] int."""
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(hidden.shape[:-1].numel(), hdim).contiguous()
    w = weight.contiguous()
    tok = tokens.reshape(-1).to(torch.int64).contiguous()
    rows, vocab = h2.shape[0], w.shape[0]
    dev = hidden.device
    out = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return out.reshape(lead)
    vt, kt = spec.vocab_tile, spec.hidden_tile
    n_tiles = max(1, cdiv(vocab, vt))
    br, ntb, warps = _blocks(rows, n_tiles)
    n_chunks = cdiv(n_tiles, ntb)
    temp = float(temperature)
    has_temp = temp != 1.0
    f32, i32 = torch.float32, torch.int32
    m = workspace("token_logprobs chunk max", (rows, n_chunks), f32, dev)
    bad = workspace("token_logprobs chunk bad", (rows, n_chunks), i32, dev)
    pz = workspace("token_logprobs chunk pz", (rows, n_chunks), i32, dev)
    shift = workspace("token_logprobs shift", (rows,), f32, dev)
    empty = workspace("token_logprobs empty", (rows,), i32, dev)
    parts = workspace("token_logprobs tile sums", (rows, n_tiles), f32, dev)
    grid2 = (n_chunks, cdiv(rows, br))
    common_args = dict(HAS_TEMP=has_temp, KT=kt, BR=br, NTB=ntb, VT=vt, VTP=next_power_of_2(vt), VEC=16 // w.element_size(),
                       num_warps=warps)
    launch(_max_kernel, grid2, h2, w, m, bad, pz, rows, vocab, hdim, h2.stride(0), w.stride(0), temp, n_chunks,
           **common_args, persistent=True)
    launch(_stats_kernel, (cdiv(rows, br),), m, bad, pz, shift, empty, rows, n_chunks, BR=br,
           BC=min(1024, next_power_of_2(n_chunks)), persistent=True)
    # a scratch slot of one program's exps per program; the programs are capped so it stays small
    programs = program_count(grid2[0] * grid2[1], _SUM_PROGRAMS_PER_SM * _sm_count(dev))
    scratch = workspace("token_logprobs exps", (programs, br * ntb * next_power_of_2(vt)), f32, dev)
    launch(_sum_kernel, grid2, h2, w, shift, parts, scratch, rows, vocab, hdim, h2.stride(0), w.stride(0), temp,
           n_tiles, **common_args, persistent=True, max_programs=programs)
    launch(_finish_kernel, (cdiv(rows, br),), h2, w, tok, shift, empty, parts, out, rows, hdim,
           h2.stride(0), w.stride(0), temp, n_tiles, HAS_TEMP=has_temp, KT=kt, BR=br, persistent=True)
    return out.reshape(lead)
