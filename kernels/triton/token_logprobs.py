"""token_logprobs under TokenLogprobsSpec (strict): the LM head computed once, its logits kept in float32.

The spec's log-softmax needs the row max M before any exp. The LM head runs once, a vocab tile of VT at a time,
in register tiles [BR rows, NTB vocab tiles, VT]; its float32 logits are kept in a scratch [rows, V] (rows in
groups, so the scratch stays under _LOGITS_SCRATCH_BYTES) and read back by the later passes:

1. ``_max_kernel``   (rows x vocab chunks): logits -> the kept logits, and per chunk (max, poisoned, has +0.0);
2. ``softmax.chunk_stats_kernel`` (rows): M from the chunk maxima (exact), the shift m_safe and the empty flag;
3. ``softmax.tile_sums_kernel`` (rows x tile chunks): the kept logits -> exp(logit - m_safe) -> each vocab tile's
   sequential sum from +0.0 in vocab order -> scratch [N, n_tiles] (the chains of softmax.py, 16 bytes a step);
4. ``_finish_kernel`` (rows): S = tile sums added in tile order from +0.0 (softmax.tiles_in_order); the token's
   logit read from the kept logits; out = (logit - m_safe) - log(S) in float32.

Passes 2-4 are softmax.py's split passes (a long row across programs): one home for the spec's tile order.

The kept logits are the values the LM head's chains computed, stored and reloaded exactly: the same values in the
same order as computing them again (which the sum pass and the finish used to do), so the same bits at half the
LM-head work. Each logit is the hidden-tiled fma chain of common.dot_k_tiled, written for a 3-D tile; temperature
(when != 1) is one correctly rounded division.

A spec with a ``matmul`` (exact or fast logits: _matmul_token_logprobs) replaces pass 1 by that policy's matmul kernels
writing the kept logits, then takes softmax.py's chunk-max pass and passes 2-4 as above.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ascend_launch, common, matmul, softmax, strict_math as sm
from .interpreter_dot import strict_dot
from .launch import cdiv, fma_dot, interpreter_layout, launch, next_power_of_2, warps_and_stages
from .workspace import workspace


@triton.jit
def _logits(h_ptr, w_ptr, rows, row_ok, vidx, v_ok, H, sh, sw_v, temp, HAS_TEMP: tl.constexpr,
            KT: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VTP: tl.constexpr, VEC: tl.constexpr,
            WORDS: tl.constexpr, NPU: tl.constexpr):
    """[BR, NTB, VTP] float32 logits hidden[row] . W[v] (v = vidx [NTB, VTP], VTP lanes per vocab tile) in the
    canonical order.

    Each vocab entry's chain takes VEC consecutive hidden elements per 16-byte load (common.dot_tile_vec; WORDS:
    the same vectors as int64 words, common.dot_tile_words, Triton 3.6's layout-conversion-free form); the Ascend
    variant takes one element per step. Same chains, same bits."""
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
            if WORDS:
                flat = flat + common.dot_tile_words(a_rows, b_lanes, row_ok, lane_ok, start, H, KT, VEC, BR, L)
            else:
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
def _max_kernel(h_ptr, w_ptr, lg_ptr, m_ptr, p_ptr, z_ptr, R, V, H, sh, sw_v, sl, temp, n_chunks, n_work, n1,
                HAS_TEMP: tl.constexpr, KT: tl.constexpr, BR: tl.constexpr, NTB: tl.constexpr, VT: tl.constexpr,
                VTP: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)  # row block fastest: row blocks of one vocab chunk run together
        row_ok = rows < R
        c = item // n1
        tiles, vidx, v_ok = _vocab_block(c, V, NTB, VT, VTP)
        x = _logits(h_ptr, w_ptr, rows, row_ok, vidx, v_ok, H, sh, sw_v, temp, HAS_TEMP, KT, BR, NTB, VTP, VEC, WORDS,
                    NPU)
        ok = row_ok[:, None, None] & v_ok[None, :, :]
        tl.store(lg_ptr + rows.to(tl.int64)[:, None, None] * sl + vidx[None, :, :], x, mask=ok)  # kept for passes 3, 4
        m, bad, pz = common.row_max(tl.reshape(x, [BR, NTB * VTP]), tl.reshape(ok, [BR, NTB * VTP]))
        out = rows.to(tl.int64) * n_chunks + c
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(p_ptr + out, bad, mask=row_ok)
        tl.store(z_ptr + out, pz, mask=row_ok)


@triton.jit
def _max_dot_kernel(h_ptr, w_ptr, lg_ptr, m_ptr, p_ptr, z_ptr, R, V, H, sh, sw_v, sl, temp, n_chunks, n_work, n1,
                    HAS_TEMP: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
                    NPU: tl.constexpr):
    """_max_kernel for row blocks of >= 16 on NVIDIA: the logits of a [BR rows, BV vocab entries] block as float32
    ieee dots (common.dot_k_tiled_fma: the same chains, so the same logits), kept, and the block's (max, poisoned,
    has +0.0) as chunk c (a chunk is BV vocab entries here: max is exact in any grouping)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = (item % n1) * BR + tl.arange(0, BR)  # row block fastest: row blocks of one vocab block run together
        row_ok = rows < R
        c = item // n1
        vidx = c * BV + tl.arange(0, BV)
        v_ok = vidx < V
        x = common.dot_k_tiled_fma(h_ptr, sh, 1, w_ptr, 1, sw_v, rows, vidx, row_ok, v_ok, H, KT, KTP, BR, BV)
        if HAS_TEMP:
            x = sm.div(x, temp, NPU)
        ok = row_ok[:, None] & v_ok[None, :]
        tl.store(lg_ptr + rows.to(tl.int64)[:, None] * sl + vidx[None, :], x, mask=ok)  # kept for passes 3, 4
        m, bad, pz = common.row_max(x, ok)
        out = rows.to(tl.int64) * n_chunks + c
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(p_ptr + out, bad, mask=row_ok)
        tl.store(z_ptr + out, pz, mask=row_ok)


