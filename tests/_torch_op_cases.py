"""Arguments for every torch.ops.lockstep.* op (shared by test_torch_ops.py and test_compile.py)."""
from __future__ import annotations

import torch

import hal
import hal.integrations.transformers.modules  # noqa: F401 (registers the HF integration's torch ops: hf_attention, hf_gated_delta_net)

F32, BF16 = torch.float32, torch.bfloat16


def _t(*shape, dtype=F32, grad=False, seed=0, noncontig=False):
    g = torch.Generator().manual_seed(seed + sum(shape))
    if noncontig:  # the same shape as a transposed view of a wider buffer
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype).transpose(-1, -2)
        assert not t.is_contiguous()
    else:
        t = torch.randn(*shape, generator=g).to(dtype)
    return t.requires_grad_(grad)


def op_args(name: str, dtype=F32, rows: int = 3, noncontig: bool = False) -> tuple:
    """Arguments of ``torch.ops.lockstep.<name>`` (without spec, backend), float inputs requiring grad."""
    grad = dtype == F32 and not noncontig
    x = _t(rows, 16, dtype=dtype, grad=grad, noncontig=noncontig)
    if name == "matmul":
        return (x, _t(16, 8, dtype=dtype, grad=grad, seed=1))
    if name == "linear":
        return (x, _t(8, 16, dtype=dtype, grad=grad, seed=1), _t(8, dtype=dtype, grad=grad, seed=2))
    if name == "rms_norm":
        return (x, _t(16, dtype=dtype, grad=grad, seed=1), 1e-6)
    if name == "rms_norm_residual":
        return (x, _t(16, dtype=dtype, grad=grad, seed=1), _t(rows, 16, dtype=dtype, grad=grad, seed=2), 1e-6)
    if name in ("softmax", "log_softmax", "logsumexp"):
        return (x, 0 if noncontig else -1)  # a non-last dim moves the rows: strides must follow
    if name == "token_logprobs":
        return (x, _t(32, 16, dtype=dtype, grad=grad, seed=1), torch.arange(rows) * 7 % 32, 0.7)
    if name in ("sigmoid", "silu", "softplus"):
        return (x,)
    if name == "silu_mul":
        return (x, _t(rows, 16, dtype=dtype, grad=grad, seed=1, noncontig=noncontig))
    if name == "rotary_cos_sin":
        return (torch.arange(rows) * 5, 8, 10000.0, None)
    if name == "apply_rotary":
        cos, sin = hal.rotary_cos_sin(torch.arange(rows), 8)
        return (x, cos.to(dtype).requires_grad_(grad), sin.to(dtype).requires_grad_(grad), False)
    if name == "flash_attn_varlen":  # two sequences (rows - 1 and 1 queries), GQA 4 -> 2 heads, fewer q than k
        q = _t(rows, 4, 8, dtype=dtype, grad=grad, noncontig=noncontig)
        k, v = (_t(rows + 2, 2, 8, dtype=dtype, grad=grad, seed=s) for s in (1, 2))
        cu_q = torch.tensor([0, rows - 1, rows], dtype=torch.int32)
        cu_k = torch.tensor([0, rows, rows + 2], dtype=torch.int32)
        return (q, k, v, cu_q, cu_k, rows, rows + 1, None, True, [-1, -1])
    if name == "flash_attn_with_kvcache":  # batch 2 with 3 and 1 cached tokens, append `rows` tokens each
        q = _t(2, rows, 4, 8, dtype=dtype, noncontig=noncontig)
        k_cache, v_cache = (_t(2, rows + 5, 2, 8, dtype=dtype, seed=s) for s in (1, 2))
        k, v = (_t(2, rows, 2, 8, dtype=dtype, seed=s) for s in (3, 4))
        return (q, k_cache, v_cache, k, v, torch.tensor([3, 1], dtype=torch.int32), None, 0.3, True, [-1, -1], 0)
    if name == "hf_attention":  # HF layout [B, H, T, D]; row 1 left-padded by 2 (an additive float mask)
        q = _t(2, 4, rows + 2, 8, dtype=dtype, grad=grad, noncontig=noncontig)
        k, v = (_t(2, 2, rows + 2, 8, dtype=dtype, grad=grad, seed=s) for s in (1, 2))
        t = rows + 2
        vis = torch.ones(t, t, dtype=torch.bool).tril().expand(2, 1, t, t).clone()
        vis[1, :, :, :2] = False
        return (q, k, v, vis, None, None, None, True, 0.25)
    if name in GDN_RULES:
        return gdn_rule_args(dtype, rows, noncontig)
    if name == "hf_gated_delta_net":  # [B, T, ...] conv input and gates, row 1 left-padded by 2; 2 key / 4 value heads
        t = rows + 2
        mask = torch.ones(2, t, dtype=torch.long)
        mask[1, :2] = 0
        g = -_t(2, t, 4, dtype=F32, seed=3).abs()
        return (_t(2, t, 64, dtype=dtype, noncontig=noncontig), g, torch.sigmoid(_t(2, t, 4, seed=4)),
                _t(64, 4, dtype=dtype, seed=1) * 0.5, None, mask, None, None, 16, 8, 8)
    if name == "gdn_gating":  # a, b [1, rows, HV] as the HF layer passes them
        return (_t(4, dtype=dtype, grad=grad) * 0.5, _t(1, rows, 4, dtype=dtype, grad=grad, seed=1),
                _t(4, dtype=dtype, grad=grad, seed=2), _t(1, rows, 4, dtype=dtype, grad=grad, seed=3))
    if name == "gdn_causal_conv1d":
        w = _t(6, 4, dtype=dtype, grad=grad, seed=1) * 0.5
        if dtype == F32 and not noncontig:  # batch 2 with bias and an incoming conv state
            return (_t(2, rows, 6, dtype=dtype, grad=grad), w, _t(6, dtype=dtype, grad=grad, seed=2),
                    _t(2, 3, 6, dtype=dtype, grad=grad, seed=3), "silu", None)
        if noncontig:  # packed: two sequences (1 and rows - 1 tokens), no bias, no state
            return (_t(1, 6, rows, dtype=dtype).transpose(1, 2), w, None, None, "silu",
                    torch.tensor([0, 1, rows], dtype=torch.int32))
        return (_t(2, rows, 6, dtype=dtype), w, None, None, None, None)
    raise KeyError(name)


