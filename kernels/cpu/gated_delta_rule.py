"""Gated delta rule under a GatedDeltaRuleSpec (kernels/reference/gated_delta_rule.py), compiled.

One task per (sequence, value head): the state S [d_k, d_v] of a head never meets another head's,
so the tasks are independent and a task's arithmetic is the reference's step order for that head,
whatever the batch or thread count. Sequences are read in place from the packed (or flattened
batched) token axis through (start, length) pairs; no padded copy is made.

* serial: per token, S' = alpha S and w = S'^T k in one pass over S, then S = fma(k, u, S') and
  o = S^T qs in a second pass.
* chunked: per chunk of the grid, the rows present (the open rows of the state first, then the new
  tokens) are gathered; row i of the chunk uses rows <= i only (the reference's order: the decay
  chain D[i, d] downward from row i, forward substitution in increasing j, fma chains in row order),
  so only the present rows are computed. Outputs are written for new rows only.

Every dot over d_k is the canonical tiled order (:func:`col_dot`).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from hal.kernels.layout import EPS_L2, Parts

from . import pool
from .host import array, canonical_nan, empty, finish, wide, zeros
from .pool import parallel_worth
from .reduce import tiled_dot
from .simd import vadd, vfma, vload, vsplat, vstore, vzero
from .strict_math import ZERO, canon, exp, fma, widen

_EPS = np.float32(EPS_L2)


@njit(inline="always", cache=True)
def col_dot(M, x, t, ncols, out, tmp):
    """out[c] = sum_a x[a] * M[a, c] for c < ncols, over a = 0..len(x)-1 in the canonical tiled order
    (per tile an fma chain from +0.0 in increasing a, tile partials added in order from +0.0). The
    columns are independent chains advanced together, so the inner loop vectorises."""
    n = x.shape[0]
    for c in range(ncols):
        out[c] = ZERO
    for a0 in range(0, n, t):
        for c in range(ncols):
            tmp[c] = ZERO
        for a in range(a0, min(a0 + t, n)):
            xa = x[a]
            row = M[a]
            for c in range(ncols):
                tmp[c] = fma(xa, row[c], tmp[c])
        for c in range(ncols):
            out[c] = out[c] + tmp[c]


@njit(inline="always", cache=True)
def rows_dot(M, X, lo, hi, t, out, tmp):
    """out[i, c] = sum_a X[i, a] * M[a, c] for rows lo <= i < hi: :func:`col_dot` for a block of rows,
    with the same chain per element; a row of M is read once per block instead of once per row."""
    n = X.shape[1]
    ncols = M.shape[1]
    for i in range(lo, hi):
        for c in range(ncols):
            out[i, c] = ZERO
    for a0 in range(0, n, t):
        for i in range(lo, hi):
            for c in range(ncols):
                tmp[i, c] = ZERO
        for a in range(a0, min(a0 + t, n)):
            row = M[a]
            for i in range(lo, hi):
                xa = X[i, a]
                ti = tmp[i]
                for c in range(ncols):
                    ti[c] = fma(xa, row[c], ti[c])
        for i in range(lo, hi):
            for c in range(ncols):
                out[i, c] = out[i, c] + tmp[i, c]


@njit(inline="always", cache=True)
def rows_dot32(M, X, lo, hi, t, out):
    """:func:`rows_dot` for M.shape[1] % 32 == 0 (C-contiguous M, out): the same chain per element,
    its tile partial and running sum held in registers (eight-lane vectors, four per block of 32
    columns) instead of stored after every fma. A 32-column block of M stays in L1 across the rows."""
    n = X.shape[1]
    ncols = M.shape[1]
    for cb in range(0, ncols, 32):
        for i in range(lo, hi):
            o0 = o1 = o2 = o3 = vzero()
            for a0 in range(0, n, t):
                t0 = t1 = t2 = t3 = vzero()
                for a in range(a0, min(a0 + t, n)):
                    xa = vsplat(X[i, a])
                    base = a * ncols + cb
                    t0 = vfma(xa, vload(M, base), t0)
                    t1 = vfma(xa, vload(M, base + 8), t1)
                    t2 = vfma(xa, vload(M, base + 16), t2)
                    t3 = vfma(xa, vload(M, base + 24), t3)
                o0, o1, o2, o3 = vadd(o0, t0), vadd(o1, t1), vadd(o2, t2), vadd(o3, t3)
            base = i * ncols + cb
            vstore(out, base, o0)
            vstore(out, base + 8, o1)
            vstore(out, base + 16, o2)
            vstore(out, base + 24, o3)


@njit(inline="always", cache=True)
def canon_copy(dst, src):
    """dst = src with canonical NaNs (the chunked kernel stores every result canonical, so the host
    needs no NaN pass per output: NaN payloads inside never reach a non-NaN result)."""
    for a in range(src.shape[0]):
        for c in range(src.shape[1]):
            dst[a, c] = canon(src[a, c])


@njit(inline="always", cache=True)
def chain_rows(acc, coef, U, n):
    """acc[c] = fma(coef[jj], U[jj, c], acc[c]) for jj = 0..n-1 in order (acc, U C-contiguous, U
    [*, len(acc)]). With len(acc) % 32 == 0 each block of 32 columns keeps its chains in four
    eight-lane registers over all jj (the scalar loop stores acc after every fma): same bits."""
    dv = acc.shape[0]
    if dv % 32 == 0:
        for cb in range(0, dv, 32):
            s0, s1, s2, s3 = vload(acc, cb), vload(acc, cb + 8), vload(acc, cb + 16), vload(acc, cb + 24)
            for jj in range(n):
                x = vsplat(coef[jj])
                ub = jj * dv + cb
                s0 = vfma(x, vload(U, ub), s0)
                s1 = vfma(x, vload(U, ub + 8), s1)
                s2 = vfma(x, vload(U, ub + 16), s2)
                s3 = vfma(x, vload(U, ub + 24), s3)
            vstore(acc, cb, s0)
            vstore(acc, cb + 8, s1)
            vstore(acc, cb + 16, s2)
            vstore(acc, cb + 24, s3)
    else:
        for jj in range(n):
            x = coef[jj]
            urow = U[jj]
            for c in range(dv):
                acc[c] = fma(x, urow[c], acc[c])


@njit(inline="always", cache=True)
def prepare_qk(q, k, tk, hk, scale, l2, t, xq, xk, part):
    """Token tk, q/k head hk (q, k [tokens, H, dk]) -> xq = (l2norm(q) or q) * scale, xk = l2norm(k)
    or k, float32. Computed inside each (sequence, value head) task: a group of value heads repeats
    this O(d_k) work rather than paying a separate parallel launch per call."""
    dk = xq.shape[0]
    for a in range(dk):
        xq[a] = widen(q[tk, hk, a])
        xk[a] = widen(k[tk, hk, a])
    if l2:
        nq = np.sqrt(tiled_dot(xq, xq, t, part) + _EPS)
        nk = np.sqrt(tiled_dot(xk, xk, t, part) + _EPS)
        for a in range(dk):
            xq[a] = xq[a] / nq
            xk[a] = xk[a] / nk
    for a in range(dk):
        xq[a] = xq[a] * scale


# ---------------------------------------------------------------- serial


@njit(nogil=True, cache=True)
def _serial(q, k, v, g, beta, starts, lengths, S0, scale, l2, t, o, S_out, work):
    """Tasks (sequence, value head), claimed from ``work``, of q, k [tokens, H, dk], v [tokens, HV, dv], g, beta
    [tokens, HV] (float32); S0 [N, HV, dk, dv]. Writes o [tokens, HV, dv] and S_out [N, HV, dk, dv] (the state after
    the last token)."""
    hv, dv = v.shape[1], v.shape[2]
    h, dk = q.shape[1], q.shape[2]
    group = hv // h
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            s = task // hv
            j = task % hv
            hk = j // group
            S = S_out[s, j]
            S[:, :] = S0[s, j]
            kv = np.empty(dk, np.float32)
            qv = np.empty(dk, np.float32)
            part = np.empty(max(1, (dk + t - 1) // t), np.float32)
            w = np.empty(dv, np.float32)
            tmp = np.empty(dv, np.float32)
            u = np.empty(dv, np.float32)
            for i in range(lengths[s]):
                tk = starts[s] + i
                alpha = exp(widen(g[tk, j]))
                b = widen(beta[tk, j])
                prepare_qk(q, k, tk, hk, scale, l2, t, qv, kv, part)
                for a in range(dk):  # S' = alpha S, in place: the pass that reads S' for w
                    row = S[a]
                    for c in range(dv):
                        row[c] = row[c] * alpha
                col_dot(S, kv, t, dv, w, tmp)                # w = S'^T k
                for c in range(dv):
                    u[c] = (widen(v[tk, j, c]) - w[c]) * b
                for a in range(dk):                          # S = S' + k u^T
                    row = S[a]
                    ka = kv[a]
                    for c in range(dv):
                        row[c] = fma(ka, u[c], row[c])
                col_dot(S, qv, t, dv, o[tk, j], tmp)  # o = S^T qs
        lo, hi = pool.claim(work)


# ---------------------------------------------------------------- chunked


@njit(cache=True)  # not inlined: inlined into the range loop it compiled several times slower
def _chunked_task(q, k, v, g, beta, starts, lengths, opened, S0, open_k, open_v, open_g, open_beta,
                  C, scale, l2, t, want_final, o, S_out, final_out, new_k, new_v, new_g, new_beta, task):
    """One (sequence, value head) of :func:`_chunked`. The work arrays are left uninitialised:
    every element is written before it is read (rows < cnt, columns < i), as the bit tests check."""
    hv, dv = v.shape[1], v.shape[2]
    h, dk = q.shape[1], q.shape[2]
    group = hv // h
    s = task // hv
    j = task % hv
    hk = j // group
    part = np.empty(max(1, (dk + t - 1) // t), np.float32)
    m = opened[s]
    total = m + lengths[s]
    S = S_out[s, j]
    canon_copy(S, S0[s, j])
    Snew = np.empty((dk, dv), np.float32)
    K = np.empty((C, dk), np.float32)
    KT = np.empty((dk, C), np.float32)
    Q = np.empty((C, dk), np.float32)
    V = np.empty((C, dv), np.float32)
    gc = np.empty(C, np.float32)
    bc = np.empty(C, np.float32)
    F = np.empty((C, C), np.float32)      # f[i, jj] = exp(g_i + ... + g_(jj+1)), jj < i
    gamma = np.empty(C, np.float32)        # exp(g_i + ... + g_0)
    KK = np.empty(C, np.float32)
    QK = np.empty(C, np.float32)
    W = np.empty((C, dv), np.float32)     # S0^T k_i
    Y = np.empty((C, dv), np.float32)     # S0^T qs_i (new rows)
    T2 = np.empty((C, dv), np.float32)
    U = np.empty((C, dv), np.float32)
    acc = np.empty(dv, np.float32)
    tmp = np.empty(max(C, dv), np.float32)
    KD = np.empty((dk, C), np.float32)    # [a, jj]: f_L,jj k_jj (k_L as is), for the state after row L
    coef = np.empty(C, np.float32)        # the coefficients of one row's fma chain over rows jj
    for ci in range((total + C - 1) // C):
        r0 = ci * C
        cnt = min(C, total - r0)
        # gather the present rows: open rows of the state, then new tokens
        for r in range(cnt):
            R = r0 + r
            if R < m:
                for a in range(dk):
                    K[r, a] = open_k[s, R, hk, a]
                for c in range(dv):
                    V[r, c] = open_v[s, R, j, c]
                gc[r] = open_g[s, R, j]
                bc[r] = open_beta[s, R, j]
            else:
                tk = starts[s] + R - m
                prepare_qk(q, k, tk, hk, scale, l2, t, Q[r], K[r], part)
                for c in range(dv):
                    V[r, c] = widen(v[tk, j, c])
                gc[r] = widen(g[tk, j])
                bc[r] = widen(beta[tk, j])
            for a in range(dk):
                KT[a, r] = K[r, a]
        # decay factors: D[i, d] = D[i, d-1] + g_(i-d), a chain from row i downward
        for i in range(cnt):
            D = gc[i]
            for d in range(1, i + 1):
                F[i, i - d] = exp(D)
                D = D + gc[i - d]
            gamma[i] = exp(D)
        new0 = max(0, m - r0)                                # first new row of the chunk
        if dv % 32 == 0:
            rows_dot32(S, K, 0, cnt, t, W)
        else:
            rows_dot(S, K, 0, cnt, t, W, T2)
        rows_dot(S, Q, new0, cnt, t, Y, T2)
        # forward substitution, row by row (row i reads rows < i only)
        for i in range(cnt):
            col_dot(KT, K[i], t, i, KK, tmp)                  # k_i . k_jj, jj < i
            ng = -gamma[i]
            for c in range(dv):
                acc[c] = fma(ng, W[i, c], V[i, c])
            for jj in range(i):
                coef[jj] = -(F[i, jj] * KK[jj])
            chain_rows(acc, coef, U, i)
            for c in range(dv):
                U[i, c] = bc[i] * acc[c]
            if i >= new0:                                     # a new row: its output
                col_dot(KT, Q[i], t, i + 1, QK, tmp)          # qs_i . k_jj, jj <= i
                out = o[starts[s] + r0 + i - m, j]
                for c in range(dv):
                    out[c] = gamma[i] * Y[i, c]
                for jj in range(i + 1):
                    coef[jj] = QK[jj] if jj == i else F[i, jj] * QK[jj]
                chain_rows(out, coef, U, i + 1)
                for c in range(dv):
                    out[c] = canon(out[c])
        complete = cnt == C
        last_here = r0 + cnt == total
        if complete or (last_here and want_final):
            # state after row L: gamma_L S0 + sum_(jj<=L) f_L,jj k_jj u_jj^T in row order
            L = cnt - 1
            gL = gamma[L]
            for jj in range(L + 1):
                fl = F[L, jj]
                for a in range(dk):
                    KD[a, jj] = K[jj, a] if jj == L else fl * K[jj, a]
            for a in range(dk):  # row by row of the state (each element's chain still runs jj = 0..L)
                srow = Snew[a]
                for c in range(dv):
                    srow[c] = S[a, c] * gL
                chain_rows(srow, KD[a], U, L + 1)
            if last_here and want_final:
                canon_copy(final_out[s, j], Snew)
            if complete:
                canon_copy(S, Snew)
        if last_here and cnt < C:  # the rows after the last boundary travel in the state
            for r in range(cnt):
                if j % group == 0:
                    for a in range(dk):
                        new_k[s, r, hk, a] = canon(K[r, a])
                for c in range(dv):
                    new_v[s, r, j, c] = canon(V[r, c])
                new_g[s, r, j] = canon(gc[r])
                new_beta[s, r, j] = canon(bc[r])


@njit(nogil=True, cache=True)
def _chunked(q, k, v, g, beta, starts, lengths, opened, S0, open_k, open_v, open_g, open_beta,
             C, scale, l2, t, want_final, o, S_out, final_out, new_k, new_v, new_g, new_beta, work):
    """Tasks (sequence, value head) claimed from ``work``, as _serial, plus: opened [N] open rows of the incoming state
    (open_* [N, C, ...] float32); writes S_out (state at the last chunk boundary), final_out (after the
    last token; if want_final) and new_* (the rows after the last boundary, zeros past them: the caller
    passes zeros)."""
    lo, hi = pool.claim(work)
    while lo < hi:
        for task in range(lo, hi):
            _chunked_task(q, k, v, g, beta, starts, lengths, opened, S0, open_k, open_v, open_g, open_beta,
                          C, scale, l2, t, want_final, o, S_out, final_out, new_k, new_v, new_g, new_beta, task)
        lo, hi = pool.claim(work)


# ---------------------------------------------------------------- entry point


def _layout(q, cu_seqlens):
    b, tlen = q.shape[:2]
    if cu_seqlens is None:
        return np.arange(b, dtype=np.int64) * tlen, np.full(b, tlen, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return cu[:-1].copy(), np.diff(cu)


def gated_delta_rule(q, k, v, g, beta, scale, parts: Parts, cu_seqlens, l2, spec, want_final):
    """The reference's entry point (same arguments and results), compiled."""
    t = spec.dk_tile
    b, tlen, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    tok = b * tlen
    starts, lengths = _layout(q, cu_seqlens)
    n = starts.shape[0]
    # float32 copies of the tokens (exact widening; O(tokens * d) against the kernel's O(tokens * d_k * d_v)):
    # the kernels compile once, not once per dtype
    q3, k3, sc = wide(q).reshape(tok, h, dk), wide(k).reshape(tok, h, dk), np.float32(scale)
    v3, g2, b2 = wide(v).reshape(tok, hv, dv), wide(g).reshape(tok, hv), wide(beta).reshape(tok, hv)
    S0 = array(parts.S.contiguous())
    o, o_np = zeros(tok, hv, dv)
    S, S_np = empty(n, hv, dk, dv)
    pos = torch.from_numpy(lengths)
    if spec.variant == "serial":
        pool.run(_serial, n * hv, q3, k3, v3, g2, b2, starts, lengths, S0, sc, l2, t, o_np, S_np,
                 parallel=parallel_worth(tok * hv * dk * dv))
        canonical_nan(S)
        new = Parts(parts.position + pos, S, None, None, None, None, S)
    else:
        C = spec.chunk
        start = parts.position if parts.open_k is not None else torch.zeros_like(parts.position)
        opened = array(start % C).astype(np.int64)
        if parts.open_k is None:
            ok, ov, og, ob = (np.zeros((n, C, *rest), np.float32) for rest in ((h, dk), (hv, dv), (hv,), (hv,)))
        else:
            ok, ov, og, ob = (array(x.contiguous())
                              for x in (parts.open_k, parts.open_v, parts.open_g, parts.open_beta))
        final, final_np = empty(n if want_final else 0, hv, dk, dv)
        (nk, nk_np), (nv, nv_np), (ng, ng_np), (nb, nb_np) = (zeros(n, C, *rest)
                                                              for rest in ((h, dk), (hv, dv), (hv,), (hv,)))
        pool.run(_chunked, n * hv, q3, k3, v3, g2, b2, starts, lengths, opened, S0, ok, ov, og, ob, C, sc, l2, t,
                 want_final, o_np, S_np, final_np, nk_np, nv_np, ng_np, nb_np,
                 parallel=parallel_worth(n * hv * (C + tlen) * dk * dv))
        new = Parts(start + pos, S, nk, nv, ng, nb, final if want_final else None)
        return finish(o, v.dtype, nan_done=True).reshape(v.shape), new
    return finish(o, v.dtype).reshape(v.shape), new
