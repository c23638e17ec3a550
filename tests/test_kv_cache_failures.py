"""A KV cache call that fails changes nothing (issue 7, section 4).

Every check compares a full snapshot (raw bits of k, v, block_table, seqlens; the free list, the
reference counts and each sequence's pages) before and after the failing call.
"""
import pytest
import torch

import hal
from hal.conformance import inputs as gen
from hal.conformance.bits import assert_same_bits
from hal.errors import InputError, SpecError
from hal.kv_cache import KVCache


def snapshot(cache: KVCache):
    tensors = {"k": cache.k.clone(), "v": cache.v.clone(), "seqlens": cache.seqlens.clone()}
    books = None
    if cache.paged_layout:
        tensors["block_table"] = cache.block_table.clone()
        books = (list(cache._free), list(cache._refs), [list(p) for p in cache._pages])
    return tensors, books


def assert_unchanged(cache: KVCache, snap) -> None:
    tensors, books = snap
    now, now_books = snapshot(cache)
    for name, t in tensors.items():
        assert_same_bits(t, now[name], name)
    assert now_books == books


def _shared_cache():
    """Row 0 holds 6 tokens (pages of 4); row 1 shares its first 6 tokens, so row 1's next append must
    copy-on-write page 1; 2 pages are left free."""
    cache = KVCache.paged(3, 16, 1, 8, page_size=4, num_pages=5, page_order=[3, 0, 4, 1, 2])
    k = gen.randn("kvf/k", (1, 6, 1, 8))
    cache.write(k, k * 2, rows=[0])
    cache.share_prefix(0, 1, 6)
    return cache


def _new(n, rows=1, dtype=torch.float32, key="kvf/new"):
    return gen.randn(f"{key}/q", (rows, n, 2, 8), dtype), gen.randn(f"{key}/k", (rows, n, 1, 8), dtype), \
        gen.randn(f"{key}/v", (rows, n, 1, 8), dtype)


# ------------------------------------------------------------------ flash_attn_with_kvcache page checks


def test_duplicate_page_in_one_row_rejected_at_batch_1():
    kc, vc = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    q, k, v = _new(8)
    before = (kc.clone(), vc.clone())
    with pytest.raises(InputError, match=r"block_table\[0, 0\] and block_table\[0, 1\] are both page 0"):
        hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=0,
                                    block_table=torch.tensor([[0, 0]], dtype=torch.int32))
    assert_same_bits(before[0], kc), assert_same_bits(before[1], vc)


def test_duplicate_page_rejected_on_reads_only():
    kc, vc = gen.randn("kvf/dup/k", (4, 4, 1, 8)), gen.randn("kvf/dup/v", (4, 4, 1, 8))
    q = gen.randn("kvf/dup/q", (2, 1, 1, 8))
    table = torch.tensor([[1, 2, 3], [2, 0, 2]], dtype=torch.int32)
    with pytest.raises(InputError, match=r"block_table\[1, 0\] and block_table\[1, 2\] are both page 2"):
        hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([12, 12], dtype=torch.int32),
                                    block_table=table)
    # pages shared ACROSS rows for reading (prefix caching) are fine, and so is an unused repeated entry
    hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([12, 8], dtype=torch.int32), block_table=table)


def test_append_into_a_slot_another_sequence_reads_is_rejected():
    # Both rows point at pages [0, 1] (a shared prefix without copy-on-write). Sequence 0 has 5 tokens
    # and appends position 5 (page 1, slot 1); sequence 1 has 4 and appends position 4 = page 1, slot 0,
    # which sequence 0 reads as its own position 4: its output would depend on the write order.
    kc, vc = gen.randn("kvf/rw/k", (4, 4, 1, 8)), gen.randn("kvf/rw/v", (4, 4, 1, 8))
    table = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    q = gen.randn("kvf/rw/q", (2, 1, 2, 8))
    k, v = gen.randn("kvf/rw/kn", (2, 1, 1, 8)), gen.randn("kvf/rw/vn", (2, 1, 1, 8))
    lens = torch.tensor([5, 4], dtype=torch.int32)
    before = (kc.clone(), vc.clone())
    with pytest.raises(InputError, match="sequence 1 appends into a cache slot that sequence 0 reads"):
        hal.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table)
    assert_same_bits(before[0], kc), assert_same_bits(before[1], vc)
    # Reading the shared pages without appending is fine.
    hal.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)


