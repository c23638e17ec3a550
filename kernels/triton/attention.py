"""The host side of Triton softmax attention (strict and fast): the triton backend's entry points
(backends/triton_seq.py) and the launch of the kernels.

``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` put a call in one layout (query rows and
per-sequence row starts and lengths on the device, contiguous or paged keys) and :func:`attend` launches
on it: the strict kernel, or the fast one when the spec is fast, then, for split-KV, the in-order merge.

Tile choice (speed only: rows are independent, so none of it changes bits): :func:`_tiles` sizes the strict
kernel's row tile and packs the query heads of a GQA group into decode-sized tiles (``PACK_MAX_Q``);
:func:`_fast_tiles` packs them inside the fast spec's ``block_m`` rows; :func:`_score_layout` gives decode
tiles vector loads. Split-KV (one program per key split) runs when asked and by default for decode.

The kernels: strict in attention_kernel.py, fast in fast_attention.py, the program layout both share
(work items, tile rows, addressing, split workspace, merge, finish) in attention_tiles.py.
"""
from __future__ import annotations

import contextlib

import torch

from . import ascend_launch
from . import attention_kernel  # its kernels are read at launch: a swapped one (tests/scripts/_variants.py) runs
from .dtypes import tl_dtype
from .interpreter_dot import strict_dot
from .launch import fma_dot, int32_starts, int32_tensor, launch, next_power_of_2
from .workspace import workspace

F32 = torch.float32


#: rows of the fast kernel's split-KV merge tile at most (query rows x packed heads): the merge is per-row float32
#: arithmetic, so its tile is speed only; on the spec's 128-row tile (4 rows of a decode tile valid) it spilled 150
#: registers under Triton 3.6 (H200 kernels.jsonl, 2026-12-04d)
MERGE_MAX_ROWS = 32