@triton.jit
def _finish_kernel(lg_ptr, tok_ptr, shift_ptr, empty_ptr, part_ptr, out_ptr, R, sl, sp, n_tiles, n_work,
                   BR: tl.constexpr, NPU: tl.constexpr):
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        rows = item * BR + tl.arange(0, BR)
        row_ok = rows < R
        s = softmax.tiles_in_order(part_ptr, rows, row_ok, sp, n_tiles, BR, NPU)  # S: tile sums in tile order
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0)
        logit = tl.load(lg_ptr + rows.to(tl.int64) * sl + tok, mask=row_ok, other=0.0)  # the kept logit
        shift = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
        empty = tl.load(empty_ptr + rows, mask=row_ok, other=0) > 0
        out = tl.where(empty, float("-inf"), (logit - shift) - sm.log(s, NPU))
        tl.store(out_ptr + rows, sm.canonical_nan(out), mask=row_ok)


#: the kept float32 logits of one row group stay under this size (rows are processed in groups above it)
_LOGITS_SCRATCH_BYTES = 1 << 29


def _blocks(rows: int, n_tiles: int):
    """(rows per program, vocab tiles per program, warps) of the logits kernel."""
    if interpreter_layout():  # few, large programs: the interpreter pays per operation
        return next_power_of_2(min(rows, 16)), next_power_of_2(n_tiles), 4
    if ascend_launch.active():
        return (16 if rows > 8 else next_power_of_2(rows)), 1, 4
    # one vocab entry (of a 256 tile) per thread; 8 rows keep the 8 x 8 hidden values of a step in registers
    # (sm_90 machine code, hal.kernels.checks.sass_profile: 152 registers, no spills; 16 rows need 254)
    return min(8, next_power_of_2(rows)), 1, 8


