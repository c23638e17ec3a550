"""Attention ops with flash-attn compatible signatures, computed under an AttentionSpec.

    out = hal.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal=True)                         # training / prefill
    out = hal.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                      block_table=table)                  # chunked prefill / decode

Both give the same bits for the same query at the same absolute position, whatever the call
cut, the cache layout or ``num_splits`` (see docs/attention.md).

The semantics every backend shares (which keys a query sees, the packed <-> padded moves) live in
kernels/layout.py (``hal.kernels.layout``), below both this module and the backends; re-exported here.
This module holds the ops and their autograd; the argument checks are in hal/attention_checks.py.
"""
from __future__ import annotations

import operator

import torch

from . import attention_checks as checks, validate as chk
from .errors import InputError
from .kernels.layout import (append_kv, capacity as cache_capacity, key_visibility, kvcache_via_padded,  # noqa: F401
                             mask_causal_window, padded_to_varlen, query_positions, token_slots, varlen_to_padded,
                             varlen_via_padded)
from .op_call import resolve
from .ops_registry import TORCH_OP, route, routing
from .spec import FAST, STRICT
from .torch_ops import HelperOp, OpBackward, OpRecord, TorchOp, register

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache", "key_visibility"]

_INT = (torch.int32, torch.int64)


# ------------------------------------------------------------------ varlen (autograd)


