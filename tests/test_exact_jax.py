"""The exact matmul policy in hal.jax (int8 lax.dot_general): the reference's bits on random shapes
(M = 1 included), the rounding cases checked against Python fractions, NaN/Inf, raw-bit invariance
under a random K permutation, and the negative control (float32 jnp.dot is caught).

Quick: a handful of shapes (each is an XLA compilation). The full conformance suite:
`hal conformance run --backend jax --ops matmul_exact,token_logprobs_exact` (--quick: 3 cases each).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("jax", reason="jax is not installed (pip install 'lockstep[jax]')")

import hal  # noqa: E402
from hal.spec import ExactMatmulSpec  # noqa: E402
from test_exact_matmul import ROUNDING_CASES, _spread, assert_bits, model_matmul  # noqa: E402

JAX = "jax"


def _both(fn):
    """fn(backend) on the reference and the jax backend: (reference bits, jax bits)."""
    return fn("reference"), fn(JAX)


@pytest.mark.parametrize("dtype,s,m,k,n,bias", [
    (torch.float32, 3, 1, 7, 5, False),      # decode row
    (torch.bfloat16, 4, 6, 129, 9, True),    # K past a tile, bias
    (torch.float16, 3, 3, 40, 4, True),
])
def test_linear_matches_reference(dtype, s, m, k, n, bias):
    x, w = _spread((m, k), dtype, 1), _spread((n, k), dtype, 2)
    b = _spread((n,), dtype, 3) if bias else None
    spec = ExactMatmulSpec(slices=s)
    ref, got = _both(lambda be: hal.linear(x, w, b, spec=spec, backend=be))
    assert_bits(f"{dtype} s{s} linear", ref, got)


def test_batched_matmul_and_direct_api():
    """hal.jax.matmul on jax arrays (leading batch dims) gives the torch reference's bits."""
    import jax.numpy as jnp
    import numpy as np
    import hal.jax as hj
    a, b = _spread((2, 3, 20), torch.float32, 4), _spread((20, 6), torch.float32, 5)
    spec = ExactMatmulSpec(slices=4)
    got = hj.matmul(jnp.asarray(a.numpy()), jnp.asarray(b.numpy()), spec=spec)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 6)
    assert_bits("hal.jax.matmul", hal.matmul(a, b, spec=spec, backend="reference"), torch.from_numpy(np.asarray(got).copy()))


@pytest.mark.parametrize("dtype,s", sorted({(c[1], c[4]) for c in ROUNDING_CASES}, key=str), ids=str)
def test_rounding_cases_against_fractions(dtype, s):
    """Ties, double rounding, overflow, subnormal inputs and results: every case of one (dtype, s) in
    one call (each row / column zero-padded to K = 3, which the exact policy ignores); the diagonal."""
    rows = [c for c in ROUNDING_CASES if (c[1], c[4]) == (dtype, s)]
    a = torch.tensor([r + [0.0] * (3 - len(r)) for _, _, r, _, _ in rows], dtype=torch.float64).to(dtype)
    b = torch.tensor([c + [0.0] * (3 - len(c)) for _, _, _, c, _ in rows], dtype=torch.float64).to(dtype).T.contiguous()
    got = hal.matmul(a, b, spec=ExactMatmulSpec(slices=s), backend=JAX).diagonal()
    for i, (label, *_rest) in enumerate(rows):
        assert_bits(label, model_matmul(a[i:i + 1], b[:, i:i + 1], s)[0], got[i:i + 1])


def test_nan_inf_zero_rows_match_reference():
    inf, nan = math.inf, math.nan
    a = torch.tensor([[1.0, 2.0, 3.0], [inf, 1.0, 0.0], [nan, 1.0, 1.0], [0.0, -0.0, 0.0], [inf, -inf, 1.0],
                      [-inf, 2.0, 1.0]]).bfloat16()
    b = torch.tensor([[1.0, 1.0, 0.0, 1.0], [2.0, -1.0, 1.0, inf], [1.0, 1.0, 1.0, 0.0]]).bfloat16()
    bias = torch.tensor([0.5, -0.0, 1.0, -inf]).bfloat16()
    spec = ExactMatmulSpec(slices=3)
    ref, got = _both(lambda be: hal.linear(a, b.T.contiguous(), bias, spec=spec, backend=be))
    assert_bits("nan/inf/zeros", ref, got)  # canonical NaN, +0.0 for exact zeros, IEEE infinities
    assert int(got[3, 1].view(torch.int16)) == 0  # the exact zero dot is +0.0, plus bias -0.0: +0.0


def test_k_permutation_invariance_and_float32_dot_is_caught():
    """Raw bits under a random K permutation; the negative control, float32 jnp.dot through the same
    permutation and against the exact bits, is caught."""
    import jax.numpy as jnp
    import numpy as np
    k = 1024
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, k, generator=g)
    w = torch.randn(8, k, generator=g) * k ** -0.5
    perm = torch.randperm(k, generator=g)
    spec = ExactMatmulSpec(slices=4)
    base = hal.linear(x, w, spec=spec, backend=JAX)
    assert_bits("K permuted", base, hal.linear(x[:, perm], w[:, perm], spec=spec, backend=JAX))
    assert_bits("== reference", hal.linear(x, w, spec=spec, backend="reference"), base)

    def f32(xx, ww):
        return torch.from_numpy(np.asarray(jnp.dot(jnp.asarray(xx.numpy()), jnp.asarray(ww.numpy()).T)).copy())
    stock = f32(x, w)
    assert not torch.equal(stock.view(torch.int32), base.view(torch.int32)), "float32 jnp.dot matched the exact bits"
    assert not torch.equal(stock.view(torch.int32), f32(x[:, perm], w[:, perm]).view(torch.int32)), \
        "float32 jnp.dot was invariant under the K permutation (the check could not fail)"


def test_bad_inputs():
    spec = ExactMatmulSpec(slices=3)
    big = torch.zeros(1, 2 ** 24 + 1, dtype=torch.bfloat16)
    with pytest.raises(hal.InputError, match="2\\*\\*24"):
        hal.linear(big, big, spec=spec, backend=JAX)
    import jax.numpy as jnp
    import hal.jax as hj
    with pytest.raises(hal.InputError, match="dtype"):
        hj.linear(jnp.zeros((2, 3), jnp.int32), jnp.zeros((4, 3), jnp.int32), spec=spec)
