"""Strict prefill attention tiles as float32 ``ieee`` tl.dot (issue 41 item 1), in the Triton interpreter.

Prefill-sized tiles (>= 16 rows, kv_block >= 16) take their scores as dots per head-dim tile and, in blocks whose
keys are each seen by every valid row or by none, P.V and l as dots (each chain split over dots of attention.DOT_K
lanes, each continuing the last one's accumulator) (attention_kernel._scores_fma_dot /
_block_fma_dot); the interpreter runs them through ``interpreter_dot.strict_dot`` (one fma_fp32 per step from the
accumulator given, NVIDIA's FMA dot lowering).

* ``bits``: varlen and paged prefill on the triton backend give the reference's raw bits (head dim off the dot
  tile, dot_tile not a power of two, causal diagonal blocks next to whole blocks, windows, GQA, p_precision input,
  NaN / inf in V rows no query sees, a V column whose chain ends at -0.0 before keys past the sequence), and the
  FMA-dot variant is what ran;
* ``golden``: the attention suite's signed-zero golden case (fp32) gives its golden bits, and the +0.0-padded
  variant below does not (the golden case catches it);
* ``negative``: three wrong variants, each caught by the same comparison: V rows of unseen keys loaded as +0.0
  (a +0 * +0 step turns a chain at -0.0 into +0.0), the fast kernels' stand-in (two roundings per step) in
  place of the strict one, and a block's key chunks chained last chunk first.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402
from _check_cli import main, report  # noqa: E402
from _variants import kernel_variant, two_rounding_dot  # noqa: E402

from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.reference import attention as ref_attn  # noqa: E402
from hal.kernels.triton import attention as tri_attn, attention_kernel as tri_kernel  # noqa: E402
from hal.spec import AttentionSpec  # noqa: E402

TINY = torch.tensor(1, dtype=torch.int32).view(torch.float32).item()  # the smallest float32 subnormal

CASES = [  # name, spec, dtype, causal, window, Hq, Hkv, D, lens_q, lens_k, special
    ("signed zero fp32 D24 dot_tile 20", AttentionSpec(kv_block=16, kv_split=48, dot_tile=20), torch.float32, False,
     (-1, -1), 2, 1, 24, (20,), (138,), "signed_zero"),
    ("causal fp32 D24 dot_tile 20", AttentionSpec(kv_block=16, kv_split=32, dot_tile=20), torch.float32, True,
     (-1, -1), 2, 1, 24, (40, 17), (70, 17), None),
    ("window bf16 p input GQA", AttentionSpec(kv_block=16, kv_split=64, dot_tile=16, p_precision="input"),
     torch.bfloat16, True, (21, -1), 4, 2, 16, (33, 20), (50, 20), None),
    ("non-causal fp16 window nan/inf", AttentionSpec(kv_block=32, kv_split=64, dot_tile=8), torch.float16, False,
     (9, 5), 2, 1, 12, (30, 18), (45, 40), "nonfinite"),
    # kv_block 64: P.V and l in 4 dots of attention.DOT_K (16) keys each, keys past the sequence in the last chunks
    ("causal bf16 kv_block 64 D40 dot_tile 20", AttentionSpec(kv_block=64, kv_split=128, dot_tile=20),
     torch.bfloat16, True, (-1, -1), 2, 1, 40, (70, 17), (150, 81), None),
]


def signed_zero_values(q, k, v):
    """One sequence whose output ends at -0.0 in head dim 0 only if the last block's P.V chain keeps -0.0 through
    the keys past the sequence (138..143 of the block [128, 144)); kv_block 16, kv_split 48, 138 keys, non-causal.
    Scores are 0.3 * k[:, 0] (q = e_0); a -0.0 survives only where the running value it is added to is exactly
    -0.0, so it is built up the spec's way: split 1 (score 0, one V of -TINY) leaves ACC = -TINY; split 2 (score 3:
    ACC * exp(-3) underflows) leaves ACC = -0.0; in split 3 block [96, 112) (score 0, one -TINY) leaves acc =
    -TINY, block [112, 128) (score 3) turns it into -0.0, and block [128, 144) starts with p = exp(-3) times -TINY
    (underflows to -0.0) followed by -0.0 products: a +0.0 product anywhere after that (a padded step of +0 * +0)
    makes the output +0.0."""
    tiny = TINY
    q.zero_()
    q[..., 0] = 1.0
    k[..., 0] = 0.0
    v[..., 0] = -0.0
    v[5, :, 0] = -tiny        # split 1
    k[48:96, :, 0] = 10.0     # split 2
    v[100, :, 0] = -tiny      # split 3, block 1
    k[112:138, :, 0] = 10.0   # blocks 2 and 3
    k[128, :, 0] = 0.0
    v[128, :, 0] = -tiny


def _inputs(i, dt, hq, hkv, d, lens_q, lens_k, special):
    g = torch.Generator().manual_seed(40 + i)
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cq[-1]), hq, d, generator=g)
    k, v = torch.randn(int(ck[-1]), hkv, d, generator=g), torch.randn(int(ck[-1]), hkv, d, generator=g)
    if special == "signed_zero":
        signed_zero_values(q, k, v)
    if special == "nonfinite":  # keys no query sees (window) and one seen key
        v[0, 0, 3], v[1, 0, 5], v[int(ck[1]) + 39, 0, 0] = float("inf"), float("nan"), float("-inf")
        q[3, 1, 2] = float("nan")
    return q.to(dt), k.to(dt), v.to(dt), cq, ck


def _cases():
    for i, (name, spec, dt, causal, window, hq, hkv, d, lens_q, lens_k, special) in enumerate(CASES):
        q, k, v, cq, ck = _inputs(i, dt, hq, hkv, d, lens_q, lens_k, special)
        args = (q, k, v, cq, ck, max(lens_q), max(lens_k), 0.3, causal, window, spec)
        variants, real = [], tri_attn.launch

        def recorded(kernel, *a, **kw):
            if "FMA_DOT" in kw:
                variants.append(kw["FMA_DOT"])
            return real(kernel, *a, **kw)
        tri_attn.launch = recorded
        try:
            got = tri_attn.flash_attn_varlen_func(*args)
        finally:
            tri_attn.launch = real
        want = ref_attn.flash_attn_varlen_func(*args)
        if special == "signed_zero":  # the inputs do what they are for: -0.0 outputs, and a +0.0 would be caught
            n_neg_zero = int((want[0][..., 0] == 0).logical_and(want[0][..., 0].signbit()).sum())
            if n_neg_zero < want[0][..., 0].numel():
                yield name, f"only {n_neg_zero} -0.0 outputs in head dim 0: the signed-zero inputs do not work"
                continue
        d_out = first_divergence("out", want[0], got[0]) or first_divergence("lse", want[1], got[1])
        yield name, (str(d_out) if d_out is not None else
                     None if variants and all(variants) else f"FMA_DOT launches {variants}")


def check_bits():
    for name, problem in _cases():
        report(name, problem)


def check_negative():
    with kernel_variant(tri_kernel, "_block_fma_dot", "neg_zero_where(v_ok, sm.widen", "neg_zero_where(v_ok | True, sm.widen"):
        caught = [name for name, problem in _cases() if problem]
    report("V rows of unseen keys loaded as +0.0 are caught (the signed-zero case)",
           None if caught == [CASES[0][0]] else f"caught in {caught}")
    with two_rounding_dot():
        caught = [name for name, problem in _cases() if problem]
    report("the fast stand-in (product rounded, then added) is caught in the random float32 case",
           None if CASES[1][0] in caught else f"caught only in {caught}")
    # the key chunks of a block chained out of key order (last chunk first): a different fma order per output
    with kernel_variant(tri_kernel, "_block_fma_dot", "for c in tl.static_range(NC):",
                        "for c in tl.static_range(NC - 1, -1, -1):"):
        caught = [name for name, problem in _cases() if problem]
    report("P.V / l dots chained out of key order are caught in the kv_block 64 case",
           None if CASES[4][0] in caught else f"caught only in {caught}")


def _golden_case_differs():
    """The attention suite's signed-zero golden case (fp32) on the triton backend against its golden file: the
    first divergence, or None."""
    from hal.conformance import golden
    from hal.conformance.suites.attention import SUITE
    case = next(c for c in SUITE.cases() if c.id == "signed_zero_h2kv1_d40_noncausal.fp32")
    inputs = SUITE.make_inputs(case)
    got = SUITE.run("triton", case, inputs)
    want = golden.load("attention", case, inputs, outputs=list(got))
    for name in sorted(got):
        d = first_divergence(name, want[name], got[name])
        if d is not None:
            return str(d)
    return None


def check_golden():
    """The golden case gives its bits; with V rows of unseen keys loaded as +0.0 it does not (the golden catches
    the wrong padding: the negative control of the golden case itself)."""
    report("golden signed_zero_h2kv1_d40_noncausal.fp32: triton == golden", _golden_case_differs())
    with kernel_variant(tri_kernel, "_block_fma_dot", "neg_zero_where(v_ok, sm.widen", "neg_zero_where(v_ok | True, sm.widen"):
        problem = _golden_case_differs()
    report("golden signed_zero_h2kv1_d40_noncausal.fp32 catches V padded with +0.0",
           None if problem else "the +0.0-padded variant gave the golden bits")


if __name__ == "__main__":
    main({"bits": check_bits, "negative": check_negative, "golden": check_golden})
