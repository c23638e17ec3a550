"""Qwen3-Next pieces (gating, causal conv1d) and agreement with transformers' Qwen3-Next reference.

Measured agreement (T=150, H=2, HV=4, l2 norm in kernel, gates as Qwen3-Next makes them), max |diff|
of o with max |o| ~ 0.12:
  fp32 inputs: lockstep (either spec) vs torch_chunk_gated_delta_rule <= 3.0e-7 (that function's own
  error against float64 is 2.8e-7); vs torch_recurrent_gated_delta_rule <= 5.2e-8; lockstep vs the
  float64 oracle <= 4.5e-8.
  bf16 inputs: <= 1.2e-4 (below one bf16 ulp at max |o|): the outputs' own rounding.
The tests assert fp32 <= 1e-5 * max|o| and bf16 <= 2^-7 * max|o| (one bf16 ulp at max |o|).
"""
import pytest
import torch
import torch.nn.functional as F

import hal
from hal.conformance.bits import same_bits
from hal.errors import InputError
from hal.spec import GatedDeltaRuleSpec
from hal.kernels.oracle import gated_delta_rule as ora



@pytest.fixture(scope="module")
def hf():
    """transformers' Qwen3-Next module. Only the checks against transformers take this fixture, so a
    transformers without it skips those and never the checks of lockstep's own pieces."""
    return pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

SPECS = [GatedDeltaRuleSpec(variant="chunked"), GatedDeltaRuleSpec(variant="serial")]


def _gdn_inputs(B, T, H, HV, dk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g).to(dtype)
    k = torch.randn(B, T, H, dk, generator=g).to(dtype)
    v = torch.randn(B, T, HV, dk, generator=g).to(dtype)
    lg = -(torch.rand(B, T, HV, generator=g) ** 2 * 3)
    beta = torch.rand(B, T, HV, generator=g).to(dtype)
    return q, k, v, lg, beta


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant)
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -7)], ids=["fp32", "bf16"])
def test_agrees_with_transformers_qwen3_next_reference(hf, spec, dtype, rel):
    q, k, v, lg, beta = _gdn_inputs(2, 100, 2, 4, 64, dtype)
    s0 = torch.randn(2, 4, 64, 64) * 0.1
    o, fin = hal.chunk_gated_delta_rule(q, k, v, lg, beta, initial_state=s0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, spec=spec)
    ref_max = o.float().abs().max()
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ho, hfin = fn(q, k, v, g=lg, beta=beta, initial_state=s0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        assert ho.dtype == o.dtype and hfin.dtype == fin.dtype == torch.float32
        assert (o.float() - ho.float()).abs().max() <= rel * ref_max, fn.__name__
        assert (fin - hfin).abs().max() <= max(rel, 1e-5) * hfin.abs().max(), fn.__name__


def test_agrees_with_transformers_without_l2norm_and_d128(hf):
    q, k, v, lg, beta = _gdn_inputs(1, 70, 1, 1, 128, torch.float32)
    k = k * 0.05
    o, _ = hal.chunk_gated_delta_rule(q, k, v, lg, beta)
    ho, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=lg, beta=beta)
    assert (o - ho).abs().max() <= 1e-5 * ho.abs().max()


# ---------------------------------------------------------------- gating


