"""RMSNorm and softmax sums on the triton backend (kernels/triton/rms_norm.py, softmax.py), in the interpreter.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_norm_softmax.py.
Usage: python tests/scripts/triton_norm_softmax_check.py CHECK...; prints "LABEL: ok" / "LABEL: FAIL ..." lines.

* ``bits``: the GPU layout (reg=False: 16-byte vector steps through common.eight / four) and the interpreter's
  register layout (reg=True; power-of-2 tiles only, its [BR, NTB, T] block needs one) give the reference's raw
  bits: rms_norm (with and without residual) and softmax / log_softmax / logsumexp, every dtype, lengths that are not multiples of VEC or of the tile, tiles that are not
  multiples of VEC (18, 20, 36), more tiles than one chain block (NTB), short rows (many rows per program),
  NaN / +inf / -inf / -0.0 inputs, fully -inf softmax rows, a residual that makes inf - inf.
* ``split``: softmax / log_softmax / logsumexp run split across the row (softmax._run_split: chunk maxima, tile sums,
  tile order, outputs per chunk) give the reference's raw bits on both layouts: every softmax case above plus long
  rows across several column chunks with NaN / +inf / -inf / -0.0 in later chunks.
* ``negative``: common.eight / four returning two neighbours swapped (the chain then takes element i+1 before i)
  is caught on the GPU layout, in each kernel through each split (eight: 2-byte dtypes, four: float32); the
  eight swap shows only in the order-sensitive rows (see _order_sensitive_cases).
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report  # noqa: E402

from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.reference import rms_norm as ref_norm, softmax as ref_softmax  # noqa: E402
from hal.kernels.reference.strict_math import canonical_nan  # noqa: E402
from hal.kernels.triton import rms_norm as tri_norm, softmax as tri_softmax  # noqa: E402
from _swapped_chain import swapped_neighbours  # noqa: E402
from hal.spec import DEFAULTS  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

NORM_CASES = [  # rows, H, hidden_tile, dtype, residual, special values
    (5, 300, 256, BF16, True, True),     # H % 8 = 4: the last vector step of the last tile is half past the end
    (3, 100, 18, F32, True, False),      # tile 18 % 4 = 2: each tile's last step stops at the tile's end
    (5, 200, 36, F16, False, True),      # tile 36 % 8 = 4
    (3, 700, 20, BF16, True, False),     # 35 tiles: two chain blocks of NTB = 32
    (2, 5, 256, BF16, False, False),     # H < VEC: one masked step
    (130, 40, 256, F32, False, True),    # short rows: 128 rows per program, two programs
]
SOFTMAX_CASES = [  # rows, n, tile, dtype, special values
    (6, 300, 256, BF16, True),
    (4, 100, 18, F32, False),
    (6, 200, 36, F16, True),
    (3, 1500, 20, BF16, False),          # 75 tiles: three chain blocks of NTB = 32
    (2, 5, 256, BF16, False),
    (130, 40, 256, F32, True),
]


def _randn(shape, dtype, g, scale=3.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _poison(x):
    """NaN, +inf, -inf and -0.0 in rows 1-4 (row 0 stays finite; special cases have at least 5 rows)."""
    n = x.shape[1]
    for row, col, v in ((1, n // 2, float("nan")), (2, n - 1, float("inf")), (3, 0, float("-inf")), (4, n // 3, -0.0)):
        x[row, col] = v
    return x


def _norm_inputs(rows, h, dtype, residual, special, g):
    x, w = _randn((rows, h), dtype, g), _randn((h,), dtype, g, 1.0)
    r = _randn((rows, h), dtype, g) if residual else None
    if special:
        _poison(x)
        if r is not None:  # inf + -inf = NaN in h = x + r
            x[0, 1], r[0, 1] = float("inf"), float("-inf")
    return x, w, r


def _softmax_input(rows, n, dtype, special, g):
    x = _randn((rows, n), dtype, g)
    if special:
        _poison(x)
        x[rows - 1] = float("-inf")  # a fully -inf row
    return x


def _diff(label, want, got):
    return first_divergence(label, canonical_nan(want), got)


def _norm_problem(x, w, r, eps, t, reg):
    spec = dataclasses.replace(DEFAULTS["rms_norm"], hidden_tile=t)
    want = ref_norm.rms_norm(x, w, eps, r, spec)
    got = tri_norm.rms_norm(x, w, eps, r, spec, reg)
    pairs = zip(("y", "h"), want, got) if r is not None else [("y", want, got)]
    return next((str(d) for d in (_diff(name, a, b) for name, a, b in pairs) if d), None)


def _softmax_problem(x, t, reg, split=None):
    spec = dataclasses.replace(DEFAULTS["softmax"], tile=t)
    for op in ("softmax", "log_softmax", "logsumexp"):
        d = _diff(op, getattr(ref_softmax, op)(x, spec), getattr(tri_softmax, op)(x, spec, reg, split))
        if d:
            return str(d)
    return None


def _order_sensitive_cases():
    """(label, dtype, tile, problem(reg)) of two bf16 rows whose outputs show the order of elements 4 and 5 (the
    pair the negative control swaps in the 8-element steps): in random bf16 data a one-ulp change of the float32
    sum hides under the output's rounding. Element 5 is the row's big term; every other term is ~0.11 ulp(1): in
    order, five of them (0.55 ulp) then 1 round up to 1 + 2^-23; element 5 before 4 rounds four (0.44 ulp) away."""
    x = torch.full((1, 16), -18.125).to(BF16)  # exp(-18.125) = 0.113 ulp(1)
    x[0, 5] = 0.0  # log_softmax[5] = -log S: -2^-23 in order, 0 with 4 and 5 swapped
    yield "softmax order-sensitive 1x16 bfloat16", BF16, 256, lambda reg, split=None: _softmax_problem(x, 256, reg, split)
    h = torch.full((1, 16), 1.1444091796875e-4).to(BF16)  # squares: 0.11 ulp(1)
    h[0, 5] = 1.0
    eps = float.fromhex("0x1.00c18p-12")  # puts y[5] = 1 / sqrt(S / 16 + eps) at the bf16 tie between 3.984375 and 4
    w = torch.ones(16, dtype=BF16)
    yield "rms_norm order-sensitive 1x16 bfloat16", BF16, 256, lambda reg: _norm_problem(h, w, None, eps, 256, reg)


def _cases():
    """(label, dtype, tile, problem(reg)) of every case."""
    for i, (rows, h, t, dtype, residual, special) in enumerate(NORM_CASES):
        label = (f"rms_norm {rows}x{h} tile {t} {str(dtype)[6:]}{' residual' if residual else ''}"
                 f"{' nan/inf' if special else ''}")
        x, w, r = _norm_inputs(rows, h, dtype, residual, special, torch.Generator().manual_seed(i))
        yield label, dtype, t, lambda reg, x=x, w=w, r=r, t=t: _norm_problem(x, w, r, 1e-6, t, reg)
    for i, (rows, n, t, dtype, special) in enumerate(SOFTMAX_CASES):
        label = f"softmax {rows}x{n} tile {t} {str(dtype)[6:]}{' nan/inf/-inf row' if special else ''}"
        x = _softmax_input(rows, n, dtype, special, torch.Generator().manual_seed(i))
        yield label, dtype, t, lambda reg, split=None, x=x, t=t: _softmax_problem(x, t, reg, split)
    yield from _order_sensitive_cases()


def _split_cases():
    """(label, dtype, tile, problem(reg)) of the softmax cases run split across the row (softmax._run_split), plus
    long rows that cross several column chunks of both layouts' blocks (the GPU layout's chunk is 2048 bf16 / 1024
    float32 columns), with -inf, NaN and -0.0 in later chunks and a row whose max is in its last chunk."""
    for label, dtype, t, problem in _cases():
        if label.startswith("softmax"):
            yield label.replace("softmax ", "softmax split ", 1), dtype, t, lambda reg, p=problem: p(reg, True)
    for i, (rows, n, t, dtype) in enumerate(((3, 5000, 256, BF16), (2, 2600, 36, F32), (5, 4500, 128, F16))):
        g = torch.Generator().manual_seed(100 + i)
        x = _randn((rows, n), dtype, g)
        x[0, n - 3] = 40.0  # the max in the last chunk
        if rows == 5:
            x[1, 3000] = float("nan")
            x[2, 2100] = float("inf")
            x[3] = float("-inf")
            x[3, 4400] = -0.0  # the only finite element: M = -0.0, S = 1
        yield f"softmax split {rows}x{n} tile {t} {str(dtype)[6:]}", dtype, t, \
            lambda reg, x=x, t=t: _softmax_problem(x, t, reg, True)


def _run_cases(regs, prefix="", cases=None):
    """(label, dtype, problem) per case and layout (the register layout: power-of-2 tiles only)."""
    for reg in regs:
        layout = "register layout" if reg else "GPU layout"
        for label, dtype, t, problem in (cases or _cases)():
            if not (reg and t & (t - 1)):
                op, rest = label.split(" ", 1)
                yield f"{prefix}{op} {layout} {rest}", dtype, problem(reg)


def check_bits():
    for label, _, problem in _run_cases((False, True)):
        report(label, problem)


def check_split():
    for label, _, problem in _run_cases((False, True), cases=_split_cases):
        report(label, problem)


def check_negative():
    with swapped_neighbours():
        results = list(_run_cases((False,), "swapped: "))
        results += list(_run_cases((False,), "swapped: ", _split_cases))
    for op in ("rms_norm", "softmax", "softmax split"):
        name, is_split = op.split(" ")[0], op.endswith("split")
        for split, dtypes in (("eight", (BF16, F16)), ("four", (F32,))):
            caught = [label for label, dtype, problem in results
                      if problem and dtype in dtypes and label.startswith(f"swapped: {name} ")
                      and ("layout split " in label) == is_split]
            report(f"swapped neighbours in the {op} chain ({split}) are caught", None if caught else "no case caught it")
            print(f"  in {caught}", flush=True)


if __name__ == "__main__":
    main({"bits": check_bits, "split": check_split, "negative": check_negative})
