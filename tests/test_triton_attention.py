"""Triton strict attention == the reference bit for bit, in the Triton interpreter (CPU).

Checks (tests/triton_seq_check.py): varlen (GQA/MQA, causal, sliding window, non-causal with a
right window, p_precision "input", fp32/bf16/fp16, padding rows, an empty sequence) and the KV cache
(paged with page size 7 and a shuffled block table, contiguous, decode, num_splits 0/2/3), with
spec tiles small enough that every block, split and dot tile boundary is crossed. Negative
control: the split partials merged in reverse order are caught.
Packed GQA decode (a group's query heads in one program's tile rows): groups 1, 2, 4 and MQA (group 3),
varlen decode with an empty cache and one shorter than a split, paged with num_splits 1 and 3, also on the
Ascend variant's persistent loop; negative control: rows reading the q of the wrong head of their group.
Default: the first case of each check (CI); LOCKSTEP_FULL=1 pytest ... runs every dtype / mode.
"""
from __future__ import annotations

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
