"""Gated delta rule under FastGatedDeltaRuleSpec: the chunk form's products on tensor cores (``tl.dot``, bf16
operands, float32 accumulation), the structure fixed by the spec (hal/spec.py ``FastGatedDeltaRuleSpec.describe``).

The strict chunked kernel's layout (kernels/triton/gated_delta_rule.py: one program per (sequence, value head,
state-column tile), the rows from the last chunk boundary laid out by the host, the open chunk carried in the
state), with six products as dots: KK = K K^T, QK = Qs K^T, W = K S0, Y = Qs S0 (d_k the dot's K) and, over the
chunk's rows, o = P U + gamma Y and the state update S = Kd^T U + gamma_L S0. The triangular solve stays the
strict forward substitution in float32 (its order is the spec's), and so do the log-decay chains.

Why any cut gives the same bits: every tile is C rows whatever the number of rows present (a decode step too), a
present row's inputs to a dot are its own row and rows <= it (row i of P is +0.0 past column i, rows past the
last present row are +0.0), and the carried state only ever comes from complete chunks. A later row enters an
earlier row's output only as a product equal to zero inside ``tl.dot`` (P_ij = +0.0 for j > i; U's non-finite
values are zeroed for that dot and flagged per row instead), which changes no bit of the dot's output: the same
assumption as the fast attention spec's masked keys, checked on a GPU by the conformance suite.

Operands are rounded to bf16 by integer operations (``strict_math.round_to_bf16``: round to nearest even, the
same bits in the interpreter and on a GPU). Under TRITON_INTERPRET=1 ``tl.dot`` is the deterministic stand-in
(kernels/triton/interpreter_dot.py ``sequential_dot``): products of bf16 values are exact in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.errors import UnsupportedError
from hal.kernels.layout import Parts, gdn_from_padded as from_padded, gdn_to_padded as to_padded
from hal.kernels.reference.strict_math import canonical_nan
from . import strict_math as sm
from .gated_delta_rule import _carry, _decay_chains, _prepare, _row, _rows, _scalar, _state_copy
from .interpreter_dot import sequential_dot
from .launch import cdiv, float32_value, launch, next_power_of_2

F32 = torch.float32
#: largest d_k the kernel's one dot over the padded head dim takes (its [C, d_k] operand tiles in shared memory)
MAX_DK = 256
#: the strict spec's d_k tile for the L2 norm's sum of squares (the fast spec takes q / k preparation from it)
PREP_TILE = 64


@triton.jit(do_not_specialize=["n_rows", "lmax", "n_work", "n1", "n2"])  # counts that change per call: no recompiles
def _fast_chunked_kernel(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax, n_work, n1, n2,
                         H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                         BDK: tl.constexpr, BDV: tl.constexpr, WANT_FINAL: tl.constexpr, NPU: tl.constexpr):
    """QR, KR [N, R, H, DK]; VR [N, R, HV, DV]; GR, BR [N, R, HV] (rows from the last chunk boundary, float32);
    S [N, HV, DK, DV] (in: S0, out: the state at the last boundary); FIN like S; O [N, Lmax, HV, DV]."""
    for item in range(tl.program_id(0), n_work, tl.num_programs(0)):  # persistent (launch.py)
        _fast_chunked_item(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax,
                           item // (n1 * n2), (item // n2) % n1, item % n2, H, HV, DK, DV, C, BDK, BDV, WANT_FINAL)


@triton.jit
def _fast_chunked_item(QR, KR, VR, GR, BR, S, FIN, O, OPENED, TOTAL, n_rows, lmax, n, hv, dv_tile,
                       H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                       BDK: tl.constexpr, BDV: tl.constexpr, WANT_FINAL: tl.constexpr):
    """The fast chunk form for sequence n, value head hv, state columns dv_tile (one work item)."""
    dv = dv_tile * BDV + tl.arange(0, BDV)
    dm = dv < DV
    h = hv // (HV // H)
    opened = tl.load(OPENED + n)
    total = tl.load(TOTAL + n)
    ri = tl.arange(0, C)
    dk = tl.arange(0, BDK)
    dkm = dk < DK
    s_base = (n.to(tl.int64) * HV + hv) * DK * DV
    s_tile = s_base + dk[:, None] * DV + dv[None, :]
    s_mask = dkm[:, None] & dm[None, :]
    for a in range(0, total, C):
        present = tl.minimum(total - a, C)                  # rows of this chunk present
        rm = ri < present
        row = n.to(tl.int64) * n_rows + a + ri              # [C] global row ids of this chunk
        qk = (row * H + h) * DK
        gv = row * HV + hv
        qk_mask = rm[:, None] & dkm[None, :]
        L = tl.minimum(total - 1 - a, C - 1)                # the row a state after this chunk is taken at
        # Every value is computed where it is first needed and its tile dies after its last use (k and S0 are
        # loaded again for the state update): the order changes no bit, it keeps the live tiles few (spills).
        A, Gm = _decay_chains(GR, n, n_rows, a, ri, present, HV, hv, C)  # the strict spec's log-decay chains
        F = sm.exp(A)
        gamma = sm.exp(Gm)
        fL = _row(F, ri, L, 0)                              # f_Lj over j (the state update's decays)
        # absent rows and d_k's padding load +0.0
        kb = sm.round_to_bf16(tl.load(KR + qk[:, None] + dk[None, :], mask=qk_mask, other=0.0))
        coef = F * tl.dot(kb, tl.trans(kb))                 # f_ij KK_ij (used for j < i); the dot from +0.0
        qb = sm.round_to_bf16(tl.load(QR + qk[:, None] + dk[None, :], mask=qk_mask, other=0.0))
        QK = tl.dot(qb, tl.trans(kb))
        P = tl.where(ri[:, None] > ri[None, :], F * QK, tl.where(ri[:, None] == ri[None, :], QK, 0.0))
        s0b = sm.round_to_bf16(tl.load(S + s_tile, mask=s_mask, other=0.0))
        vt = tl.load(VR + gv[:, None] * DV + dv[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        X = tl.fma(-gamma[:, None], tl.dot(kb, s0b), vt)    # x_i = v_i - gamma_i (S0^T k_i)
        o_acc = gamma[:, None] * tl.dot(qb, s0b)            # gamma_i (S0^T qs_i)
        U = tl.zeros([C, BDV], tl.float32)
        seen = tl.zeros([BDV], tl.int32)                    # a non-finite u_j[c] at some j so far
        bad = tl.zeros([C, BDV], tl.int32)                  # ... at some j <= i: o_i[c] is NaN
        for j in range(0, present):  # forward substitution in increasing j (the strict order)
            beta_j = tl.load(BR + (n.to(tl.int64) * n_rows + a + j) * HV + hv)
            u_j = beta_j * _row(X, ri, j, 0)
            U = tl.where(ri[:, None] == j, u_j[None, :], U)
            seen = seen | ((u_j != u_j) | (tl.abs(u_j) == float("inf"))).to(tl.int32)
            bad = tl.where(ri[:, None] == j, seen[None, :], bad)
            X = tl.where(ri[:, None] > j, tl.fma(-_row(coef, ri, j, 1)[:, None], u_j[None, :], X), X)
        # rows past the present ones are +0.0 in U already; non-finite values are flagged, zeroed for the dot
        u_ok = tl.where((U == U) & (tl.abs(U) != float("inf")), U, 0.0)
        Ot = tl.dot(sm.round_to_bf16(P), sm.round_to_bf16(u_ok), o_acc)
        Ot = tl.where(bad != 0, float("nan"), Ot)
        r_abs = a + ri
        new = (r_abs >= opened) & (r_abs < total)
        o_row = n.to(tl.int64) * lmax + (r_abs - opened)
        tl.store(O + (o_row * HV + hv)[:, None] * DV + dv[None, :], sm.canonical_nan(Ot),
                 mask=new[:, None] & dm[None, :])
        complete = total >= a + C
        last_here = (total - 1) // C == a // C
        if complete | (last_here & WANT_FINAL):
            k32 = tl.load(KR + qk[:, None] + dk[None, :], mask=qk_mask, other=0.0)
            kd = tl.where(ri[:, None] == L, k32, fL[:, None] * k32)
            kd = tl.where(ri[:, None] <= L, kd, 0.0)
            u_L = tl.where(ri[:, None] <= L, U, 0.0)
            S0 = tl.load(S + s_tile, mask=s_mask, other=0.0)
            St = tl.dot(tl.trans(sm.round_to_bf16(kd)), sm.round_to_bf16(u_L), S0 * _scalar(gamma, ri, L))
            tl.debug_barrier()  # every read of S0 above happens before it is overwritten
            St = sm.canonical_nan(St)
            if WANT_FINAL & last_here:
                tl.store(FIN + s_tile, St, mask=s_mask)
            if complete:
                tl.store(S + s_tile, St, mask=s_mask)
            tl.debug_barrier()  # ... and the next chunk reads the new S0 rows after they are stored


def gated_delta_rule(q, k, v, g, beta, scale: float, parts: Parts, cu_seqlens, l2: bool, spec, want_final: bool):
    """The strict entry point's contract (kernels/triton/gated_delta_rule.py), under a FastGatedDeltaRuleSpec."""
    dev = v.device
    hv, dv = v.shape[2], v.shape[3]
    h, dk = k.shape[2], k.shape[3]
    if dk > MAX_DK:
        raise UnsupportedError(f"chunk_gated_delta_rule under {spec.id} (triton): head dim d_k = {dk} > {MAX_DK} "
                               "(the [chunk, d_k] tiles of one dot); use the strict spec")
    C = spec.chunk
    if cu_seqlens is None:
        lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64)
        lengths_dev = torch.full((q.shape[0],), q.shape[1], dtype=torch.int32, device=dev)
    else:
        lengths = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)])
        lengths_dev = lengths.to(device=dev, dtype=torch.int32)
    qs = _prepare(to_padded(q, cu_seqlens), float32_value(scale), l2, PREP_TILE)
    kn = _prepare(to_padded(k, cu_seqlens), None, l2, PREP_TILE)
    v32 = to_padded(v, cu_seqlens).to(F32).contiguous()
    g32 = to_padded(g, cu_seqlens).to(F32).contiguous()
    b32 = to_padded(beta, cu_seqlens).to(F32).contiguous()
    n, lmax = v32.shape[:2]
    S = _state_copy(parts.S, dev)
    o = torch.zeros((n, lmax, hv, dv), dtype=F32, device=dev)
    position = parts.position.to(torch.int64)
    fresh = parts.open_k is None
    start = torch.zeros_like(position) if fresh else position
    opened = torch.zeros((n,), dtype=torch.int32, device=dev) if fresh else \
        (start % C).to(device=dev, dtype=torch.int32)
    total = opened + lengths_dev
    n_chunks = cdiv(lmax + (0 if fresh else C - 1), C) if n else 0
    R = max(1, n_chunks) * C
    kr = _rows(None if fresh else parts.open_k, kn, opened, total, C, R)
    vr = _rows(None if fresh else parts.open_v, v32, opened, total, C, R)
    gr = _rows(None if fresh else parts.open_g, g32, opened, total, C, R)
    br = _rows(None if fresh else parts.open_beta, b32, opened, total, C, R)
    qr = _rows(None, qs, opened, total, C, R)
    fin = torch.empty_like(S) if want_final else S
    bdv = spec.block_dv
    if n and n_chunks:
        with sequential_dot():
            launch(_fast_chunked_kernel, (n, hv, cdiv(dv, bdv)), qr, kr, vr, gr, br, S, fin, o, opened, total, R,
                   lmax, H=h, HV=hv, DK=dk, DV=dv, C=C, BDK=max(16, next_power_of_2(dk)), BDV=bdv,
                   WANT_FINAL=bool(want_final), num_warps=spec.num_warps, persistent=True)
    new = Parts(start + lengths.to(start.device), S, _carry(kr, total, C, R), _carry(vr, total, C, R),
                _carry(gr, total, C, R), _carry(br, total, C, R), fin if want_final else None)
    new = new._replace(**{f: canonical_nan(getattr(new, f)) for f in ("open_k", "open_v", "open_g", "open_beta")})
    return canonical_nan(from_padded(o, cu_seqlens).to(v.dtype)), new
