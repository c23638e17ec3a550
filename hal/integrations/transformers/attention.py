"""The "lockstep" attention function and mask function for transformers' AttentionInterface.

HF hands an attention function padded tensors (``query [B, Hq, Tq, D]``, keys already joined with
the cache) plus a mask. lockstep's attention is defined per *sequence*: a query at position p of
its sequence sees keys 0..p of that sequence and the tile grid starts at the sequence's first key.
So this function turns whatever HF passes into sequences:

1. the keys each query row may see (``visibility``): the 4-D mask, intersected with packing read
   from ``cu_seq_lens_q/k`` or from ``position_ids`` resets (stock eager/sdpa ignore the latter when
   a cache is in use and let packed sequences see each other);
2. each query's visible keys must be one contiguous run ``[s, e]`` (padding, packing and causality
   all give that; anything else raises);
3. consecutive queries of one row with the same ``s`` and ``e`` growing by one form a sequence,
   handed to :func:`hal.flash_attn_varlen_func` with the query rows bottom-right aligned.

A query then gets the same bits whether its sequence was alone, padded left or right, packed with
others, or fed one token at a time from a cache (the op's L1/L2 guarantees).
"""
from __future__ import annotations

import torch

from ...attention import flash_attn_varlen_func
from ... import attention_checks
from ...errors import InputError, UnsupportedError
from ...ops_registry import TORCH_OP, route, routing
from ...torch_ops import HelperOp, OpBackward, TorchOp, register

NAME = "lockstep"