# ------------------------------------------------------------------ KVCache: validate everything, then change


def test_attend_bf16_query_into_fp32_cache_changes_nothing():
    cache = _shared_cache()
    snap = snapshot(cache)
    q, k, v = _new(3)
    with pytest.raises(InputError, match="dtypes differ"):
        cache.attend(q.bfloat16(), k, v, rows=[1])  # row 1 would copy-on-write page 1 and take a page
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("kw,err", [
    (dict(spec="attention/no-such-spec"), SpecError),
    (dict(backend="no-such-backend"), hal.BackendUnavailable),
    (dict(window_size=(1.5, 2)), InputError),
    (dict(softmax_scale=1e39), InputError),
    (dict(num_splits=-1), InputError),
])
def test_attend_bad_option_changes_nothing(kw, err):
    cache = _shared_cache()
    snap = snapshot(cache)
    q, k, v = _new(3, rows=2)
    with pytest.raises(err):
        cache.attend(q, k, v, rows=[1, 2], **kw)
    assert_unchanged(cache, snap)


def test_attend_out_of_pages_on_a_later_row_changes_nothing():
    cache = _shared_cache()  # 2 free pages: row 1 needs 1 (copy-on-write), row 2 needs 2 for 5 tokens
    snap = snapshot(cache)
    q, k, v = _new(5, rows=2)
    with pytest.raises(InputError, match="out of pages"):
        cache.attend(q, k, v, rows=[1, 2])
    assert_unchanged(cache, snap)


def test_write_out_of_pages_on_row_1_changes_nothing():
    cache = KVCache.paged(2, 16, 1, 8, page_size=4, num_pages=3)
    snap = snapshot(cache)
    k = gen.randn("kvf/w/k", (2, 6, 1, 8))
    with pytest.raises(InputError, match="out of pages"):
        cache.write(k, k, rows=[0, 1])  # row 0 takes 2 pages, row 1 finds 1
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("paged", [True, False])
def test_write_float64_v_changes_nothing(paged):
    cache = KVCache.paged(2, 16, 1, 8, page_size=4) if paged else KVCache.contiguous(2, 16, 1, 8)
    snap = snapshot(cache)
    k = gen.randn("kvf/w64/k", (2, 3, 1, 8))
    with pytest.raises(InputError, match="v has dtype torch.float64"):
        cache.write(k, k.double())
    assert_unchanged(cache, snap)


def test_contiguous_subset_failure_changes_nothing():
    cache = KVCache.contiguous(3, 8, 1, 8)
    cache.write(gen.randn("kvf/c/k", (3, 2, 1, 8)), gen.randn("kvf/c/v", (3, 2, 1, 8)))
    snap = snapshot(cache)
    q, k, v = _new(2)
    with pytest.raises(InputError, match="dtypes differ"):
        cache.attend(q.half(), k, v, rows=[1])
    assert_unchanged(cache, snap)


def test_successful_attend_after_a_failure_matches_a_fresh_cache():
    q, k, v = _new(3)
    fresh = _shared_cache()
    want = fresh.attend(q, k, v, rows=[1])
    cache = _shared_cache()
    with pytest.raises(InputError):
        cache.attend(q.bfloat16(), k, v, rows=[1])
    got = cache.attend(q, k, v, rows=[1])
    assert_same_bits(want, got, "out")
    assert_same_bits(fresh.keys(1), cache.keys(1), "keys(1)")
    assert_same_bits(fresh.keys(0), cache.keys(0), "keys(0)")  # the owner of the shared page is untouched


def test_share_prefix_with_itself_is_rejected_and_changes_nothing():
    cache = _shared_cache()
    snap = snapshot(cache)
    with pytest.raises(InputError, match="src and dst are both sequence 0"):
        cache.share_prefix(0, 0, 6)
    assert_unchanged(cache, snap)
    assert int(cache.seqlens[0]) == 6 and len(cache.keys(0)) == 6
    with pytest.raises(InputError, match="dst must be a sequence index"):
        cache.share_prefix(0, 7, 2)
    assert_unchanged(cache, snap)
