"""Exact matmul slice products as one Triton kernel: int8 ``tl.dot`` -> int32, any tile config, split-K.

Self-contained (imports triton; never imported by ``import hal``) so that a Triton backend can call
:func:`exact_linear_triton` / :func:`exact_matmul_triton`. Slicing and the final rounding are the
shared torch code of ``hal.kernels.exact.core`` (it runs on the tensors' device); the kernel
computes the wide accumulator limbs (hi, lo) of every output tile:

* for each slice pair (t, u) a K loop of int8 x int8 ``tl.dot`` with int32 accumulation (exact: a
  program never sums more than 131,072 products of |.| <= 127**2);
* the int32 sums are shifted into the int64 limbs (``core.combine``'s layout);
* programs of a split-K grid add their limbs with integer ``atomic_add`` (one split: a plain store) -- exact and
  associative, so the block sizes, the split count and the order the atomics land in cannot change
  a bit. Under ``TRITON_INTERPRET=1`` ``tl.dot`` is a numpy integer matmul, exact as well.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import core
from .prepared import unpack


@triton.jit
def _limbs_kernel(a_ptr, w_ptr, hi_ptr, lo_ptr, M, N, K, k_per_split,
                  sa_s, sa_m, sa_k, sw_s, sw_n, sw_k,
                  S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    hi = tl.zeros((BM, BN), dtype=tl.int64)
    lo = tl.zeros((BM, BN), dtype=tl.int64)
    for t in tl.static_range(S):
        for u in tl.static_range(S):
            acc = tl.zeros((BM, BN), dtype=tl.int32)
            for k0 in range(k_lo, k_hi, BK):
                rk = k0 + tl.arange(0, BK)
                km = rk < k_hi
                a = tl.load(a_ptr + t * sa_s + rm[:, None] * sa_m + rk[None, :] * sa_k,
                            mask=(rm[:, None] < M) & km[None, :], other=0)
                w = tl.load(w_ptr + u * sw_s + rk[:, None] * sw_k + rn[None, :] * sw_n,
                            mask=km[:, None] & (rn[None, :] < N), other=0)
                acc = tl.dot(a, w, acc, out_dtype=tl.int32)  # int8 x int8 -> int32 (Triton < 3.9 defaults to fp32)
            shift = DIGIT * (2 * S - 2 - t - u)
            if shift >= LIMB:
                hi += acc.to(tl.int64) * (1 << (shift - LIMB))
            else:
                lo += acc.to(tl.int64) * (1 << shift)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    if ATOMIC:  # several programs share this tile (split-K): integer adds, exact in any order
        tl.atomic_add(hi_ptr + offs, hi, mask=mask)
        tl.atomic_add(lo_ptr + offs, lo, mask=mask)
    else:
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)


def limbs(da: torch.Tensor, dw: torch.Tensor, block=(32, 32, 32), split_k: int = 1, **launch):
    """Digits da [s, M, K], dw [s, N, K] (int8) -> limbs (hi, lo) [M, N] int64 (core.combine's)."""
    s, m, k = da.shape
    n = dw.shape[1]
    bm, bn, bk = block
    hi = torch.zeros((m, n), dtype=torch.int64, device=da.device)
    lo = torch.zeros_like(hi)
    if 0 in (m, n, k):
        return hi, lo
    per = min(-(-k // split_k), core.INT32_SAFE_K)  # any split point; int32 sums stay exact
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, per))
    _limbs_kernel[grid](da, dw, hi, lo, m, n, k, per, *da.stride(), *dw.stride(),
                        S=s, DIGIT=core.DIGIT, LIMB=core.LIMB, BM=bm, BN=bn, BK=bk, ATOMIC=grid[2] > 1, **launch)
    return hi, lo


def exact_linear_triton(x: torch.Tensor, weight, bias: torch.Tensor | None, spec,
                        block=(32, 32, 32), split_k: int = 1, **launch) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) under an ExactMatmulSpec; the reference's bits.

    ``weight``: a tensor (sliced here) or a prepared ``ExactWeight`` (the kernel reads its int8
    planes through their strides); ``launch``: Triton launch options (num_warps, num_stages). No
    choice here changes a bit.
    """
    s = spec.slices
    w, sw = unpack(weight, spec)
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    core.check_k("x / a", x2.shape[-1])
    sa = core.slice_rows(x2, s)
    sw = sw if sw is not None else core.slice_rows(w, s)
    hi, lo = limbs(sa.digits, sw.digits, block, split_k, **launch)
    v = core.to_f64_odd(hi, lo, core.scale_exponent(sa.exp, sw.exp, s))
    flags = None if sa.finite and sw.finite else core.special_flags(x2, w)
    out = core.finish(v, flags, bias, x.dtype)
    return out.reshape(*x.shape[:-1], w.shape[0])


def exact_matmul_triton(a: torch.Tensor, b: torch.Tensor, spec, block=(32, 32, 32), split_k: int = 1):
    """a [..., M, K] @ b [K, N] under an ExactMatmulSpec."""
    return exact_linear_triton(a, b.transpose(0, 1), None, spec, block, split_k)