GDN_RULES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
_FINAL = {0: False, 1: True, 2: "state"}


def gdn_rule_args(dtype=F32, rows=3, noncontig=False, spec=None):
    """A gated delta rule op's arguments, H = 2 q/k heads, HV = 4 value heads, d_k = d_v = 8:
    float32: packed, two sequences (rows - 1 and 1 tokens) from a bare initial state (requiring grad),
    the FLA final tensor out; bfloat16: batch 2 from zeros, no final state; non-contiguous: batch 2
    continuing a state object made by an earlier call of 3 tokens under ``spec``, a state object out."""
    grad = dtype == F32 and not noncontig
    b, cu = (1, torch.tensor([0, rows - 1, rows], dtype=torch.int32)) if grad else (2, None)
    q, k = (_t(b, rows, 2, 8, dtype=dtype, grad=grad, seed=s, noncontig=noncontig) for s in (0, 1))
    v = _t(b, rows, 4, 8, dtype=dtype, grad=grad, seed=2)
    g = (-_t(b, rows, 4, dtype=dtype, seed=3).abs() * 0.3).requires_grad_(grad)
    beta = torch.sigmoid(_t(b, rows, 4, dtype=dtype, seed=4)).requires_grad_(grad)
    if grad:
        init = _t(2, 4, 8, 8, grad=True, seed=5) * 0.1
        return (q, k, v, g, beta, None, init.detach().requires_grad_(True), None, [], *[None] * 7, 1, 0, cu, True)
    if not noncontig:
        return (q, k, v, g, beta, 0.3, None, None, [], *[None] * 7, 0, 0, cu, False)
    earlier = [_t(2, 3, h, 8, seed=10 + i) for i, h in enumerate((2, 2, 4))]
    with torch.no_grad():
        _, st = hal.chunk_gated_delta_rule(*earlier, -_t(2, 3, 4, seed=13).abs(), torch.full((2, 3, 4), 0.5),
                                           output_final_state="state", spec=spec)
    opened = st.parts.open_k is not None
    return (q, k, v, g, beta, None, None, st.spec_id, list(st.layout), *st.parts, 2,
            st.parts.open_k.shape[1] if opened else 0, cu, True)


def gdn_public(name, args, **choice):
    """The public rule op's call for the torch op's arguments; its results flattened as the op returns them."""
    (q, k, v, g, beta, scale, init, state_spec, layout, *parts), (want, _, cu, l2) = args[:16], args[16:]
    if state_spec is not None:
        from hal.kernels.layout import Parts
        init = hal.GatedDeltaRuleState(state_spec, layout, Parts(*parts))
    o, final = getattr(hal, name)(q, k, v, g, beta, scale, init, _FINAL[want], cu, l2, **choice)
    if final is None:
        return (o,)
    if isinstance(final, torch.Tensor):
        return (o, final)
    return (o, final.final_state, *[x for x in final.parts[:-1] if x is not None])


def public(name, args):
    """The public op's call for the torch op's arguments."""
    if name == "rms_norm_residual":
        x, w, r, eps = args
        return hal.rms_norm(x, w, eps, r)
    if name == "flash_attn_varlen":
        *head, scale, causal, window = args
        return hal.flash_attn_varlen_func(*head, scale, causal, window, return_lse=True)
    if name == "flash_attn_with_kvcache":
        q, kc, vc, k, v, lens, table, scale, causal, window, splits = args
        return hal.flash_attn_with_kvcache(q, kc, vc, k, v, lens, table, scale, causal, window, splits,
                                           return_lse=True)
    if name == "hf_attention":
        from hal.integrations.transformers.attention import masked_attention
        return masked_attention(*args, return_lse=True)
    if name in GDN_RULES:
        return gdn_public(name, args)
    if name == "hf_gated_delta_net":
        from hal.integrations.transformers.modules import packed_conv_and_rule
        return packed_conv_and_rule(*args)
    return getattr(hal, name)(*args)
