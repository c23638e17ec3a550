"""Strict gated delta rule in Triton: ``GatedDeltaRuleSpec`` bits (kernels/reference/gated_delta_rule.py).

One program owns (sequence, value head, d_v tile): the state columns of that tile never meet
another program, so the state lives with it for the whole call (rows of S in memory for the
serial scan, an S [d_k, d_v-tile] register tile for the chunked state update). Every loop is a
spec order:

* ``serial``: per token S' = alpha S, w = S'^T k (tiled chain over d_k), u = (v - w) beta,
  S = fma(k, u, S'), o = S^T qs (tiled chain);
* ``chunked``: per chunk of C rows on the grid anchored at absolute position 0: the log-decay
  chains D[i, d] from row i downward, KK / QK / S0^T k / S0^T qs as tiled chains over d_k, the
  forward substitution in increasing j, o_i accumulated in the same j loop, and the state after
  row L as the chain over j <= L of rank-one fma updates.

Rows are taken out of register tiles by an integer sum of their bit patterns (exact, order-free).
The host side lays out the rows of the unfinished chunk exactly as the reference does (copies).
Every kernel is persistent (``launch(..., persistent=True)``): one work item per program on CUDA, at
most the core count for the Ascend variant (which also takes the NPU substitutes and, for the chunked
form, d_v tiles sized for the unified buffer: ``_block_dv``).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from hal.kernels.layout import Parts, gdn_from_padded as from_padded, gdn_to_padded as to_padded
from hal.kernels.reference.strict_math import canonical_nan
from . import ascend_launch, common, strict_math as sm
from .interpreter_dot import strict_dot
from .launch import cdiv, float32_value, fma_dot, launch, next_power_of_2

F32 = torch.float32
EPS_L2 = 1e-6


def _env_switch(name: str, default: str) -> bool:
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (the gated delta rule's chunked products), got {value!r}")
    return value == "1"


#: The chunked kernel's d_k products (KK, QK, S0^T k, S0^T qs) as float32 ``ieee`` tl.dot tiles where launch.fma_dot
#: allows (NVIDIA, and the interpreter's strict stand-in) and the row tile has >= 16 rows; off: the explicit fma
#: chains (the same bits; the path before issue 41 item 1). ``LOCKSTEP_GDN_FMA_DOT=0`` at import turns it off; the
#: attribute is read at each call (benchmarks/gpu_perf.py measures one path against the other in one run).
FMA_DOT_PRODUCTS = _env_switch("LOCKSTEP_GDN_FMA_DOT", "1")

#: d_k lanes per dot of those products on full C-row tiles: each d_k tile's chain runs through one dot per FULL_DOT_K
#: lanes, each continuing the last one's accumulator (the same bits). 0: one dot per tile (DTP lanes, the first FMA-dot
#: path): at C = 64 on 8 warps that held a dot's [64, 64]-lane operands and spilled 56 B per thread under Triton 3.6;
#: 32 lanes spill nothing under 3.6 and 3.9 (docs/gated_delta_rule.md). Decode row tiles (RT < C) keep one dot per
#: tile (spill-free; 32 lanes there cost registers). Read at each call.
FULL_DOT_K = 32

EPS = tl.constexpr(9.999999974752427e-07)  # float32(1e-6), exact


@triton.jit
def _row(x, idx, j, AXIS: tl.constexpr):
    """Slice j of a float32 tile along AXIS (idx: the index along that axis), exact."""
    if AXIS == 0:
        return tl.sum(tl.where(idx[:, None] == j, x.to(tl.int32, bitcast=True), 0), axis=0).to(tl.float32, bitcast=True)
    else:
        return tl.sum(tl.where(idx[None, :] == j, x.to(tl.int32, bitcast=True), 0), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _decay_chains(GR, n, n_rows, a, ri, present, HV: tl.constexpr, hv, R: tl.constexpr):
    """The strict spec's log-decay chains of a row tile starting at row ``a`` of sequence ``n`` (the fast spec keeps
    them): A[i, j] = D[i, i-j-1] (j < i) and Gm[i] = D[i, i], each summed from row i downward, one term at a time."""
    A = tl.zeros([R, R], tl.float32)
    Gm = tl.zeros([R], tl.float32)
    for d in range(0, present):
        ok = ri - d >= 0
        gd = tl.load(GR + (n.to(tl.int64) * n_rows + a + ri - d) * HV + hv, mask=ok, other=0.0)
        A = tl.where(ri[:, None] - d >= ri[None, :] + 1, A + gd[:, None], A)
        Gm = tl.where(ok, Gm + gd, Gm)
    return A, Gm


@triton.jit
def _scalar(x, idx, j):
    """Element j of a float32 vector, exact."""
    return tl.sum(tl.where(idx == j, x.to(tl.int32, bitcast=True), 0), axis=0).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------ q / k preparation


@triton.jit(do_not_specialize=["n_rows", "n_work"])  # counts that change per call: no recompiles
def _prep_kernel(X, OUT, n_rows, scale, n_work, L2: tl.constexpr, SCALE: tl.constexpr, DK: tl.constexpr,
                 BT: tl.constexpr, BDK: tl.constexpr, DT: tl.constexpr, NPU: tl.constexpr):
    """Rows of X [n_rows, DK] widened, optionally L2-normalised (x / sqrt(ss + 1e-6)), optionally * scale."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        r = item * BT + tl.arange(0, BT)
        rm = r < n_rows
        dcol = tl.arange(0, BDK)
        r64 = r.to(tl.int64) * DK
        mask = rm[:, None] & (dcol[None, :] < DK)
        x = sm.widen(tl.load(X + r64[:, None] + dcol[None, :], mask=mask, other=0.0))
        if L2:
            ss = tl.zeros([BT], tl.float32)
            for t0 in range(0, DK, DT):
                part = tl.zeros([BT], tl.float32)
                for d in range(t0, tl.minimum(t0 + DT, DK)):
                    xd = sm.widen(tl.load(X + r64 + d, mask=rm, other=0.0))
                    part = tl.fma(xd, xd, part)
                ss = ss + part
            x = sm.div(x, sm.sqrt(ss + tl.full([BT], EPS, tl.float32), NPU)[:, None], NPU)
        if SCALE:
            x = x * scale
        tl.store(OUT + r64[:, None] + dcol[None, :], x, mask=mask)


