"""Backward of the gated delta rule ops: a chunked forward in plain torch, differentiated by autograd.

The forward of ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` gives the spec's
bits; the gradients need not match any bits, only be correct and deterministic. Recomputing the
token-by-token recurrence under autograd (``kernels/oracle/gated_delta_rule.py``, still the
readable definition and selectable with ``LOCKSTEP_GDN_BACKWARD=recurrent``) builds O(T) tiny
graph nodes. Here the same function is written in the WY/UT chunk form (C = 64 rows per chunk),
so the graph holds O(T / C) batched matmuls and one batched triangular inverse, and autograd
differentiates that. Every op used is deterministic forward and backward on CPU and CUDA (matmul,
elementwise, reductions, slicing, expand); the ones that are not on CUDA -- float cumsum,
repeat_interleave, gather/index_select and scatter/index_add backward -- are avoided, so two runs
give the same bits.

Per chunk with start state S and in-chunk log-decay sums ``D[i, j] = g_(j+1) + ... + g_i``
(``j <= i``) and ``G_i = g_0 + ... + g_i``, the recurrence unrolls to

    (I + L) u = beta v - beta exp(G) K S,    L_ij = beta_i exp(D[i, j]) k_i.k_j   (j < i)
    o_i = exp(G_i) S^T q_i + sum_(j <= i) exp(D[i, j]) (q_i.k_j) u_j
    S_end = exp(G_last) S + sum_j exp(D[last, j]) k_j u_j^T

so ``u = U - W S`` with ``U, W`` from one triangular inverse that does not depend on S: all of it is
batched over chunks except the state carried from chunk to chunk (:func:`state_scan`, a loop over
chunks in torch, or a backend's kernels: kernels/triton/gdn_backward.py); o then comes for every chunk
at once from the states entering the chunks. ``D`` is
built by summing ``g`` forward from each row (never as a difference of prefix sums), so
``g = -inf`` gives decays of exactly 0 and no ``inf - inf``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hal.errors import InputError
from hal.kernels.oracle.gated_delta_rule import l2_normalize
from hal.kernels.oracle.gated_delta_rule import gated_delta_rule as recurrent
from hal.kernels.layout import gdn_from_padded as from_padded, gdn_to_padded as to_padded

C = 64  # rows per chunk
F32, F64 = torch.float32, torch.float64


def _prefix_sums(x):
    """Inclusive prefix sums along the last dim as a chain of adds (torch.cumsum is not
    deterministic on CUDA for floating point)."""
    cols = x.unbind(-1)  # (not x[..., i]: each select's backward would add a full-size zero gradient)
    acc = [cols[0]]
    for col in cols[1:]:
        acc.append(acc[-1] + col)
    return torch.stack(acc, -1)


def _expand_heads(x, hv: int):
    """[..., H, d] -> [..., HV, d], value head j reading head j // (HV / H), as an expand (whose
    backward is a sum; repeat_interleave's is not deterministic on CUDA)."""
    *lead, h, d = x.shape
    return x.unsqueeze(-2).expand(*lead, h, hv // h, d).reshape(*lead, hv, d)


def _unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower triangular L [..., n, n] (n a power of two), by 2 x 2 block
    recursion: [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], all diagonal blocks of a
    level at once: log2(n) levels of batched matmuls (torch's batched triangular solve makes one
    small LAPACK call per matrix on CPU: 0.2 s where a matmul of the same batch takes 1 ms)."""
    *lead, n, _ = L.shape
    inv = torch.ones((*lead, n, 1, 1), dtype=L.dtype, device=L.device)  # the 1 x 1 diagonal blocks
    b = 1
    while b < n:
        m = n // (2 * b)
        blocks = torch.diagonal(L.reshape(*lead, m, 2 * b, m, 2 * b), dim1=-4, dim2=-2).movedim(-1, -3)
        pair = inv.reshape(*lead, m, 2, b, b)
        a_inv, d_inv = pair.unbind(-3)
        low = -(d_inv @ blocks[..., b:, :b] @ a_inv)
        inv = torch.cat([torch.cat([a_inv, torch.zeros_like(a_inv)], -1), torch.cat([low, d_inv], -1)], -2)
        b *= 2
    return inv.reshape(*lead, n, n)


def _chunks(q, k, v, g, beta, S, scan=None):
    """The chunk form. q (scaled), k [N, HV, L, dk]; v [N, HV, L, dv]; g, beta [N, HV, L]; L % C == 0;
    S [N, HV, dk, dv]. Rows with g = beta = 0 are inert (no update, no decay). ``scan``: a
    :func:`state_scan` replacement (same arguments and results), or None for the torch loop.
    Returns (o, S_end)."""
    n, hv, length, dk = k.shape
    nc = length // C
    q, k, v = (x.reshape(n, hv, nc, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(n, hv, nc, C) for x in (g, beta))
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    later, below = ones.triu(1), ones.tril()  # [j, l]: l > j;  [i, j]: j <= i
    # R[.., j, i] = D[.., i, j]: for each j, g summed over l = j+1 .. i (prefix sums of the rows after
    # j; where, not a multiply by a mask, so that -inf stays -inf instead of becoming nan)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    R = _prefix_sums(torch.where(later, g.unsqueeze(-2), zero))
    decay = torch.where(below, R.transpose(-1, -2), torch.full((), float("-inf"), dtype=g.dtype,
                                                                 device=g.device)).exp()
    gamma = (g[..., :1] + R[..., 0, :]).exp()                    # exp(G_i): the start state's decay at row i
    tail = decay[..., C - 1, :]                                  # exp(D[last, j]): row j's decay to the chunk end
    kb = k * beta.unsqueeze(-1)
    lower = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    inv = _unit_lower_inverse(lower)
    U, W = inv @ (v * beta.unsqueeze(-1)), inv @ (kb * gamma.unsqueeze(-1))
    attn = (q @ k.transpose(-1, -2)) * decay                     # causal: decay is 0 above the diagonal
    qg = q * gamma.unsqueeze(-1)
    kt = (k * tail.unsqueeze(-1)).transpose(-1, -2)
    end = gamma[..., C - 1]
    u, starts, S = (scan or state_scan)(U, W, kt, end, S)
    o = qg @ starts + attn @ u                                   # every chunk at once, off the sequential path
    return o.reshape(n, hv, length, -1), S


def state_scan(U, W, kt, end, S0):
    """The only sequential part of the chunk form: the state carried across chunks.

    U [n, hv, nc, C, dv], W [n, hv, nc, C, dk], kt [n, hv, nc, dk, C], end [n, hv, nc] (each chunk's
    decay of its start state), S0 [n, hv, dk, dv]. Per chunk c, from S = S0:
    ``u_c = U_c - W_c S;  S <- end_c S + kt_c u_c``. Returns (u [n, hv, nc, C, dv], S_starts
    [n, hv, nc, dk, dv] (the state entering each chunk), S_end [n, hv, dk, dv]). This torch loop,
    differentiated by autograd, is the readable definition; a backend may offer a kernel for it
    (``gdn_state_scan``, e.g. kernels/triton/gdn_backward.py).
    """
    S, us, starts = S0, [], []
    # per-chunk pieces by unbind: its backward is one stack, where indexing chunk c of a tensor in
    # the loop would give a backward that adds a zero-filled full-size gradient per chunk
    for U_c, W_c, kt_c, end_c in zip(*(x.unbind(2) for x in (U, W, kt, end[..., None, None]))):
        starts.append(S)
        u = U_c - W_c @ S
        us.append(u)
        S = end_c * S + kt_c @ u
    return torch.stack(us, 2), torch.stack(starts, 2), S


def chunked_gated_delta_rule(q, k, v, g, beta, scale: float, S0=None, cu_seqlens: list[int] | None = None,
                             l2: bool = False, dtype=F32, scan=None):
    """Same arguments and results as the oracle's ``gated_delta_rule`` (o [B, T, HV, dv], final
    [N, HV, dk, dv] in ``dtype``), computed in the chunk form (``scan``: see :func:`_chunks`). Packed
    sequences (``cu_seqlens``) are padded into a batch, each starting its own chunk grid at its first token."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if l2:
        q, k = l2_normalize(q), l2_normalize(k)
    hv, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    q, k = _expand_heads(q, hv) * scale, _expand_heads(k, hv)
    xs = [to_padded(x, cu_seqlens) for x in (q, k, v, g, beta)]  # [N, Lmax, ...], zeros after each end
    n, lmax = xs[0].shape[:2]
    pad = -lmax % C  # inert rows (g = beta = 0) up to a whole chunk: the end state is unchanged
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in xs[:3])
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in xs[3:])
    S = torch.zeros((n, hv, dk, dv), dtype=dtype, device=v.device) if S0 is None else S0.to(dtype)
    o, S = _chunks(q, k, v, g, beta, S, scan)
    return from_padded(o[:, :, :lmax].transpose(1, 2), cu_seqlens), S