def mask_function(*args, **kwargs):
    """Mask interface entry: always a 4-D bool mask (never None, never the sdpa is_causal shortcut).

    Without a registered mask function HF passes ``None`` for padded batches; generate also only
    forwards 4-D masks for compileable caches. sdpa's builder with both skips disabled gives a
    ``[B, 1, Tq, Tk]`` bool mask that includes padding, causality and HF's own packing detection.
    """
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _mask_to_bool(mask: torch.Tensor, B: int, Tq: int, Tk: int) -> torch.Tensor:
    if mask.dim() != 4:
        raise UnsupportedError(f"lockstep attention needs a 4-D attention mask [B, 1, Tq, Tk]; got {mask.dim()}-D "
                               "(register lockstep's mask function: hal.integrations.transformers.register())")
    if mask.dtype == torch.bool:
        vis = mask
    elif mask.is_floating_point():
        # additive masks (eager style): 0 = visible, a huge negative number or -inf = masked; any other
        # value is a bias lockstep's attention does not apply
        lo = torch.finfo(mask.dtype).min / 2
        if bool(((mask != 0) & (mask > lo)).any()):
            raise UnsupportedError("the attention mask carries an additive bias (values other than 0 and -inf); "
                                   "lockstep attention supports visibility masks only")
        vis = mask == 0
    else:
        raise UnsupportedError(f"attention mask dtype {mask.dtype} is not supported (bool or float)")
    if vis.shape[-2:] != (Tq, Tk) or vis.shape[0] not in (1, B):
        raise UnsupportedError(f"attention mask shape {tuple(mask.shape)} does not match queries/keys "
                               f"[B={B}, 1, Tq={Tq}, Tk={Tk}]")
    if vis.shape[1] != 1:
        if bool((vis != vis[:, :1]).any()):
            raise UnsupportedError("per-head attention masks are not supported (the mask differs across heads)")
    return vis[:, 0].expand(B, Tq, Tk).to("cpu")


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, T] sequence ids within each row: a new sequence starts where position != previous + 1."""
    p = position_ids.to("cpu", torch.int64)
    start = torch.ones_like(p, dtype=torch.bool)
    start[:, 1:] = p[:, 1:] != p[:, :-1] + 1
    return start.cumsum(-1)


def segments_from_cu(cu: torch.Tensor, T: int, name: str) -> torch.Tensor:
    c = cu.to("cpu", torch.int64)
    if c.dim() != 1 or int(c[0]) != 0 or int(c[-1]) != T or bool((c[1:] < c[:-1]).any()):
        raise InputError(f"{name} must be [0, ..., {T}] non-decreasing cumulative lengths, got {c.tolist()}")
    ids = torch.zeros(T, dtype=torch.int64)
    ids[c[1:-1]] += 1  # (empty sequences add nothing visible)
    return ids.cumsum(0).reshape(1, T)


def visibility(B: int, Tq: int, Tk: int, attention_mask, position_ids=None, cu_seq_lens_q=None,
               cu_seq_lens_k=None, causal: bool = True) -> torch.Tensor:
    """bool [B, Tq, Tk] (CPU): key j is visible to query row i of batch row b."""
    if attention_mask is not None:
        vis = _mask_to_bool(attention_mask, B, Tq, Tk)
    else:
        i = torch.arange(Tq).reshape(-1, 1) + (Tk - Tq)  # bottom-right, as with a cache
        j = torch.arange(Tk).reshape(1, -1)
        vis = ((j <= i) if causal else torch.ones(Tq, Tk, dtype=torch.bool)).expand(B, Tq, Tk)
    seg_q = seg_k = None
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if B != 1:
            raise InputError(f"cu_seq_lens_q/k describe packed sequences in one row; got batch {B}")
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise InputError("pass both cu_seq_lens_q and cu_seq_lens_k")
        if Tq != Tk:
            raise UnsupportedError("packed sequences (cu_seq_lens_q/k) together with cached keys are not supported")
        seg_q = segments_from_cu(cu_seq_lens_q, Tq, "cu_seq_lens_q")
        seg_k = segments_from_cu(cu_seq_lens_k, Tk, "cu_seq_lens_k")
    elif position_ids is not None and Tq == Tk and Tq > 1:
        if position_ids.dim() != 2 or position_ids.shape[-1] != Tq or position_ids.shape[0] not in (1, B):
            raise UnsupportedError(f"position_ids of shape {tuple(position_ids.shape)} are not supported "
                                   f"(expected [B or 1, {Tq}])")
        seg_q = seg_k = segments_from_positions(position_ids).expand(B, Tq)
    if seg_q is not None:
        vis = vis & (seg_q.unsqueeze(-1) == seg_k.unsqueeze(-2))
    return vis


def plan(vis: torch.Tensor):
    """From visibility to sequences: (bq, iq, bk, jk, cu_q, cu_k, max_q, max_k) index tensors.

    Raises if some query sees a key set with holes (not expressible as one sequence).
    """
    B, Tq, Tk = vis.shape
    cnt = vis.sum(-1)
    j = torch.arange(Tk)
    big = torch.full_like(vis, Tk, dtype=torch.int64)
    s = torch.where(vis, j, big).amin(-1)
    e = torch.where(vis, j, -1).amax(-1)
    holes = (cnt > 0) & (cnt != e - s + 1)
    if bool(holes.any()):
        b, i = (int(x) for x in holes.nonzero()[0])
        raise UnsupportedError(f"attention mask row (batch {b}, query {i}) sees keys with gaps; lockstep attention "
                               "needs each query's visible keys to be one contiguous run (padding, packing, causal)")
    rows = []  # (b, i0, i1, s, e_last)
    S, E, C = s.tolist(), e.tolist(), cnt.tolist()
    for b in range(B):
        cur = None
        for i in range(Tq):
            if C[b][i] == 0:
                cur = None
                continue
            if cur is not None and S[b][i] == cur[3] and E[b][i] == cur[4] + 1:
                cur[2], cur[4] = i + 1, E[b][i]
            else:
                cur = [b, i, i + 1, S[b][i], E[b][i]]
                rows.append(cur)
    if not rows:
        return None
    bq = torch.cat([torch.full((r[2] - r[1],), r[0]) for r in rows])
    iq = torch.cat([torch.arange(r[1], r[2]) for r in rows])
    bk = torch.cat([torch.full((r[4] - r[3] + 1,), r[0]) for r in rows])
    jk = torch.cat([torch.arange(r[3], r[4] + 1) for r in rows])
    lq = torch.tensor([r[2] - r[1] for r in rows])
    lk = torch.tensor([r[4] - r[3] + 1 for r in rows])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32)
    if bool((lq > lk).any()):  # cannot happen for causal masks; a safety net for exotic ones
        raise UnsupportedError("a sequence has more queries than visible keys; not expressible bottom-right")
    return bq, iq, bk, jk, cu_q, cu_k, int(lq.max()), int(lk.max())


def check_attention_args(dropout=0.0, sliding_window=None, softcap=None, s_aux=None) -> None:
    if dropout:
        raise UnsupportedError(f"attention dropout ({dropout}) is not supported by lockstep attention "
                               "(set config.attention_dropout = 0 or use model.eval())")
    if sliding_window is not None:
        raise UnsupportedError("sliding-window attention is not supported by lockstep's transformers integration "
                               "(sliding-window caches evict keys; refusing rather than computing different bits)")
    if softcap is not None or s_aux is not None:
        raise UnsupportedError("attention softcap / sink logits (s_aux) are not supported by lockstep attention")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers AttentionInterface function: returns ``(out [B, Tq, Hq, D], None)``."""
    check_attention_args(dropout, sliding_window, softcap, s_aux)
    B, Hq, Tq, D = query.shape
    causal = bool(getattr(module, "is_causal", True))
    return masked_attention(query, key, value, attention_mask, kwargs.get("position_ids"),
                            kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), causal, scaling), None


