"""Attention backward in Triton, flash-attention-2 style: deterministic, not strict.

Only the forward is a spec; these gradients need not match ``hal.attention._backward_math`` (the
readable definition) bit for bit, but every call with the same inputs on the same GPU gives the same
bits: fixed tiles, fixed loop orders, every sum owned by one program, no atomics.

* :func:`_preprocess_kernel`: ``delta = rowsum(dO * O) - dlse`` in float32 per (query row, head), so
  that ``dS = P * (dP - delta)`` carries the lse gradient too (d lse / d s = P).
* :func:`_dkdv_kernel`: one program per (key block, kv head, sequence). It loops over the query heads
  of its GQA group, then over the query blocks that can see its keys, accumulating dK and dV in
  registers: the GQA sum happens inside the program.
* :func:`_dq_kernel`: one program per (query block, query head, sequence) looping over the key blocks
  its rows can see (the forward's key range).

P is recomputed from q, k and the forward's lse. Products go through ``tl.dot`` with float32
accumulators: bf16/fp16 inputs on tensor cores (P and dS cast to the input dtype first, as
flash-attention does); float32 inputs with ``input_precision="ieee"`` (tf32 would drop 13 mantissa
bits of q, k and dO, far more error than the rest of the backward). Launched with Triton's default
options (fp fusion on: no spec fixes these bits) through :func:`launch.launch` with ``strict=False``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.errors import InputError, UnsupportedError

from . import strict_math as sm
from .attention_tiles import _key_range, _rows, _visible
from .launch import cdiv, int32_tensor, interpreting, launch, next_power_of_2

F32 = torch.float32
#: Head dims served by the kernels; larger ones take hal's torch backward (tiles would not fit on chip).
MAX_HEAD_DIM = 256


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with a float32 accumulator. IEEE: float32 operands in full precision; also how bf16 operands go
    through the interpreter, widened first (exact): Triton 3.9's interpreter multiplies bf16 bit patterns."""
    if IEEE:
        return tl.dot(sm.widen(a), sm.widen(b), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _query_range(n0, qlen, klen, causal, left, right, BLOCK_N: tl.constexpr):
    """[lo, hi): the query rows that may see some key of [n0, n0 + BLOCK_N) (row i sits at klen - qlen + i)."""
    shift = klen - qlen
    lo = 0
    if causal:
        lo = tl.maximum(n0 - shift, 0)
    elif right >= 0:
        lo = tl.maximum(n0 - right - shift, 0)
    hi = qlen
    if left >= 0:
        hi = tl.minimum(hi, tl.minimum(n0 + BLOCK_N, klen) - 1 + left - shift + 1)
    return lo, hi


@triton.jit
def _key_tiles(K, V, k_rows, kmask, hk_off, d, dmask, stride_kt):
    """k, v tiles [keys, BLOCK_D] of key rows k_rows (int64) at kv head offset hk_off; their offsets and mask."""
    kv_off = k_rows[:, None] * stride_kt + hk_off + d[None, :]
    km = kmask[:, None] & dmask[None, :]
    k = tl.load(K + kv_off, mask=km, other=0.0)
    v = tl.load(V + kv_off, mask=km, other=0.0)
    return k, v, kv_off, km


@triton.jit
def _row_tiles(Q, DO, LSE, DELTA, q_rows, valid, h, d, dmask, stride_qt, stride_qh, n_rows):
    """q, dO tiles [rows, BLOCK_D] of query rows q_rows (int64) of head h, their offsets and mask, and the rows'
    lse and delta."""
    q_off = q_rows[:, None] * stride_qt + h * stride_qh + d[None, :]
    qm = valid[:, None] & dmask[None, :]
    q = tl.load(Q + q_off, mask=qm, other=0.0)
    do = tl.load(DO + q_off, mask=qm, other=0.0)
    lse_off = h.to(tl.int64) * n_rows + q_rows
    lse = tl.load(LSE + lse_off, mask=valid, other=0.0)
    delta = tl.load(DELTA + lse_off, mask=valid, other=0.0)
    return q, do, lse, delta, q_off, qm


@triton.jit
def _preprocess_kernel(O, DO, DLSE, DELTA, n_rows, stride_t, stride_h,
                       HAS_DLSE: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[h, r] = sum_d dO[r, h, d] O[r, h, d] - dlse[h, r] (float32)."""
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask = r < n_rows
    off = r.to(tl.int64)[:, None] * stride_t + h * stride_h + d[None, :]
    m = rmask[:, None] & (d[None, :] < D)
    o = tl.load(O + off, mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=m, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    lse_off = h.to(tl.int64) * n_rows + r
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + lse_off, mask=rmask, other=0.0)
    tl.store(DELTA + lse_off, delta, mask=rmask)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, Q_ROW0, QLEN, KLEN, K_ROW0,
                 stride_qt, stride_qh, stride_kt, stride_kh, n_rows, scale, causal, left, right, n_blk,
                 GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0) % n_blk  # grid (key block x sequence, kv head): no 65535 cap on sequences
    b = tl.program_id(0) // n_blk
    hk = tl.program_id(1)
    qlen = tl.load(QLEN + b)
    klen = tl.load(KLEN + b)
    n0 = pid_n * BLOCK_N
    if n0 < klen:
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        kj = n0 + tl.arange(0, BLOCK_N)
        kmask = kj < klen
        k_rows = tl.load(K_ROW0 + b).to(tl.int64) + kj
        k, v, kv_off, km = _key_tiles(K, V, k_rows, kmask, hk * stride_kh, d, dmask, stride_kt)
        q_row0 = tl.load(Q_ROW0 + b).to(tl.int64)
        lo, hi = _query_range(n0, qlen, klen, causal, left, right, BLOCK_N)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        rows = tl.arange(0, BLOCK_M)
        for g in range(GROUP):  # the query heads reading this kv head, in order: the GQA sum stays here
            h = hk * GROUP + g
            for m0 in range((lo // BLOCK_M) * BLOCK_M, hi, BLOCK_M):
                i = m0 + rows
                valid = i < qlen
                q, do, lse, delta, _, _ = _row_tiles(Q, DO, LSE, DELTA, q_row0 + i, valid, h, d, dmask,
                                                     stride_qt, stride_qh, n_rows)
                # transposed tiles [keys, rows]: dK, dV accumulate without transposing P
                vis = _visible(kj[:, None], (klen - qlen + i)[None, :], valid[None, :], klen, causal, left, right)
                p_t = tl.where(vis, tl.exp(_dot(k, tl.trans(q), IEEE) * scale - lse[None, :]), 0.0)
                dv += _dot(p_t.to(do.dtype), do, IEEE)
                ds_t = p_t * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
                dk += _dot(ds_t.to(q.dtype), q, IEEE)
        tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=km)
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=km)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, Q_ROW0, QLEN, KLEN, K_ROW0,
               stride_qt, stride_qh, stride_kt, stride_kh, n_rows, scale, causal, left, right, n_blk,
               GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0) % n_blk  # grid (query block x sequence, query head)
    b = tl.program_id(0) // n_blk
    h = tl.program_id(1)
    i, _h, valid, pos, qlen, klen = _rows(pid_m, b, h, QLEN, KLEN, BLOCK_M, 1, BLOCK_M)  # one head per program
    if pid_m * BLOCK_M < qlen:
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q, do, lse, delta, q_off, qm = _row_tiles(Q, DO, LSE, DELTA, tl.load(Q_ROW0 + b).to(tl.int64) + i, valid,
                                                  h, d, dmask, stride_qt, stride_qh, n_rows)
        k_row0 = tl.load(K_ROW0 + b).to(tl.int64)
        hk_off = (h // GROUP) * stride_kh
        lo, hi = _key_range(pid_m, qlen, klen, causal, left, right, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):  # key blocks in order
            kj = n0 + cols
            k, v, _, _ = _key_tiles(K, V, k_row0 + kj, kj < klen, hk_off, d, dmask, stride_kt)
            vis = _visible(kj[None, :], pos[:, None], valid[:, None], klen, causal, left, right)
            p = tl.where(vis, tl.exp(_dot(q, tl.trans(k), IEEE) * scale - lse[:, None]), 0.0)
            ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
        tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=qm)


# ------------------------------------------------------------------ host side


def _config(d: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options per kernel (speed only: a fixed choice per (head dim, dtype), so the bits
    are fixed too). GPU choices are unmeasured defaults in flash-attention-2's shape (the program's own
    tile on the long side, the loop tile on the short); dK/dV keeps two float32 [BLOCK_N, D] accumulators,
    hence 8 warps from D 128. The interpreter takes tl.dot's minimum tile of 16."""
    bd = max(16, next_power_of_2(d))
    if interpreting():
        return dict(BLOCK_D=bd, kv=dict(BLOCK_M=16, BLOCK_N=16), q=dict(BLOCK_M=16, BLOCK_N=16))
    small = dtype == F32 or bd > 128  # float32 tiles take twice the registers / shared memory
    kv = dict(BLOCK_M=16 if small else 32, BLOCK_N=32 if small else 64, num_warps=8 if bd >= 128 else 4,
              num_stages=2)
    q = dict(BLOCK_M=32 if small else 64, BLOCK_N=16 if small else 32, num_warps=4, num_stages=2)
    return dict(BLOCK_D=bd, kv=kv, q=q)


def _check(name, x, shape, dtype) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise InputError(f"{name} must be {dtype} of shape {tuple(shape)}, got {x.dtype} {tuple(x.shape)}")


def flash_attn_varlen_backward(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, gout, glse):
    """(dq, dk, dv) of ``flash_attn_varlen_func`` (packed q [Tq, Hq, D], k, v [Tk, Hkv, D]; out, lse
    [Hq, Tq] its forward results; gout like out, glse like lse or None), in the inputs' dtypes. Rows
    past the last sequence, queries that see no key and keys no query sees get zero gradients."""
    tq, hq, d = q.shape
    _check("out", out, q.shape, q.dtype)
    _check("gout", gout, q.shape, q.dtype)
    _check("lse", lse, (hq, tq), F32)
    if glse is not None:
        _check("glse", glse, (hq, tq), F32)
    if d > MAX_HEAD_DIM:
        raise UnsupportedError(f"head_dim (q.shape[-1]) = {d} > {MAX_HEAD_DIM}: not served by the Triton attention "
                               "backward kernels (hal's torch backward serves it)")
    dev = q.device
    cq, ck = int32_tensor(cu_q, dev), int32_tensor(cu_k, dev)
    qlen, klen = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    n_seq = qlen.shape[0]
    q, k, v, out, gout, lse = (x.contiguous() for x in (q, k, v, out, gout, lse))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if n_seq == 0 or tq == 0 or k.shape[0] == 0 or max_q == 0 or max_k == 0:
        return dq, dk, dv
    cfg = _config(d, q.dtype)
    bd = cfg["BLOCK_D"]
    delta = torch.empty((hq, tq), dtype=F32, device=dev)
    has_dlse = glse is not None
    dlse = glse.contiguous() if has_dlse else lse
    br = 16
    launch(_preprocess_kernel, (cdiv(tq, br), hq), out, gout, dlse, delta, tq, q.stride(0), q.stride(1),
           HAS_DLSE=has_dlse, D=d, BLOCK_R=br, BLOCK_D=bd, strict=False)
    left, right = window
    common = (q, k, v, gout, lse, delta)
    rows = (cq[:-1], qlen, klen, ck[:-1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), tq,
            scale, int(causal), left, right)
    ieee = q.dtype == F32 or (q.dtype == torch.bfloat16 and interpreting())  # see _dot
    meta = dict(GROUP=hq // k.shape[1], D=d, BLOCK_D=bd, IEEE=ieee, strict=False)
    kv, qc = cfg["kv"], cfg["q"]
    n_kb, n_qb = cdiv(max_k, kv["BLOCK_N"]), cdiv(max_q, qc["BLOCK_M"])
    launch(_dkdv_kernel, (n_kb * n_seq, k.shape[1]), *common, dk, dv, *rows, n_kb, **kv, **meta)
    launch(_dq_kernel, (n_qb * n_seq, hq), *common, dq, *rows, n_qb, **qc, **meta)
    return dq, dk, dv