def start_state(parts, scale: float, dtype):
    """The state after the last consumed token, without gradient: a chunked-spec state object's
    boundary state advanced over its open rows (zero rows past ``position % C`` are inert)."""
    if parts.open_k is None:
        return parts.S.to(dtype)
    zq = torch.zeros_like(parts.open_k)
    with torch.no_grad():
        _, S = chunked_gated_delta_rule(zq, parts.open_k, parts.open_v, parts.open_g, parts.open_beta, scale,
                                        parts.S, None, False, dtype)
    return S


FORMS = ("chunked", "chunked-torch", "recurrent")


def form() -> str:
    """From ``LOCKSTEP_GDN_BACKWARD``: ``chunked`` (default; the chunk-state scan in the backend's kernels
    when it offers them), ``chunked-torch`` (the chunk form with the torch scan on every backend: the
    comparison row of benchmarks/gdn_backward.py) or ``recurrent`` (token by token)."""
    name = os.environ.get("LOCKSTEP_GDN_BACKWARD", "chunked")
    if name not in FORMS:
        raise InputError(f"LOCKSTEP_GDN_BACKWARD must be one of {', '.join(map(repr, FORMS))}, got {name!r}")
    return name


def backend_scan(impl):
    """The state scan to use with backend ``impl``: its ``gdn_state_scan`` (differentiable; None back
    for a shape or dtype it does not serve) when it has one, falling back to :func:`state_scan`."""
    offered = getattr(impl, "gdn_state_scan", None)
    if offered is None:
        return state_scan

    def scan(U, W, kt, end, S0):
        got = offered(U, W, kt, end, S0)
        return state_scan(U, W, kt, end, S0) if got is None else got
    return scan