#: the logits' vector chains read as int64 words (common.dot_tile_words) where matmul.whole_vectors allows it (Triton
#: < 3.7, hidden size and tile whole 16-byte vectors, 8-byte aligned rows) and a block has more than one row, as the
#: 2-8-row GEMV: under 3.6 dot_tile_vec's reshape / split convert layouts through shared memory in the hidden loop
#: (sm_90: 612 shared-memory instructions / 155 barriers at 8 rows; words: 0 in the loop). H200, Triton 3.6, 8 rows of
#: a 151,936 x 4096 head: 2511 -> 1405 us, same bits (docs/triton.md). False keeps dot_tile_vec everywhere (the old
#: path; benchmarks/gpu_perf.py measures both)
WORDS_LOGITS = True

#: warps of the words logits kernel at 8 rows: 16, so each thread holds 4 rows' chains. On 8 warps (8 rows a thread)
#: ptxas held the 256-thread program to 128 registers under Triton 3.6 and spilled 16 bytes (four words of the
#: epilogue, outside the hidden loop); on 16 it takes 88 registers, no stack, 38 / 17 shared-memory instructions /
#: barriers instead of 67 / 19 (sm_90, hal.kernels.checks.sass_profile). One program of 16 warps is the occupancy of
#: the two 8-warp programs an SM ran at 128 registers; each W word is now loaded by two threads (the second from L1).
#: Speed only (rows are independent); 8 is the earlier launch, measured against it by benchmarks/gpu_perf.py
#: (token_logprobs/strict/N8/words_8_warps)
WORDS_WARPS = 16

#: rows from which the logits run as FMA-dot tiles (tl.dot needs 16 rows; fewer rows keep the vector chains)
_DOT_MIN_ROWS = 16


#: the FMA-dot logits tile on the GPU: (rows, vocab entries), its warps and its hidden loop's pipeline stages (None:
#: Triton's default). 32 x 64 on 4 warps: sm_90 profile 118 registers, no spill under Triton 3.6 and 3.9 (64 x 32
#: spills 16 bytes under 3.6 with the row max); on the H200 at 14 % of the fp32 FMA peak (N >= 64, 2026-12-04). Speed
#: only (each logit's chain is the same): benchmarks/gpu_sweep.sh times other choices against it
_DOT_TILE, _DOT_WARPS, _DOT_STAGES = (32, 64), 4, None


def _dot_blocks(rows: int, vocab: int):
    """(rows, vocab entries) of an FMA-dot logits tile: _DOT_TILE on the GPU; few, large programs in the interpreter."""
    if interpreter_layout():
        return max(16, next_power_of_2(min(rows, 64))), max(16, next_power_of_2(min(vocab, 256)))
    return _DOT_TILE


