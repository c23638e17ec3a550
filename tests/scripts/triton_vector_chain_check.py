"""Chains fed by 16-byte vector loads (common.dot_tile_vec) on the triton backend, in the interpreter: the
reference's bits, with the interpreter's block sizes and with the GPU's (``interpreter_layout`` patched off).

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_vector_chains.py.
Usage: python tests/scripts/triton_vector_chain_check.py CHECK...; prints "LABEL: ok" / "LABEL: FAIL ..." lines.

* ``gemv``: ``hal.linear`` / ``hal.matmul`` with 1-16 rows give the reference's raw bits, through the vector
  kernel (K contiguous in both operands: 8 consecutive k per load) and through the element-per-step kernel
  (a [K, N] operand, a transposed weight view): K tails inside an 8-step and past a tile, K tiles that are not
  multiples of 8, column tails, every dtype, bias, NaN / inf in x and w. Which kernel ran is counted per case.
* ``gemv_words``: the same with the int64-word chains (common.dot_tile_words: the launchers' choice on Triton < 3.7,
  forced here), which run wherever K and the K tile are whole vectors (4 of the 5 cases) and give the same bits.
* ``gemv_variants``: the GEMV selectors kept for the H200 to decide (matmul.GEMV_LANES, COMBINE_UNROLL,
  GEMV_MAX_ROWS): the cases above under the other lanes / combine, and 33 / 40 rows through the GEMV (GEMV_MAX_ROWS
  64; with 16 they take the FMA-dot tiles), 36 with whole K tiles, each the reference's bits, the GEMV kernels
  counted.
* ``lm_head``: ``hal.token_logprobs`` (the LM head's logits chains) gives the reference's raw bits: vocab and
  hidden sizes off every tile, 1-16 rows (two row blocks with the GPU's 8), temperature, NaN / inf.
* ``lm_head_words``: ``hal.token_logprobs`` with the logits' int64-word chains (token_logprobs.WORDS_LOGITS: the
  launcher's choice on Triton < 3.7 for 2-15 rows of whole vectors, forced here) gives the reference's raw bits.
* ``odd_tiles``: tiles that are not powers of two (softmax / rms_norm tile 20, a vocab tile of 100) give the
  reference's bits with the default layouts (the interpreter's register layout needs power-of-two tiles and
  steps aside; token_logprobs pads a vocab tile's lanes to a power of two).
* ``negative``: common.eight / four returning two neighbours swapped (the chain then adds k+1 before k) is
  caught by both checks.
"""
from __future__ import annotations

import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report  # noqa: E402
from _linear_inputs import linear_inputs  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import matmul as km, token_logprobs as ktl  # noqa: E402
from _swapped_chain import swapped_neighbours  # noqa: E402

CASES = [  # m, k, n, k_tile, dtype, bias, special values
    (1, 200, 37, 64, torch.float32, True, False),    # K tail inside an 8-step of the last tile
    (3, 128, 64, 64, torch.bfloat16, False, True),   # NaN / inf in x and w
    (16, 96, 20, 48, torch.float16, True, False),    # 16 rows, two row blocks on the GPU layout
    (5, 70, 9, 20, torch.float32, False, False),     # k_tile 20: the third step of a tile stops at its end
    (2, 8, 3, 64, torch.bfloat16, True, False),      # one step, one tile
]


def _counting():
    """{kernel name: launches} while it is active (matmul.launch wrapped)."""
    counts, real = {}, km.launch

    def counted(kernel, *a, **kw):
        name = getattr(kernel, "fn", kernel).__name__
        counts[name] = counts.get(name, 0) + 1
        if kw.get("WORDS"):
            counts["words"] = counts.get("words", 0) + 1
        return real(kernel, *a, **kw)
    km.launch = counted
    return counts, real


def _diff(got, want):
    d = first_divergence("out", want, got)
    return None if d is None else str(d)


LAYOUTS = {"interpreter blocks": None, "GPU blocks": lambda: False}