def _prepare(x, scale, l2: bool, dt: int):
    """[..., DK] any float dtype -> float32 (normalised / scaled), the reference's prepare_qk for one input."""
    dk = x.shape[-1]
    flat = x.contiguous().reshape(-1, dk)
    out = torch.empty(flat.shape, dtype=F32, device=x.device)
    n = flat.shape[0]
    if n:
        bt = 16
        launch(_prep_kernel, (cdiv(n, bt),), flat, out, n, 1.0 if scale is None else scale,
               L2=l2, SCALE=scale is not None, DK=dk, BT=bt, BDK=next_power_of_2(dk), DT=dt, persistent=True)
    return out.reshape(x.shape)


# ------------------------------------------------------------------ the state's working copy


@triton.jit(do_not_specialize=["n", "n_work"])  # counts that change per call: no recompiles
def _state_copy_kernel(X, Y, n, n_work, BLOCK: tl.constexpr, NPU: tl.constexpr):
    """Y = X (float32) with the canonical NaN: the op's own copy of a given state, in one pass."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        i = tl.full([BLOCK], item, tl.int64) * BLOCK + tl.arange(0, BLOCK)  # states past 2**31 elements
        ok = i < n
        tl.store(Y + i, sm.canonical_nan(tl.load(X + i, mask=ok, other=0.0)), mask=ok)


def _state_copy(S, dev):
    """A float32 copy of the state the kernels update in place (ops never modify a state they are given), with
    the canonical NaN: the kernels store every state they compute canonicalised too, so the returned state
    needs no NaN pass afterwards (a NaN's payload changes no later value that is not NaN)."""
    x = S.to(device=dev, dtype=F32).contiguous()
    out = torch.empty_like(x)
    if x.numel():
        block = 1024
        launch(_state_copy_kernel, (cdiv(x.numel(), block),), x, out, x.numel(), BLOCK=block, persistent=True)
    return out


# ------------------------------------------------------------------ serial


@triton.jit(do_not_specialize=["lmax", "n_work", "n1", "n2"])  # counts that change per call: no recompiles
def _serial_kernel(QS, KN, V, G, B, S, O, LEN, lmax, n_work, n1, n2, H: tl.constexpr, HV: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, DT: tl.constexpr, NPU: tl.constexpr):
    """QS, KN [N, Lmax, H, DK]; V, O [N, Lmax, HV, DV]; G, B [N, Lmax, HV]; S [N, HV, DK, DV] (in place)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        _serial_item(QS, KN, V, G, B, S, O, LEN, lmax, item // (n1 * n2), (item // n2) % n1, item % n2,
                     H, HV, DK, DV, BDV, DT)


@triton.jit
def _serial_item(QS, KN, V, G, B, S, O, LEN, lmax, n, hv, dv_tile, H: tl.constexpr, HV: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, DT: tl.constexpr):
    """The serial scan of sequence n, value head hv, d_v tile dv_tile (one work item)."""
    dv = dv_tile * BDV + tl.arange(0, BDV)
    dm = dv < DV
    h = hv // (HV // H)
    length = tl.load(LEN + n)
    s_base = (n.to(tl.int64) * HV + hv) * DK * DV
    for t in range(0, length):
        tok = n.to(tl.int64) * lmax + t
        qk_base = (tok * H + h) * DK
        alpha = sm.exp(tl.load(G + tok * HV + hv))
        beta = tl.load(B + tok * HV + hv)
        w = tl.zeros([BDV], tl.float32)
        for t0 in range(0, DK, DT):
            part = tl.zeros([BDV], tl.float32)
            for d in range(t0, tl.minimum(t0 + DT, DK)):
                sp = tl.load(S + s_base + d * DV + dv, mask=dm, other=0.0) * alpha
                part = tl.fma(sp, tl.load(KN + qk_base + d), part)
            w = w + part
        vt = tl.load(V + (tok * HV + hv) * DV + dv, mask=dm, other=0.0)
        u = (vt - w) * beta
        o = tl.zeros([BDV], tl.float32)
        for t0 in range(0, DK, DT):
            part = tl.zeros([BDV], tl.float32)
            for d in tl.range(t0, tl.minimum(t0 + DT, DK), num_stages=common.STAGES):
                sp = tl.load(S + s_base + d * DV + dv, mask=dm, other=0.0) * alpha
                s_new = tl.fma(tl.load(KN + qk_base + d), u, sp)
                tl.store(S + s_base + d * DV + dv, sm.canonical_nan(s_new), mask=dm)
                part = tl.fma(s_new, tl.load(QS + qk_base + d), part)
            o = o + part
        tl.store(O + (tok * HV + hv) * DV + dv, o, mask=dm)
        tl.debug_barrier()  # the next token reads rows of S this token stored (maybe from another thread)


# ------------------------------------------------------------------ chunked


@triton.jit
def _products_fma(QR, KR, S, qk, s_base, dv, dm, DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                  DT: tl.constexpr, RT: tl.constexpr, STAGES: tl.constexpr):
    """KK = K K^T, QK = Qs K^T [RT, RT], W = S0^T k, Y = S0^T qs [RT, BDV] of a chunk's rows (qk: their row offsets)
    as the spec's tiled chains over d_k, one explicit fma per step (AMD, Ascend, row tiles under 16, and
    ``FMA_DOT_PRODUCTS`` off): in a tile a chain from +0.0 over exactly its valid d, tile partials added in order
    from +0.0."""
    KK = tl.zeros([RT, RT], tl.float32)
    QK = tl.zeros([RT, RT], tl.float32)
    W = tl.zeros([RT, BDV], tl.float32)
    Y = tl.zeros([RT, BDV], tl.float32)
    for t0 in range(0, DK, DT):
        pkk = tl.zeros([RT, RT], tl.float32)
        pqk = tl.zeros([RT, RT], tl.float32)
        pw = tl.zeros([RT, BDV], tl.float32)
        py = tl.zeros([RT, BDV], tl.float32)
        for d in tl.range(t0, tl.minimum(t0 + DT, DK), num_stages=STAGES):
            kd = tl.load(KR + qk + d)
            qd = tl.load(QR + qk + d)
            s0d = tl.load(S + s_base + d * DV + dv, mask=dm, other=0.0)
            pkk = tl.fma(kd[:, None], kd[None, :], pkk)
            pqk = tl.fma(qd[:, None], kd[None, :], pqk)
            pw = tl.fma(kd[:, None], s0d[None, :], pw)
            py = tl.fma(qd[:, None], s0d[None, :], py)
        KK = KK + pkk
        QK = QK + pqk
        W = W + pw
        Y = Y + py
    return KK, QK, W, Y


@triton.jit
def _products_fma_dot(QR, KR, S, qk, s_base, dv, dm, DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                      DT: tl.constexpr, DTP: tl.constexpr, RT: tl.constexpr, STAGES: tl.constexpr,
                      DOT_K: tl.constexpr):
    """:func:`_products_fma`'s bits with float32 ``ieee`` tl.dots per d_k tile and product (NVIDIA: an fma chain per
    output over d in order from the zero accumulator; launch.fma_dot). A tile is DTP >= DT lanes (a power of two,
    >= 16 for tl.dot), its chain run through one dot per DOT_K lanes, each continuing the last one's accumulator
    (the same fma steps in the same order as one dot over the tile; DOT_K = DTP is one dot per tile): the FMA
    lowering holds a dot's operands of all its K lanes in registers, so narrower dots leave room for the tile's
    other live values. A lane past the tile or past DK is a padded step, which adds a product equal to -0.0: the
    row operand (k or qs rows, [RT, DOT_K]) is -0.0 there (sm.neg_zero_where), the column operand (k^T, S0 rows,
    [DOT_K, *]) +0.0, and fma(-0, +0, c) = c for every c. Tile partials are added in tile order from +0.0 by
    tl.fma(part, 1.0, total): total + part rounded once, not an addf Triton could fold into the next dot's
    accumulator. (Rows of the tile past the chunk's present rows read the zeros the host lays out there and feed
    nothing: rows are independent in every product.) One loop per product: with all four dots in one loop the
    operands live at once spilled 0.9 KB per thread at C = 64 (Triton 3.6 and 3.9; docs/gated_delta_rule.md)."""
    KK = tl.zeros([RT, RT], tl.float32)
    QK = tl.zeros([RT, RT], tl.float32)
    W = tl.zeros([RT, BDV], tl.float32)
    Y = tl.zeros([RT, BDV], tl.float32)
    lane = tl.arange(0, DOT_K)
    for t0 in tl.range(0, DK, DT, num_stages=STAGES):  # KK
        part = tl.zeros([RT, RT], tl.float32)
        for c in tl.static_range(0, DT, DOT_K):  # the tile's lanes, DOT_K per dot
            d = t0 + c + lane
            d_ok = (c + lane < DT) & (d < DK)
            k_col = tl.load(KR + qk[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)  # [RT, DOT_K], +0.0 padded
            k_row = sm.neg_zero_where(d_ok[None, :], k_col)                                 # -0.0 padded
            part = tl.dot(k_row, tl.trans(k_col), part, input_precision="ieee")
        KK = tl.fma(part, 1.0, KK)
    for t0 in tl.range(0, DK, DT, num_stages=STAGES):  # QK
        part = tl.zeros([RT, RT], tl.float32)
        for c in tl.static_range(0, DT, DOT_K):
            d = t0 + c + lane
            d_ok = (c + lane < DT) & (d < DK)
            k_col = tl.load(KR + qk[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            q_row = sm.neg_zero_where(d_ok[None, :],
                                      tl.load(QR + qk[:, None] + d[None, :], mask=d_ok[None, :], other=0.0))
            part = tl.dot(q_row, tl.trans(k_col), part, input_precision="ieee")
        QK = tl.fma(part, 1.0, QK)
    for t0 in tl.range(0, DK, DT, num_stages=STAGES):  # W
        part = tl.zeros([RT, BDV], tl.float32)
        for c in tl.static_range(0, DT, DOT_K):
            d = t0 + c + lane
            d_ok = (c + lane < DT) & (d < DK)
            k_row = sm.neg_zero_where(d_ok[None, :],
                                      tl.load(KR + qk[:, None] + d[None, :], mask=d_ok[None, :], other=0.0))
            s0 = tl.load(S + s_base + d.to(tl.int64)[:, None] * DV + dv[None, :], mask=d_ok[:, None] & dm[None, :],
                         other=0.0)                                                     # [DOT_K, BDV], +0.0 padded
            part = tl.dot(k_row, s0, part, input_precision="ieee")
        W = tl.fma(part, 1.0, W)
    for t0 in tl.range(0, DK, DT, num_stages=STAGES):  # Y
        part = tl.zeros([RT, BDV], tl.float32)
        for c in tl.static_range(0, DT, DOT_K):
            d = t0 + c + lane
            d_ok = (c + lane < DT) & (d < DK)
            q_row = sm.neg_zero_where(d_ok[None, :],
                                      tl.load(QR + qk[:, None] + d[None, :], mask=d_ok[None, :], other=0.0))
            s0 = tl.load(S + s_base + d.to(tl.int64)[:, None] * DV + dv[None, :], mask=d_ok[:, None] & dm[None, :],
                         other=0.0)
            part = tl.dot(q_row, s0, part, input_precision="ieee")
        Y = tl.fma(part, 1.0, Y)
    return KK, QK, W, Y


@triton.jit(do_not_specialize=["n_rows", "lmax", "n_work", "n1", "n2"])  # counts that change per call: no recompiles
def _chunked_kernel(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax, n_work, n1, n2,
                    H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                    BDK: tl.constexpr, BDV: tl.constexpr, DT: tl.constexpr, WANT_FINAL: tl.constexpr,
                    RT: tl.constexpr, STAGES: tl.constexpr, NPU: tl.constexpr, FMA_DOT: tl.constexpr = False,
                    DTP: tl.constexpr = 16, DOT_K: tl.constexpr = 16):
    """QR, KR [N, R, H, DK]; VR [N, R, HV, DV]; GR, BR [N, R, HV] (rows from the last chunk boundary);
    S [N, HV, DK, DV] (in: S0, out: state at the last boundary); FIN like S; O [N, Lmax, HV, DV].
    RT: rows per register tile, C unless the host knows every sequence ends inside its first RT rows
    (decode steps: ``_row_tile``). STAGES: software-pipeline depth of the d_k loop (1: none; ``_stages``).
    FMA_DOT: the d_k products as float32 ieee dots over DTP-lane tiles (``_products_fma_dot``; ``_fma_dot_products``),
    else explicit fma chains (AMD, Ascend)."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        _chunked_item(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax,
                      item // (n1 * n2), (item // n2) % n1, item % n2, H, HV, DK, DV, C, BDK, BDV, DT, WANT_FINAL,
                      RT, STAGES, FMA_DOT, DTP, DOT_K, NPU)


