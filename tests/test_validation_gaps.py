"""Bad arguments raise hal.InputError naming the argument before anything runs (issue 7, section 6).

Scalars are checked as the float32 number the kernels use (one validator: hal.validate.scalar).
"""
import pytest
import torch

import hal
from hal import validate
from hal.conformance.bits import assert_same_bits
from hal.errors import InputError

F32 = torch.float32


def _gdn_inputs(B=1, T=5, H=1, HV=2, dk=4, dv=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dk, generator=g),
            torch.randn(B, T, HV, dv, generator=g), -torch.rand(B, T, HV, generator=g),
            torch.rand(B, T, HV, generator=g)]


def _kvcache_args():
    q = torch.randn(1, 1, 2, 8)
    return q, torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)


def _varlen(q_dim=8, **kw):
    q, k, v = torch.randn(4, 2, q_dim), torch.randn(4, 2, q_dim), torch.randn(4, 2, q_dim)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    return hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, **kw)


EMPTY = torch.zeros(3, 0)
CASES = [
    # empty reduction axes (were IndexError)
    ("softmax-empty", lambda: hal.softmax(EMPTY), r"x has an empty axis 1"),
    ("log_softmax-empty", lambda: hal.log_softmax(EMPTY), r"x has an empty axis 1"),
    ("logsumexp-empty", lambda: hal.logsumexp(EMPTY), r"x has an empty axis 1"),
    ("logsumexp-empty-dim0", lambda: hal.logsumexp(torch.zeros(0, 3), dim=0), r"x has an empty axis 0"),
    ("token_logprobs-empty-vocab", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(0, 4), torch.tensor([0, 0])),
     r"lm_head_weight has an empty axis 0"),
    # zero head dims / head counts (were ZeroDivisionError, or accepted)
    ("attention-head-dim-0", lambda: _varlen(q_dim=0), r"head_dim \(q.shape\[-1\]\) must be >= 1"),
    ("kvcache-head-dim-0", lambda: hal.flash_attn_with_kvcache(torch.ones(1, 1, 2, 0), torch.ones(1, 6, 1, 0),
                                                               torch.ones(1, 6, 1, 0), cache_seqlens=3),
     r"head_dim \(q.shape\[-1\]\) must be >= 1"),
    ("gdn-H-0", lambda: hal.chunk_gated_delta_rule(*[t[:, :, :0] if i < 2 else t for i, t in
                                                     enumerate(_gdn_inputs())]), r"H = 0 \(q.shape\[2\]\)"),
    ("gdn-HV-0", lambda: hal.chunk_gated_delta_rule(*[t[:, :, :0] if i >= 2 else t for i, t in
                                                      enumerate(_gdn_inputs())]), r"HV = 0 \(v.shape\[2\]\)"),
    # scalars
    ("rms_norm-eps-str", lambda: hal.rms_norm(torch.ones(2, 4), torch.ones(4), eps="abc"), r"eps must be a real"),
    ("rms_norm-eps-inf", lambda: hal.rms_norm(torch.ones(2, 4), torch.ones(4), eps=float("inf")), "eps must be finite"),
    ("rms_norm-eps-f32-overflow", lambda: hal.rms_norm(torch.ones(2, 4), torch.ones(4), eps=1e39), "eps must be finite"),
    ("rms_norm-eps-negative", lambda: hal.rms_norm(torch.ones(2, 4), torch.ones(4), eps=-1e-6), r"eps must be >= 0"),
    ("temperature-subnormal", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1, 2]),
                                                         1e-45), "temperature"),
    ("temperature-tiny-normal-in-f64", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4),
                                                                  torch.tensor([1, 2]), 1e-39), "temperature"),
    ("temperature-bool", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1, 2]), True),
     "temperature must be a real number"),
    ("temperature-str", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1, 2]), "1.0"),
     "temperature must be a real number"),
    ("softmax_scale-f32-inf", lambda: _varlen(softmax_scale=1e39), "softmax_scale must be finite"),
    ("softmax_scale-f32-zero", lambda: _varlen(softmax_scale=1e-50), r"softmax_scale must be > 0"),
    ("kvcache-softmax_scale", lambda: hal.flash_attn_with_kvcache(*_kvcache_args(), cache_seqlens=3,
                                                                  softmax_scale=1e39), "softmax_scale"),
    ("window-float", lambda: _varlen(window_size=(1.5, 2)), r"window_size\[0\] \(left\) must be an int"),
    ("window-bool", lambda: _varlen(window_size=(2, True)), r"window_size\[1\] \(right\) must be an int"),
    ("kvcache-window-float", lambda: hal.flash_attn_with_kvcache(*_kvcache_args(), cache_seqlens=3,
                                                                 window_size=(2, 0.5)), "window_size"),
    ("gdn-scale-inf-f32", lambda: hal.chunk_gated_delta_rule(*_gdn_inputs(), scale=1e39), "scale must be finite"),
    ("gdn-scale-str", lambda: hal.chunk_gated_delta_rule(*_gdn_inputs(), scale="0.5"), "scale must be a real"),
    # devices and dtypes
    ("tokens-meta", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4),
                                               torch.tensor([1, 2], device="meta")), "tokens is on the meta device"),
    ("mixed-f32-f64", lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4, dtype=torch.float64),
                                                 torch.tensor([1, 2])), r"hidden: torch.float32, lm_head_weight: torch.float64"),
    ("mixed-bf16-f32", lambda: hal.token_logprobs(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(10, 4),
                                                  torch.tensor([1, 2])), "dtypes differ"),
    ("cu_seqlens-meta", lambda: hal.chunk_gated_delta_rule(*[t.reshape(1, 5, *t.shape[2:]) for t in _gdn_inputs()],
                                                           cu_seqlens=torch.tensor([0, 5], device="meta")),
     "cu_seqlens is on the meta device"),
]