def masked_attention(query, key, value, attention_mask=None, position_ids=None, cu_seq_lens_q=None,
                     cu_seq_lens_k=None, causal=True, scaling=None, spec=None, backend=None, return_lse=False):
    """:func:`visibility` then :func:`attend`. Under torch.compile / export one ``torch.ops.lockstep.hf_attention``
    (the plan reads the mask's values on the host: inside the op's kernel, never in the traced graph); its
    backward is ``torch.ops.lockstep.hf_attention_backward`` (:func:`attend_backward`), the eager grads' bits."""
    if routing("hf_attention", query, key, value, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k) is TORCH_OP:
        out, lse = route("hf_attention", query, key, value, attention_mask, position_ids, cu_seq_lens_q,
                         cu_seq_lens_k, bool(causal), scaling, spec=spec, backend=backend)
        return (out, lse) if return_lse else out
    vis = visibility(query.shape[0], query.shape[2], key.shape[2], attention_mask, position_ids, cu_seq_lens_q,
                     cu_seq_lens_k, causal)
    return attend(query, key, value, vis, scaling, spec=spec, backend=backend, return_lse=return_lse)


def several_sequences_per_row(vis: torch.Tensor) -> bool:
    """True when some batch row holds queries of different sequences (visible key runs starting apart)."""
    cnt = vis.sum(-1)
    j = torch.arange(vis.shape[-1])
    s = torch.where(vis, j, vis.shape[-1]).amin(-1)
    lo = torch.where(cnt > 0, s, vis.shape[-1] + 1).amin(-1)
    hi = torch.where(cnt > 0, s, -1).amax(-1)
    return bool(((hi >= 0) & (hi != lo)).any())


class _Rows:
    """A plan's index tensors on the queries' device: query rows (bq, iq) and key rows (bk, jk) of the
    packed sequences, their cu_seqlens and longest lengths."""

    def __init__(self, p, device):
        bq, iq, bk, jk, cu_q, cu_k, self.max_q, self.max_k = p
        self.q, self.k = (bq.to(device), iq.to(device)), (bk.to(device), jk.to(device))
        self.cu_q, self.cu_k = cu_q.to(device), cu_k.to(device)

    def packed(self, query, key, value):
        """``[B, H, T, D]`` HF tensors -> the packed ``[total, H, D]`` rows of the plan's sequences."""
        kt, vt = key.transpose(1, 2), value.transpose(1, 2)
        return query.transpose(1, 2)[self.q], kt[self.k], vt[self.k]


def attend(query, key, value, vis, scaling, spec=None, backend=None, return_lse=False):
    """``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tk, D]``, visibility [B, Tq, Tk] -> ``[B, Tq, Hq, Dv]``
    (and with ``return_lse`` the float32 ``lse [B, Tq, Hq]``, -inf where a query sees no key)."""
    B, Hq, Tq, D = query.shape
    out = query.new_zeros((B, Tq, Hq, value.shape[-1]))
    lse = query.new_full((B, Tq, Hq), float("-inf"), dtype=torch.float32) if return_lse else None
    p = plan(vis)
    if p is not None:
        rows = _Rows(p, query.device)
        o, lse_rows = flash_attn_varlen_func(*rows.packed(query, key, value), rows.cu_q, rows.cu_k, rows.max_q,
                                             rows.max_k, softmax_scale=scaling, causal=True, return_lse=True,
                                             spec=spec, backend=backend)
        out = out.index_put(rows.q, o)
        if return_lse:
            lse = lse.index_put(rows.q, lse_rows.t())
    return (out, lse) if return_lse else out