@triton.jit
def _chunked_item(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax, n, hv, dv_tile,
                  H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                  BDK: tl.constexpr, BDV: tl.constexpr, DT: tl.constexpr, WANT_FINAL: tl.constexpr,
                  RT: tl.constexpr, STAGES: tl.constexpr, FMA_DOT: tl.constexpr, DTP: tl.constexpr,
                  DOT_K: tl.constexpr, NPU: tl.constexpr):
    """The chunked form for sequence n, value head hv, d_v tile dv_tile (one work item).

    Row i reads rows <= i only, so the serial loops over rows stop at the chunk's last present row
    (``present``): the rows after it are never read by an earlier row (the spec's partial chunk), and a
    decode step into an open chunk of r rows costs r steps, not C."""
    dv = dv_tile * BDV + tl.arange(0, BDV)
    dm = dv < DV
    h = hv // (HV // H)
    opened = tl.load(OPENED + n)
    total = tl.load(TOTAL + n)
    ri = tl.arange(0, RT)
    dk = tl.arange(0, BDK)
    s_base = (n.to(tl.int64) * HV + hv) * DK * DV
    s_tile = s_base + dk[:, None] * DV + dv[None, :]
    s_mask = (dk[:, None] < DK) & dm[None, :]
    for a in range(0, total, C):
        present = tl.minimum(total - a, C)                  # rows of this chunk present (<= RT)
        row = n.to(tl.int64) * n_rows + a + ri              # [RT] global row ids of this chunk
        qk = (row * H + h) * DK
        gv = row * HV + hv
        # KK, QK [C, C] and W = S0^T k, Y = S0^T qs [C, BDV]: tiled chains over d_k
        if NPU:  # Ascend: the explicit chains (a dot would run on the cube unit)
            KK, QK, W, Y = _products_fma(QR, KR, S, qk, s_base, dv, dm, DK, DV, BDV, DT, RT, STAGES)
        elif FMA_DOT:  # NVIDIA (and the interpreter's strict stand-in): fp32 ieee dots, an fma chain each
            KK, QK, W, Y = _products_fma_dot(QR, KR, S, qk, s_base, dv, dm, DK, DV, BDV, DT, DTP, RT, STAGES,
                                               DOT_K)
        else:  # AMD, row tiles under 16, the switch off: the explicit chains
            KK, QK, W, Y = _products_fma(QR, KR, S, qk, s_base, dv, dm, DK, DV, BDV, DT, RT, STAGES)
        A, Gm = _decay_chains(GR, n, n_rows, a, ri, present, HV, hv, RT)
        F = sm.exp(A)
        gamma = sm.exp(Gm)
        coef = F * KK
        P = tl.where(ri[:, None] == ri[None, :], QK, F * QK)
        vt = tl.load(VR + gv[:, None] * DV + dv[None, :], mask=dm[None, :], other=0.0)
        X = tl.fma(-gamma[:, None], W, vt)
        Ot = gamma[:, None] * Y
        U = tl.zeros([RT, BDV], tl.float32)
        for j in range(0, present):  # forward substitution, o accumulated in the same order
            beta_j = tl.load(BR + (n.to(tl.int64) * n_rows + a + j) * HV + hv)
            u_j = beta_j * _row(X, ri, j, 0)
            U = tl.where(ri[:, None] == j, u_j[None, :], U)
            X = tl.where(ri[:, None] > j, tl.fma(-_row(coef, ri, j, 1)[:, None], u_j[None, :], X), X)
            Ot = tl.where(ri[:, None] >= j, tl.fma(_row(P, ri, j, 1)[:, None], u_j[None, :], Ot), Ot)
        # outputs of the new rows
        r_abs = a + ri
        new = (r_abs >= opened) & (r_abs < total)
        o_row = n.to(tl.int64) * lmax + (r_abs - opened)
        tl.store(O + (o_row * HV + hv)[:, None] * DV + dv[None, :], Ot, mask=new[:, None] & dm[None, :])
        complete = total >= a + C
        last_here = (total - 1) // C == a // C
        if complete | (last_here & WANT_FINAL):
            L = tl.minimum(total - 1 - a, C - 1)
            fL = _row(F, ri, L, 0)                           # f_Lj over j
            St = tl.load(S + s_tile, mask=s_mask, other=0.0) * _scalar(gamma, ri, L)
            for j in range(0, L + 1):
                kj = tl.load(KR + ((n.to(tl.int64) * n_rows + a + j) * H + h) * DK + dk, mask=dk < DK, other=0.0)
                kd = tl.where(j == L, kj, _scalar(fL, ri, j) * kj)
                St = tl.fma(kd[:, None], _row(U, ri, j, 0)[None, :], St)
            tl.debug_barrier()  # every read of S0 above happens before it is overwritten
            St = sm.canonical_nan(St)  # the returned states need no NaN pass (_state_copy)
            if WANT_FINAL & last_here:
                tl.store(FIN + s_tile, St, mask=s_mask)
            if complete:
                tl.store(S + s_tile, St, mask=s_mask)
            tl.debug_barrier()  # ... and the next chunk reads the new S0 rows after they are stored


