"""Region lookups in Python: which registered range holds an address.

The native core keeps the host regions' tables (kvf_submit checks every
batch against them); what Python asks itself is answered here, once:
`RegionTable` (regions by start address: the one holding [addr, addr+n)
in O(log n), or whether any of a batch's addresses lies in one, vectorised:
the GPU regions, which never enter the native tables; the host regions of
an engine or of a peer, for what a direct copy may touch), `locate` and
`first_outside` (blocks against sorted (start, end) spans: prepared block
lists, a relayed write's host ranges, compat/nixl)."""
from __future__ import annotations

import bisect
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from kvflow.memory import CUDA, HOST

__all__ = ["RegionTable", "first_outside", "gpu_table", "host_table", "locate"]


class RegionTable:
    """Regions by start address: the one that holds [addr, addr+n), in
    O(log n); any_in() answers for a whole batch's addresses at once (its
    columns are kept as arrays, rebuilt when the table changes, not per
    batch)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[Any] = []
        self._columns()

    def _columns(self) -> None:
        self._starts_np = np.asarray(self._starts, dtype=np.uint64)
        self._ends_np = np.asarray([r.end for r in self._regions], dtype=np.uint64)

    def set(self, regions: Sequence[Any]) -> None:
        ordered = sorted(regions, key=lambda r: r.addr)
        self._starts = [r.addr for r in ordered]
        self._regions = ordered
        self._columns()

    def add(self, region: Any) -> bool:
        i = bisect.bisect_left(self._starts, region.addr)
        if i > 0 and self._regions[i - 1].end > region.addr:
            return False
        if i < len(self._regions) and self._regions[i].addr < region.end:
            return False
        self._starts.insert(i, region.addr)
        self._regions.insert(i, region)
        self._columns()
        return True

    def remove(self, region: Any) -> None:
        i = bisect.bisect_left(self._starts, region.addr)
        if i < len(self._regions) and self._regions[i] is region:
            del self._starts[i], self._regions[i]
            self._columns()

    def find(self, addr: int, n: int) -> Any:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr + n <= self._regions[i].end:
            return self._regions[i]
        return None

    def holds(self, addr: int, n: int, need: int = 0) -> bool:
        """Whether [addr, addr+n) lies inside one region whose access has
        every bit of `need` (0: any region). The regions do not overlap
        (add() refuses it), so the one find() names is the only candidate,
        but for an empty range where two regions touch: it lies in both."""
        i = bisect.bisect_right(self._starts, addr) - 1
        for j in (i, i - 1) if n == 0 else (i,):
            if j >= 0:
                r = self._regions[j]
                if r.addr <= addr and addr + n <= r.end and int(r.access) & need == need:
                    return True
        return False

    def any_in(self, addrs: np.ndarray) -> bool:
        """Whether any address lies inside a region (vectorised)."""
        if not self._regions:
            return False
        i = np.searchsorted(self._starts_np, addrs, side="right").astype(np.int64) - 1
        return bool(np.any((i >= 0) & (addrs < self._ends_np[np.maximum(i, 0)])))

    def __bool__(self) -> bool:
        return bool(self._regions)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._regions)


def gpu_table(regions: Sequence[Any]) -> RegionTable:
    """A table of the GPU (CUDA) regions among `regions` (a peer's, as its
    descriptor lists them)."""
    t = RegionTable()
    t.set([r for r in regions if r.kind == CUDA])
    return t


def host_table(regions: Iterable[Any]) -> RegionTable:
    """A table of the host regions among `regions` (an engine's, or a
    peer's as its descriptor lists them: neither overlaps another)."""
    t = RegionTable()
    t.set([r for r in regions if r.kind == HOST])
    return t


def locate(spans: Iterable[tuple[int, int]], addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For each block [addrs[i], addrs[i]+lens[i]), the ordinal of the span
    ((start, end) pairs that do not overlap, in sorted order) it lies inside,
    or -1 (int64)."""
    spans = sorted(spans)
    if not spans or not len(addrs):
        return np.full(len(addrs), -1, dtype=np.int64)
    starts = np.array([s for s, _ in spans], dtype=np.uint64)
    ends = np.array([e for _, e in spans], dtype=np.uint64)
    i = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    end = addrs + lens
    ok = (i >= 0) & (end >= addrs) & (end <= ends[np.maximum(i, 0)])   # end >= addrs: no wrap-around
    return np.where(ok, i, -1)


def first_outside(spans: Iterable[tuple[int, int]], addrs: np.ndarray, lens: np.ndarray) -> int:
    """Index of the first block not inside one of `spans`, or -1 when all are."""
    bad = np.flatnonzero(locate(spans, addrs, lens) < 0)
    return int(bad[0]) if len(bad) else -1
