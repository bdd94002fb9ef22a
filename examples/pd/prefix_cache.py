"""A prefill server's prefix cache: full pages of earlier prompts kept in its
KV pool, keyed by chained block keys (`kvflow.conductor.block_keys`, one
block per page), least recently used first.

A page in the cache belongs to the cache; a request that reuses it pins it
(`acquire`) for as long as its prefill reads it, pages handed to the cache
(`insert`) come pinned until their transfer is done, and eviction takes only
unpinned pages, a chain's tail before its head. After a prefill the request's full pages are handed to the
cache (`insert`); a page whose block is already cached (a fetched copy of a
block computed meanwhile) stays the caller's, to free when done with it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .model import KVPool, OutOfPagesError

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, pool: KVPool, max_pages: int) -> None:
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.pool = pool
        self.max_pages = max_pages
        self._pages: OrderedDict[int, int] = OrderedDict()    # key -> page, coldest first
        self._pins: dict[int, int] = {}
        self.evicted: list[int] = []                          # keys dropped since the last take_evicted()

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, keys: Sequence[int]) -> list[int]:
        """Pages of the longest cached prefix of `keys`."""
        out = []
        for k in keys:
            page = self._pages.get(k)
            if page is None:
                break
            out.append(page)
        return out

    def acquire(self, keys: Sequence[int]) -> list[int]:
        """Pin the cached prefix of `keys` and return its pages (most
        recently used now, its first page most of all: eviction takes a
        chain's tail first). Release exactly the keys of the pages returned."""
        pages = self.match(keys)
        got = keys[:len(pages)]
        for k in got:
            self._pins[k] = self._pins.get(k, 0) + 1
        for k in reversed(got):
            self._pages.move_to_end(k)
        return pages

    def release(self, keys: Sequence[int]) -> None:
        """Drop one pin of each of `keys` (each pinned by acquire or insert)."""
        for k in keys:
            left = self._pins.get(k, 0) - 1
            if left > 0:
                self._pins[k] = left
            else:
                self._pins.pop(k, None)
        self._shrink(0)

    def insert(self, keys: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Hand `pages` (one per key, owned by the caller until now) to the
        cache, every key pinned once (release them when the pages may be
        evicted: after their transfer, or once matched): pinned before the
        cache shrinks, so new pages are never evicted as they arrive.
        Returns the pages it did not take (their blocks were cached
        already): they stay the caller's, to free once nothing reads them."""
        kept = []
        for k, p in zip(keys, pages):
            self._pins[k] = self._pins.get(k, 0) + 1
            if k in self._pages:
                if self._pages[k] != p:
                    kept.append(int(p))
            else:
                self._pages[k] = int(p)
        for k in reversed(keys[:len(pages)]):
            self._pages.move_to_end(k)
        self._shrink(0)
        return kept

    def alloc(self, n: int) -> list[int]:
        """`n` free pages from the pool, evicting unpinned cached pages if
        needed. Raises OutOfPagesError when even that does not free enough."""
        if n > self.pool.num_free:
            self._shrink(n - self.pool.num_free)
        return [int(p) for p in self.pool.alloc(n)]

    def pinned_pages(self, keys: Sequence[int]) -> list[int]:
        return [self._pages[k] for k in keys if k in self._pages]

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def _shrink(self, need_free: int) -> None:
        """Evict unpinned pages, coldest first, until the cache is within
        max_pages and `need_free` more pages are free in the pool."""
        freed: list[int] = []
        for k in list(self._pages):
            if len(self._pages) <= self.max_pages and len(freed) >= need_free:
                break
            if k in self._pins:
                continue
            freed.append(self._pages.pop(k))
            self.evicted.append(k)
        if freed:
            self.pool.free(freed)
        if len(freed) < need_free:
            raise OutOfPagesError(f"need {need_free} more free pages; the prefix cache could free {len(freed)}")