def _rows(open_rows, new_rows, opened, total, C, R):
    """[N, R, ...]: the open rows, then the new rows, then zeros (the reference's chunk-row layout)."""
    n, lmax = new_rows.shape[:2]
    if open_rows is None:
        open_rows = new_rows.new_zeros((n, C, *new_rows.shape[2:]))
    src = torch.cat([open_rows.to(new_rows.device), new_rows, new_rows.new_zeros((n, 1, *new_rows.shape[2:]))], dim=1)
    r = torch.arange(R, device=new_rows.device).unsqueeze(0)
    idx = torch.where(r < opened[:, None], r, torch.where(r < total[:, None], C + r - opened[:, None], C + lmax))
    return src[torch.arange(n, device=new_rows.device)[:, None], idx].contiguous()


def _carry(x, total, C, R):
    """Rows after the last boundary (the new open chunk), zeros after them."""
    n = x.shape[0]
    dev = x.device
    boundary = total - total % C
    ridx = boundary[:, None] + torch.arange(C, device=dev).unsqueeze(0)
    keep = torch.arange(C, device=dev).unsqueeze(0) < (total % C)[:, None]
    got = x[torch.arange(n, device=dev)[:, None], ridx.clamp_max(R - 1)]
    return torch.where(keep.reshape(n, C, *([1] * (got.dim() - 2))), got, torch.zeros((), dtype=F32, device=dev))