def _backward_math(q, k, v, cu_q, cu_k, scale, causal, window, gout, glse):
    """Gradients by ordinary torch math in float32 (float64 for float64 inputs), sequence by sequence.

    P is recomputed from the inputs: dV = P^T dO, dS = P * (dP - rowsum(P * dP) + dlse),
    dQ = scale dS K, dK = scale dS^T Q; GQA sums over the query heads sharing a kv head.
    Deterministic: fixed shapes, fixed loop order, no atomics.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    gq = torch.zeros(q.shape, dtype=acc, device=q.device)
    gk = torch.zeros(k.shape, dtype=acc, device=k.device)
    gv = torch.zeros(v.shape, dtype=acc, device=v.device)
    cq, ck = cu_q.cpu().tolist(), cu_k.cpu().tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qb = q[q0:q1].to(acc)
        kb = k[k0:k1].to(acc).repeat_interleave(group, dim=1)
        vb = v[k0:k1].to(acc).repeat_interleave(group, dim=1)
        go = gout[q0:q1].to(acc)
        qpos, qvalid = query_positions(torch.tensor([q1 - q0]), torch.tensor([k1 - k0]), q1 - q0)
        vis = key_visibility(qpos, qvalid, torch.tensor([k1 - k0]), k1 - k0, causal, window)[0].to(q.device)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        s = s.masked_fill(~vis, float("-inf"))
        any_vis = vis.any(-1)
        p = torch.softmax(torch.where(any_vis.reshape(1, -1, 1), s, 0.0), -1)
        p = torch.where(vis, p, 0.0)  # also zeroes fully masked rows
        dp = torch.einsum("qhd,khd->hqk", go, vb)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if glse is not None:
            ds = ds + p * glse[:, q0:q1].to(acc).unsqueeze(-1)
        gq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kb) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, qb) * scale
        dv = torch.einsum("hqk,qhd->khd", p, go)
        gk[k0:k1] = dk.reshape(k1 - k0, hkv, group, -1).sum(2)
        gv[k0:k1] = dv.reshape(k1 - k0, hkv, group, -1).sum(2)
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


class _VarlenFn(torch.autograd.Function):
    """Backward: the backend's ``flash_attn_varlen_backward`` kernels when it has them (triton), else
    :func:`_backward_math`. Neither is a spec: only the forward's bits are fixed; both are deterministic."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, s, impl):
        out, lse = impl.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, s)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.args = (scale, causal, window)
        ctx.maxes = (max_q, max_k)
        ctx.impl = impl
        return out, lse

    @staticmethod
    def backward(ctx, gout, glse):
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        if gout is None:
            gout = torch.zeros_like(q)
        kernels = getattr(ctx.impl, "flash_attn_varlen_backward", None)
        grads = None
        # double backward (create_graph) needs differentiable math: the torch backward then
        if kernels is not None and not torch.is_grad_enabled():  # None back: a case the kernels do not serve
            grads = kernels(q, k, v, out, lse, cu_q, cu_k, *ctx.maxes, *ctx.args, gout, glse)
        if grads is None:
            grads = _backward_math(q, k, v, cu_q, cu_k, *ctx.args, gout, glse)
        return (*grads, None, None, None, None, None, None, None, None, None)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), return_lse=False, *, dropout_p=0.0, softcap=0.0,
                           alibi_slopes=None, deterministic=True, return_attn_probs=False, spec=None, backend=None):
    """Attention over packed sequences: ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``.

    Sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; key positions count from 0 at its first key. With
    fewer queries than keys the queries are the last positions (bottom-right, as flash-attn).
    Returns ``out [total_q, Hq, D]`` (q's dtype), and with ``return_lse`` (or
    ``return_attn_probs``) also ``lse [Hq, total_q]`` float32. Query rows past cu_seqlens_q[-1]
    and queries that see no key get out 0 and lse -inf. Differentiable in q, k, v (and lse).
    ``deterministic`` is accepted for compatibility: lockstep always is.
    """
    if routing("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k) is TORCH_OP:
        checks.only_defaults(dropout_p=(dropout_p, lambda x: x == 0), softcap=(softcap, lambda x: x == 0),
                     alibi_slopes=(alibi_slopes, lambda x: x is None))
        out, lse = route("flash_attn_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, bool(causal), list(window_size), spec=spec, backend=backend)
        if return_attn_probs:
            return out, lse, None
        return (out, lse) if return_lse else out
    chk.tensor("q", q, ndim=3), chk.tensor("k", k, ndim=3), chk.tensor("v", v, ndim=3)
    dtype = chk.same_dtype(q=chk.floating("q", q), k=chk.floating("k", k), v=chk.floating("v", v))
    checks.kv_pair("k", k, "v", v)
    checks.head_counts(q.shape[1], k.shape[1])
    checks.head_dim(q.shape[2])
    chk.dim_eq("flash_attn_varlen_func: k head dim vs q head dim", k.shape[2], q.shape[2], "q, k, v must share head_dim")
    checks.only_defaults(dropout_p=(dropout_p, lambda x: x == 0), softcap=(softcap, lambda x: x == 0),
                 alibi_slopes=(alibi_slopes, lambda x: x is None))
    cq = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise InputError(f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}; "
                         "both describe the same batch")
    maxes = []
    for name, cu, given in (("max_seqlen_q", cq, max_seqlen_q), ("max_seqlen_k", ck, max_seqlen_k)):
        need = checks.longest(cu)
        try:
            got = operator.index(given)
        except TypeError:
            got = None
        if got is None or isinstance(given, bool) or got < need:
            raise InputError(f"{name} must be an int >= the longest sequence ({need}), got {given!r}")
        maxes.append(got)
    causal = bool(causal)
    window = checks.window(window_size)
    scale = checks.softmax_scale(softmax_scale, q.shape[2])
    s, impl = resolve("flash_attn_varlen_func", spec, backend, dtype, q=q, k=k, v=v,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, maxes[0], maxes[1], scale, causal, window, s)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _VarlenFn.apply(*args, impl)
    else:
        out, lse = impl.flash_attn_varlen_func(*args)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ kv cache


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=True, window_size=(-1, -1), num_splits=0, return_lse=False,
                            *, return_softmax_lse=False, rotary_cos=None, rotary_sin=None, cache_batch_idx=None,
                            cache_leftpad=None, softcap=0.0, alibi_slopes=None, spec=None, backend=None):
    """Attention of ``q [batch, Sq, Hq, D]`` against a KV cache, appending ``k, v [batch, Sk, Hkv, D]``.

    Cache: contiguous ``[batch, capacity, Hkv, D]``, or paged ``[num_pages, page_size, Hkv, D]``
    with ``block_table [batch, max_pages]`` (any page size). ``cache_seqlens`` (int or ``[batch]``
    ints; None = the whole capacity) tokens are already cached; ``k, v`` are written after them
    in place and the queries are the last Sq of the cache_seqlens + Sk keys (bottom-right).
    ``num_splits`` (0 = automatic) only sets how many KV splits run in parallel: never the bits.
    Every argument is checked before the cache is touched. Returns ``out [batch, Sq, Hq, D]`` and,
    with ``return_lse``, ``lse [batch, Hq, Sq]`` float32. No backward pass (inference op).
    """
    if routing("flash_attn_with_kvcache", q, k_cache, v_cache, k, v, cache_seqlens, block_table) is TORCH_OP:
        checks.only_defaults(rotary_cos=(rotary_cos, lambda x: x is None), rotary_sin=(rotary_sin, lambda x: x is None),
                     cache_batch_idx=(cache_batch_idx, lambda x: x is None),
                     cache_leftpad=(cache_leftpad, lambda x: x is None), softcap=(softcap, lambda x: x == 0),
                     alibi_slopes=(alibi_slopes, lambda x: x is None))
        checks.no_grad_needed("flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):  # a tensor crosses the op
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
        out, lse = route("flash_attn_with_kvcache", q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                         softmax_scale, bool(causal), list(window_size), num_splits, spec=spec, backend=backend)
        return (out, lse) if (return_lse or return_softmax_lse) else out
    call = plan_kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                             window_size, num_splits, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, softcap=softcap,
                             alibi_slopes=alibi_slopes, spec=spec, backend=backend)
    out, lse = call()
    return (out, lse) if (return_lse or return_softmax_lse) else out


