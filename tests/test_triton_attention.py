"""Triton strict attention == the reference bit for bit, in the Triton interpreter (CPU).

Checks (tests/triton_seq_check.py): varlen (GQA/MQA, causal, sliding window, non-causal with a
right window, p_precision "input", fp32/bf16/fp16, padding rows, an empty sequence) and the KV cache
(paged with page size 7 and a shuffled block table, contiguous, decode, num_splits 0/2/3), with
spec tiles small enough that every block, split and dot tile boundary is crossed. Negative
control: the split partials merged in reverse order are caught.
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