def grads(inputs, S0, parts, scale: float, cu, l2: bool, do, dfinal, impl=None):
    """Gradients of (o, final) w.r.t. (q, k, v, g, beta, S0) for incoming (do, dfinal).

    ``inputs`` = the saved (q, k, v, g, beta); ``S0`` the bare initial state tensor (differentiated)
    or None, then the call began from the kernel ``parts`` (no gradient). ``impl``: the backend that
    ran the forward; its state-scan kernel, if any, runs the chunk form's sequential part. Computes in
    float32 (float64 for float64 inputs); returns six gradients in the inputs' dtypes (None for S0
    when not given).
    """
    acc = F64 if inputs[2].dtype == F64 else F32
    how = form()
    with torch.enable_grad():
        leaves = [x.detach().to(acc).requires_grad_(True) for x in inputs]
        s0 = S0.detach().to(acc).requires_grad_(True) if S0 is not None else start_state(parts, scale, acc)
        if how != "recurrent":
            scan = backend_scan(impl) if how == "chunked" else state_scan
            o, fin = chunked_gated_delta_rule(*leaves, scale, s0, cu, l2, acc, scan=scan)
        else:
            o, fin = recurrent(*leaves, scale, s0, cu, l2, acc)
        wrt = leaves + ([s0] if S0 is not None else [])
        got = torch.autograd.grad((o, fin), wrt, (do.to(acc), dfinal.to(acc)), allow_unused=True)
    out = [None if gr is None else gr.to(x.dtype) for gr, x in zip(got, (*inputs, S0))]
    return out + [None] * (6 - len(out))