def _sum_blocks(rows: int, n_tiles: int, br: int, ntb: int):
    """(rows, tiles) per program of the tile-sum pass: the logits kernel's blocks in the interpreter and on Ascend;
    on the GPU one (row, tile) lane per thread of 4 warps, as softmax's chains."""
    if interpreter_layout() or ascend_launch.active():
        return br, ntb
    ntb = min(32, next_power_of_2(n_tiles))
    return max(4, common.VECTOR_LANES // ntb), ntb


def _finish_blocks(br: int):
    """(rows per program, warps) of the finish: on the GPU one warp, one row per thread (a row's 4-wide vectors of
    tile sums stay whole in its thread: 16-byte loads); elsewhere the logits kernel's rows."""
    if interpreter_layout() or ascend_launch.active():
        return br, 4
    return 32, 1


def _round16(n: int) -> int:
    """n rounded up to a multiple of 16: row strides that keep rows 16-byte aligned (and get Triton's
    divisibility hint, so the rows are read with 16-byte loads)."""
    return cdiv(n, 16) * 16


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   spec) -> torch.Tensor:
    """float32 log p(tokens[n] | hidden[n]) for hidden [..., H], weight [V, H], tokens [...] int."""
    if spec.matmul is not None:  # the exact or the fast policy's logits
        return _matmul_token_logprobs(hidden, weight, tokens, temperature, spec)
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
    sl, sp = _round16(vocab), _round16(n_tiles)  # row strides of the kept logits and of the tile sums
    group = min(rows, max(16, _LOGITS_SCRATCH_BYTES // (4 * sl) // 16 * 16))  # rows a pass keeps the logits of
    br, ntb, warps = _blocks(group, n_tiles)
    sbr, sntb = _sum_blocks(group, n_tiles, br, ntb)
    fbr, fwarps = _finish_blocks(br)
    dot = fma_dot() and group >= _DOT_MIN_ROWS  # the logits as FMA-dot tiles (matmul's, K = the hidden axis)
    if dot:
        dbr, dbv = _dot_blocks(group, vocab)
        n_chunks = cdiv(vocab, dbv)
    else:
        n_chunks = cdiv(n_tiles, ntb)
    words = WORDS_LOGITS and not dot and br > 1 and matmul.whole_vectors(h2, w, kt)  # the NPU variant ignores WORDS
    if words and br == 8:
        warps = WORDS_WARPS
    temp = float(temperature)
    has_temp = temp != 1.0
    logits = workspace("token_logprobs logits", (group, sl), torch.float32, dev)
    ws = softmax.split_scratch("token_logprobs", group, n_chunks, sp, dev)
    m, bad, pz, shift, empty, parts = ws
    vtp = next_power_of_2(vt)
    for r0 in range(0, rows, group):  # row groups: each pass sees only its group's rows (the bits are per row)
        n = min(group, rows - r0)
        hg = h2[r0:r0 + n]
        if dot:
            with strict_dot():
                launch(_max_dot_kernel, (n_chunks, cdiv(n, dbr)), hg, w, logits, m, bad, pz, n, vocab, hdim,
                       h2.stride(0), w.stride(0), sl, temp, n_chunks, HAS_TEMP=has_temp, KT=kt,
                       KTP=max(16, next_power_of_2(kt)), BR=dbr, BV=dbv,
                       **({} if interpreter_layout() else warps_and_stages(_DOT_WARPS, _DOT_STAGES)), persistent=True)
        else:
            launch(_max_kernel, (n_chunks, cdiv(n, br)), hg, w, logits, m, bad, pz, n, vocab, hdim, h2.stride(0),
                   w.stride(0), sl, temp, n_chunks, HAS_TEMP=has_temp, KT=kt, BR=br, NTB=ntb, VT=vt, VTP=vtp,
                   VEC=16 // w.element_size(), WORDS=words, num_warps=warps, persistent=True)
        softmax.run_chunk_stats(ws, n, n_chunks)
        launch(softmax.tile_sums_kernel, (cdiv(n_tiles, sntb), cdiv(n, sbr)), logits, shift, parts, n, vocab, sl, sp,
               n_tiles, VT=vt, VTP=vtp, BR=sbr, NTB=sntb, VEC=4, ROW_PAD=True, REG=interpreter_layout(), persistent=True)
        launch(_finish_kernel, (cdiv(n, fbr),), logits, tok[r0:r0 + n], shift, empty, parts, out[r0:r0 + n], n, sl,
               sp, n_tiles, BR=fbr, num_warps=fwarps, persistent=True)
    return out.reshape(lead)


#: vocab entries per exact-logits step: its int64 limbs are 16 bytes per (row, entry), [group rows, this] at a time
EXACT_VOCAB_TILE = 8192


def _matmul_token_logprobs(hidden, weight, tokens, temperature, spec):
    """token_logprobs whose logits are another policy's matmul (``spec.matmul``). Pass 1 writes a row group's float32
    logits, divided by the temperature (one correctly rounded division), straight into the kept logits:

    * an ExactMatmulSpec: the exact policy's kernels (hal.kernels.exact.triton_matmul: the dot rounded once to
      float32), a vocab tile at a time; ``weight`` a tensor (sliced once per call) or a prepared ExactWeight (its
      slices read a vocab tile at a time);
    * a fast matmul spec: the fast matmul kernel (fast_matmul.logits: tensor cores, the spec's launch, the float32
      accumulator stored unrounded), the whole vocabulary in one launch.

    Their chunk maxima are softmax.py's chunk-max pass over the kept rows; passes 2-4 are the strict path's, so the
    log-softmax has the strict spec's bits whatever computed the logits."""
    from hal.spec import EXACT
    mm = spec.matmul
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(hidden.shape[:-1].numel(), hdim)
    temp = float(temperature)
    if mm.policy == EXACT:
        from hal.kernels.exact import core, triton_matmul as tx
        core.check_k("hidden", hdim)
        w, sw, wbad = tx.weight_slices(weight, mm)

        def fill(hg, out):
            sh, hbad = tx.slice_rows(hg, mm.slices)  # once per row group, read by every vocab tile
            for v0 in range(0, out.shape[1], EXACT_VOCAB_TILE):
                v1 = min(out.shape[1], v0 + EXACT_VOCAB_TILE)
                tx.linear_from_slices(hg, sh, hbad, w[v0:v1], sw.rows(v0, v1), wbad[v0:v1], None, mm.slices,
                                      out[:, v0:v1], temp)
    else:
        from . import fast_matmul
        w = weight

        def fill(hg, out):
            fast_matmul.logits(hg, w, mm, out, temp)
    tok = tokens.reshape(-1).to(torch.int64).contiguous()
    rows, vocab = h2.shape[0], w.shape[0]
    dev = hidden.device
    out = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return out.reshape(lead)
    vt = spec.vocab_tile
    n_tiles = max(1, cdiv(vocab, vt))
    sl, sp = _round16(vocab), _round16(n_tiles)
    group = min(rows, max(16, _LOGITS_SCRATCH_BYTES // (4 * sl) // 16 * 16))
    br, ntb, _ = _blocks(group, n_tiles)
    sbr, sntb = _sum_blocks(group, n_tiles, br, ntb)
    fbr, fwarps = _finish_blocks(br)
    mbc = min(4096 if interpreter_layout() else 1024, next_power_of_2(max(vocab, 1)))  # chunk-max lanes
    mbr = min(16, next_power_of_2(group)) if interpreter_layout() else 1
    mch = mbc if interpreter_layout() else 4 * mbc
    n_chunks = cdiv(vocab, mch)
    logits = workspace("token_logprobs logits", (group, sl), torch.float32, dev)
    ws = softmax.split_scratch("token_logprobs", group, n_chunks, sp, dev)
    m, bad, pz, shift, empty, parts = ws
    vtp = next_power_of_2(vt)
    for r0 in range(0, rows, group):
        n = min(group, rows - r0)
        fill(h2[r0:r0 + n], logits[:n, :vocab])
        launch(softmax._chunk_max_kernel, (n_chunks, cdiv(n, mbr)), logits, m, bad, pz, n, vocab, sl, n_chunks,
               CH=mch, BR=mbr, BC=mbc, persistent=True)
        softmax.run_chunk_stats(ws, n, n_chunks)
        launch(softmax.tile_sums_kernel, (cdiv(n_tiles, sntb), cdiv(n, sbr)), logits, shift, parts, n, vocab, sl, sp,
               n_tiles, VT=vt, VTP=vtp, BR=sbr, NTB=sntb, VEC=4, ROW_PAD=True, REG=interpreter_layout(), persistent=True)
        launch(_finish_kernel, (cdiv(n, fbr),), logits, tok[r0:r0 + n], shift, empty, parts, out[r0:r0 + n], n, sl,
               sp, n_tiles, BR=fbr, num_warps=fwarps, persistent=True)
    return out.reshape(lead)
