"""hal.ops.linear_with_float32: the strict linear's output and the float32 result it rounded, from one pass.

Raw bits on each backend that serves it (reference, cpu: the 1-row, 2-8-row streaming and gemm kernels): the
output is hal.linear's, the float32 result rounded once (round to nearest even) is hal.linear's output, and it is
the float32 logits hal.token_logprobs reduces (hal.sampling.logits_logprobs of it gives token_logprobs' bits).
Special values in the operands: NaN, +-inf, -0.0, subnormals. Negative controls: the rounded output widened is not
the float32 result; another K tile's float32 result is caught; the backends without it refuse by name."""
from __future__ import annotations

import pytest
import torch

import hal
from hal.conformance.bits import same_bits
from hal.ops import linear_with_float32
from hal.sampling import head_logits_are_the_logprobs_dot, logits_logprobs
from hal.spec import MatmulSpec, TokenLogprobsSpec
from hal.torch_ops import routed

BACKENDS = ["reference", "cpu"]
HALF = [torch.bfloat16, torch.float16]


def _special(dtype, rows, k=80, n=70, seed=0, inf=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    tiny = torch.finfo(dtype).tiny
    x[0, :4] = torch.tensor([-0.0, tiny / 4, -tiny / 8, 3 * tiny / 16])  # -0.0 and subnormals of the dtype
    w[:3, :4] = torch.tensor([-0.0, tiny / 2, tiny / 4, -0.0])
    w[5] = -0.0  # a column of -0.0 products
    if inf:
        w[6, 9] = float("inf")  # +-inf per row of x (NaN where the sum meets the other sign)
    if rows > 1:
        x[-1, 11] = float("nan")  # a NaN row
    if rows > 2:
        x[1, 9] = 0.0  # inf * 0: NaN in column 6 of row 1
    return x, w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 11])  # cpu: decode streaming (1 and 2-8 rows), the gemm
def test_output_is_linear_and_float32_result_rounds_to_it(backend, dtype, rows):
    x, w = _special(dtype, rows)
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)
    for b in (None, bias):
        y, y32 = linear_with_float32(x, w, b, backend=backend)
        ref = hal.linear(x, w, b, backend=backend)
        assert y32.dtype == torch.float32 and y32.data_ptr() != y.data_ptr()
        assert same_bits(y, ref)
        finite = ~torch.isnan(y32)
        assert same_bits(y32.to(dtype)[finite], ref[finite])  # the rounding of every non-NaN value
        assert torch.equal(torch.isnan(ref), ~finite)  # NaN exactly where the float32 result is NaN
        assert same_bits(y32, linear_with_float32(x, w, b, backend="reference")[1])  # one float32 result
    assert bool(torch.isnan(y32).any()) == (rows > 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF)
def test_float32_result_is_unrounded_negative_control(backend, dtype):
    """The check above can fail: hal.linear's rounded output widened is not the float32 result, and another K
    tile's float32 result (another chain) differs from it."""
    x, w = _special(dtype, 3, k=300)
    y, y32 = linear_with_float32(x, w, backend=backend)
    assert not same_bits(y.float(), y32)
    _, other = linear_with_float32(x, w, spec=MatmulSpec(k_tile=32), backend=backend)
    assert not same_bits(other, y32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_result_gives_token_logprobs_bits(backend, dtype, temperature):
    """The float32 result is the logits hal.token_logprobs reduces (K tile == the spec's hidden tile)."""
    x, w = _special(dtype, 6, k=96, n=300, inf=False)  # one NaN row, the others finite
    x[2, 5] = float("inf")  # and a row with +-inf logits
    g = torch.Generator().manual_seed(2)
    tok, every = torch.randint(0, 300, (6,), generator=g), torch.arange(300).expand(6, 300)
    assert head_logits_are_the_logprobs_dot(dtype)
    _, y32 = linear_with_float32(x, w, backend=backend)
    assert same_bits(logits_logprobs(y32, tok, temperature, backend=backend),
                     hal.token_logprobs(x, w, tok, temperature, backend=backend))
    assert same_bits(logits_logprobs(y32, every, temperature, backend=backend),
                     hal.token_logprobs(x, w, every, temperature, backend=backend))
    # control: another hidden tile's token_logprobs is another chain, and the predicate says so
    other = TokenLogprobsSpec(hidden_tile=32)
    assert not head_logits_are_the_logprobs_dot(dtype, spec=other)
    assert not same_bits(logits_logprobs(y32, every, temperature, spec=other, backend=backend),
                         hal.token_logprobs(x, w, every, temperature, spec=other, backend=backend))


@pytest.mark.parametrize("backend", ["stock", "jax"])
def test_backends_without_the_float32_result_refuse_by_name(backend):
    x, w = _special(torch.bfloat16, 3)
    with pytest.raises(hal.UnsupportedError, match=backend):
        linear_with_float32(x, w, backend=backend)


def test_refusals():
    x, w = _special(torch.bfloat16, 3)
    with pytest.raises(hal.UnsupportedError, match="eagerly"), routed():
        linear_with_float32(x, w)
    with pytest.raises(hal.UnsupportedError, match="backward"):
        linear_with_float32(x.float().requires_grad_(), w.float())
    with pytest.raises(hal.UnsupportedError, match="float64"):
        linear_with_float32(x.double(), w.double())
    with pytest.raises(hal.UnsupportedError, match="strict"):
        linear_with_float32(x, w, spec="matmul.exact.s4.v2")
    with pytest.raises(hal.InputError, match="weight"):
        linear_with_float32(x, w[:, :-1])
