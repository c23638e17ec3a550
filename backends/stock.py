"""The stock backend: torch's own ops, ignoring the spec's tiling and math.

It is the conformance suite's negative control. It serves every spec so the suite can run it
through the same checks, claims no level, and is never chosen automatically. The suite must
report where it diverges (batch invariance of ``F.linear`` on CPU, golden bits, ...); tests
assert that it does, which proves the checks can fail.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.backend import Backend
from hal.spec import EXACT, FAST, STRICT


class StockBackend(Backend):
    name = "stock"
    device_types = ("cpu", "cuda", "npu", "xpu", "mps")
    priority = -100
    auto = False
    policies = (STRICT, FAST, EXACT)
    description = "torch's own ops (negative control; claims no level)"

    def matmul(self, a, b, spec):
        return torch.matmul(a, b)

    def linear(self, x, weight, bias, spec):
        return F.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual, spec):
        h = x if residual is None else x + residual
        y = F.rms_norm(h, (h.shape[-1],), weight.to(h.dtype), eps)
        return y if residual is None else (y, h)

    def softmax(self, x, spec):
        return torch.softmax(x, -1)

    def log_softmax(self, x, spec):
        return torch.log_softmax(x, -1)

    def logsumexp(self, x, spec):
        return torch.logsumexp(x, -1)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        logits = F.linear(hidden.float(), weight.float()) / temperature
        if tokens.ndim == hidden.ndim:  # [N, K]: K tokens of each row
            return torch.log_softmax(logits, -1).gather(-1, tokens.long())
        return torch.log_softmax(logits, -1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)

    # torch's scaled_dot_product_attention, one call per sequence, the way an eager engine would
    # call it: is_causal for a full causal prefill, no mask when every key is visible (decode),
    # a boolean mask otherwise. On CPU its bits depend on the query length (prefill vs decode).
    def _sdpa(self, q, k, v, qlen, klen, scale, causal, window):
        from hal.kernels.layout import key_visibility, query_positions
        nq, nk = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        qpos, qvalid = query_positions(torch.tensor([qlen]), torch.tensor([klen]), nq)
        vis = key_visibility(qpos, qvalid, torch.tensor([klen]), nk, causal, window)[0].to(q.device)
        qt = q.transpose(0, 1).unsqueeze(0)
        kt = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vt = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        if bool(vis.all()):
            o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        elif causal and nq == nk and window == (-1, -1):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=vis, scale=scale)
        seen = vis.any(-1)
        o = torch.where(seen.reshape(1, 1, -1, 1), o, 0.0)[0].transpose(0, 1)
        sc = torch.einsum("hqd,hkd->hqk", qt[0].float(), kt[0].float()) * scale
        lse = torch.logsumexp(torch.where(vis, sc, float("-inf")), -1)
        return o, torch.where(seen, lse, float("-inf"))

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for b in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
            if q1 > q0 and k1 > k0:
                out[q0:q1], lse[:, q0:q1] = self._sdpa(q[q0:q1], k[k0:k1], v[k0:k1], q1 - q0, k1 - k0, scale,
                                                       causal, window)
        return out, lse

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        from hal.kernels.layout import gather_kv
        bsz, sq = q.shape[:2]
        out = torch.zeros_like(q)
        lse = torch.full((bsz, q.shape[2], sq), float("-inf"), dtype=torch.float32, device=q.device)
        max_k = int(seqlens_k.max()) if bsz else 0
        kp = gather_kv(k_cache, seqlens_k, block_table, max_k)
        vp = gather_kv(v_cache, seqlens_k, block_table, max_k)
        for b in range(bsz):
            n = int(seqlens_k[b])
            if n:
                out[b], lse[b] = self._sdpa(q[b], kp[b, :n], vp[b, :n], sq, n, scale, causal, window)
        return out, lse

    # transformers' Qwen3-Next reference functions: the chunk form restarts its chunk grid at every
    # call and continues from the bare final state; the recurrent form is token by token.
    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        if op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
            try:
                import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401
            except Exception as e:  # not installed, or too old to have Qwen3-Next
                reasons.append(f"stock: {op} runs transformers' Qwen3-Next reference functions, which cannot be "
                               f"imported here ({type(e).__name__}: {e}); pip install 'transformers>=4.57'")
        return reasons

    def _hf_gdn(self, fn, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        from transformers.models.qwen3_next import modeling_qwen3_next as hf
        from hal.kernels.layout import Parts
        # transformers always scales by d_k ** -0.5; o is linear in the scaled query, so another
        # scale is applied to q (no in-kernel norm) or to o (with it), in float32
        ratio = scale / (q.shape[-1] ** -0.5)
        q = q.float() if l2 or ratio == 1.0 else q.float() * ratio
        s0 = state.final if state.final is not None else state.S
        cu = cu_seqlens or [0, q.shape[1]]
        rows = [slice(None)] if cu_seqlens is None else [slice(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
        outs, finals = [], []
        for i, r in enumerate(rows):
            s_i = s0 if cu_seqlens is None else s0[i: i + 1]
            o, f = getattr(hf, fn)(q[:, r], k[:, r], v[:, r], g=g[:, r], beta=beta[:, r], initial_state=s_i,
                                   output_final_state=True, use_qk_l2norm_in_kernel=l2)
            outs.append((o * ratio if l2 and ratio != 1.0 else o).to(v.dtype))
            finals.append(f)
        fin = torch.cat(finals)
        n = fin.shape[0]
        lengths = torch.full((n,), q.shape[1]) if cu_seqlens is None else torch.tensor([cu[i + 1] - cu[i] for i in range(n)])
        return torch.cat(outs, 1), Parts(state.position + lengths, fin, None, None, None, None, fin)

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        return self._hf_gdn("torch_chunk_gated_delta_rule", q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                            want_final)

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        return self._hf_gdn("torch_recurrent_gated_delta_rule", q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                            want_final)

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b.float())

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        # What an eager engine does: F.conv1d (depthwise, groups = channels) over the previous K-1
        # inputs followed by this call's, then F.silu, in x's dtype.
        from hal.kernels.oracle.gated_delta_rule import conv_windows
        w = weight.to(x.dtype).unsqueeze(1)
        b = None if bias is None else bias.to(x.dtype)

        def one(rows, n):
            y = F.conv1d(rows.t().unsqueeze(0), w, b, groups=rows.shape[-1])[0].t()
            return F.silu(y) if activation == "silu" else y
        return conv_windows(x, conv_state, weight.shape[1], cu_seqlens, one)

    # What an eager model does: torch's activations, and HF's rotary (float32 tables from
    # inv_freq = 1 / base ** (arange(0, R, 2) / R), torch.cos / torch.sin, rotate_half in x's dtype).
    def sigmoid(self, x, spec):
        return torch.sigmoid(x)

    def silu(self, x, spec):
        return F.silu(x)

    def softplus(self, x, spec):
        return F.softplus(x)

    def silu_mul(self, a, b, spec):
        return F.silu(a) * b

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        if inv_freq is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
                                       .float() / rotary_dim))
        freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
        return freqs.cos(), freqs.sin()

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        half = cos.shape[-1]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        rot = x[..., :2 * half]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
        else:
            c2, s2 = torch.cat([c, c], -1), torch.cat([s, s], -1)
            rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)  # HF rotate_half
            out = rot * c2 + rotated * s2
        return torch.cat([out, x[..., 2 * half:]], -1)
