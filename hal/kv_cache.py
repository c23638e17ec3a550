"""KV caches for attention: contiguous or paged, and the exact data movement around them.

Two layouts, as in flash-attn:

* contiguous: ``k_cache [batch, capacity, Hkv, D]``; token t of sequence b is ``k_cache[b, t]``;
* paged: ``k_cache [num_pages, page_size, Hkv, D]`` and ``block_table [batch, max_pages]`` (int);
  token t of sequence b is ``k_cache[block_table[b, t // page_size], t % page_size]``. Any page
  size works, pages may be in any order and may be shared (prefix caching).

Moving keys in and out of a cache is a copy, so it never changes bits: the attention spec sees
the same key values at the same absolute positions whatever the layout.

:func:`append_kv` and :func:`gather_kv` are the low-level moves used by ``hal.flash_attn_with_kvcache``
and the backends (they live in kernels/layout.py, ``hal.kernels.layout``, below both; re-exported here);
:class:`KVCache` is a small owner of one layer's cache (page allocation with reference counts, prefix
sharing) that tests and the engine share.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .errors import InputError
from .kernels.layout import append_kv, capacity, gather_kv, kv_rows, token_slots  # noqa: F401  (re-exported)


# ------------------------------------------------------------------ KVCache


class KVCache:
    """One attention layer's KV cache for ``batch`` sequences, contiguous or paged.

    ``seqlens[b]`` tokens of sequence b are valid. Paged caches allocate pages on demand from a
    free list (in ``page_order``, so tests can shuffle the physical layout) and reference-count
    them, so :meth:`share_prefix` can point a second sequence at the pages of a cached prefix.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None = None,
                 page_order: Sequence[int] | None = None, capacity: int | None = None):
        if k.shape != v.shape or k.dim() != 4:
            raise InputError(f"KVCache: k and v must both be 4-D with one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        self.k, self.v = k, v
        self.block_table = block_table
        if block_table is None:
            self.batch = int(k.shape[0])
            self.capacity = int(k.shape[1])
        else:
            self.batch = int(block_table.shape[0])
            self.capacity = int(capacity if capacity is not None else block_table.shape[1] * k.shape[1])
            order = list(range(int(k.shape[0]))) if page_order is None else [int(p) for p in page_order]
            if sorted(order) != list(range(int(k.shape[0]))):
                raise InputError(f"KVCache: page_order must be a permutation of range({int(k.shape[0])})")
            self._free = order[::-1]  # pop() takes from the front of page_order
            self._refs = [0] * int(k.shape[0])
            self._pages: list[list[int]] = [[] for _ in range(self.batch)]
        self.seqlens = torch.zeros(self.batch, dtype=torch.int32, device=k.device)

    @classmethod
    def contiguous(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
                   dtype=torch.float32, device="cpu") -> "KVCache":
        shape = (batch, capacity, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def paged(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, page_size: int,
              dtype=torch.float32, device="cpu", num_pages: int | None = None,
              page_order: Sequence[int] | None = None) -> "KVCache":
        if page_size <= 0 or capacity <= 0:
            raise InputError(f"KVCache.paged: page_size and capacity must be > 0, got {page_size}, {capacity}")
        max_pages = -(-capacity // page_size)
        num_pages = batch * max_pages if num_pages is None else num_pages
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        table = torch.full((batch, max_pages), -1, dtype=torch.int32, device=device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   table, page_order, capacity=capacity)

    @property
    def paged_layout(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int | None:
        return int(self.k.shape[1]) if self.paged_layout else None

    # -- pages: every change is planned first (pure), checked, then committed in one step

    def _plan(self, rows: list[int], n: int) -> "_PagePlan":
        """The pages ``rows`` need to append ``n`` tokens each; raises before anything changes."""
        plan = _PagePlan(self, rows)
        for r in rows:
            plan.grow(r, int(self.seqlens[r]) + n)
        return plan

    def free(self, row: int) -> None:
        """Forget sequence ``row`` (its pages return to the free list when no one shares them)."""
        row = self._row("row", row)
        if self.paged_layout:
            for p in self._pages[row]:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)
            self._pages[row] = []
            self.block_table[row] = -1
        self.seqlens[row] = 0

    def share_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        """Make sequence ``dst`` start with the first ``n_tokens`` cached tokens of ``src``.

        Paged: dst's table points at src's pages (shared, reference-counted; a partial last page is
        copied when dst appends). Contiguous: the tokens are copied. Either way dst sees the same
        key/value bits at the same absolute positions, so its outputs equal a full recompute.
        ``src`` and ``dst`` must differ (to shorten a sequence, free it and write it again).
        """
        src, dst = self._row("src", src), self._row("dst", dst)
        if src == dst:
            raise InputError(f"KVCache.share_prefix: src and dst are both sequence {src}; sharing a sequence's "
                             "prefix with itself is not defined (free it and write it again to shorten it)")
        n_tokens = _count("n_tokens", n_tokens)
        if not 0 <= n_tokens <= int(self.seqlens[src]):
            raise InputError(f"KVCache.share_prefix: n_tokens must be in [0, {int(self.seqlens[src])}] "
                             f"(tokens cached for sequence {src}), got {n_tokens}")
        self.free(dst)
        if self.paged_layout:
            n_pages = -(-n_tokens // self.page_size)
            for i, p in enumerate(self._pages[src][:n_pages]):
                self._refs[p] += 1
                self._pages[dst].append(p)
                self.block_table[dst, i] = p
        else:
            self.k[dst, :n_tokens] = self.k[src, :n_tokens]
            self.v[dst, :n_tokens] = self.v[src, :n_tokens]
        self.seqlens[dst] = n_tokens

    # -- tokens

    def _row(self, name: str, row) -> int:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.batch:
            raise InputError(f"KVCache: {name} must be a sequence index in [0, {self.batch}), got {row!r}")
        return row

    def _rows(self, rows) -> list[int]:
        rows = list(range(self.batch)) if rows is None else [int(r) for r in rows]
        if len(set(rows)) != len(rows) or any(not 0 <= r < self.batch for r in rows):
            raise InputError(f"KVCache: rows must be distinct sequence indices in [0, {self.batch}), got {rows}")
        return rows

    def write(self, k: torch.Tensor, v: torch.Tensor, rows=None) -> None:
        """Append ``k, v [len(rows), n, Hkv, D]`` without computing attention (an exact copy).

        Every argument and the pages of every row are checked first: a failing call changes nothing.
        """
        rows = self._rows(rows)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"KVCache.write: {name} must be a torch.Tensor, got {type(t).__name__}")
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != len(rows) or k.shape[2:] != self.k.shape[2:]:
            raise InputError(f"KVCache.write: k and v must be [{len(rows)}, n, {self.k.shape[2]}, {self.k.shape[3]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != self.k.dtype:
                raise InputError(f"KVCache.write: {name} has dtype {t.dtype}, the cache holds {self.k.dtype}")
            if t.device != self.k.device:
                raise InputError(f"KVCache.write: {name} is on {t.device}, the cache on {self.k.device}")
        n = int(k.shape[1])
        plan = self._plan(rows, n)
        idx = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        start = self.seqlens[idx]
        if self.paged_layout:
            table = plan.table[idx]
            plan.commit()
            append_kv(self.k, self.v, k, v, start, table)
        else:
            kc, vc = self.k[idx], self.v[idx]
            append_kv(kc, vc, k, v, start, None)
            self.k[idx], self.v[idx] = kc, vc
        self.seqlens[idx] += n

    def attend(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, rows=None,
               **kwargs):
        """``hal.flash_attn_with_kvcache`` for sequences ``rows`` (default all), appending k/v.

        ``q [len(rows), Sq, Hq, D]``; keyword arguments go to the op (causal, window_size,
        num_splits, softmax_scale, return_lse, spec, backend). The call is checked in full (against
        the pages it is about to get) before any page is allocated or copied: a failing call changes
        nothing, and seqlens advance only on success.
        """
        from .attention import plan_kvcache_call

        rows = self._rows(rows)
        if k is not None and not (isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[0] == len(rows)):
            raise InputError(f"KVCache.attend: k must be a [{len(rows)}, n, Hkv, D] tensor, got "
                             f"{tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__}")
        n = 0 if k is None else int(k.shape[1])
        want_lse = bool(kwargs.pop("return_lse", False)) | bool(kwargs.pop("return_softmax_lse", False))
        plan = self._plan(rows, n)
        idx = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        seqlens = self.seqlens[idx]
        kc, vc, table = self.k, self.v, None
        if self.paged_layout:
            table = plan.table[idx]
        elif rows != list(range(self.batch)):  # a subset of a contiguous cache: work on a copy of those rows
            kc, vc = self.k[idx], self.v[idx]
        run = plan_kvcache_call(q, kc, vc, k, v, seqlens, table, **kwargs)
        plan.commit()
        out, lse = run()
        if kc is not self.k:
            self.k[idx], self.v[idx] = kc, vc
        self.seqlens[idx] += n
        return (out, lse) if want_lse else out

    def _tokens(self, cache: torch.Tensor, row: int) -> torch.Tensor:
        n = int(self.seqlens[row])
        if not self.paged_layout:
            return cache[row, :n]
        return gather_kv(cache, self.seqlens[row:row + 1], self.block_table[row:row + 1], n)[0]

    def keys(self, row: int) -> torch.Tensor:
        """The cached keys of sequence ``row`` as ``[seqlen, Hkv, D]``."""
        return self._tokens(self.k, row)

    def values(self, row: int) -> torch.Tensor:
        return self._tokens(self.v, row)


def _count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise InputError(f"KVCache: {name} must be an int, got {n!r}")
    return n


class _PagePlan:
    """Page allocation and copy-on-write for one call, worked out on copies of the cache's books.

    Nothing of the cache changes until :meth:`commit`, which cannot fail: so a call whose pages or
    arguments are wrong leaves the block table, free list, reference counts and tensors as they were.
    """

    def __init__(self, cache: KVCache, rows: list[int]):
        self.cache = cache
        self.paged = cache.paged_layout
        if self.paged:
            self.free = list(cache._free)
            self.refs = list(cache._refs)
            self.pages = {r: list(cache._pages[r]) for r in rows}
            self.table = cache.block_table.clone()
            self.copies: list[tuple[int, int]] = []  # (old page, new page)

    def _take(self, why: str) -> int:
        if not self.free:
            raise InputError(f"KVCache: out of pages ({why}); free finished sequences or make more pages")
        return self.free.pop()

    def grow(self, row: int, n_tokens: int) -> None:
        c = self.cache
        if n_tokens > c.capacity:
            raise InputError(f"KVCache: sequence {row} needs {n_tokens} tokens, capacity is {c.capacity}; "
                             "make a larger cache")
        if not self.paged:
            return
        page = c.page_size
        need = -(-n_tokens // page)
        pages = self.pages[row]
        cur = int(c.seqlens[row])
        # A shared partial last page would be written by this append: give this sequence its own copy.
        if cur % page and n_tokens > cur and self.refs[pages[cur // page]] > 1:
            i, old = cur // page, pages[cur // page]
            new = self._take(f"copy-on-write of page {old}, shared by sequence {row}")
            self.copies.append((old, new))
            self.refs[old] -= 1
            self.refs[new] = 1
            pages[i] = new
            self.table[row, i] = new
        if need - len(pages) > len(self.free):
            raise InputError(f"KVCache: out of pages ({len(self.free)} free after the sequences before it, "
                             f"sequence {row} needs {need - len(pages)} more); free finished sequences or make "
                             "more pages")
        while len(pages) < need:
            p = self.free.pop()
            self.refs[p] = 1
            pages.append(p)
            self.table[row, len(pages) - 1] = p

    def commit(self) -> None:
        if not self.paged:
            return
        c = self.cache
        for old, new in self.copies:
            c.k[new] = c.k[old]
            c.v[new] = c.v[old]
        c.block_table.copy_(self.table)
        c._free, c._refs = self.free, self.refs
        for r, pages in self.pages.items():
            c._pages[r] = pages
