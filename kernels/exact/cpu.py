"""Exact slice products with ``torch._int_mm`` (int8 x int8 -> int32, exact; VNNI/AMX on x86).

Backend-neutral host code: the reference's bits (``hal.kernels.exact.core`` does everything but the
products), any device where ``torch._int_mm`` runs. Two ways to the same integers:

* ``products_int_mm``: all s x s products are one GEMM, the s digit matrices of A stacked along M
  times those of W stacked along N (each weight plane read once: the fast one for few rows).
* ``diagonals_int_mm``: one GEMM per diagonal t + u, the pairs of a diagonal laid side by side along
  K, so the GEMM's int32 sum is the diagonal's sum and the combine has 2s - 1 terms instead of s²
  (s² int32 outputs fewer to widen and shift; each weight plane is read once per diagonal).

K is cut into pieces whose int32 sums cannot overflow (at most 131,072 int8 x int8 terms per GEMM
sum); the pieces are added in int64 (exact, any order). The cpu backend picks the way by shape
(kernels/cpu/exact_slice.py ``products``), and takes the diagonal GEMMs only once the probe
(kernels/exact/probe.py) admitted them on the machine.
"""
from __future__ import annotations

import torch

from .core import INT32_SAFE_K, exact_linear
from .prepared import unpack


def _operand(t: torch.Tensor) -> torch.Tensor:
    """A matrix ``torch._int_mm`` reads correctly. A column-major B ([sN, K] row-major, transposed)
    is its fast layout and needs no copy (an int8 transpose copy costs more than the product). A
    dimension of size 1 may carry any stride, and ``_int_mm`` on CPU then reads the wrong elements
    (seen at K = 1), so such a matrix is copied to canonical row-major strides."""
    if 1 in t.shape:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t


def products_int_mm(da: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    s, m, k = da.shape
    n = dw.shape[1]
    if 0 in (m, n, k):
        return torch.zeros((s, s, m, n), dtype=torch.int64, device=da.device)
    a = da.reshape(s * m, k)
    # [K, s*N], column-major; a row range of a prepared weight (a vocab tile, digit planes apart in
    # memory) is one GEMM per plane instead of a copy of the planes
    wts = [dw.reshape(s * n, k).T] if dw.is_contiguous() else [d.T for d in dw]
    p = None
    for k0 in range(0, k, INT32_SAFE_K):
        a_k = a[:, k0:k0 + INT32_SAFE_K]
        w_ks = [wt[k0:k0 + INT32_SAFE_K] for wt in wts]
        if k > INT32_SAFE_K:
            a_k, w_ks = a_k.contiguous(), [w_k.T.contiguous().T for w_k in w_ks]
        parts = [torch._int_mm(_operand(a_k), _operand(w_k)) for w_k in w_ks]
        part = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).to(torch.int64)
        p = part if p is None else p + part
    return p.reshape(s, m, s, n).permute(0, 2, 1, 3)


def diagonals_int_mm(da: torch.Tensor, dw: torch.Tensor, piece_k: int | None = None) -> torch.Tensor:
    """Diagonal sums q [2s - 1, M, N] (int64), q_d = sum over t + u = d of A_t @ W_u^T (core.combine takes them).

    Per K piece, A's planes are laid out reversed along K ([A_{s-1} | ... | A_0] per row) and W's in order
    ([W_0 | ... | W_{s-1}] per row); diagonal d is then one window of each, its pairs side by side, and one
    GEMM. A piece holds ``piece_k`` values per plane (default INT32_SAFE_K // s), so a diagonal's GEMM sums at
    most s x piece_k <= INT32_SAFE_K terms (``piece_k`` is a parameter for the probe's negative control).
    """
    s, m, k = da.shape
    n = dw.shape[1]
    q = torch.zeros((2 * s - 1, m, n), dtype=torch.int64, device=da.device)
    if 0 in (m, n, k):
        return q
    piece = piece_k or INT32_SAFE_K // s
    for k0 in range(0, k, piece):
        kk = min(piece, k - k0)
        a = torch.cat([da[t, :, k0:k0 + kk] for t in reversed(range(s))], 1)   # [M, s*kk]
        w = torch.cat([dw[u, :, k0:k0 + kk] for u in range(s)], 1)             # [N, s*kk]
        for d in range(2 * s - 1):
            t_lo, t_hi = max(0, d - s + 1), min(d, s - 1)
            a_d = a[:, (s - 1 - t_hi) * kk:(s - t_lo) * kk]        # A_t_hi ... A_t_lo
            w_d = w[:, (d - t_hi) * kk:(d - t_lo + 1) * kk].T      # W_(d - t_hi) ... W_(d - t_lo), column-major
            q[d] += torch._int_mm(_operand(a_d), _operand(w_d))
    return q


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None, spec, out_dtype: torch.dtype | None = None,
           slicer=None, products=products_int_mm) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias under an ExactMatmulSpec (``weight``: a tensor, sliced here, or
    a prepared ``ExactWeight``; ``out_dtype``: other than x's, e.g. float32 logits; ``slicer``: a
    compiled core.slice_rows; ``products``: either way above, or a chooser between them)."""
    w, w_sliced = unpack(weight, spec)
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    out = exact_linear(x2, w, bias, spec.slices, products, w_sliced, out_dtype, slicer)
    return out.reshape(*x.shape[:-1], w.shape[0])


def matmul(a: torch.Tensor, b: torch.Tensor, spec) -> torch.Tensor:
    return linear(a, b.transpose(0, 1), None, spec)
