"""Public ops: values, bad inputs, autograd."""
import pytest
import torch
import torch.nn.functional as F

import hal
from hal.conformance.bits import same_bits
from hal import InputError, SpecError, UnsupportedError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_close_to_torch(dtype):
    a, b = _rand(5, 70, dtype=dtype), _rand(70, 9, dtype=dtype, seed=1)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hal.matmul(a, b).float(), (a.float() @ b.float()), **tol)
    bias = _rand(9, dtype=dtype, seed=2)
    torch.testing.assert_close(hal.linear(a, b.t(), bias).float(), F.linear(a.float(), b.t().float(), bias.float()), **tol)
    w = _rand(70, dtype=dtype, seed=3)
    torch.testing.assert_close(hal.rms_norm(a, w).float(), F.rms_norm(a.float(), (70,), w.float(), 1e-6), **tol)
    torch.testing.assert_close(hal.softmax(a, 0).float(), torch.softmax(a.float(), 0), **tol)
    torch.testing.assert_close(hal.log_softmax(a).float(), torch.log_softmax(a.float(), -1), **tol)
    torch.testing.assert_close(hal.logsumexp(a, 0).float(), torch.logsumexp(a.float(), 0), **tol)


def test_batched_matmul_and_fused_residual():
    a, b = _rand(2, 3, 16), _rand(16, 4, seed=1)
    assert same_bits(hal.matmul(a, b)[1], hal.matmul(a[1], b))
    x, r, w = _rand(4, 32), _rand(4, 32, seed=1), _rand(32, seed=2)
    y, h = hal.rms_norm(x, w, residual=r)
    assert same_bits(h, x + r) and same_bits(y, hal.rms_norm(x + r, w))


def test_token_logprobs_matches_fp32_lm_head_and_temperature():
    h, w = _rand(6, 32), _rand(300, 32, seed=1)
    tok = torch.tensor([0, 5, 299, 17, 17, 100])
    for t in (1.0, 0.6):
        ref = torch.log_softmax((h @ w.t()) / t, -1).gather(-1, tok[:, None]).squeeze(-1)
        got = hal.token_logprobs(h, w, tok, t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # bf16 hidden/head still give float32 log-probs
    assert hal.token_logprobs(h.bfloat16(), w.bfloat16(), tok).dtype == torch.float32


def test_fully_masked_and_poisoned_rows_have_defined_results():
    x = torch.tensor([[float("-inf")] * 4, [0.0, float("nan"), 1.0, 2.0], [float("inf"), 0.0, 1.0, 2.0],
                      [0.0, float("-inf"), 1.0, float("-inf")]])
    sm, lsm, lse = hal.softmax(x), hal.log_softmax(x), hal.logsumexp(x)
    assert same_bits(sm[0], torch.zeros(4)) and torch.all(lsm[0] == float("-inf")) and lse[0] == float("-inf")
    assert torch.isnan(sm[1:3]).all() and torch.isnan(lsm[1:3]).all() and torch.isnan(lse[1:3]).all()
    assert sm[3, 1] == 0 and sm[3, 3] == 0 and lsm[3, 1] == float("-inf")


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("call, match", [
    (lambda: hal.matmul(torch.ones(2, 3), torch.ones(4, 2)), "K"),
    (lambda: hal.matmul(torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64)), "int64"),
    (lambda: hal.matmul(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float16)), "dtypes differ"),
    (lambda: hal.matmul(torch.ones(3), torch.ones(3, 2)), "at least 2 dims"),
    (lambda: hal.linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(5)), "bias"),
    (lambda: hal.rms_norm(torch.ones(2, 3), torch.ones(4)), "hidden size"),
    (lambda: hal.rms_norm(torch.ones(2, 3), torch.ones(3), residual=torch.ones(2, 4)), "residual shape"),
    (lambda: hal.rms_norm(torch.ones(2, 3), torch.ones(3), eps=-1), "eps"),
    (lambda: hal.softmax(torch.ones(2, 3), dim=2), "dim 2 out of range"),
    (lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1, 10])), r"\[0, 10\)"),
    (lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1.0, 2.0])), "int64"),
    (lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1])), "tokens shape"),
    (lambda: hal.token_logprobs(torch.ones(2, 4), torch.ones(10, 4), torch.tensor([1, 2]), 0.0), "temperature"),
    (lambda: hal.matmul(torch.ones(2, 3), torch.ones(3, 2, device="meta")), "different devices"),
])
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_wrong_spec_family_and_unknown_spec():
    with pytest.raises(SpecError, match="is for 'softmax' ops"):
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), spec=hal.spec.DEFAULTS["softmax"])
    with pytest.raises(SpecError, match="unknown spec id"):
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), spec="matmul.strict.k63.v9")
    with pytest.raises(SpecError, match="positive int"):
        hal.spec.MatmulSpec(k_tile=0)