def _merge_tiles(max_q: int, rows: int, pack: int) -> tuple[int, int]:
    """(ROWS, PACK) of the fast kernel's merge launch: the query rows that exist (at most the attention tile's), the
    same packed heads, at most MERGE_MAX_ROWS tile rows (one query row per program where PACK alone exceeds it)."""
    return max(1, min(rows, next_power_of_2(max(1, max_q)), MERGE_MAX_ROWS // pack)), pack


#: decode-sized query tiles (max_q at most this) pack the query heads of a GQA group into one program
PACK_MAX_Q = 16


def _tiles(max_q: int, group: int, bd: int, kb: int, cap: int = 32) -> tuple[int, int, int]:
    """(BLOCK_M, ROWS, PACK): tile rows, query rows and query heads per program (rows are independent, so
    none of them changes bits). Decode-sized tiles pack PACK heads of a GQA group (the largest divisor of
    the group that fits) so K/V tiles are loaded once for them; prefill keeps one head per program, whose
    row tile already shares each K/V load among up to 32 query rows. The tile is at most 32 rows; the Ascend
    variant also fits the unified buffer, whose live float32 tiles are ACC, acc, acc_blk and the fma
    result [BM, BD] and the scores s, part, bits [BM, KB]."""
    if ascend_launch.npu_layout():
        cap = ascend_launch.fit_block(cap, lambda b: [(b, bd)] * 4 + [(b, kb)] * 3)
    pack = 1
    if max_q <= PACK_MAX_Q:
        pack = max(p for p in range(1, min(group, cap) + 1) if group % p == 0)
    rows = max(1, min(next_power_of_2(max(1, max_q)), cap // next_power_of_2(pack)))
    return next_power_of_2(rows * pack), rows, pack


def _fast_tiles(max_q: int, group: int, block_m: int) -> tuple[int, int]:
    """(ROWS, PACK) of the fast kernel, whose tile is the spec's block_m rows: decode-sized query tiles pack
    the largest divisor of the GQA group that fits (K/V blocks loaded once for PACK heads, PACK times fewer
    padding rows in the tensor-core tile); prefill keeps one head per program."""
    pack = 1
    if max_q <= PACK_MAX_Q:
        pack = max(p for p in range(1, min(group, block_m) + 1) if group % p == 0)
    return block_m // pack, pack


#: tiles of at most this many rows (decode: a packed GQA group) feed the score chains with vector loads
VECTOR_MAX_ROWS = 8


#: decode tiles' vector chains load q as [rows, keys, VEC] with the same address along keys (attention_kernel.
#: _dot_tile_vectors, QB), the earlier kernel; False (default): each row's vector once, [rows, 1, VEC], broadcast by the
#: chains. Speed only. Under Triton 3.6 the broadcast load put rows on threads and converted q to the chains' layout
#: through shared memory at every step (sm_90, split-KV decode: 434 / 306 shared-memory instructions, 340 / 276
#: barriers, bf16 / fp32); the row load leaves 50 / 20 (the epilogue's), none in the key loop, and 3.9's counts are
#: unchanged (docs/triton.md). A bet: q keys-first and permuted, the earlier way to the same counts, measured slower
#: on the H200 (2026-12-04: B 8 417.7 against 314.3 us) for a reason the run could not show; gpu_perf times this
#: against the broadcast load (attention_decode/strict/B*/broadcast_q)
Q_BROADCAST_LOAD = False


def _score_layout(block_m: int, kb: int, element_size: int) -> tuple[int, dict]:
    """(VEC, launch options) of the score chains (speed only: the chains are the same either way). Decode-sized
    tiles load VEC = 16 bytes of head dims per key and thread, one key per thread (KB / 32 warps), so k fills the
    threads with one vector each; larger tiles (prefill) keep one element per step (VEC 1), whose [rows, keys,
    VEC] operand tiles would not fit the registers."""
    if block_m > VECTOR_MAX_ROWS or ascend_launch.active():  # the Ascend variant: no tl.split
        return 1, {}
    return 16 // element_size, dict(num_warps=max(1, min(4, kb // 32)))


#: rows and warps of the FMA-dot prefill tile. hal.kernels.checks.sass_profile, sm_90, bf16, D 128, kv_block 64, one dot
#: per 64-lane tile: 16 rows on 8 warps spill least (stack 424 B under Triton 3.6, 376 under 3.9), 16 on 4 warps
#: 1112 / 2304, 32 on 8 warps 816 / 688; with DOT_K 16 lanes per dot 16 x 8 spills 24-64 B (values of the work item,
#: stored before and read after the key loop: the loop's FMA-dot operands fill the 255 registers), 16 x 4 328, 16 x 16
#: warps 8-48 (128 registers a thread): docs/triton.md ("Visibility relative to the query")
DOT_ROWS, DOT_WARPS = 16, 8


#: K lanes of one strict FMA dot (attention_kernel._scores_fma_dot / _block_fma_dot): a head-dim tile's score chains
#: and a key block's P.V and l chains run through one dot per DOT_K lanes, each continuing the last one's accumulator
#: (the same fma steps in the same order). Triton's FMA lowering holds a dot's operands of all its K lanes in registers
#: (rows + columns per thread, times K): one dot over 64 keys and a 128-wide head dim spilled 312-496 bytes per
#: thread (sm_90, Triton 3.6 and 3.9), dots of 16 lanes none (docs/triton.md). 0: one dot per tile / block, the
#: earlier kernel (kept selectable for benchmarks/gpu_perf.py's old-vs-new rows)
DOT_K = 16


def dot_k(dtp: int, kb: int) -> int:
    """The DK constexpr of the strict kernel: DOT_K lanes per dot, or (DOT_K 0) one dot per head-dim tile (DTP lanes)
    and per key block (kb)."""
    return DOT_K if DOT_K else max(dtp, kb)


def _fma_dot_tiles(block_m: int, kb: int, vec: int) -> bool:
    """Strict tiles as float32 ``ieee`` tl.dots (attention_kernel._scores_fma_dot / _block_fma_dot): prefill-sized
    tiles (a dot takes >= 16 rows and keys; decode tiles keep their vector chains) where launch.fma_dot allows
    (NVIDIA and the interpreter's strict stand-in; AMD and Ascend keep the explicit chains)."""
    return vec == 1 and block_m >= 16 and kb >= 16 and fma_dot()


def attend(q, k, v, *, q_row0, qlen, klen, k_row0, block_table, page, lse, lse_row0, lse_hstride,
           scale, causal, window, spec, num_splits: int, max_q: int, max_k: int):
    """Launch the kernels. q [rows, Hq, D] (contiguous); k, v [rows, Hkv, D] (``k_row0`` per sequence)
    or paged pages [P, page, Hkv, D] (``block_table``). Returns out like q; fills ``lse``."""
    n_seq = qlen.shape[0]
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[-2]
    out = torch.zeros_like(q)
    if n_seq == 0 or q.shape[0] == 0 or max_q == 0:
        return out
    if spec.policy == "fast":  # tensor-core block step (fast_attention.py); grid, workspace, merge as here
        from . import fast_attention
        from .interpreter_dot import sequential_dot
        cfg = fast_attention.launch_config(spec, d, prefill_sized=max_q > PACK_MAX_Q)
        kernel, bm, bd, spec_args, options = (cfg["kernel"], cfg["block_m"], cfg["block_d"], cfg["constexprs"],
                                              cfg["options"])
        rows, pack = _fast_tiles(max_q, group, bm)
        kbnd, n_kb = (fast_attention.key_bounds(k, v, klen, k_row0, block_table, page, spec.kv_block, max_k, bd)
                      if cfg["interior"] else (lse, 1))  # lse: never read without INTERIOR
        spec_args = dict(spec_args, ROWS=rows, PACK=pack, KBND=kbnd, n_kb=n_kb)
        merge_rows, merge_pack = (_merge_tiles(max_q, rows, pack) if fast_attention.FAST_BLOCK_PATH
                                  else (rows, pack))
        dots = sequential_dot()
    else:
        kernel, bd = attention_kernel._attn_kernel, next_power_of_2(d)
        bm, rows, pack = _tiles(max_q, group, bd, spec.kv_block)
        vec, options = _score_layout(bm, spec.kv_block, q.element_size())
        dot = _fma_dot_tiles(bm, spec.kv_block, vec)
        if dot:  # the FMA-dot tile's rows and warps (see DOT_ROWS)
            bm, rows, pack = _tiles(max_q, group, bd, spec.kv_block, cap=DOT_ROWS)
            options = dict(num_warps=DOT_WARPS)
        dtp = max(16, next_power_of_2(min(spec.dot_tile, d)))
        spec_args = dict(KB=spec.kv_block, KS=spec.kv_split, DT=spec.dot_tile, VEC=vec,
                         P_IN=spec.p_precision == "input", ROWS=rows, PACK=pack, FMA_DOT=dot, DTP=dtp,
                         DK=dot_k(dtp, spec.kv_block), QB=vec > 1 and Q_BROADCAST_LOAD)
        dots = strict_dot() if dot else contextlib.nullcontext()
        merge_rows, merge_pack = rows, pack
    n_tiles = -(-max_q // rows)
    n_groups = n_seq * (hq // pack)  # (sequence, head group) pairs
    paged = block_table is not None
    dummy = qlen  # an int32 tensor never read where it stands in (no allocation per call)
    bt = block_table if paged else dummy
    krow = dummy if paged else k_row0
    stride_kp = k.stride(0) if paged else 0
    stride_kt, stride_kh = (k.stride(1), k.stride(2)) if paged else (k.stride(0), k.stride(1))
    left, right = window
    n_splits = max(1, -(-max_k // spec.kv_split))
    # split-KV (one program per split + merge kernel) when asked, and by default for decode-sized query
    # tiles, where (sequence, head) programs alone would leave most of the GPU idle; bits are the same
    one_split = n_splits > 1 and (num_splits > 1 or (num_splits == 0 and max_q <= 16))
    meta = dict(HQ=hq, D=d, BLOCK_M=bm, BLOCK_D=bd)
    common = dict(OUT=tl_dtype(q.dtype), PAGED=paged, GROUP=group, **spec_args, **meta)
    n_rows = max_q  # workspace rows per (sequence, head): row i < qlen <= max_q
    if one_split:
        # one program per split (num_splits only sets parallelism: all splits run at once here)
        bh = n_seq * hq
        ws = (bh, n_rows, n_splits)
        wm = workspace("attention split max", ws, F32, q.device)
        wl = workspace("attention split sum", ws, F32, q.device)
        wn = workspace("attention split count", ws, torch.int32, q.device, zero=True)
        wa = workspace("attention split acc", (*ws, bd), F32, q.device)
    else:
        wm = wl = wa = lse  # never read without ONE_SPLIT
        wn = dummy
    grid = (n_tiles, n_groups, n_splits if one_split else 1)
    with dots:
        launch(kernel, grid, q, k, v, out, lse, wm, wl, wa, wn, q_row0, qlen, klen, krow, bt, lse_row0,
               q.stride(0), q.stride(1), stride_kp, stride_kt, stride_kh, lse_hstride,
               bt.stride(0) if paged else 0, page, scale, int(causal), left, right, n_rows, n_splits,
               ONE_SPLIT=one_split, **common, **options, persistent=True)
    if one_split:  # per-row arithmetic: its tile (merge_rows query rows x merge_pack heads) is speed only
        merge_bm = next_power_of_2(merge_rows * merge_pack)
        launch(attention_kernel._merge_kernel, (-(-max_q // merge_rows), n_seq * (hq // merge_pack)), out, lse,
               wm, wl, wa, wn, q_row0, qlen, klen, lse_row0, q.stride(0), q.stride(1), lse_hstride, n_rows, n_splits,
               OUT=tl_dtype(q.dtype), ROWS=merge_rows, PACK=merge_pack, KS=spec.kv_split,
               **dict(meta, BLOCK_M=merge_bm), persistent=True)
    return out


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] -> out [Tq, Hq, D], lse [Hq, Tq] (the reference's contract).

    The per-sequence rows and lengths stay on the device (no host copy, no sync): max_q / max_k are the
    caller's bounds (hal checks them >= the longest sequence); larger bounds only add programs that exit
    at once (the row tiles and key splits sit on fixed grids, so the bits do not depend on them)."""
    dev = q.device
    cq, ck = int32_tensor(cu_q, dev), int32_tensor(cu_k, dev)
    qlen, klen = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=F32, device=dev)
    n = qlen.shape[0]
    out = attend(q, k, v, q_row0=cq[:-1], qlen=qlen, klen=klen, k_row0=ck[:-1], block_table=None, page=1, lse=lse,
                 lse_row0=cq[:-1], lse_hstride=q.shape[0], scale=scale, causal=causal, window=window, spec=spec,
                 num_splits=0, max_q=int(max_q) if n else 0, max_k=int(max_k) if n else 0)
    return out, lse


def flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window, num_splits, spec):
    """q [B, Sq, Hq, D] against a contiguous or paged cache -> out [B, Sq, Hq, D], lse [B, Hq, Sq]."""
    dev = q.device
    bsz, sq, hq, d = q.shape
    lens = int32_tensor(seqlens_k, dev)
    qf = q.contiguous().reshape(bsz * sq, hq, d)
    lse = torch.full((bsz, hq, sq), float("-inf"), dtype=F32, device=dev)
    if block_table is None:  # contiguous: sequence b's keys are rows b * capacity + j
        kk = k_cache.contiguous().reshape(-1, *k_cache.shape[2:])
        vv = v_cache.contiguous().reshape(-1, *v_cache.shape[2:])
        paged = dict(k_row0=int32_starts(bsz, k_cache.shape[1], dev), block_table=None, page=1)
    else:
        kk, vv = k_cache, v_cache
        paged = dict(k_row0=None, block_table=block_table.to(torch.int32).contiguous(), page=int(k_cache.shape[1]))
    # the cache's capacity bounds the key splits (no host read of seqlens_k: the launch can be captured in a CUDA
    # graph); splits past a sequence's length exit at once and the bits do not depend on their number
    cap = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    out = attend(qf, kk, vv, q_row0=int32_starts(bsz, sq, dev),
                 qlen=torch.full((bsz,), sq, dtype=torch.int32, device=dev), klen=lens, **paged, lse=lse,
                 lse_row0=int32_starts(bsz, hq * sq, dev), lse_hstride=sq, scale=scale, causal=causal,
                 window=window, spec=spec, num_splits=num_splits, max_q=sq, max_k=cap if bsz else 0)
    return out.reshape(bsz, sq, hq, d), lse
