"""The gated delta rule backward's chunk-state scan in Triton: deterministic, not strict.

``hal/gdn_backward.py`` differentiates the WY/UT chunk form of the recurrence with autograd; all of it
is batched over chunks except the state carried from chunk to chunk (``state_scan`` there, the
readable definition):

    u_c = U_c - W_c S_c ;  S_(c+1) = end_c S_c + kt_c u_c        (S_0 = the initial state)

:func:`state_scan` is the same function as a ``torch.autograd.Function`` over two kernels:

* :func:`_scan_fwd_kernel`: one program per (sequence x value head, block of BV state columns); the
  state block S [d_k, BV] stays in float32 registers while the program walks the chunks in order,
  writing u_c and the state entering each chunk (S_starts, kept for the backward and for o).
* :func:`_scan_bwd_kernel`: the same programs walking the chunks in reverse with dS (from dS_end):

      du_tot_c = du_c + kt_c^T dS ;  dU_c = du_tot_c ;  dW_c = -du_tot_c S_c^T ;  dkt_c = dS u_c^T ;
      dend_c = sum(dS * S_c) ;  dS <- end_c dS - W_c^T du_tot_c + dS_starts_c      (finally dS_0)

  dW, dkt and dend sum over the state's columns, so each column block writes its own partial and
  torch adds the partials (a fixed-order reduction): no atomics, the same bits every run.

Products are ``tl.dot`` with float32 operands and ``input_precision="ieee"`` (tf32 would drop 13
mantissa bits). Launched with Triton's default options (``launch(strict=False)``: no spec fixes these
bits, only determinism on a given GPU).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from hal.errors import InputError

from .launch import cdiv, interpreting, launch, next_power_of_2

F32 = torch.float32
#: Head dims served (d_k and d_v); larger ones keep hal's torch scan (the state tile would not fit on chip).
MAX_HEAD_DIM = 256


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tiles(pid_v, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BDK: tl.constexpr, BV: tl.constexpr):
    """Index vectors of program column block pid_v: chunk rows i [C], state rows r [BDK], state columns j [BV]
    (and the masks of r, j); the state tile's offsets and mask. Chunk bases are int64 (n hv nc C d may pass 2**31)."""
    i = tl.arange(0, C)
    r = tl.arange(0, BDK)
    j = pid_v * BV + tl.arange(0, BV)
    rm, jm = r < DK, j < DV
    return i, r, j, rm, jm, r[:, None] * DV + j[None, :], rm[:, None] & jm[None, :]


