"""Triton strict gated delta rule and GDN layer pieces == the reference bit for bit (Triton interpreter).

Checks (tests/scripts/triton_seq_check.py): serial and chunked (C = 16 so chunk boundaries are crossed)
over two calls (varlen, GVA, L2 norm in kernel or not, initial state, open rows carried across
calls, a one-token decode, final state), gdn_gating and gdn_causal_conv1d (varlen, conv state,
fp32/bf16/fp16). Negative control: a chunk grid restarting at the call start is caught.
Default: the first case of each check (CI); LOCKSTEP_FULL=1 pytest ... runs every dtype / mode.
"""
from __future__ import annotations

from _triton_seq_run import needs_interpreter, run_checks

pytestmark = needs_interpreter


def test_serial_bits_equal_reference():
    run_checks("gdn-serial")


def test_chunked_bits_equal_reference():
    run_checks("gdn-chunked")


def test_chunked_decode_row_tiles_bits_equal_reference():
    out = run_checks("gdn-chunked-decode")
    assert "wrong variant caught" in out  # a recurrent step is not the chunked spec's decode


def test_negative_control_restarted_chunk_grid_is_caught():
    out = run_checks("gdn-negative")
    assert "wrong variant caught" in out


def test_gating_and_conv1d_bits_equal_reference():
    run_checks("gdn-layer")


def test_chunked_products_as_fma_dots_bits_equal_reference():
    # issue 41 item 1: the d_k products as strict dot tiles (one dot per d_k tile, or a tile's chain over dots of
    # fewer lanes: gated_delta_rule.FULL_DOT_K) and as explicit chains (the switch off), same bits; the two-rounding
    # stand-in in place of the strict dot is caught (the dots ran) and changes nothing with the switch off (the
    # chains ran); 4 configurations
    out = run_checks("gdn-fma-dot")
    assert out.count("wrong variant caught") == 4 and out.count("outputs identical") == 12, out
