"""float64 oracle of attention: plain masked softmax(q k^T * scale) v in float64.

Same semantics as the spec (visibility, GQA, bottom-right alignment, empty rows -> 0 / -inf),
none of its tiling: the mathematical value the accuracy level A measures against. It also serves
float64 calls of the reference backend (gradcheck).
"""
from __future__ import annotations

import torch

from hal.kernels.layout import gather_kv, key_visibility, padded_to_varlen, query_positions, varlen_to_padded

F64 = torch.float64


def attend_padded(q, k, v, qlen, klen, scale: float, causal: bool, window):
    """q [b, Q, Hq, D], k, v [b, K, Hkv, D] -> out [b, Q, Hq, D] float64, lse [b, Q, Hq] float64."""
    bsz, n_q, hq, d = q.shape
    group = hq // k.shape[2]
    k64 = k.to(F64).repeat_interleave(group, dim=2)
    v64 = v.to(F64).repeat_interleave(group, dim=2)
    qpos, qvalid = query_positions(qlen, klen, n_q)
    vis = key_visibility(qpos, qvalid, klen, k.shape[1], causal, window).unsqueeze(2)  # [b, Q, 1, K]
    s = torch.einsum("bqhd,bkhd->bqhk", q.to(F64), k64) * scale
    s = torch.where(vis, s, float("-inf"))
    seen = vis.any(-1)
    m = torch.where(seen, s.amax(-1), 0.0)
    p = torch.where(vis, torch.exp(s - m.unsqueeze(-1)), 0.0)
    l = p.sum(-1)
    out = torch.einsum("bqhk,bkhd->bqhd", p, v64) / torch.where(seen, l, 1.0).unsqueeze(-1)
    lse = torch.where(seen, m + torch.log(l), float("-inf"))
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window):
    # pad to the real longest sequence (max_q / max_k may be generous upper bounds)
    max_q, max_k = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k))
    qp, qlen = varlen_to_padded(q, cu_q, max_q)
    kp, klen = varlen_to_padded(k, cu_k, max_k)
    vp, _ = varlen_to_padded(v, cu_k, max_k)
    out, lse = attend_padded(qp, kp, vp, qlen, klen, scale, causal, window)
    return (padded_to_varlen(out, cu_q, q.shape[0]),
            padded_to_varlen(lse, cu_q, q.shape[0], float("-inf")).transpose(0, 1).contiguous())


def flash_attn_with_kvcache(q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window):
    bsz, sq = q.shape[:2]
    max_k = int(seqlens_k.max()) if bsz else 0
    kp = gather_kv(k_cache, seqlens_k, block_table, max_k)
    vp = gather_kv(v_cache, seqlens_k, block_table, max_k)
    qlen = torch.full((bsz,), sq, dtype=torch.int64)
    out, lse = attend_padded(q, kp, vp, qlen, seqlens_k, scale, causal, window)
    return out, lse.transpose(1, 2).contiguous()
