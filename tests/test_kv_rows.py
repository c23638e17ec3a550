"""hal.kv_cache.kv_rows (the cpu backend reads a KV cache in place through it) names, for every
token, the cache row that gather_kv copies: same bits for paged (shuffled pages, unused -1 table
entries, ragged lengths) and contiguous caches."""
import torch

from hal.conformance.bits import assert_same_bits, first_divergence
from hal.kv_cache import KVCache, gather_kv, kv_rows


def _cache(paged: bool, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    bsz, cap, hkv, d = 3, 70, 2, 8
    if paged:
        c = KVCache.paged(bsz, cap, hkv, d, page_size=16, dtype=dtype,
                          page_order=torch.randperm(3 * 5, generator=g).tolist())
    else:
        c = KVCache.contiguous(bsz, cap, hkv, d, dtype=dtype)
    c.write(torch.randn(bsz, 50, hkv, d, generator=g).to(dtype), torch.randn(bsz, 50, hkv, d, generator=g).to(dtype))
    c.seqlens[1], c.seqlens[2] = 17, 1  # ragged: later pages of sequences 1, 2 are unused
    return c


def test_kv_rows_name_the_rows_gather_kv_copies():
    for paged in (True, False):
        c = _cache(paged)
        n = int(c.seqlens.max())
        rows = kv_rows(c.k, c.seqlens, c.block_table, n)
        flat = c.k.reshape(-1, *c.k.shape[2:])
        want = gather_kv(c.k, c.seqlens, c.block_table, n)
        for b in range(3):  # tokens past a sequence's length hold arbitrary (but in-range) rows
            L = int(c.seqlens[b])
            assert_same_bits(want[b, :L], flat[rows[b, :L]], f"paged={paged} sequence {b}")
        assert int(rows.min()) >= 0 and int(rows.max()) < flat.shape[0]


def test_kv_rows_negative_control_off_by_one_page_is_caught():
    c = _cache(True)
    n = int(c.seqlens.max())
    flat = c.k.reshape(-1, *c.k.shape[2:])
    wrong = (kv_rows(c.k, c.seqlens, c.block_table, n) + 16) % flat.shape[0]  # the next physical page
    assert first_divergence("shifted rows", gather_kv(c.k, c.seqlens, c.block_table, n)[0, :n], flat[wrong[0]]) \
        is not None
