"""Slots: bounded pools of host bounce buffers, the staging pipeline that
moves GPU memory through them over providers that move host memory only,
and the one check of a request's pieces against a slot.

A batch's entries are packed into slots of the bounce pool (small entries
share a slot, a large one is cut across several). For each slot in turn:
the slot is taken from the pool (waiting while every slot is busy: the
memory is bounded), filled (a device→host copy for a write from GPU
memory, a host read for a read into it), and then drained (the host
write of the slot to the peer, or the host→device copy into GPU memory)
as a task of its own, which returns the slot. So while slot k drains,
slot k+1 fills: the D2H copy of one slice overlaps the send of the one
before, and on a read the H2D copy of one slice overlaps the receive of
the next. run() returns once the last drain has finished (a write is
complete only when the last byte is where it is going); on an error it
cancels the drains still running and raises the first error.

The pool is allocated once (pinned memory where CUDA is used) and never
per slice; `stats` counts what it did, and readout() is the figures an
engine publishes (engine.staging_stats(), engine.metrics()["staging"]).

A peer that asks this engine to act on one of its slots (land it in GPU
memory, fill it from there, forward it to a third engine: staged.py,
relay/) names pieces as [offset in the slot, address, nbytes]:
slot_pieces() checks them, the one place that does.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from kvflow.errors import InvalidArgumentError, ProtocolError

__all__ = ["BouncePool", "Packed", "Slot", "StagingStats", "pack", "run_staged", "slot_pieces"]


@dataclass
class Slot:
    """One bounce buffer: `addr`, `size` bytes, its index in the pool."""

    index: int
    addr: int
    size: int


@dataclass
class StagingStats:
    slots_in_use: int = 0
    max_in_use: int = 0
    fills: int = 0
    drains: int = 0
    allocations: int = 0            # of the pool's memory: 1 once made, whatever the traffic
    # (fills started, drains finished) in order: drains overlapping fills show as
    # a fill of slot k+1 started before the drain of slot k finished
    events: list[tuple[str, int]] = field(default_factory=list, repr=False)
    keep_events: bool = False


class BouncePool:
    """`count` slots of `slot_bytes` each, in one allocation made on the
    first acquire() by `allocate(total) -> (addr, keepalive)`."""

    def __init__(self, slot_bytes: int, count: int, allocate: Callable[[int], tuple[int, Any]]) -> None:
        if slot_bytes <= 0 or count < 1:
            raise InvalidArgumentError(f"a bounce pool needs slots (slot_bytes={slot_bytes}, count={count})")
        self.slot_bytes = slot_bytes
        self.count = count
        self._allocate = allocate
        self._keep: Any = None
        self._free: list[Slot] = []
        self._waiting: "collections.deque[asyncio.Future[None]]" = collections.deque()
        self.stats = StagingStats()
        self.base = 0

    @property
    def free(self) -> int:
        """Slots free now (all of them before the pool's memory is made)."""
        return len(self._free) if self._keep is not None else self.count

    @property
    def total(self) -> int:
        return self.slot_bytes * self.count

    def _ensure(self) -> None:
        if self._keep is not None:
            return
        addr, keep = self._allocate(self.total)
        self._keep = keep
        self.base = addr
        self.stats.allocations += 1
        self._free = [Slot(i, addr + i * self.slot_bytes, self.slot_bytes) for i in reversed(range(self.count))]

    async def acquire(self) -> Slot:
        """A free slot, waiting (first come, first served) while none is."""
        self._ensure()
        while not self._free:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake()                # pass the turn on
                raise
        slot = self._free.pop()
        s = self.stats
        s.slots_in_use += 1
        s.max_in_use = max(s.max_in_use, s.slots_in_use)
        return slot

    def release(self, slot: Slot) -> None:
        self._free.append(slot)
        self.stats.slots_in_use -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def readout(self) -> dict[str, int]:
        """The pool's figures, a plain dict: `slot_bytes`; `slots` (its
        size); `free` and `in_use` (now: they add up to `slots`, all free
        before its memory is made); `max_in_use` (the most at once);
        `allocations` (of its memory: 1 once made, whatever the traffic);
        `fills` and `drains` (slots the staging pipeline filled and
        drained: run_staged; 0 for an inbox, whose slots are leased)."""
        s = self.stats
        return {"slot_bytes": self.slot_bytes, "slots": self.count, "free": self.free,
                "in_use": s.slots_in_use, "max_in_use": s.max_in_use, "allocations": s.allocations,
                "fills": s.fills, "drains": s.drains}

    def close(self) -> Any:
        """Drops the pool's memory (returns its keepalive for the caller to
        free, after nothing uses it)."""
        keep, self._keep = self._keep, None
        self._free = []
        return keep


@dataclass
class Packed:
    """One slot's worth of a batch: entries (slot offset, local addr,
    remote addr, nbytes), `nbytes` in all."""

    entries: list[tuple[int, int, int, int]]
    nbytes: int


def pack(local: Sequence[int], remote: Sequence[int], lengths: Sequence[int], slot_bytes: int) -> list[Packed]:
    """Packs a batch's entries, in order, into slots of slot_bytes: small
    entries share a slot, large ones are cut at slot boundaries."""
    la = np.asarray(local, dtype=np.uint64)
    ra = np.asarray(remote, dtype=np.uint64)
    ln = np.asarray(lengths, dtype=np.uint64)
    if not (len(la) == len(ra) == len(ln)) or len(ln) == 0:
        raise InvalidArgumentError("a batch needs entries, as many local as remote addresses and lengths")
    out: list[Packed] = []
    cur: list[tuple[int, int, int, int]] = []
    used = 0
    for l_addr, r_addr, n in zip(la.tolist(), ra.tolist(), ln.tolist()):
        if n == 0:
            raise InvalidArgumentError("a batch entry of 0 bytes")
        while n:
            take = min(n, slot_bytes - used)
            cur.append((used, l_addr, r_addr, take))
            used += take
            l_addr += take
            r_addr += take
            n -= take
            if used == slot_bytes:
                out.append(Packed(cur, used))
                cur, used = [], 0
    if cur:
        out.append(Packed(cur, used))
    return out


async def run_staged(pool: BouncePool, packed: Sequence[Packed],
                     fill: Callable[[Slot, Packed], Awaitable[None]],
                     drain: Callable[[Slot, Packed], Awaitable[None]]) -> None:
    """For each packed slot, in order: take a slot, `fill` it (awaited),
    then `drain` it in a task that returns the slot when done. Returns when
    every drain finished; the first error cancels the rest and is raised."""
    stats = pool.stats
    drains: list[asyncio.Task[None]] = []
    # Each slot handed to a drain task, and whether its body has started: a
    # task cancelled before its first step never runs its body (the
    # coroutine is closed at its first line, outside the try), so its
    # `finally` cannot return the slot; the cleanup below does. A record per
    # hand-over, set by the body itself (an eager task factory runs the body
    # inside create_task, before anything here could note the task).
    handed: list[list[Any]] = []
    failed: list[BaseException] = []

    async def drain_then_release(record: list[Any], part: Packed) -> None:
        record[1] = True
        slot = record[0]
        try:
            await drain(slot, part)
            stats.drains += 1
            if stats.keep_events:
                stats.events.append(("drained", slot.index))
        except BaseException as e:
            failed.append(e)
            raise
        finally:
            pool.release(slot)

    try:
        for part in packed:
            if failed:
                break
            slot = await pool.acquire()
            try:
                if stats.keep_events:
                    stats.events.append(("fill", slot.index))
                await fill(slot, part)
                stats.fills += 1
            except BaseException:
                pool.release(slot)
                raise
            record: list[Any] = [slot, False]
            handed.append(record)
            drains.append(asyncio.get_running_loop().create_task(drain_then_release(record, part)))
        done = await asyncio.gather(*drains, return_exceptions=True)
    except BaseException:
        for t in drains:
            t.cancel()
        try:
            # shielded: a second cancel of this wait must not cancel the
            # drains again, which would cut short their own wait for bytes
            # still on the wire and free a slot a copy or a NIC still reads
            await asyncio.shield(asyncio.gather(*drains, return_exceptions=True))
        finally:
            # also when this wait is cancelled in its turn: the drains that
            # never started are done (cancelled), their slots free now
            for slot, started in handed:
                if not started:
                    pool.release(slot)
        raise
    for r in done:
        if isinstance(r, BaseException):
            raise r


def slot_pieces(what: str, entries: Any, size: int) -> list[tuple[int, int, int]] | str:
    """The pieces a request on a slot of `size` bytes names, each
    [offset in the slot, address, nbytes], as (offset, address, nbytes)
    tuples; or why one lies outside the slot (a non-positive length, a
    negative offset, past its end). Raises ProtocolError for anything that
    is not a list of three-int lists. `what` names the request in both."""
    if not isinstance(entries, list):
        raise ProtocolError(f"{what}: entries is a list of [offset, address, nbytes]")
    out = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) for v in e)):
            raise ProtocolError(f"{what}: an entry is [offset, address, nbytes]")
        off, addr, n = e
        if n <= 0 or off < 0 or off + n > size:
            return f"{what}: {off}+{n} is outside the slot"
        out.append((off, addr, n))
    return out