def _layouts():
    """Yield each layout name with the kernels' interpreter_layout patched to it."""
    real = km.interpreter_layout, ktl.interpreter_layout
    for name, patch in LAYOUTS.items():
        km.interpreter_layout, ktl.interpreter_layout = (patch, patch) if patch else real
        try:
            yield name
        finally:
            km.interpreter_layout, ktl.interpreter_layout = real


def _gemv_cases(label_prefix=""):
    for layout in _layouts():
        yield from _gemv_cases_in(f"{label_prefix}{layout}: ")


def _gemv_cases_in(label_prefix):
    for m, k, n, kt, dtype, bias, special in CASES:
        spec = hal.spec.MatmulSpec(k_tile=kt)
        x, w, b = linear_inputs(m, k, n, dtype, bias, special)
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
        vec = 16 // x.element_size()
        words_want = int(km.WORDS_LAYOUT and m > 1 and k % vec == 0 and kt % vec == 0)  # the int64-word chains: rows > 1, whole vectors
        problem = (_diff(got_vec, want) and f"vector kernel: {_diff(got_vec, want)}") or \
            (_diff(got_elem, want) and f"element kernel: {_diff(got_elem, want)}") or \
            (_diff(got_mm, want_mm) and f"matmul: {_diff(got_mm, want_mm)}") or \
            (None if (vec_ran, elem_ran) == (1, 2) else f"kernels ran: vector {vec_ran}, element {elem_ran} (want 1, 2)") \
            or (None if counts.get("words", 0) == words_want else f"word chains ran {counts.get('words', 0)}, want {words_want}")
        yield name, problem


@contextlib.contextmanager
def _words_layout():
    """The int64-word chains (common.dot_tile_words, the launchers' choice on Triton < 3.7) whatever Triton runs."""
    real = km.WORDS_LAYOUT
    km.WORDS_LAYOUT = True
    try:
        yield
    finally:
        km.WORDS_LAYOUT = real


LM_CASES = [  # rows, hidden, vocab, hidden_tile, vocab_tile, dtype, temperature, special values, row groups
    (1, 136, 600, 64, 256, torch.bfloat16, 1.0, False, False),   # vocab off the tile; hidden off 8 and the tile
    (5, 70, 300, 20, 128, torch.float32, 0.7, True, False),      # hidden tile 20 (not a multiple of 4); NaN / inf
    (16, 64, 257, 64, 256, torch.float16, 1.0, False, False),    # 16 rows: two row blocks with the GPU's 8
    (40, 24, 300, 16, 128, torch.bfloat16, 1.0, False, True),    # kept logits in 3 row groups of 16, 16, 8
    (33, 70, 300, 20, 128, torch.float32, 0.7, True, False),     # >= 16 rows: FMA-dot logits (k_tile 20 on 32 lanes)
]


LM_WORDS_CASES = [  # 2-15 rows, hidden size and tile whole 16-byte vectors: the int64-word chains where forced
    (8, 64, 300, 32, 128, torch.bfloat16, 1.0, False, False),    # 8 rows: one row block with the GPU's 8
    (3, 48, 260, 16, 128, torch.float32, 0.7, True, False),      # float32 words, NaN / inf, temperature
    (5, 80, 257, 40, 256, torch.float16, 1.0, False, False),     # hidden tile 40: 5 vectors a tile
]


