"""Prepared descriptor lists: blocks named once, then moved by index.

A KV pool is a fixed set of pages, and a transfer names some of them. A
`Blocks` list holds (address, length) pairs checked once against the memory
they lie in: this engine's registered regions (`engine.blocks()`) or a
peer's, as its descriptor tells them (`peer.blocks()`). `peer.prepare(local,
remote)` pairs a local list with a list of that peer's; its write() and
read() take indices ("local blocks 3, 7, 9 to remote blocks 0, 1, 2"),
picked natively in one pass (kvflow._core.take_pairs), so a caller builds no
address arrays per transfer. NIXL's prep_xfer_dlist / make_prepped_xfer,
as a kvflow feature (kvflow.compat.nixl is built on it).

The checks made here are for the caller's sake (an error names the block at
prepare time, not at some later transfer); every batch is still checked by
the native core when it is submitted, so a list that went stale (its memory
deregistered) fails with the same typed error as an address array would.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from kvflow._core import take_pairs
from kvflow.errors import InvalidArgumentError, LengthMismatchError, RemoteAccessError, UnregisteredMemoryError
from kvflow.regions import first_outside, locate  # noqa: F401 (first_outside: re-exported, compat/nixl imports it here)
from kvflow.schedule.qos import Priority

if TYPE_CHECKING:
    from kvflow.engine.peer import Peer
    from kvflow.engine.posted import PostedTransfer
    from kvflow.engine.transfer import TaskTransfer, Transfer

__all__ = ["Blocks", "Prepared", "first_outside", "locate"]


def _column(values: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what}: {e}") from None
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f")):
        raise InvalidArgumentError(f"{what} must be a 1-D sequence of integers, not {arr.dtype} of shape "
                                   f"{arr.shape}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise InvalidArgumentError(f"{what}: negative value {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


class Blocks:
    """A list of blocks of one side's memory: `addrs` and `lengths` (read-only
    uint64 columns), `owner` (None: this engine's memory; else the peer's address). Made by
    engine.blocks() or peer.blocks(); len() is its number of blocks, and
    blocks[i] is (address, length)."""

    __slots__ = ("addrs", "lengths", "owner", "spans")

    def __init__(self, addrs: Any, lengths: Any, owner: str | None, spans: Iterable[tuple[int, int]],
                 outside: type[Exception]) -> None:
        a = _column(addrs, "block addresses")
        if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
            if lengths <= 0:
                raise InvalidArgumentError(f"block length must be > 0, not {lengths}")
            n = np.full(len(a), lengths, dtype=np.uint64)      # one length for every block
        else:
            n = _column(lengths, "block lengths")
            if len(n) != len(a):
                raise InvalidArgumentError(f"{len(a)} block addresses and {len(n)} lengths")
            if len(n) and int(n.min()) == 0:
                raise InvalidArgumentError(f"block {int(np.argmin(n))} has length 0")
        if a is addrs:
            a = a.copy()        # the caller's array may change later; ours may not
        if n is lengths:
            n = n.copy()
        inside = locate(spans, a, n)
        outside_at = np.flatnonzero(inside < 0)
        if len(outside_at):
            bad = int(outside_at[0])
            where = "this engine's registered memory" if owner is None else f"the memory peer {owner} registered"
            raise outside(f"block {bad} ({int(a[bad]):#x}+{int(n[bad])}) is not inside {where}", index=bad,
                          **({} if owner is None else {"peer": owner}))
        a.flags.writeable = n.flags.writeable = inside.flags.writeable = False
        self.addrs, self.lengths, self.owner = a, n, owner
        self.spans = inside         # the region each block lies in: adjacent picks merge only within one

    @classmethod
    def local(cls, regions: Iterable[Any], addrs: Any, lengths: Any) -> "Blocks":
        return cls(addrs, lengths, None, [(r.addr, r.end) for r in regions], UnregisteredMemoryError)

    @classmethod
    def remote(cls, peer: str, regions: Iterable[Any], addrs: Any, lengths: Any) -> "Blocks":
        return cls(addrs, lengths, peer, [(r.addr, r.end) for r in regions], RemoteAccessError)

    def __len__(self) -> int:
        return len(self.addrs)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(self.addrs[i]), int(self.lengths[i])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __repr__(self) -> str:
        return f"<kvflow.Blocks {len(self)} blocks, {self.nbytes} bytes, {self.owner or 'this engine'}>"


class Prepared:
    """A local and a remote Blocks list paired for one peer (peer.prepare()).
    Every transfer takes local indices and remote indices (the same ones when
    remote_indices is None), pairs them position by position, and moves
    local block i to remote block j (write) or back (read); paired blocks must
    have the same length (LengthMismatchError). An index outside its list
    raises InvalidArgumentError naming it; nothing moves then. The keyword
    arguments are those of the peer's call of the same name, but strided
    entries: a pick is of whole blocks, each checked once when its list was
    made; a strided piece would run outside the block that was checked."""

    __slots__ = ("peer", "local", "remote")

    def __init__(self, peer: "Peer", local: Blocks, remote: Blocks) -> None:
        if not isinstance(local, Blocks) or not isinstance(remote, Blocks):
            raise InvalidArgumentError("prepare() takes two kvflow.Blocks lists (engine.blocks(), peer.blocks())")
        if local.owner is not None:
            raise InvalidArgumentError(f"prepare(): the first list is of peer {local.owner}'s memory, not this "
                                       "engine's (engine.blocks())")
        if remote.owner != peer.address:
            raise InvalidArgumentError(f"prepare(): the second list is of {remote.owner!r}'s memory, not of peer "
                                       f"{peer.address} (peer.blocks())")
        self.peer, self.local, self.remote = peer, local, remote

    def pick(self, local_indices: Any, remote_indices: Any = None,
             merge: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(local_addrs, remote_addrs, lengths) of the paired blocks: the
        columns the peer's batch calls take (empty for no indices). With
        `merge`, a pick that continues the previous entry on both sides (the
        next block of the same region on each) is merged into it, as NIXL
        merges descriptors: pages 3, 4, 5 to 10, 11, 12 are one entry."""
        ri = local_indices if remote_indices is None else remote_indices
        lo, re = self.local, self.remote
        try:
            if merge:
                la, ra, ln, mismatch = take_pairs(lo.addrs, lo.lengths, re.addrs, re.lengths, local_indices, ri,
                                                  lo.spans, re.spans)
            else:
                la, ra, ln, mismatch = take_pairs(lo.addrs, lo.lengths, re.addrs, re.lengths, local_indices, ri)
        except (IndexError, TypeError, ValueError, OverflowError) as e:
            raise InvalidArgumentError(f"transfer of prepared blocks: {e} ({len(self.local)} local, "
                                       f"{len(self.remote)} remote blocks)", peer=self.peer.address) from None
        if mismatch >= 0:
            i, j = int(np.asarray(local_indices)[mismatch]), int(np.asarray(ri)[mismatch])
            raise LengthMismatchError(
                f"transfer of prepared blocks: at position {mismatch}, local block {i} has "
                f"{int(self.local.lengths[i])} bytes and remote block {j} {int(self.remote.lengths[j])}",
                peer=self.peer.address, index=mismatch)
        return la, ra, ln           # (none: the peer's call refuses an empty batch; NIXL's posts only a notification)

    async def write(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                    priority: Priority = Priority.NORMAL, deadline: float | None = None, after: Any = None) -> None:
        await self.peer.write(*self.pick(local_indices, remote_indices), timeout=timeout, priority=priority,
                              deadline=deadline, after=after)

    async def read(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                   priority: Priority = Priority.NORMAL, deadline: float | None = None, after: Any = None) -> None:
        await self.peer.read(*self.pick(local_indices, remote_indices), timeout=timeout, priority=priority,
                             deadline=deadline, after=after)

    def write_nowait(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                     priority: Priority = Priority.NORMAL, deadline: float | None = None,
                     after: Any = None) -> "Transfer | TaskTransfer":
        return self.peer.write_nowait(*self.pick(local_indices, remote_indices), timeout=timeout,
                                      priority=priority, deadline=deadline, after=after)

    def read_nowait(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                    priority: Priority = Priority.NORMAL, deadline: float | None = None,
                    after: Any = None) -> "Transfer | TaskTransfer":
        return self.peer.read_nowait(*self.pick(local_indices, remote_indices), timeout=timeout,
                                     priority=priority, deadline=deadline, after=after)

    def write_blocking(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                       priority: Priority = Priority.NORMAL, deadline: float | None = None,
                       after: Any = None) -> None:
        self.peer.write_blocking(*self.pick(local_indices, remote_indices), timeout=timeout, priority=priority,
                                 deadline=deadline, after=after)

    def read_blocking(self, local_indices: Any, remote_indices: Any = None, *, timeout: float | None = None,
                      priority: Priority = Priority.NORMAL, deadline: float | None = None,
                      after: Any = None) -> None:
        self.peer.read_blocking(*self.pick(local_indices, remote_indices), timeout=timeout, priority=priority,
                                deadline=deadline, after=after)

    def post_write(self, local_indices: Any, remote_indices: Any = None, *, priority: Priority = Priority.NORMAL,
                   deadline: float | None = None, after: Any = None) -> "PostedTransfer":
        return self.peer.post_write(*self.pick(local_indices, remote_indices), priority=priority, deadline=deadline,
                                    after=after)

    def post_read(self, local_indices: Any, remote_indices: Any = None, *, priority: Priority = Priority.NORMAL,
                  deadline: float | None = None, after: Any = None) -> "PostedTransfer":
        return self.peer.post_read(*self.pick(local_indices, remote_indices), priority=priority, deadline=deadline,
                                   after=after)

    def __repr__(self) -> str:
        return f"<kvflow.Prepared {len(self.local)} local x {len(self.remote)} remote blocks, peer {self.peer.address}>"