def test_unsupported_spec_backend_combination_lists_reasons():
    fast = hal.spec.FastMatmulSpec()
    with pytest.raises(UnsupportedError) as e:
        hal.matmul(torch.ones(2, 2), torch.ones(2, 2), spec=fast, backend="reference")
    assert "policies ['strict', 'exact'], not 'fast'" in str(e.value) and e.value.reasons


def test_spec_ids_are_stable_and_change_with_the_bits():
    assert hal.spec.MatmulSpec().id == "matmul.strict.k64.v2"
    assert hal.spec.MatmulSpec(k_tile=128).id == "matmul.strict.k128.v2"
    assert hal.spec.MatmulSpec() == hal.spec.MatmulSpec() and hash(hal.spec.MatmulSpec()) == hash(hal.spec.MatmulSpec())
    a, b = _rand(3, 200), _rand(200, 4, seed=1)
    # a different K tile is a different computation: different bits somewhere
    assert not same_bits(hal.matmul(a, b), hal.matmul(a, b, spec=hal.spec.MatmulSpec(k_tile=16)))


def test_inputs_are_not_modified():
    a, b = _rand(3, 5), _rand(5, 2, seed=1)
    a0, b0 = a.clone(), b.clone()
    hal.linear(a, b.t())
    hal.rms_norm(a, b[:, 0], residual=a.clone())
    assert same_bits(a, a0) and same_bits(b, b0)


# ------------------------------------------------------------------ autograd


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    tok = torch.tensor([0, 10, 3])
    assert torch.autograd.gradcheck(lambda a, b: hal.matmul(a, b), (a, b))
    assert torch.autograd.gradcheck(lambda a, b, c: hal.linear(a, b.t(), c), (a, b, bias))
    assert torch.autograd.gradcheck(lambda a, w: hal.rms_norm(a, w), (a, w))
    assert torch.autograd.gradcheck(lambda a, w, r: hal.rms_norm(a, w, residual=r), (a, w, r))
    for f in (hal.softmax, hal.log_softmax, hal.logsumexp):
        assert torch.autograd.gradcheck(lambda a: f(a, 0), (a,))
    assert torch.autograd.gradcheck(lambda a, W: hal.token_logprobs(a, W, tok, 0.7), (a, W))


def test_backward_is_deterministic_and_close_to_torch():
    def grads():
        g = torch.Generator().manual_seed(3)
        h = torch.randn(8, 40, generator=g, requires_grad=True)
        W = torch.randn(500, 40, generator=g, requires_grad=True)
        w = torch.randn(40, generator=g, requires_grad=True)
        x = hal.rms_norm(h, w)
        lp = hal.token_logprobs(x, W, torch.arange(8) * 7)
        lp.sum().backward()
        return h.grad, W.grad, w.grad, (h, W, w)
    g1, g2 = grads(), grads()
    for x, y in zip(g1[:3], g2[:3]):
        assert same_bits(x, y)
    h, W, w = [t.detach().requires_grad_(True) for t in g1[3]]
    lp = torch.log_softmax(F.rms_norm(h, (40,), w, 1e-6) @ W.t(), -1).gather(-1, (torch.arange(8) * 7)[:, None]).sum()
    lp.backward()
    torch.testing.assert_close(g1[0], h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g1[1], W.grad, rtol=1e-4, atol=1e-5)