def _lm_cases(label_prefix="", cases=LM_CASES, words=False):
    """words: the int64-word chains are wanted in the logits pass (matmul.whole_vectors forced on: _words_layout)."""
    for layout in _layouts():
        for rows, h, v, ht, vt, dtype, temp, special, groups in cases:
            g = torch.Generator().manual_seed(rows)
            hid = torch.randn(rows, h, generator=g).to(dtype)
            w = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
            tok = torch.randint(0, v, (rows,), generator=g)
            if special:
                hid[1, 3], w[7, 2] = float("nan"), float("inf")
            spec = hal.spec.TokenLogprobsSpec(hidden_tile=ht, vocab_tile=vt)
            cap, real_launch, ran = ktl._LOGITS_SCRATCH_BYTES, ktl.launch, set()
            ktl._LOGITS_SCRATCH_BYTES = 1 if groups else cap  # the smallest group: 16 rows

            def recorded(kernel, *a, **kw):
                ran.add(getattr(kernel, "fn", kernel).__name__ + (" words" if kw.get("WORDS") else ""))
                return real_launch(kernel, *a, **kw)
            ktl.launch = recorded
            try:
                got = hal.token_logprobs(hid, w, tok, temperature=temp, spec=spec, backend="triton")
            finally:
                ktl._LOGITS_SCRATCH_BYTES, ktl.launch = cap, real_launch
            want_max = "_max_dot_kernel" if rows >= ktl._DOT_MIN_ROWS else "_max_kernel"  # FMA-dot logits from 16 rows
            want_max += " words" if words else ""
            want = hal.token_logprobs(hid, w, tok, temperature=temp, spec=spec, backend="reference")
            yield (f"{label_prefix}{layout}: rows {rows} H{h} V{v} h{ht} v{vt} {str(dtype)[6:]} T{temp}"
                   f"{' nan/inf' if special else ''}{' row groups' if groups else ''}",
                   _diff(got, want) or (None if want_max in ran else f"{want_max} did not run: {sorted(ran)}"))


def check_odd_tiles():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 70, generator=g), torch.randn(70, generator=g)
    hid, lm, tok = torch.randn(2, 16, generator=g), torch.randn(300, 16, generator=g), torch.tensor([1, 250])
    S = hal.spec
    calls = {
        "softmax tile 20": lambda b: hal.softmax(x, spec=S.SoftmaxSpec(tile=20), backend=b),
        "rms_norm tile 20": lambda b: hal.rms_norm(x, w, 1e-6, spec=S.RMSNormSpec(hidden_tile=20), backend=b),
        "token_logprobs vocab tile 100": lambda b: hal.token_logprobs(
            hid, lm, tok, spec=S.TokenLogprobsSpec(vocab_tile=100), backend=b),
    }
    for name, call in calls.items():
        report(name, _diff(call("triton"), call("reference")))


def check_gemv():
    for name, problem in _gemv_cases():
        report(name, problem)


def _order_sensitive_bf16():
    """(label, problem) of a 2 x 8 bf16 GEMV (weights 1; two equal rows: one row keeps the vector chains) whose bf16
    output shows the order of neighbours 0/1, 2/3, ...:
    in order the float32 chain ends at 1 + 2^-8 + 2^-23 (rounds up to 1.0078125), with each pair swapped at
    1 + 2^-8 (a tie: 1.0). Random bf16 data hides a one-ulp float32 change under the output's rounding."""
    x = torch.tensor([[-2.0 ** -17, 2.0 ** -17, 2.0 ** -24, 2.0 ** -8, -2.0 ** -9, 2.0 ** -9, 2.0 ** -24, 1.0]],
                     dtype=torch.bfloat16).repeat(2, 1)
    w = torch.ones(1, 8, dtype=torch.bfloat16)
    spec = hal.spec.MatmulSpec(k_tile=64)
    return "order-sensitive 2x8 bfloat16", _diff(hal.linear(x, w, spec=spec, backend="triton"),
                                                 hal.linear(x, w, spec=spec, backend="reference"))


def check_gemv_words():
    with _words_layout():
        for name, problem in _gemv_cases("words: "):
            report(name, problem)
        name, problem = _order_sensitive_bf16()
        report(f"words: {name}", problem)


@contextlib.contextmanager
def _selected(**values):
    """matmul's GEMV selectors (module constants) set for the block."""
    real = {name: getattr(km, name) for name in values}
    for name, value in values.items():
        setattr(km, name, value)
    try:
        yield
    finally:
        for name, value in real.items():
            setattr(km, name, value)