def _i32(x, dev):
    return torch.as_tensor(x).to(device=dev, dtype=torch.int32)


def _block_dv(spec, dk: int, dv: int) -> int:
    """d_v columns per program (columns are independent: never changes bits). Ascend variant, chunked: the
    [C, BDV] tiles (W, Y and their partials, X, Ot, U, v) and the S tile [BDK, BDV] fit the unified-buffer
    budget; the [C, C] tiles (F, KK, QK and partials: 80 KB at C = 64) come on top (docs/ascend.md)."""
    bdv = min(64, next_power_of_2(dv))
    if ascend_launch.npu_layout() and spec.variant == "chunked":
        c, bdk = spec.chunk, next_power_of_2(dk)
        bdv = ascend_launch.fit_block(bdv, lambda b: [(c, b)] * 8 + [(bdk, b)])
    return bdv


def _row_tile(C: int, most_rows) -> int:
    """Rows per register tile of the chunked kernel: C, or the power of two (>= 16) that holds every
    sequence's rows when all of them end inside their first chunk (``most_rows`` < C; None: unknown). Rows
    are independent in every tile operation and the serial loops stop at the last present row, so the
    tile's height never changes bits; a decode step then works on [16, *] tiles, not [C, *]."""
    if most_rows is None or most_rows >= C:
        return C
    return min(C, max(16, next_power_of_2(most_rows)))


