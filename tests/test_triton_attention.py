"""Triton strict attention == the reference bit for bit, in the Triton interpreter (CPU).

Checks (tests/scripts/triton_seq_check.py): varlen (GQA/MQA, causal, sliding window, non-causal with a
right window, p_precision "input", fp32/bf16/fp16, padding rows, an empty sequence) and the KV cache
(paged with page size 7 and a shuffled block table, contiguous, decode, num_splits 0/2/3), with
spec tiles small enough that every block, split and dot tile boundary is crossed. Negative
control: the split partials merged in reverse order are caught.
Packed GQA decode (a group's query heads in one program's tile rows): groups 1, 2, 4 and MQA (group 3),
varlen decode with an empty cache and one shorter than a split, paged with num_splits 1 and 3, also on the
Ascend variant's persistent loop; negative control: rows reading the q of the wrong head of their group.
Vector score chains (the GPU decode layout: 16-byte loads of head dims through common.eight / four) on every
tile: head dims that are not multiples of VEC or of the dot tile; negative control: two neighbours swapped in
the chain. Machine code (sm_90, no GPU): 64 more head dims add exactly one 16-byte k load and one per q row
per VEC head dims to the decode kernel, and no shared memory or shuffle; negative control: one head dim per
step (the prefill / Ascend chain) is flagged.
Default: the first case of each check (CI); LOCKSTEP_FULL=1 pytest ... runs every dtype / mode.
"""
from __future__ import annotations

import os

import pytest

from _triton_seq_run import needs_interpreter, run_checks

pytestmark = needs_interpreter


def test_varlen_bits_equal_reference():
    run_checks("attn-varlen")


def test_kvcache_paged_contiguous_splits_bits_equal_reference():
    run_checks("attn-kvcache")


def test_negative_control_reverse_split_merge_is_caught():
    out = run_checks("attn-negative")
    assert "wrong variant caught" in out


def test_gqa_packed_decode_bits_equal_reference():
    run_checks("attn-gqa-packed")


def test_gqa_packed_decode_ascend_variant_bits_equal_reference():
    run_checks("--ascend", "attn-gqa-packed")


def test_negative_control_wrong_head_in_group_is_caught():
    out = run_checks("attn-gqa-negative")
    assert out.count("wrong variant caught") == 2


def test_decode_tiles_pack_the_group_and_fit_the_unified_buffer(monkeypatch):
    from hal.kernels.triton import ascend_launch
    from hal.kernels.triton.attention import _tiles
    assert _tiles(1, 4, 128, 64) == (4, 1, 4)      # decode: the whole group in one program
    assert _tiles(1, 6, 128, 64) == (8, 1, 6)      # a group of 6: two padding rows
    assert _tiles(16, 4, 128, 64) == (32, 8, 4)    # verify step: heads first, query rows fill the tile
    assert _tiles(17, 4, 128, 64) == (32, 32, 1)   # prefill: one head per program
    assert _tiles(1, 64, 128, 64) == (32, 1, 32)   # MQA with 64 heads: half a group per program
    monkeypatch.setenv("LOCKSTEP_ASCEND_NPU_LAYOUT", "1")
    with ascend_launch.variant("cpu"):
        cap = ascend_launch.fit_block(32, lambda b: [(b, 128)] * 4 + [(b, 64)] * 3)
        assert cap < 32
        for max_q, group in ((1, 4), (1, 32), (1, 6), (16, 8), (40, 1)):
            bm, rows, pack = _tiles(max_q, group, 128, 64)
            assert bm <= cap and rows * pack <= bm and group % pack == 0, (max_q, group, bm, rows, pack)


def test_vector_score_chains_bits_equal_reference():
    run_checks("attn-vector")


def test_vector_score_chains_broadcast_q_bits_equal_reference():
    run_checks("attn-vector-broadcast-q")


def test_negative_control_swapped_chain_order_is_caught():
    out = run_checks("attn-vector-negative")
    assert out.count("wrong variant caught") == 2


# ------------------------------------------------------------------ machine code (sm_90, no GPU needed)

needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="kernels are interpreter objects under TRITON_INTERPRET=1")


def _case(name):
    from hal.kernels.checks import lint
    return next(c for c in lint.strict_kernels(full=True) if c.name == name)


def _score_chain_growth(name, **consts) -> tuple[dict, dict]:
    """(what 64 more head dims add to the decode kernel's machine code, what the vector chains should add: per
    VEC head dims one 16-byte k load and one 16-byte q load per row, nothing through shared memory, no shuffle).
    Compiles the lint case (a packed GQA group of 4 rows, split-KV) at head dims 64 and 128 with the same
    128-wide [rows, head dim] tiles, so only the score chains differ: the per-key loop and the epilogue drop out."""
    import dataclasses
    from hal.kernels.checks.sass_profile import profile_case
    case = _case(name)
    c = dict(case.constexprs, **consts)
    small, large = (profile_case(dataclasses.replace(case, constexprs=dict(c, D=d))) for d in (64, 128))
    fields = ("vector_loads", "narrow_loads", "shared", "barriers", "shuffles")
    want = dict.fromkeys(fields, 0)
    want["vector_loads"] = 64 // c["VEC"] * (1 + c["BLOCK_M"])
    return {f: getattr(large, f) - getattr(small, f) for f in fields}, want


@needs_compiler
@pytest.mark.parametrize("name", ["attention[bf16,paged=True,one_split=True]",
                                  "attention[fp32,paged=True,one_split=True]",
                                  "attention[fp16,paged=False,one_split=True]"])
def test_decode_score_chains_stream_16_byte_vectors(name):
    grown, want = _score_chain_growth(name)
    assert grown == want, name


@needs_compiler
def test_element_per_step_score_chains_are_flagged():
    """Negative control: the same decode kernel with one head dim per step (VEC 1, the prefill / Ascend chain)."""
    grown, want = _score_chain_growth("attention[bf16,paged=True,one_split=True]", VEC=1)
    assert grown != want and grown["narrow_loads"] > 0 and grown["vector_loads"] == 0, grown
