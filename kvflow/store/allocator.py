"""A segment's free space: best-fit allocation from a free list of extents,
with coalescing on free. Pure and synchronous; the master owns one per
segment.

Two sorted views of the same extents: by offset (a freed extent finds its
neighbours with one bisect, so coalescing is O(log n) plus the list
insert) and by (size, offset) (best fit is the first extent at least as
large as the request: one bisect). `bisect.insort` moves memory in C, which
for the few thousand extents a fragmented segment holds costs less than a
balanced tree in Python.

A fence (`fence()`, `unfence()`) takes every free extent out of use for a
while: after a failover, space no recorded object holds may still receive
a dead master's puts' late writes (fence.py says how long); fenced space
is neither free nor used.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import accumulate

import numpy as np

from kvflow.errors import InvalidArgumentError

__all__ = ["ALIGN", "Allocator"]

# Every allocation starts on a 64-byte boundary (a cache line), so one
# object's bytes never share a line with another's.
ALIGN = 64


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Allocator:
    """Best-fit free-list allocator over [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < ALIGN:
            raise InvalidArgumentError(f"segment capacity must be an int >= {ALIGN}, not {capacity!r}")
        self.capacity = capacity // ALIGN * ALIGN
        self._by_offset: list[int] = [0]                   # extent starts, sorted
        self._size: dict[int, int] = {0: self.capacity}    # start -> length
        self._by_size: list[tuple[int, int]] = [(self.capacity, 0)]
        self._used: dict[int, int] = {}                    # allocated start -> rounded length
        self.used = 0
        self._fenced: dict[int, int] = {}                  # fenced start -> length (fence())
        self.fenced = 0

    def __repr__(self) -> str:
        return (f"<Allocator capacity={self.capacity} used={self.used} "
                f"extents={len(self._by_offset)} largest={self.largest_free}>")

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.fenced

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def extents(self) -> int:
        """How many free extents there are (1 when nothing is fragmented)."""
        return len(self._by_offset)

    def allocated_length(self, offset: int) -> int:
        """The (rounded) length of the allocation at `offset`."""
        return self._used[offset]

    def allocations(self) -> int:
        return len(self._used)

    def fits(self, size: int) -> bool:
        return _round_up(max(size, 1)) <= self.largest_free

    def allocate(self, size: int) -> int | None:
        """Offset of a new allocation of `size` bytes, or None when no free
        extent is large enough."""
        if not isinstance(size, int) or size <= 0:
            raise InvalidArgumentError(f"allocation size must be a positive int, not {size!r}")
        need = (size + ALIGN - 1) // ALIGN * ALIGN
        by_size = self._by_size
        i = bisect.bisect_left(by_size, (need, -1))
        if i == len(by_size):
            return None
        length, start = by_size[i]
        if length > need:
            # the tail stays free, in the extent's place in both views: it
            # starts before the next extent (extents never touch), and when
            # no smaller extent sorts after it the size view keeps its order
            # too (a put carving a fresh segment: no list moves at all)
            tail, rest = start + need, length - need
            self._by_offset[bisect.bisect_left(self._by_offset, start)] = tail
            del self._size[start]
            self._size[tail] = rest
            if i == 0 or by_size[i - 1] < (rest, tail):
                by_size[i] = (rest, tail)
            else:
                del by_size[i]
                bisect.insort(by_size, (rest, tail))
        else:
            del by_size[i]
            self._remove_offset(start)
        self._used[start] = need
        self.used += need
        return start

    def allocate_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of a batch's allocations (positive int sizes) laid end
        to end in one free extent, the best fit for their total: one
        search and one split for the batch instead of one per object (each
        is still an allocation of its own, released alone). None when no
        extent holds them all (then allocate() each)."""
        needs = [(n + ALIGN - 1) // ALIGN * ALIGN for n in sizes]
        start = self.allocate(sum(needs))
        if start is None:
            return None
        del self._used[start]
        offsets = list(accumulate(needs[:-1], initial=start))
        self._used.update(zip(offsets, needs))
        return offsets

    def reserve(self, offset: int, length: int) -> None:
        """Marks [offset, offset + length) allocated, as an earlier allocate()
        had returned it (a master recovering its index from etcd rebuilds
        each segment's free list from the objects' recorded extents).
        InvalidArgumentError when the range is not free (two records claim
        the same bytes) or not aligned."""
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length <= 0 \
                or offset % ALIGN or length % ALIGN:
            raise InvalidArgumentError(f"bad extent [{offset!r}, +{length!r})")
        i = bisect.bisect_right(self._by_offset, offset) - 1
        start = self._by_offset[i] if i >= 0 else -1
        if start < 0 or start + self._size[start] < offset + length:
            raise InvalidArgumentError(f"extent [{offset}, +{length}) is not free")
        size = self._size[start]
        self._drop_extent(start)
        if offset > start:
            self._add_extent(start, offset - start)
        if start + size > offset + length:
            self._add_extent(offset + length, start + size - offset - length)
        self._used[offset] = length
        self.used += length

    def reserve_many(self, offsets: np.ndarray, lengths: np.ndarray, step: int = 1 << 16) -> Iterator[None]:
        """reserve() of every extent [offsets[i], +lengths[i]) of a fresh
        allocator (nothing allocated or fenced yet) in one sorted pass: the
        free list is the gaps between them, built at C speed (a recovering
        master restores a million extents in a fraction of a second
        instead of ~6 us per reserve()). A generator: it yields after each
        `step` extents, so that a caller on an event loop can let others
        run (iterate it to the end; the allocator is complete then).
        InvalidArgumentError, at the first step and with the allocator
        unchanged, when one is not aligned, not inside the segment, or two
        overlap (reserve() one at a time says which)."""
        if self.used or self.fenced or len(self._by_offset) != 1:
            raise InvalidArgumentError("reserve_many needs an allocator with nothing allocated or fenced")
        offs = np.asarray(offsets, dtype=np.int64)
        lens = np.asarray(lengths, dtype=np.int64)
        if offs.shape != lens.shape or offs.ndim != 1:
            raise InvalidArgumentError("reserve_many: offsets and lengths differ in shape")
        if not len(offs):
            return
        order = np.argsort(offs, kind="stable")
        offs, lens = offs[order], lens[order]
        ends = offs + lens
        if (offs[0] < 0 or ends[-1] > self.capacity or (lens <= 0).any() or (offs % ALIGN).any()
                or (lens % ALIGN).any() or (ends[:-1] > offs[1:]).any()):
            raise InvalidArgumentError("reserve_many: an extent is not aligned, outside the segment, or overlaps")
        starts = np.concatenate(([0], ends))
        sizes = np.concatenate((offs, [self.capacity])) - starts
        gap = sizes > 0
        starts, sizes = starts[gap], sizes[gap]
        by_size = np.lexsort((starts, sizes))
        by_offset: list[int] = []
        size_of: dict[int, int] = {}
        sized: list[tuple[int, int]] = []
        used: dict[int, int] = {}
        for lo in range(0, max(len(offs), len(starts)), step):
            st, sz = starts[lo:lo + step].tolist(), sizes[lo:lo + step].tolist()
            by_offset += st
            size_of.update(zip(st, sz))
            sized += zip(sizes[by_size[lo:lo + step]].tolist(), starts[by_size[lo:lo + step]].tolist())
            used.update(zip(offs[lo:lo + step].tolist(), lens[lo:lo + step].tolist()))
            yield
        self._by_offset, self._size, self._by_size, self._used = by_offset, size_of, sized, used
        self.used = int(lens.sum())

    def release(self, offset: int) -> int:
        """Frees the allocation at `offset`; returns its (rounded) length.
        InvalidArgumentError for an offset that is not allocated (a double free)."""
        need = self._used.pop(offset, None)
        if need is None:
            raise InvalidArgumentError(f"offset {offset} is not allocated")
        self.used -= need
        start, length = offset, need
        i = bisect.bisect_left(self._by_offset, start)
        # merge with the following extent
        if i < len(self._by_offset) and self._by_offset[i] == start + length:
            nxt = self._by_offset[i]
            length += self._size[nxt]
            self._drop_extent(nxt)
        # merge with the preceding extent
        if i > 0:
            prev = self._by_offset[i - 1]
            if prev + self._size[prev] == start:
                start, length = prev, length + self._size[prev]
                self._drop_extent(prev)
        self._add_extent(start, length)
        return need

    def fence(self) -> int:
        """Takes every free extent out of use until unfence() (allocate and
        largest_free no longer see it); returns the bytes fenced."""
        n = 0
        for start in list(self._by_offset):
            length = self._size[start]
            self._drop_extent(start)
            self._fenced[start] = length
            n += length
        self.fenced += n
        return n

    def unfence(self) -> int:
        """Gives the fenced extents back to the free list (coalesced with
        their free neighbours); returns the bytes."""
        n = self.fenced
        for start, length in self._fenced.items():
            self._used[start] = length
            self.used += length
            self.release(start)
        self._fenced, self.fenced = {}, 0
        return n

    def check(self) -> None:
        """Asserts the invariants (tests): extents sorted, disjoint, never
        adjacent (coalesced), not overlapping allocations or fenced space,
        and free + used + fenced == capacity."""
        spans = sorted([(s, self._size[s], "free") for s in self._by_offset]
                       + [(s, n, "used") for s, n in self._used.items()]
                       + [(s, n, "fenced") for s, n in self._fenced.items()])
        pos = 0
        prev_kind = None
        for start, length, kind in spans:
            assert start == pos, f"gap or overlap at {pos}: next span starts at {start}"
            assert not (kind == "free" and prev_kind == "free"), f"uncoalesced extents at {start}"
            pos, prev_kind = start + length, kind
        assert pos == self.capacity, f"spans end at {pos}, capacity {self.capacity}"
        assert sorted(self._by_size) == self._by_size
        assert len(self._by_size) == len(self._by_offset) == len(self._size)
        assert self.fenced == sum(self._fenced.values()) and self.used == sum(self._used.values())

    # -- the two views ---------------------------------------------------------
    def _add_extent(self, start: int, length: int) -> None:
        bisect.insort(self._by_offset, start)
        self._size[start] = length
        bisect.insort(self._by_size, (length, start))

    def _drop_extent(self, start: int) -> None:
        length = self._size[start]
        self._remove_offset(start)
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]

    def _remove_offset(self, start: int) -> None:
        i = bisect.bisect_left(self._by_offset, start)
        del self._by_offset[i]
        del self._size[start]