def _full_chunk_tiles(bdv: int):
    """(d_v columns, launch options) of the chunked kernel on full C-row tiles, NVIDIA: 16 columns on 8 warps.
    Columns are independent (no bits change); at C = 64, d = 128 the [C, C] and [C, 64] tiles spilled ~1.2 KB
    per thread on 4 warps (2.9 KB before the row-bounded loops) under Triton 3.6 and 3.9; 16 columns on 8 warps
    spill nothing under either and give 4x the programs (256 for one sequence of 32 value heads), at the cost
    of recomputing the [C, C] products per column block (docs/gated_delta_rule.md)."""
    return min(bdv, 16), dict(num_warps=8)


def _fma_dot_products(rt: int) -> bool:
    """The chunked kernel's products as FMA-dot tiles (``FMA_DOT_PRODUCTS``): tl.dot takes >= 16 rows (RT >= 16; a
    chunk under 16 rows keeps the chains) and >= 16 columns (the host pads BDV to 16: columns are independent)."""
    return FMA_DOT_PRODUCTS and rt >= 16 and fma_dot()


def _dot_k(rt: int, C: int, dtp: int) -> int:
    """Lanes per dot of the chunked products (the kernel's DOT_K): ``FULL_DOT_K`` on full C-row tiles, else the
    whole d_k tile (DTP). Never changes bits (one chain per tile either way)."""
    if FULL_DOT_K and (FULL_DOT_K < 16 or FULL_DOT_K & (FULL_DOT_K - 1)):
        raise ValueError(f"gated_delta_rule.FULL_DOT_K must be 0 or a power of two >= 16, got {FULL_DOT_K!r}")
    return min(FULL_DOT_K, dtp) if FULL_DOT_K and rt == C else dtp


