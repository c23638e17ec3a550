"""Every cpu-backend op leaves the storage of its inputs and outputs resizable (issue 23, item 4).

``tensor.numpy()`` marks a tensor's storage non-resizable for good; FSDP2 frees an unsharded
parameter by ``untyped_storage().resize_(0)`` after the forward and then fails with "Trying to
resize storage that is not resizable". The check below is exactly that resize, on every tensor an op
was given or returned. Negative control: the same check catches ``.numpy()`` itself, and a cpu
backend whose host conversion is swapped for ``.numpy()`` from the outside (monkeypatch).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import hal
from hal.spec import ExactMatmulSpec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for i in x for t in _tensors(i)]
    parts = getattr(x, "parts", None)  # GatedDeltaRuleState
    if parts is not None:
        return _tensors(tuple(parts))
    return []


def not_resizable(tensors) -> list[int]:
    """Indices of the tensors whose storage refuses ``resize_`` (each is resized to 0 bytes)."""
    bad = []
    for i, t in enumerate(tensors):
        try:
            t.untyped_storage().resize_(0)
        except RuntimeError as e:
            assert "not resizable" in str(e), e
            bad.append(i)
    return bad


def _r(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _case_linear(dt):
    x, w, b = _r(3, 8, dtype=dt), _r(5, 8, dtype=dt, seed=1), _r(5, dtype=dt, seed=2)
    return (x, w, b), hal.linear(x, w, b, backend="cpu")


def _case_linear_big(dt):  # the packed GEMM path (many rows)
    x, w = _r(80, 16, dtype=dt), _r(24, 16, dtype=dt, seed=1)
    return (x, w), hal.linear(x, w, backend="cpu")


def _case_matmul(dt):
    a, b = _r(2, 3, 8, dtype=dt), _r(8, 4, dtype=dt, seed=1)
    return (a, b), hal.matmul(a, b, backend="cpu")


def _case_linear_exact(dt):
    x, w = _r(3, 8, dtype=dt), _r(5, 8, dtype=dt, seed=1)
    return (x, w), hal.linear(x, w, spec=ExactMatmulSpec(slices=3), backend="cpu")


def _case_rms_norm(dt):
    x, w, r = _r(3, 16, dtype=dt), _r(16, dtype=dt, seed=1), _r(3, 16, dtype=dt, seed=2)
    return (x, w, r), hal.rms_norm(x, w, 1e-6, residual=r, backend="cpu")


def _case_softmax_family(dt):
    x = _r(3, 10, dtype=dt)
    return (x,), (hal.softmax(x, backend="cpu"), hal.log_softmax(x, backend="cpu"), hal.logsumexp(x, backend="cpu"))


def _case_token_logprobs(dt):
    h, w, tok = _r(4, 8, dtype=dt), _r(11, 8, dtype=dt, seed=1), torch.tensor([0, 3, 10, 5])
    return (h, w, tok), hal.token_logprobs(h, w, tok, backend="cpu")


def _case_elementwise(dt):
    x, y = _r(4, 6, dtype=dt), _r(4, 6, dtype=dt, seed=1)
    outs = (hal.sigmoid(x, backend="cpu"), hal.silu(x, backend="cpu"), hal.softplus(x, backend="cpu"),
            hal.silu_mul(x, y, backend="cpu"))
    return (x, y), outs


def _case_rotary(dt):
    pos = torch.arange(5)
    cos, sin = hal.rotary_cos_sin(pos, 8, backend="cpu")
    x = _r(1, 5, 2, 8, dtype=dt)
    return (pos, x), (cos, sin, hal.apply_rotary(x, cos[None, :, None], sin[None, :, None], backend="cpu"))


def _case_varlen_attention(dt):
    q, k, v = _r(6, 2, 8, dtype=dt), _r(6, 1, 8, dtype=dt, seed=1), _r(6, 1, 8, dtype=dt, seed=2)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, return_lse=True, backend="cpu")
    return (q, k, v, cu), out


def _case_kvcache_attention(dt):
    kc, vc = torch.zeros(4, 4, 1, 8, dtype=dt), torch.zeros(4, 4, 1, 8, dtype=dt)
    q, k, v = _r(1, 3, 2, 8, dtype=dt), _r(1, 3, 1, 8, dtype=dt, seed=1), _r(1, 3, 1, 8, dtype=dt, seed=2)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    out = hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, backend="cpu")
    return (q, kc, vc, k, v, table, lens), out


def _case_gated_delta_rule(dt):
    q, k = _r(1, 5, 2, 8, dtype=dt), _r(1, 5, 2, 8, dtype=dt, seed=1)
    v, g = _r(1, 5, 2, 8, dtype=dt, seed=2), -_r(1, 5, 2, dtype=dt, seed=3).abs()
    beta = _r(1, 5, 2, dtype=dt, seed=4).sigmoid()
    outs = []
    for op in (hal.chunk_gated_delta_rule, hal.fused_recurrent_gated_delta_rule):
        o, state = op(q, k, v, g, beta, output_final_state=True, backend="cpu")
        o2, state2 = op(q, k, v, g, beta, initial_state=state, output_final_state=True, backend="cpu")
        outs += [o, state, o2, state2]
    return (q, k, v, g, beta), outs


def _case_qwen3_next(dt):
    A_log, a, dt_bias, b = _r(2, dtype=dt), _r(3, 2, dtype=dt, seed=1), _r(2, dtype=dt, seed=2), _r(3, 2, dtype=dt, seed=3)
    gating = hal.gdn_gating(A_log, a, dt_bias, b, backend="cpu")
    x, w, bias = _r(1, 5, 4, dtype=dt, seed=4), _r(4, 3, dtype=dt, seed=5), _r(4, dtype=dt, seed=6)
    conv = hal.gdn_causal_conv1d(x, w, bias, backend="cpu")
    return (A_log, a, dt_bias, b, x, w, bias), (gating, conv)


CASES = [_case_linear, _case_linear_big, _case_matmul, _case_linear_exact, _case_rms_norm, _case_softmax_family,
         _case_token_logprobs, _case_elementwise, _case_rotary, _case_varlen_attention, _case_kvcache_attention,
         _case_gated_delta_rule, _case_qwen3_next]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[6:])
def test_cpu_ops_leave_storage_resizable(case, dt):
    inputs, outputs = case(dt)
    outputs = _tensors(outputs)
    assert outputs, "the case returned no tensors"
    assert not_resizable(list(inputs)) == [], "an input's storage was made non-resizable"
    assert not_resizable(outputs) == [], "an output's storage is not resizable"


def test_check_catches_numpy():
    t = torch.ones(4)
    assert not_resizable([t.clone()]) == []
    t.numpy()
    assert not_resizable([t]) == [0]


def test_check_catches_a_backend_converting_with_numpy(monkeypatch):
    """The old host conversion (``.numpy()``) swapped in from the outside: the same check fails."""
    from hal.kernels.cpu import host
    monkeypatch.setattr(host, "array", lambda t: t.detach().numpy())
    x = _r(3, 10)
    y = hal.softmax(x, backend="cpu")
    assert not_resizable([x]) == [0]
    assert not_resizable([y]) == [0]
