"""Tensor-parallel linear layers on ``torch.distributed`` under the exact matmul policy.

With integer-exact accumulation the tensor-parallel degree cannot change a bit:

* ``row_parallel_linear`` (K sharded): the per-row and per-channel scales are agreed first (an
  all-reduce MAX of the shards' exponents), every rank slices its shard with them, computes its
  exact partial dot as two int64 limbs, and the limbs are all-reduced with SUM -- integer addition,
  exact in any order and any reduction tree. NaN/Inf flags are OR-ed the same way. Every rank then
  rounds the same integers once: TP = 1, 2, 4, ... give the bits of ``hal.linear(x, w, spec=...)``.
* ``column_parallel_linear`` (N sharded): each output channel needs only its own weight row and the
  whole x row, so the shards are independent; the optional all-gather only moves bits.

The stock alternative -- float32 partial sums all-reduced -- rounds differently for every degree
(tests/test_distributed_exact.py catches it). Slice products use ``torch._int_mm`` (CPU; pass
``products=`` for another device).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import InputError, SpecError
from .spec import ExactMatmulSpec
from .kernels.exact import core
from .kernels.exact.cpu import products_int_mm


def _check(x, weight, spec, name):
    if not isinstance(spec, ExactMatmulSpec):
        raise SpecError(f"{name}: spec must be an ExactMatmulSpec (the exact policy), got {spec!r}")
    if weight.dim() != 2:
        raise InputError(f"{name}: weight must be [N, K_shard], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise InputError(f"{name}: x.shape[-1] ({x.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]})")
    if x.dtype != weight.dtype or x.dtype not in core.DTYPES:
        raise InputError(f"{name}: x and weight must share one dtype of float32/bfloat16/float16, got "
                         f"{x.dtype} and {weight.dtype}")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ExactMatmulSpec,
                        group=None, products=products_int_mm) -> torch.Tensor:
    """x [..., K_r] @ weight [N, K_r]^T summed over the ranks' K shards (+ bias, added once) -> [..., N].

    Every rank gets the full result, bit-identical to the unsharded ``hal.linear`` under ``spec``.
    """
    _check(x, weight, spec, "row_parallel_linear")
    s = spec.slices
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    k_total = torch.tensor([x2.shape[1]], dtype=torch.int64)
    dist.all_reduce(k_total, group=group)
    core.check_k("row_parallel_linear: total K", int(k_total))
    ea = core.row_exponents(x2, keep_empty=True)
    ew = core.row_exponents(weight, keep_empty=True)
    both = torch.cat([ea, ew])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)     # one scale per row / channel on every rank
    ea, ew = core.settle_exponents(both[:ea.numel()]), core.settle_exponents(both[ea.numel():])
    sa, sw = core.slice_rows(x2, s, ea), core.slice_rows(weight, s, ew)
    hi, lo = core.combine(products(sa.digits, sw.digits), s)
    limbs = torch.stack([hi, lo])
    dist.all_reduce(limbs, group=group)                           # int64 sum: exact, any order
    flags = None if sa.finite and sw.finite else core.special_flags(x2, weight)
    f = torch.stack(flags).to(torch.int32) if flags is not None else torch.zeros((3, *hi.shape), dtype=torch.int32)
    dist.all_reduce(f, op=dist.ReduceOp.MAX, group=group)         # OR over the shards
    flags = (f[0] > 0, f[1] > 0, f[2] > 0) if bool(f.any()) else None
    v = core.to_f64_odd(limbs[0], limbs[1], core.scale_exponent(ea, ew, s))
    out = core.finish(v, flags, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ExactMatmulSpec,
                           group=None, gather: bool = True, products=products_int_mm) -> torch.Tensor:
    """x [..., K] @ weight [N_r, K]^T (+ bias [N_r]) on each rank; ``gather``: all ranks' outputs
    concatenated along the last dim in rank order (every rank's N_r must be equal)."""
    _check(x, weight, spec, "column_parallel_linear")
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    out = core.exact_linear(x2, weight, bias, spec.slices, products).reshape(*x.shape[:-1], weight.shape[0])
    if not gather:
        return out
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def stock_row_parallel_linear(x, weight, bias=None, group=None):
    """The usual row-parallel linear (float32 partials, all-reduce SUM, bias once): the negative control."""
    part = torch.nn.functional.linear(x.float(), weight.float())
    dist.all_reduce(part, group=group)
    if bias is not None:
        part = part + bias.float()
    return part.to(x.dtype)