@triton.jit
def _scan_fwd_kernel(U, W, KT, END, S0, UO, STARTS, SEND, nc,
                     DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BDK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    i, r, j, rm, jm, s_off, s_m = _tiles(pid_v, DK, DV, C, BDK, BV)
    S = tl.load(S0 + bh.to(tl.int64) * DK * DV + s_off, mask=s_m, other=0.0)
    for c in range(nc):
        ch = bh.to(tl.int64) * nc + c
        tl.store(STARTS + ch * DK * DV + s_off, S, mask=s_m)
        w = tl.load(W + ch * C * DK + i[:, None] * DK + r[None, :], mask=rm[None, :], other=0.0)   # [C, BDK]
        u_off = ch * C * DV + i[:, None] * DV + j[None, :]
        u = tl.load(U + u_off, mask=jm[None, :], other=0.0) - _dot(w, S)                         # [C, BV]
        tl.store(UO + u_off, u, mask=jm[None, :])
        kt = tl.load(KT + ch * DK * C + r[:, None] * C + i[None, :], mask=rm[:, None], other=0.0)  # [BDK, C]
        S = tl.load(END + ch) * S + _dot(kt, u)
    tl.store(SEND + bh.to(tl.int64) * DK * DV + s_off, S, mask=s_m)


@triton.jit
def _scan_bwd_kernel(W, KT, END, UO, STARTS, DU, DSTARTS, DSEND, DUT, DW_PART, DKT_PART, DEND_PART, DS0, nc, n_ch,
                     HAS_DSTARTS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, BDK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    i, r, j, rm, jm, s_off, s_m = _tiles(pid_v, DK, DV, C, BDK, BV)
    part = pid_v.to(tl.int64) * n_ch  # this column block's slice of the partials [n_blocks, n x hv x nc, ...]
    dS = tl.load(DSEND + bh.to(tl.int64) * DK * DV + s_off, mask=s_m, other=0.0)
    for t in range(nc):
        ch = bh.to(tl.int64) * nc + (nc - 1 - t)  # chunks in reverse
        S = tl.load(STARTS + ch * DK * DV + s_off, mask=s_m, other=0.0)                           # [BDK, BV]
        u_off = ch * C * DV + i[:, None] * DV + j[None, :]
        u = tl.load(UO + u_off, mask=jm[None, :], other=0.0)                                     # [C, BV]
        w_off = ch * C * DK + i[:, None] * DK + r[None, :]
        w = tl.load(W + w_off, mask=rm[None, :], other=0.0)                                      # [C, BDK]
        kt_off = ch * DK * C + r[:, None] * C + i[None, :]
        kt = tl.load(KT + kt_off, mask=rm[:, None], other=0.0)                                   # [BDK, C]
        dut = tl.load(DU + u_off, mask=jm[None, :], other=0.0) + _dot(tl.trans(kt), dS)          # [C, BV]
        tl.store(DUT + u_off, dut, mask=jm[None, :])
        tl.store(DW_PART + part * C * DK + w_off, -_dot(dut, tl.trans(S)), mask=rm[None, :])
        tl.store(DKT_PART + part * DK * C + kt_off, _dot(dS, tl.trans(u)), mask=rm[:, None])
        tl.store(DEND_PART + part + ch, tl.sum(dS * S))
        dS = tl.load(END + ch) * dS
        dS = dS - _dot(tl.trans(w), dut)
        if HAS_DSTARTS:
            dS += tl.load(DSTARTS + ch * DK * DV + s_off, mask=s_m, other=0.0)
    tl.store(DS0 + bh.to(tl.int64) * DK * DV + s_off, dS, mask=s_m)


# ------------------------------------------------------------------ host side


def _config(dk: int, dv: int) -> dict:
    """Tiles and launch options (speed only; a fixed choice per shape, so fixed bits): the state tile
    [BDK, BV]. GPU: unmeasured defaults that keep S, dS and the [C, d_k] operand tiles on chip; two
    pipeline stages (Triton's default three would ask 160 / 202 KB of shared memory at d_k = 128, over
    an A100's 163 KB; two: 88 / 114 KB), one at d_k 256. The interpreter: tl.dot's minimum tile of 16
    (so that d_v = 32 already has two column blocks and the partial sums are exercised)."""
    bdk = max(16, next_power_of_2(dk))
    if interpreting():
        return dict(BDK=bdk, BV=16)
    bv = min(32 if bdk <= 128 else 16, max(16, next_power_of_2(dv)))
    return dict(BDK=bdk, BV=bv, num_warps=4, num_stages=2 if bdk <= 128 else 1)


def serves(U, W, S0) -> bool:
    """float32 tensors (the backward's compute dtype; float64 keeps the torch scan) on CUDA, or on the CPU under
    the interpreter, with d_k, d_v <= MAX_HEAD_DIM."""
    on = all(x.device.type == "cuda" for x in (U, W, S0)) or (interpreting() and U.device.type == "cpu")
    return (on and all(x.dtype == F32 for x in (U, W, S0)) and W.shape[-1] <= MAX_HEAD_DIM
            and U.shape[-1] <= MAX_HEAD_DIM)


def _shapes(U, W, kt, end, S0):
    if U.dim() != 5 or W.dim() != 5 or kt.dim() != 5:
        raise InputError(f"U, W, kt must be 5-D [n, hv, nc, ...], got {U.dim()}, {W.dim()}, {kt.dim()} dims")
    n, hv, nc, c, dv = U.shape
    dk = W.shape[-1]
    for name, x, want in (("W", W, (n, hv, nc, c, dk)), ("kt", kt, (n, hv, nc, dk, c)), ("S0", S0, (n, hv, dk, dv))):
        if tuple(x.shape) != want or x.dtype != F32:
            raise InputError(f"{name} must be float32 of shape {want}, got {x.dtype} {tuple(x.shape)}")
    if end.numel() != n * hv * nc or end.shape[:3] != (n, hv, nc) or end.dtype != F32:
        raise InputError(f"end must be float32 [n, hv, nc] (or [..., 1, 1]) = {(n, hv, nc)}, got {end.dtype} "
                         f"{tuple(end.shape)}")
    if c < 16 or c & (c - 1):
        raise InputError(f"the chunk size (U.shape[3]) must be a power of two >= 16, got {c}")
    return n, hv, nc, c, dk, dv


class _ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, U, W, kt, end, S0):
        n, hv, nc, c, dk, dv = _shapes(U, W, kt, end, S0)
        U, W, kt, S0 = (x.contiguous() for x in (U, W, kt, S0))
        e = end.reshape(n, hv, nc).contiguous()
        u = torch.empty_like(U)
        starts = torch.empty((n, hv, nc, dk, dv), dtype=F32, device=U.device)
        S_end = torch.empty_like(S0)
        cfg = _config(dk, dv)
        if nc == 0:
            S_end.copy_(S0)
        else:
            launch(_scan_fwd_kernel, (n * hv, cdiv(dv, cfg["BV"])), U, W, kt, e, S0, u, starts, S_end, nc,
                   DK=dk, DV=dv, C=c, **cfg, strict=False)
        ctx.save_for_backward(W, kt, e, u, starts)
        ctx.end_shape = end.shape
        return u, starts, S_end

    @staticmethod
    @once_differentiable
    def backward(ctx, du, dstarts, dS_end):
        W, kt, e, u, starts = ctx.saved_tensors
        n, hv, nc, c, dv = u.shape
        dk = W.shape[-1]
        du = torch.zeros_like(u) if du is None else du.contiguous()
        dS_end = torch.zeros((n, hv, dk, dv), dtype=F32, device=u.device) if dS_end is None else dS_end.contiguous()
        cfg = _config(dk, dv)
        nb = cdiv(dv, cfg["BV"])
        dU = torch.empty_like(u)
        dW = torch.empty((nb, *W.shape), dtype=F32, device=u.device)
        dkt = torch.empty((nb, *kt.shape), dtype=F32, device=u.device)
        dend = torch.empty((nb, n, hv, nc), dtype=F32, device=u.device)
        dS0 = torch.empty_like(dS_end)
        if nc == 0:
            dS0.copy_(dS_end)
        else:
            has = dstarts is not None
            with torch.cuda.device(u.device) if u.is_cuda else contextlib.nullcontext():  # the forward's GPU
                    launch(_scan_bwd_kernel, (n * hv, nb), W, kt, e, u, starts, du,
                       dstarts.contiguous() if has else starts,
                       dS_end, dU, dW, dkt, dend, dS0, nc, n * hv * nc, HAS_DSTARTS=has,
                       DK=dk, DV=dv, C=c, **cfg, strict=False)
        # the column blocks' partials, added in a fixed order (torch's sum over a dim: deterministic)
        return dU, dW.sum(0), dkt.sum(0), dend.sum(0).reshape(ctx.end_shape), dS0


def state_scan(U, W, kt, end, S0):
    """``hal.gdn_backward.state_scan`` in Triton (same arguments and results, differentiable once): U [n, hv, nc,
    C, dv], W [n, hv, nc, C, dk], kt [n, hv, nc, dk, C], end [n, hv, nc] (or [..., 1, 1]), S0 [n, hv, dk, dv], all
    float32 (see :func:`serves`) -> (u, S_starts [n, hv, nc, dk, dv], S_end)."""
    return _ScanFn.apply(U, W, kt, end, S0)