def attend_backward(query, key, value, vis, scaling, out, lse, gout, glse=None, spec=None, backend=None):
    """The gradients of :func:`attend` (query, key, value), bit for bit what eager autograd gives.

    Eager autograd runs: the output scatter's backward (a gather of ``gout``), varlen attention's backward
    (``torch.ops.lockstep.flash_attn_varlen_backward``: the op's own, with a zero lse gradient when lse
    was not used, as autograd materialises it), then the packing gathers' backward (zeros, index_put with
    accumulate). ``out``, ``lse``: :func:`attend`'s outputs (with ``return_lse``)."""
    p = plan(vis)
    if p is None:
        return tuple(_unpacked(None, t, None) for t in (query, key, value))
    rows = _Rows(p, query.device)
    q, k, v = rows.packed(query, key, value)
    lse_rows = lse[rows.q].t()
    glse_rows = torch.zeros_like(lse_rows) if glse is None else glse[rows.q].t()
    gq, gk, gv = torch.ops.lockstep.flash_attn_varlen_backward(
        q, k, v, out[rows.q], lse_rows.contiguous(), rows.cu_q, rows.cu_k, rows.max_q, rows.max_k,
        attention_checks.softmax_scale(scaling, query.shape[-1]), True, [-1, -1], gout[rows.q], glse_rows.contiguous(),
        spec, backend)
    return _unpacked(gq, query, rows.q), _unpacked(gk, key, rows.k), _unpacked(gv, value, rows.k)


def _unpacked(g, like, index):
    """Packed rows' gradient ``g [total, H, D]`` -> ``like``'s ``[B, H, T, D]``: summed into zeros laid out
    ``[B, T, H, D]`` as eager's index backward does (the gathers index the ``transpose(1, 2)`` view), so
    the same strides reach the later backward kernels."""
    b, h, t, d = like.shape
    full = like.new_zeros((b, t, h, d))
    if g is not None:
        full.index_put_(index, g, accumulate=True)
    return full.transpose(1, 2)


# ---------------------------------------------------------------- the integration's own torch ops
# The patched attention as one torch op (hal/torch_ops.py register): mask / positions -> sequences (a plan that reads
# values) + varlen attention inside one kernel, so that a traced model holds no data-dependent host code. lse
# [B, Tq, Hq] is returned for the backward op, which plans again (host values) and runs attend_backward.


def _backward_kernel(query, key, value, attention_mask, position_ids, cu_q, cu_k, causal, scaling, out, lse, gout,
                     glse, spec, backend):
    vis = visibility(query.shape[0], query.shape[2], key.shape[2], attention_mask, position_ids, cu_q, cu_k, causal)
    with torch.no_grad():
        return attend_backward(query, key, value, vis, scaling, out, lse, gout, glse, spec=spec, backend=backend)


def _fake_backward(query, key, value, *rest):
    """The real kernel's layout: [B, H, T, D] views of [B, T, H, D] buffers (as eager's gradients)."""
    return tuple(t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2)
                 for t in (query, key, value))


def _setup(ctx, inputs, output):
    query, key, value, *masks, causal, scaling, spec, backend = inputs
    ctx.save_for_backward(query, key, value, *masks, *output)
    ctx.rest = (bool(causal), scaling, spec, backend)


def _backward(ctx, gout, glse):
    query, key, value, mask, positions, cu_q, cu_k, out, lse = ctx.saved_tensors
    causal, scaling, spec, backend = ctx.rest
    if gout is None:
        gout = torch.zeros_like(out)
    grads = torch.ops.lockstep.hf_attention_backward(
        query, key, value, mask, positions, cu_q, cu_k, causal, scaling, out, lse, gout, glse, spec, backend)
    return *grads, *[None] * 8


register(TorchOp(
    "hf_attention", "flash_attn_varlen_func", masked_attention,
    "Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? position_ids, Tensor? cu_seq_lens_q, "
    "Tensor? cu_seq_lens_k, bool causal, float? scaling", "(Tensor, Tensor)", fixed=(("return_lse", True),),
    fake=lambda query, key, value, *rest: (query.new_empty((query.shape[0], query.shape[2], query.shape[1],
                                                            value.shape[-1])),
                                           query.new_empty((query.shape[0], query.shape[2], query.shape[1]),
                                                           dtype=torch.float32)),
    backward=OpBackward(HelperOp(
        "hf_attention_backward(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? position_ids, "
        "Tensor? cu_seq_lens_q, Tensor? cu_seq_lens_k, bool causal, float? scaling, Tensor out, Tensor lse, "
        "Tensor gout, Tensor? glse, str? spec, str? backend) -> (Tensor, Tensor, Tensor)",
        _backward_kernel, _fake_backward), _setup, _backward)))
