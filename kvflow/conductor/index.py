"""Where every prefix block is cached: one LRU cache of block keys per
instance, and a replica count per key across instances.

An instance's cache holds up to `capacity_blocks` blocks (a DRAM pool of
KV pages, in the simulator; a prefill server's prefix cache, live). Blocks
that a request is using (being computed on, or being copied out as the
source of a replica) are pinned and never evicted; eviction takes the least
recently used unpinned block. Matching walks a request's keys from the
first and stops at the first miss: because keys are chained
(`blocks.block_keys`), the length matched is the cached prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockCache", "PrefixIndex", "add_counts", "drop_counts"]


def add_counts(counts: dict[int, int], keys: Iterable[int]) -> None:
    """One more use of each of `keys`."""
    for k in keys:
        counts[k] = counts.get(k, 0) + 1


def drop_counts(counts: dict[int, int], keys: Iterable[int]) -> None:
    """One use fewer of each of `keys`; a key at zero leaves the dict."""
    for k in keys:
        left = counts.get(k, 0) - 1
        if left > 0:
            counts[k] = left
        else:
            counts.pop(k, None)


class BlockCache:
    """One instance's cached blocks, least recently used first."""

    __slots__ = ("name", "capacity_blocks", "_lru", "_pins", "evicted")

    def __init__(self, name: str, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks   # None: unbounded
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    def keys(self) -> list[int]:
        """The cached keys, least recently used first."""
        return list(self._lru)

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, are cached here."""
        lru = self._lru
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[int]) -> None:
        """Mark cached `keys` (a prefix, in order) as just used; keys not
        cached are ignored. Last to first, so that a prefix's first block is
        its most recently used: eviction takes a chain's tail before its
        head (a head gone leaves the rest unmatchable), as vLLM and SGLang
        evict."""
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)

    def insert(self, keys: Sequence[int]) -> list[int]:
        """Cache `keys` (a prefix, in order; most recently used, the first
        block most of all, as `touch`), evicting least recently used
        unpinned blocks past the capacity; returns the evicted keys. When
        every cached block is pinned the cache stays over its capacity until
        pins are released (a request in flight is never robbed of its
        prefix)."""
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        return self._shrink()

    def pin(self, keys: Iterable[int]) -> None:
        """Keep `keys` from eviction until `unpin`; counted, so two requests
        can pin one block."""
        add_counts(self._pins, keys)

    def unpin(self, keys: Iterable[int]) -> list[int]:
        """Release one pin of each of `keys`; returns blocks evicted now
        that the cache may shrink back to its capacity."""
        drop_counts(self._pins, keys)
        return self._shrink()

    def remove(self, keys: Iterable[int]) -> list[int]:
        """Drop `keys` (an instance reported evicting them); pinned keys
        are dropped too, since the instance no longer has them. Returns the
        keys that were cached."""
        gone = []
        for k in keys:
            if k in self._lru:
                del self._lru[k]
                gone.append(k)
        return gone

    def _shrink(self) -> list[int]:
        cap = self.capacity_blocks
        lru = self._lru
        if cap is None or len(lru) <= cap:
            return []
        out: list[int] = []
        pins = self._pins
        # Pinned blocks met at the cold end move to the hot end: they are in
        # use, and skipping them in place would make every later eviction
        # walk past them again. Bounded by one pass over the cache.
        budget = len(lru)
        while len(lru) > cap and budget > 0:
            k = next(iter(lru))
            budget -= 1
            if k in pins:
                lru.move_to_end(k)
                continue
            del lru[k]
            out.append(k)
        self.evicted += len(out)
        return out


class PrefixIndex:
    """The caches of all instances, with replica counts per block."""

    def __init__(self) -> None:
        self._caches: dict[str, BlockCache] = {}
        self._replicas: dict[int, int] = {}

    def add(self, name: str, capacity_blocks: int | None) -> BlockCache:
        if name in self._caches:
            raise ValueError(f"instance {name!r} is already in the index")
        cache = self._caches[name] = BlockCache(name, capacity_blocks)
        return cache

    def drop(self, name: str) -> None:
        """Forget an instance and its blocks (it left the cluster)."""
        cache = self._caches.pop(name)
        self._uncount(list(cache._lru))

    def cache(self, name: str) -> BlockCache:
        return self._caches[name]

    def __contains__(self, name: str) -> bool:
        return name in self._caches

    def names(self) -> list[str]:
        return list(self._caches)

    def replicas(self, key: int) -> int:
        """On how many instances block `key` is cached."""
        return self._replicas.get(key, 0)

    def matches(self, keys: Sequence[int], names: Iterable[str] | None = None) -> dict[str, int]:
        """Cached prefix length (in blocks) of `keys` on each instance."""
        caches = self._caches
        if not keys:
            return {n: 0 for n in (caches if names is None else names)}
        first = keys[0]
        if self._replicas.get(first, 0) == 0:
            # Nobody has the first block: nobody has any prefix. One lookup
            # instead of one per instance, the common case for a new prompt.
            return {n: 0 for n in (caches if names is None else names)}
        return {n: caches[n].match(keys) for n in (caches if names is None else names)}

    def best(self, keys: Sequence[int], names: Iterable[str] | None = None) -> tuple[str | None, int]:
        """The instance with the longest cached prefix of `keys` and that
        length; (None, 0) when no instance has the first block."""
        best_name, best_len = None, 0
        for n, m in self.matches(keys, names).items():
            if m > best_len:
                best_name, best_len = n, m
        return best_name, best_len

    def insert(self, name: str, keys: Sequence[int]) -> list[int]:
        """Cache `keys` on `name`; returns what it evicted."""
        cache = self._caches[name]
        before = len(cache)
        fresh = [k for k in keys if k not in cache]
        evicted = cache.insert(keys)
        self._count(fresh)
        self._uncount(evicted)
        assert len(cache) == before + len(fresh) - len(evicted)
        return evicted

    def unpin(self, name: str, keys: Sequence[int]) -> list[int]:
        evicted = self._caches[name].unpin(keys)
        self._uncount(evicted)
        return evicted

    def pin(self, name: str, keys: Sequence[int]) -> None:
        self._caches[name].pin(keys)

    def remove(self, name: str, keys: Iterable[int]) -> list[int]:
        gone = self._caches[name].remove(keys)
        self._uncount(gone)
        return gone

    def _count(self, keys: Iterable[int]) -> None:
        add_counts(self._replicas, keys)

    def _uncount(self, keys: Iterable[int]) -> None:
        drop_counts(self._replicas, keys)