def plan_kvcache_call(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                      softmax_scale=None, causal=True, window_size=(-1, -1), num_splits=0, *, rotary_cos=None,
                      rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, softcap=0.0, alibi_slopes=None,
                      spec=None, backend=None):
    """Check every argument of :func:`flash_attn_with_kvcache` and choose spec and backend, touching nothing.

    Returns a function of no arguments that appends k, v and runs the op, returning ``(out, lse)``.
    :class:`~hal.kv_cache.KVCache` plans a call against the block table it is about to have, so a
    call that would fail changes neither its pages nor its tensors.
    """
    chk.tensor("q", q, ndim=4), chk.tensor("k_cache", k_cache, ndim=4), chk.tensor("v_cache", v_cache, ndim=4)
    checks.kv_pair("k_cache", k_cache, "v_cache", v_cache)
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    if (k is None) != (v is None):
        raise InputError("pass both k and v (the new tokens to append) or neither")
    if k is not None:
        chk.tensor("k", k, ndim=4), chk.tensor("v", v, ndim=4)
        checks.kv_pair("k", k, "v", v)
        named.update(k=k, v=v)
    for n, t in named.items():
        chk.floating(n, t)
    dtype = chk.same_dtype(**named)
    checks.only_defaults(rotary_cos=(rotary_cos, lambda x: x is None), rotary_sin=(rotary_sin, lambda x: x is None),
                 cache_batch_idx=(cache_batch_idx, lambda x: x is None),
                 cache_leftpad=(cache_leftpad, lambda x: x is None), softcap=(softcap, lambda x: x == 0),
                 alibi_slopes=(alibi_slopes, lambda x: x is None))
    bsz, sq, hq, hd = q.shape
    hkv = k_cache.shape[2]
    checks.head_counts(hq, hkv)
    checks.head_dim(hd)
    chk.dim_eq("flash_attn_with_kvcache: k_cache head dim vs q head dim", k_cache.shape[3], hd)
    if k is not None:
        if k.shape[0] != bsz or k.shape[2] != hkv or k.shape[3] != hd:
            raise InputError(f"k and v must be [batch={bsz}, seqlen_new, Hkv={hkv}, D={hd}], got {tuple(k.shape)}")
    tensors = dict(named)
    if block_table is not None:
        chk.tensor("block_table", block_table, ndim=2)
        chk.integer("block_table", block_table)
        if block_table.shape[0] != bsz:
            raise InputError(f"block_table has {block_table.shape[0]} rows but q has batch {bsz}; one row per sequence")
        tensors["block_table"] = block_table
    elif k_cache.shape[0] != bsz:
        raise InputError(f"contiguous k_cache has batch {k_cache.shape[0]} but q has batch {bsz} "
                         "(cache_batch_idx is not supported; index the cache rows yourself)")
    cap = cache_capacity(k_cache, block_table)
    if cache_seqlens is None:
        seqlens = torch.full((bsz,), cap, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((bsz,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        chk.tensor("cache_seqlens", cache_seqlens, ndim=1)
        chk.integer("cache_seqlens", cache_seqlens)
        if cache_seqlens.shape[0] != bsz:
            raise InputError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, q has batch {bsz}")
        seqlens = cache_seqlens
        tensors["cache_seqlens"] = cache_seqlens
    n_new = 0 if k is None else int(k.shape[1])
    lens = seqlens.detach().cpu().to(torch.int64)
    if bool((lens < 0).any()):
        raise InputError(f"cache_seqlens must be >= 0, got {lens.tolist()}")
    after = lens + n_new
    if bool((after > cap).any()):
        b = int((after > cap).nonzero()[0, 0])
        where = "k_cache.shape[1]" if block_table is None else f"block_table.shape[1] * page_size = {block_table.shape[1]} * {k_cache.shape[1]}"
        raise InputError(f"cache too small: sequence {b} needs {int(after[b])} slots ({int(lens[b])} cached + {n_new} "
                         f"new) but holds {cap} ({where}); allocate a larger cache")
    if block_table is not None:
        checks.pages(block_table, after, lens, n_new, k_cache)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InputError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    checks.no_grad_needed("flash_attn_with_kvcache", **named)
    causal = bool(causal)
    window = checks.window(window_size)
    scale = checks.softmax_scale(softmax_scale, hd)
    s, impl = resolve("flash_attn_with_kvcache", spec, backend, dtype, **tensors)

    def run():
        # Everything is valid and a backend is chosen: only now touch the cache.
        if k is not None:
            append_kv(k_cache, v_cache, k, v, seqlens, block_table)
        seqlens_k = (seqlens.to(torch.int64) + n_new).to(q.device)
        return impl.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                            num_splits, s)
    return run


# ---------------------------------------------------------------- the records (hal/torch_ops.py derives every table)
# The varlen backward is an op too: its math reads cu_seqlens on the host (sequence by sequence), so under AOT
# autograd it must stay opaque. flash_attn_with_kvcache writes its caches and takes no gradient (its public
# function refuses inputs that require one).


def _varlen_backward_kernel(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, gout, glse, spec,
                            backend):
    """_VarlenFn.backward with the backend chosen now (as the forward kernel chose its own)."""
    from types import SimpleNamespace
    _, impl = resolve("flash_attn_varlen_func", spec, backend, q.dtype, q=q, k=k, v=v, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k)
    ctx = SimpleNamespace(saved_tensors=(q, k, v, cu_q, cu_k, out, lse), args=(scale, causal, tuple(window)),
                          maxes=(max_q, max_k), impl=impl)
    with torch.no_grad():
        gq, gk, gv = _VarlenFn.backward(ctx, gout, glse)[:3]
    return gq.contiguous(), gk.contiguous(), gv.contiguous()


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window, spec, backend = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.rest = (max_q, max_k, checks.softmax_scale(softmax_scale, q.shape[2]), bool(causal),
                list(checks.window(window)), spec, backend)


def _varlen_backward(ctx, gout, glse):
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    max_q, max_k, scale, causal, window, spec, backend = ctx.rest
    if gout is None:
        gout = torch.zeros_like(out)
    gq, gk, gv = torch.ops.lockstep.flash_attn_varlen_backward(
        q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, gout, glse, spec, backend)
    return gq, gk, gv, *[None] * 9


_VARLEN_BACKWARD = HelperOp(
    "flash_attn_varlen_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, bool causal, SymInt[] window_size, "
    "Tensor gout, Tensor? glse, str? spec, str? backend) -> (Tensor, Tensor, Tensor)",
    _varlen_backward_kernel, lambda q, k, v, *rest: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))


class _Contract:
    """The backend methods (hal/backend_contract.py): hal calls them with validated tensors and the resolved spec."""

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        """``(out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] float32)`` over packed sequences (cu_* as lists)."""

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        """``(out, lse)`` of q [B, Sq, Hq, D] over the cached keys (already appended by hal)."""


_SUITES = (("attention", (STRICT,)), ("attention_fast", (FAST,)))

# lse is always returned by the torch ops (the public op drops it unless asked); max_seqlen as SymInt
register(OpRecord("flash_attn_varlen_func", "attention", contract=_Contract.flash_attn_varlen_func, suites=_SUITES,
                  torch_ops=(TorchOp(
    "flash_attn_varlen", None, flash_attn_varlen_func,
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt[] window_size", "(Tensor, Tensor)",
    fixed=(("return_lse", True),),
    fake=lambda q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, spec, backend: (
        q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)),
    backward=OpBackward(_VARLEN_BACKWARD, _varlen_setup, _varlen_backward)),)))

# appends k, v into the caches in place: the schema says so (a!), (b!)
register(OpRecord("flash_attn_with_kvcache", "attention", contract=_Contract.flash_attn_with_kvcache, suites=_SUITES,
                  torch_ops=(TorchOp(
    "flash_attn_with_kvcache", None, flash_attn_with_kvcache,
    "Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
    "Tensor? block_table, float? softmax_scale, bool causal, SymInt[] window_size, int num_splits",
    "(Tensor, Tensor)", fixed=(("return_lse", True),),
    fake=lambda q, k_cache, v_cache, *rest: (q.new_empty((*q.shape[:3], v_cache.shape[-1])),
                                             q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))),)))
