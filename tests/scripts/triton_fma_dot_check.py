"""Strict matmul tiles as float32 ``ieee`` tl.dot (issue 41 item 1), in the Triton interpreter.

Above 16 rows the matmul kernel's K tiles are ``tl.dot(a, b, 0, input_precision="ieee")`` on widened operands
(NVIDIA lowers it to one fma chain per output over k in order); the interpreter runs them through
``interpreter_dot.strict_dot`` (the same chain: one fma_fp32 per step, from the accumulator given).

* ``bits``: hal.linear / hal.matmul on the triton backend give the reference's raw bits (K off the tile, k_tile
  not a power of two, NaN / inf, bias, every dtype), with the interpreter's and the GPU's block sizes, and the
  FMA-dot kernel variant is what ran;
* ``negative``: the same cases with the fast kernels' stand-in (the product rounded first, then added: two
  roundings per step) in place of the strict one differ in the float32 cases: the check sees the stand-in's
  rounding.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report  # noqa: E402
from _linear_inputs import linear_inputs  # noqa: E402
from _variants import two_rounding_dot  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import matmul as km  # noqa: E402

CASES = [  # m, k, n, k_tile, dtype, bias, special values
    (33, 70, 40, 64, torch.float32, True, False),    # K tail of 6 in a 64 tile: 58 padded steps
    (20, 200, 24, 64, torch.bfloat16, False, True),  # NaN / inf in x and w
    (17, 45, 18, 20, torch.float16, True, False),    # k_tile 20 on 32 dot lanes: 12 padded steps a tile
    (40, 128, 16, 64, torch.float32, False, False),  # whole tiles
]


def _cases():
    real_layout, real_gemv_rows = km.interpreter_layout, km.GEMV_MAX_ROWS
    km.GEMV_MAX_ROWS = 16  # 17-64 rows take the dot tiles, not the GEMV (triton_vector_chain_check.py checks that)
    try:
        for layout, patch in (("interpreter blocks", real_layout), ("GPU blocks", lambda: False)):
            km.interpreter_layout = patch  # GPU blocks: the dot tiles of a CUDA launch (64 x 32)
            try:
                for name, problem in _layout_cases():
                    yield f"{layout}: {name}", problem
            finally:
                km.interpreter_layout = real_layout
    finally:
        km.GEMV_MAX_ROWS = real_gemv_rows


def _layout_cases():
    for m, k, n, kt, dtype, bias, special in CASES:
        spec = hal.spec.MatmulSpec(k_tile=kt)
        x, w, b = linear_inputs(m, k, n, dtype, bias, special)
        variants, real = [], km.launch

        def recorded(kernel, *a, **kw):
            if getattr(kernel, "fn", kernel).__name__ == "_matmul_kernel":
                variants.append(kw.get("FMA_DOT"))
            return real(kernel, *a, **kw)
        km.launch = recorded
        try:
            got = hal.linear(x, w, b, spec=spec, backend="triton")
            got_mm = hal.matmul(x, w.t().contiguous(), spec=spec, backend="triton")
        finally:
            km.launch = real
        want = hal.linear(x, w, b, spec=spec, backend="reference")
        want_mm = hal.matmul(x, w.t().contiguous(), spec=spec, backend="reference")
        d = first_divergence("linear", want, got) or first_divergence("matmul", want_mm, got_mm)
        problem = str(d) if d is not None else (None if variants == [True, True] else f"FMA_DOT launches {variants}")
        yield f"m{m} k{k} n{n} kt{kt} {str(dtype)[6:]}{' bias' if bias else ''}{' nan/inf' if special else ''}", problem


def check_bits():
    for name, problem in _cases():
        report(name, problem)


def check_negative():
    with two_rounding_dot():
        caught = [name for name, problem in _cases() if problem]
    report("the fast stand-in (product rounded, then added) is caught in the float32 cases",
           None if sum("float32" in name for name in caught) == 4 else f"caught only in {caught}")


if __name__ == "__main__":
    main({"bits": check_bits, "negative": check_negative})