def _stages(rt: int, C: int) -> int:
    """Pipeline depth of the chunked kernel's d_k loop: only the row tiles below C pipeline it; at C = 64 the
    pipelined loop spills more under Triton 3.6 (stack 1160 -> 3880 B per thread; docs/gated_delta_rule.md)."""
    return common.STAGES.value if rt < C else 1


def gated_delta_rule(q, k, v, g, beta, scale: float, parts: Parts, cu_seqlens, l2: bool, spec, want_final: bool):
    """The reference's entry point and contract (kernels/reference/gated_delta_rule.py), on Triton."""
    dev = v.device
    t = spec.dk_tile
    hv, dv = v.shape[2], v.shape[3]
    h, dk = k.shape[2], k.shape[3]
    if cu_seqlens is None:
        lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64)
        lengths_dev = torch.full((q.shape[0],), q.shape[1], dtype=torch.int32, device=dev)  # no host copy
    else:
        lengths = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)])
        lengths_dev = _i32(lengths, dev)
    qs = _prepare(to_padded(q, cu_seqlens), float32_value(scale), l2, t)
    kn = _prepare(to_padded(k, cu_seqlens), None, l2, t)
    v32 = to_padded(v, cu_seqlens).to(F32).contiguous()
    g32 = to_padded(g, cu_seqlens).to(F32).contiguous()
    b32 = to_padded(beta, cu_seqlens).to(F32).contiguous()
    n, lmax = v32.shape[:2]
    bdv = _block_dv(spec, dk, dv)
    grid = (n, hv, cdiv(dv, bdv))
    S = _state_copy(parts.S, dev)
    o = torch.zeros((n, lmax, hv, dv), dtype=F32, device=dev)
    position = parts.position.to(torch.int64)
    if spec.variant == "serial":
        if n and lmax:
            launch(_serial_kernel, grid, qs, kn, v32, g32, b32, S, o, lengths_dev, lmax,
                   H=h, HV=hv, DK=dk, DV=dv, BDV=bdv, DT=t, persistent=True)
        new = Parts(position + lengths.to(position.device), S, None, None, None, None, S)
    else:
        C = spec.chunk
        fresh = parts.open_k is None
        start = torch.zeros_like(position) if fresh else position
        if fresh:  # a fresh grid: nothing open, no host-to-device copy
            opened = torch.zeros((n,), dtype=torch.int32, device=dev)
            most_rows = lmax
        else:
            opened = (start % C).to(device=dev, dtype=torch.int32)
            # the open rows' count is read on the host only where the positions live there (no device sync)
            most_rows = int((start % C).max()) + lmax if start.device.type == "cpu" and n else None
        total = opened + lengths_dev
        # chunk rows per sequence from the shapes (no host read of device positions): total < C + lmax, and the
        # kernel stops at each sequence's own total, so spare all-zero rows change no bits
        n_chunks = cdiv(lmax + (0 if fresh else C - 1), C) if n else 0
        rt = _row_tile(C, most_rows)
        R = rt if rt < C else max(1, n_chunks) * C
        kr = _rows(None if fresh else parts.open_k, kn, opened, total, C, R)
        vr = _rows(None if fresh else parts.open_v, v32, opened, total, C, R)
        gr = _rows(None if fresh else parts.open_g, g32, opened, total, C, R)
        br = _rows(None if fresh else parts.open_beta, b32, opened, total, C, R)
        qr = _rows(None, qs, opened, total, C, R)
        # every work item stores its final state (each sequence has a last chunk): no copy of S needed
        fin = torch.empty_like(S) if want_final else S
        bdv_c, warps = _full_chunk_tiles(bdv) if rt == C and not ascend_launch.active() else (bdv, {})
        dot = _fma_dot_products(rt)
        bdv_c = max(16, bdv_c) if dot else bdv_c  # a dot's tile has >= 16 columns (past d_v: masked)
        dtp = max(16, next_power_of_2(min(t, dk)))  # a d_k tile's dot lanes
        if n and n_chunks:
            with strict_dot() if dot else contextlib.nullcontext():
                launch(_chunked_kernel, (n, hv, cdiv(dv, bdv_c)), qr, kr, vr, gr, br, S, fin, o, opened, total, R,
                       lmax, H=h, HV=hv, DK=dk, DV=dv, C=C, BDK=next_power_of_2(dk),
                       BDV=bdv_c, DT=t, WANT_FINAL=bool(want_final), RT=rt,
                       STAGES=_stages(rt, C), FMA_DOT=dot, DTP=dtp, DOT_K=_dot_k(rt, C, dtp), persistent=True,
                       **warps)
        new = Parts(start + lengths.to(start.device), S, _carry(kr, total, C, R), _carry(vr, total, C, R),
                    _carry(gr, total, C, R), _carry(br, total, C, R), fin if want_final else None)
    # the strict policy's last step: one NaN pattern per dtype in the output and every state part (S and the
    # final state are canonical already: _state_copy and the kernels' stores)
    new = new._replace(**{f: canonical_nan(getattr(new, f)) for f in ("open_k", "open_v", "open_g", "open_beta")
                          if getattr(new, f) is not None})
    return canonical_nan(from_padded(o, cu_seqlens).to(v.dtype)), new
