"""The linear check scripts' inputs (triton_fma_dot_check.py, triton_vector_chain_check.py): x [m, k], w [n, k] and
an optional bias b [n] in one dtype, seeded; ``special`` plants NaN and infinities in x and w."""
from __future__ import annotations

import torch


def linear_inputs(m, k, n, dtype, bias, special, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    if special:
        x[0, 5], w[1, 7], w[2, 3], x[-1, 100] = float("nan"), float("inf"), float("-inf"), float("inf")
    return x, w, b