@pytest.mark.parametrize("name,call,message", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_raises_input_error_naming_it(name, call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_state_select_out_of_range():
    _, st = hal.chunk_gated_delta_rule(*_gdn_inputs(B=2), output_final_state="state")
    for bad in (5, -3, [0, 2], torch.tensor([2])):
        with pytest.raises(InputError, match="out of range for a state of 2 sequences"):
            st.select(bad)
    with pytest.raises(InputError, match="index must be"):
        st.select(True)
    assert st.select(-1).position.tolist() == [5] and st.select(slice(0, 1)).batch_size == 1


@pytest.mark.parametrize("kind", ["bare", "state"])
def test_zero_token_gdn_call_returns_a_copy_of_the_state(kind):
    x = _gdn_inputs(B=2)
    _, st = hal.chunk_gated_delta_rule(*x, output_final_state="state" if kind == "state" else True)
    empty = [t[:, :0] for t in x]
    o, fin = hal.chunk_gated_delta_rule(*empty, initial_state=st, output_final_state=True)
    assert o.shape[1] == 0
    if kind == "bare":
        assert fin is not st and fin.data_ptr() != st.data_ptr()
        assert_same_bits(st, fin)
        fin.add_(1.0)  # the caller's state stays theirs
        assert not torch.equal(fin, st)
    else:
        assert fin is not st
        for a, b in zip(st.parts, fin.parts):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.data_ptr() != b.data_ptr()
                assert_same_bits(a, b)


def test_zero_token_conv1d_returns_a_copy_of_the_state():
    x, w = torch.randn(2, 0, 3), torch.randn(3, 4)
    state = torch.randn(2, 3, 3)
    _, st = hal.gdn_causal_conv1d(x, w, conv_state=state)
    assert st is not state and st.data_ptr() != state.data_ptr()
    assert_same_bits(state, st)


def test_scalar_validator_is_the_one_used_and_keeps_valid_values():
    # Valid values pass through unchanged (the kernels round them to float32 themselves).
    assert validate.scalar("t", 0.7, positive=True, reciprocal=True) == 0.7
    assert validate.scalar("eps", 0) == 0.0
    assert validate.scalar("t", torch.tensor(2.0), positive=True) == 2.0
    # The smallest normal float32 is accepted as a temperature; the next value below it is not.
    tiny = torch.finfo(F32).tiny
    assert validate.scalar("t", tiny, positive=True, reciprocal=True) == tiny
    with pytest.raises(InputError, match="below the smallest normal float32"):
        validate.scalar("temperature", tiny * 0.5, positive=True, reciprocal=True)
    # float32 max is fine, the next float64 that rounds to inf in float32 is not.
    assert validate.scalar("s", float(torch.finfo(F32).max), positive=True) == float(torch.finfo(F32).max)
    with pytest.raises(InputError, match="finite"):
        validate.scalar("s", 3.5e38, positive=True)
    assert validate.index_scalar("w", 3, minimum=-1) == 3
    with pytest.raises(InputError, match=">= -1"):
        validate.index_scalar("w", -2, minimum=-1)


def test_scalars_round_to_float32_as_torch_does():
    """validate.as_float32 (plain Python) gives torch's float32 conversion, bit for bit: the edges (signed zeros,
    subnormals and the halfway points below them, the overflow boundary, infinities, NaN) and random float64
    bit patterns. Control: a conversion that truncates toward zero instead of rounding differs on the same set."""
    import math
    import random
    import struct
    big = float(torch.finfo(F32).max)
    values = [0.0, -0.0, 2.0 ** -149, 2.0 ** -150, 3 * 2.0 ** -151, -(2.0 ** -150), 1e-40, 1 / 3, 0.1, big,
              3.4028235677973366e38, 3.4028235677973362e38, 3.5e38, -3.5e38, 1e308, math.inf, -math.inf, math.nan]
    rng = random.Random(0)
    values += [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(4000)]
    values += [rng.uniform(-1, 1) * 10.0 ** rng.uniform(-48, 39) for _ in range(4000)]

    def bits(f):
        return struct.pack("d", f) if not math.isnan(f) else b"nan"
    torch_f32 = [bits(float(torch.tensor(f, dtype=F32))) for f in values]
    assert [bits(validate.as_float32(f)) for f in values] == torch_f32

    def toward_zero(f):  # the control: the float32 next to the rounded one, toward zero, where rounding went up
        r = validate.as_float32(f)
        if math.isnan(f) or math.isinf(f) or abs(r) <= abs(f):
            return r
        if math.isinf(r):  # rounded past float32's largest value
            return math.copysign(big, f)
        (b,) = struct.unpack("<I", struct.pack("<f", r))
        return struct.unpack("<f", struct.pack("<I", b - 1))[0]  # one step down in magnitude, sign kept
    control = [bits(toward_zero(f)) for f in values]
    assert sum(a != b for a, b in zip(control, torch_f32)) > 1000


def test_valid_edge_scalars_still_run():
    h, w, tok = torch.full((2, 4), 0.1), torch.ones(10, 4), torch.tensor([1, 2])
    lp = hal.token_logprobs(h, w, tok, torch.finfo(F32).tiny * 4)  # equal logits: log(1/10) each
    assert lp.dtype == F32 and torch.allclose(lp, torch.full((2,), -2.302585))
    out = _varlen(window_size=(torch.tensor(2), 0), causal=True)
    assert out.shape == (4, 2, 8)
