"""Decode GEMV on the triton backend (kernels/triton/matmul.py), in the interpreter: the reference's bits.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_gemv.py.
Usage: python tests/triton_gemv_check.py CHECK...; prints "LABEL: ok" / "LABEL: FAIL ..." lines.

* ``bits``: ``hal.linear`` / ``hal.matmul`` with 1-16 rows on the triton backend give the reference's raw bits,
  through the vector kernel (K contiguous in both operands: 8 consecutive k per load, common.eight) and through
  the element-per-step kernel (a [K, N] operand, a transposed weight view): K tails inside an 8-step and past a
  tile, K tiles that are not multiples of 8, column tails, every dtype, bias, NaN / inf in x and w. Which kernel
  ran is counted per case.
* ``negative``: common.eight / four returning two neighbours swapped (the chain then adds k+1 before k) is caught.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's hal
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _check_cli import main, report  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import common, matmul as km  # noqa: E402

CASES = [  # m, k, n, k_tile, dtype, bias, special values
    (1, 200, 37, 64, torch.float32, True, False),    # K tail inside an 8-step of the last tile
    (3, 128, 64, 64, torch.bfloat16, False, True),   # NaN / inf in x and w
    (16, 96, 20, 48, torch.float16, True, False),    # 16 rows, two row blocks on the GPU layout
    (5, 70, 9, 20, torch.float32, False, False),     # k_tile 20: the third step of a tile stops at its end
    (2, 8, 3, 64, torch.bfloat16, True, False),      # one step, one tile
]


def _inputs(m, k, n, dtype, bias, special, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    if special:
        x[0, 5], w[1, 7], w[2, 3], x[-1, 100] = float("nan"), float("inf"), float("-inf"), float("inf")
    return x, w, b


def _counting():
    """{kernel name: launches} while it is active (matmul.launch wrapped)."""
    counts, real = {}, km.launch

    def counted(kernel, *a, **kw):
        name = getattr(kernel, "fn", kernel).__name__
        counts[name] = counts.get(name, 0) + 1
        return real(kernel, *a, **kw)
    km.launch = counted
    return counts, real


def _diff(got, want):
    d = first_divergence("out", want, got)
    return None if d is None else str(d)


def _run_cases(label_prefix=""):
    bad = []
    for m, k, n, kt, dtype, bias, special in CASES:
        spec = hal.spec.MatmulSpec(k_tile=kt)
        x, w, b = _inputs(m, k, n, dtype, bias, special)
        name = f"{label_prefix}m{m} k{k} n{n} kt{kt} {str(dtype)[6:]}{' bias' if bias else ''}{' nan/inf' if special else ''}"
        counts, real = _counting()
        try:
            got_vec = hal.linear(x, w, b, spec=spec, backend="triton")
            vec_ran = counts.get("_gemv_vec_kernel", 0)
            got_elem = hal.linear(x, w.t().contiguous().t(), b, spec=spec, backend="triton")  # [K, N]-major weight
            got_mm = hal.matmul(x, w.t().contiguous(), spec=spec, backend="triton")
            elem_ran = counts.get("_gemv_partials_kernel", 0)
        finally:
            km.launch = real
        want = hal.linear(x, w, b, spec=spec, backend="reference")
        want_mm = hal.matmul(x, w.t().contiguous(), spec=spec, backend="reference")
        problem = (_diff(got_vec, want) and f"vector kernel: {_diff(got_vec, want)}") or \
            (_diff(got_elem, want) and f"element kernel: {_diff(got_elem, want)}") or \
            (_diff(got_mm, want_mm) and f"matmul: {_diff(got_mm, want_mm)}") or \
            (None if (vec_ran, elem_ran) == (1, 2) else f"kernels ran: vector {vec_ran}, element {elem_ran} (want 1, 2)")
        bad.append(problem)
        yield name, problem


def check_bits():
    for name, problem in _run_cases():
        report(name, problem)


_REAL_EIGHT, _REAL_FOUR = common.eight, common.four


@triton.jit
def _swapped_eight(x, D0: tl.constexpr, D1: tl.constexpr):
    x0, x1, x2, x3, x4, x5, x6, x7 = _REAL_EIGHT(x, D0, D1)
    return x0, x1, x2, x3, x5, x4, x6, x7


@triton.jit
def _swapped_four(x, D0: tl.constexpr, D1: tl.constexpr):
    x0, x1, x2, x3 = _REAL_FOUR(x, D0, D1)
    return x0, x2, x1, x3


def check_negative():
    common.eight, common.four = _swapped_eight, _swapped_four
    try:
        caught = [name for name, problem in _run_cases("swapped: ") if problem and "vector kernel" in problem]
    finally:
        common.eight, common.four = _REAL_EIGHT, _REAL_FOUR
    report("swapped neighbours in the chain are caught", None if caught else "no case caught it")
    print(f"caught in {len(caught)} of {len(CASES)} cases", flush=True)


if __name__ == "__main__":
    main({"bits": check_bits, "negative": check_negative})