def _gate_inputs(T=50, HV=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    A_log = torch.log(torch.rand(HV, generator=g) * 16 + 0.01)
    dt_bias = torch.randn(HV, generator=g)
    a = (torch.randn(2, T, HV, generator=g) * 4).to(dtype)
    b = (torch.randn(2, T, HV, generator=g) * 4).to(dtype)
    a[0, 0, :2] = torch.tensor([-40.0, 30.0])  # softplus tails
    if HV > 2:
        a[0, 0, 2:4] = torch.tensor([0.0, -1e-3])  # and the region near 0
    return A_log, a, dt_bias, b


def test_gating_accuracy_and_transformers_formula():
    A_log, a, dt_bias, b = _gate_inputs()
    g, beta = hal.gdn_gating(A_log, a, dt_bias, b)
    assert g.dtype == beta.dtype == torch.float32
    # the spec adds a + dt_bias in float32; from that sum on, g is within a few float32 ulps
    x32 = a.float() + dt_bias.float()
    g64 = -torch.exp(A_log.double()) * F.softplus(x32.double())
    _, b64 = ora.gdn_gating(A_log, a, dt_bias, b)
    assert ((g.double() - g64).abs() <= 8 * 2.0 ** -24 * g64.abs()).all()
    assert ((beta.double() - b64).abs() <= 8 * 2.0 ** -24 * b64.abs()).all()
    hf_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert torch.allclose(g, hf_g, rtol=1e-5, atol=1e-6)
    assert torch.allclose(beta, b.sigmoid().float(), atol=2.0 ** -8)


def test_gating_is_per_token_so_decode_exact():
    A_log, a, dt_bias, b = _gate_inputs()
    g, beta = hal.gdn_gating(A_log, a, dt_bias, b)
    for t in (0, 17, 49):
        gt, bt = hal.gdn_gating(A_log, a[:, t:t + 1], dt_bias, b[:, t:t + 1])
        assert same_bits(gt, g[:, t:t + 1]) and same_bits(bt, beta[:, t:t + 1])
    # the stock control (torch softplus/exp) is a different computation
    gs, _ = hal.gdn_gating(A_log, a, dt_bias, b, backend="stock")
    assert not same_bits(gs, g)


def test_gating_gradcheck_and_errors():
    A_log, a, dt_bias, b = (t.double().requires_grad_(True) for t in _gate_inputs(T=3, HV=2, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *x: hal.gdn_gating(*x), (A_log, a, dt_bias, b))
    with pytest.raises(InputError, match="HV"):
        hal.gdn_gating(A_log.detach()[:1], a.detach(), dt_bias.detach(), b.detach())


# ---------------------------------------------------------------- causal conv1d


def _conv_inputs(B=2, T=40, D=12, K=4, dtype=torch.bfloat16, bias=True):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    w = (torch.randn(D, K, generator=g) * 0.5).to(dtype)
    bb = torch.randn(D, generator=g).to(dtype) if bias else None
    return x, w, bb


@pytest.mark.parametrize("bias", [True, False])
def test_conv_split_anywhere_and_decode_equal_full(bias):
    x, w, bb = _conv_inputs(bias=bias)
    y, st = hal.gdn_causal_conv1d(x, w, bb)
    assert y.dtype == x.dtype and st.shape == (2, 3, 12) and same_bits(st, x[:, -3:])
    for p in range(1, 40):
        y1, s1 = hal.gdn_causal_conv1d(x[:, :p], w, bb)
        y2, s2 = hal.gdn_causal_conv1d(x[:, p:], w, bb, conv_state=s1)
        assert same_bits(torch.cat([y1, y2], 1), y) and same_bits(s2, st), p
    s, outs = None, []
    for t in range(40):
        yt, s = hal.gdn_causal_conv1d(x[:, t:t + 1], w, bb, conv_state=s)
        outs.append(yt)
    assert same_bits(torch.cat(outs, 1), y)


def test_conv_packed_equals_batched_and_matches_the_oracle():
    x, w, bb = _conv_inputs(dtype=torch.float32)
    y, st = hal.gdn_causal_conv1d(x, w, bb)
    yp, sp = hal.gdn_causal_conv1d(x.reshape(1, 80, 12), w, bb, cu_seqlens=torch.tensor([0, 40, 80]))
    assert same_bits(yp.reshape(y.shape), y) and same_bits(sp, st)
    y64, _ = ora.causal_conv1d(x, w, bb)
    assert ((y.double() - y64).abs() <= 16 * 2.0 ** -24 * (y64.abs() + 1)).all()


def test_conv_matches_transformers(hf):
    x, w, bb = _conv_inputs(dtype=torch.float32)
    y, _ = hal.gdn_causal_conv1d(x, w, bb)
    # transformers' layout is [B, D, T]; weight [D, K]
    hy = hf.causal_conv1d_fn(x.transpose(1, 2), w, bb, activation="silu").transpose(1, 2)
    assert torch.allclose(y, hy, rtol=1e-5, atol=1e-6)


def test_conv_gradcheck_and_errors():
    x, w, bb = (t.double().requires_grad_(True) for t in _conv_inputs(B=1, T=5, D=3, K=4, dtype=torch.float64))
    s0 = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, bb, s0: hal.gdn_causal_conv1d(x, w, bb, conv_state=s0),
                                    (x, w, bb, s0))
    x, w, bb = _conv_inputs()
    with pytest.raises(InputError, match="conv_state shape"):
        hal.gdn_causal_conv1d(x, w, bb, conv_state=torch.zeros(2, 4, 12, dtype=x.dtype))
    with pytest.raises(InputError, match="x's dtype"):
        hal.gdn_causal_conv1d(x, w, bb, conv_state=torch.zeros(2, 3, 12))
    with pytest.raises(InputError, match="channels"):
        hal.gdn_causal_conv1d(x, w[:5], bb)
    with pytest.raises(InputError, match="activation"):
        hal.gdn_causal_conv1d(x, w, bb, activation="gelu")


# ---------------------------------------------------------------- a whole Qwen3-Next GDN layer


def test_transformers_layer_with_lockstep_pieces_matches_transformers(hf, monkeypatch):
    """Qwen3NextGatedDeltaNet (tiny, random weights, built locally) with its conv and chunk function
    swapped for lockstep's gives transformers' output within float32 tolerance."""
    from transformers import Qwen3NextConfig
    cfg = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=32)
    torch.manual_seed(0)
    layer = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    h = torch.randn(2, 70, 64)
    with torch.no_grad():
        want = layer(h)

    def conv(x, weight, bias=None, activation=None, **kw):
        y, _ = hal.gdn_causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation)
        return y.transpose(1, 2)

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kw):
        return hal.chunk_gated_delta_rule(q, k, v, g.float(), beta, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    monkeypatch.setattr(hf, "causal_conv1d_fn", conv)
    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", chunk)
    monkeypatch.setattr(layer, "causal_conv1d_fn", conv, raising=False)
    monkeypatch.setattr(layer, "chunk_gated_delta_rule", chunk, raising=False)
    with torch.no_grad():
        got = layer(h)
    assert not same_bits(got, want)  # the swap took effect
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