ROWS_CASES = [  # m, k, n, k_tile, dtype, bias, special: past 16 rows (GEMV_MAX_ROWS 64)
    (33, 136, 40, 64, torch.bfloat16, True, True),   # 5 row blocks of 8 (GPU), K off the tile, NaN / inf
    (40, 70, 9, 20, torch.float32, False, False),    # k_tile 20, column tail
    (36, 128, 24, 64, torch.float16, True, False),   # whole K tiles: the chains without selects (GEMV_EVEN_K)
]


def _rows_cases(lanes, label_prefix=""):
    """(label, problem) of ROWS_CASES through the GEMV (GEMV_MAX_ROWS 64) with the given lanes, both layouts."""
    with _selected(GEMV_MAX_ROWS=64, GEMV_LANES=lanes):
        for layout in _layouts():
            for m, k, n, kt, dtype, bias, special in ROWS_CASES:
                spec = hal.spec.MatmulSpec(k_tile=kt)
                x, w, b = linear_inputs(m, k, n, dtype, bias, special)
                counts, real = _counting()
                try:
                    got = hal.linear(x, w, b, spec=spec, backend="triton")
                finally:
                    km.launch = real
                ran = (counts.get("_gemv_vec_kernel", 0), counts.get("_gemv_combine_kernel", 0))
                yield (f"{label_prefix}max rows 64, lanes {lanes}, {layout}: m{m} k{k} n{n} kt{kt} {str(dtype)[6:]}",
                       _diff(got, hal.linear(x, w, b, spec=spec, backend="reference"))
                       or (None if ran == (1, 1) else f"GEMV kernels ran {ran}, want (1, 1)"))


def check_gemv_variants():
    other_lanes = "tiles" if km.GEMV_LANES == "cols" else "cols"
    other_unroll = 1 if km.COMBINE_UNROLL != 1 else 8
    with _selected(GEMV_LANES=other_lanes, COMBINE_UNROLL=other_unroll):
        for name, problem in _gemv_cases(f"lanes {other_lanes}, combine {other_unroll}: "):
            report(name, problem)
    for lanes in ("cols", "tiles"):
        for name, problem in _rows_cases(lanes):
            report(name, problem)


def check_lm_head():
    for name, problem in _lm_cases():
        report(name, problem)


def check_lm_head_words():
    with _words_layout():
        for name, problem in _lm_cases("words: ", LM_WORDS_CASES, words=True):
            report(name, problem)


def check_negative():
    with swapped_neighbours():
        gemv = [name for name, problem in _gemv_cases("swapped: ") if problem and "vector kernel" in problem]
        lm = [name for name, problem in _lm_cases("swapped: ") if problem]
        with _words_layout():
            words = [name for name, problem in _gemv_cases("swapped words: ") if problem and "vector kernel" in problem]
            name, problem = _order_sensitive_bf16()
            words += [f"swapped words: {name}"] if problem else []
            lm_words = [name for name, problem in _lm_cases("swapped words: ", LM_WORDS_CASES, words=True) if problem]
        rows = [name for name, problem in _rows_cases(km.GEMV_LANES, "swapped: ") if problem]
    report("swapped neighbours caught by the gemv check", None if gemv else "no case caught it")
    report("swapped neighbours caught by the gemv_variants rows check", None if rows else "no case caught it")
    for dt in ("float32", "bfloat16", "float16"):  # floats32, and halves for both 2-byte dtypes
        hit = [name for name in words if name.endswith(dt) or f" {dt} " in name]
        report(f"swapped neighbours caught by the gemv_words check ({dt})", None if hit else "no case caught it")
    report("swapped neighbours caught by the lm_head check", None if lm else "no case caught it")
    report("swapped neighbours caught by the lm_head_words check", None if lm_words else "no case caught it")
    print(f"caught in {len(gemv)} of {2 * len(CASES)} gemv and {len(lm)} of {2 * len(LM_CASES)} lm_head cases",
          flush=True)


if __name__ == "__main__":
    main({"gemv": check_gemv, "gemv_words": check_gemv_words, "gemv_variants": check_gemv_variants, "lm_head": check_lm_head,
          "lm_head_words": check_lm_head_words, "odd_tiles": check_odd_tiles, "negative": check_negative})
