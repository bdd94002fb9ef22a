"""Moving an operation's bytes: one batch per holder engine, all holders at
once. The client's own segment is in this process, so its share is a plain
memmove; every other holder gets one kvflow Peer.write (puts) or Peer.read
(gets) with the whole call's entries for it as address arrays.

A holder's batch that fails (the holder was lost or is unreachable, its
memory is gone, the timeout elapsed) fails only that holder's entries: the
caller learns which holders failed and decides (another replica, or fewer
replicas). kvflow drains a failed batch before raising, so nothing of it
lands afterwards and the space may be reused at once: over tcp, what a
holder stopped meanwhile still has queued of the batch is dropped when it
runs again (kvflow/_native/sockio.c: sk_not_reset), and a writer's process
that dies resets its connections (providers/tcp.py); the same-host paths
copy on the writer's own threads (tests/test_store_late_bytes.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import kvflow
from kvflow.errors import KVFlowError, PeerLostError

from .device import DeviceRanges, by_memory, split_rows
from .fence import CONNECT_TIMEOUT

__all__ = ["Moves", "Mover", "finish_before_cancel", "holders_of"]


# own-segment copies up to this many bytes run on the loop's thread (about
# 100 us of memcpy); larger ones on a worker thread
COPY_INLINE = 1 << 20


async def finish_before_cancel(fut: asyncio.Future) -> Any:
    """Awaits work on worker threads that writes into memory the caller
    gets back: a cancel of the caller waits for it to finish before it is
    raised, so nothing lands after the caller gave the space back. Returns
    its result."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


class Moves:
    """A call's entries as four columns (what Peer.write takes), appended
    to without an object per entry."""

    __slots__ = ("local", "holder", "remote", "length")

    def __init__(self) -> None:
        self.local: list[int] = []
        self.holder: list[str] = []
        self.remote: list[int] = []
        self.length: list[int] = []

    @classmethod
    def of(cls, local: list[int], holder: list[str], remote: list[int], length: list[int]) -> "Moves":
        """The entries given as whole columns (a batch's common case)."""
        m = cls()
        m.local, m.holder, m.remote, m.length = local, holder, remote, length
        return m

    def add(self, local: int, holder: str, remote: int, length: int) -> None:
        self.local.append(local)
        self.holder.append(holder)
        self.remote.append(remote)
        self.length.append(length)

    def __len__(self) -> int:
        return len(self.local)


def holders_of(sids: Sequence[int], segs: dict) -> list[str]:
    """The holder engine of each of `sids` (segment ids of a master's reply,
    whose segments table maps id -> [client, engine, host])."""
    if len(segs) == 1:              # one holder (the common case): one lookup
        ((sid, (_, engine, _)),) = segs.items()
        if set(sids) == {sid}:
            return [engine] * len(sids)
    return [segs[sid][1] for sid in sids]


class Mover:
    def __init__(self, engine: kvflow.Engine, *, connect_timeout: float = CONNECT_TIMEOUT, shm: Any = None) -> None:
        self.engine = engine
        self.shm = shm                  # same-host holders' segments mapped here (shmseg.SameHost)
        self.connect_timeout = connect_timeout
        self.writing = 0                # write batches in progress on the loop (idle() waits for none)
        # set once a call named GPU memory (device.py): from then on the
        # own segment's rows are split, GPU ones off the memmove
        self.device = False
        self._idle: asyncio.Event | None = None
        # puts on callers' threads (direct.py), counted from before their
        # put_start is sent to after their writes: a reply the old leader
        # sent is always inside the count, whichever thread reads it
        self._threads = 0
        self._threads_lock = threading.Lock()

    @contextlib.contextmanager
    def thread_put(self) -> Iterator[None]:
        """Counts a put run on a caller's thread while it may write."""
        with self._threads_lock:
            self._threads += 1
        try:
            yield
        finally:
            with self._threads_lock:
                self._threads -= 1

    async def idle(self, timeout: float) -> bool:
        """Waits until no write is in progress (True), at most `timeout` s
        (False). A client re-attaching to a new leader says its writes
        allowed by the old one are over (fence.py)."""
        deadline = time.monotonic() + timeout
        while self._threads:            # callers' threads cannot set the loop's event: polled (a failover's rare path)
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        if not self.writing:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return await self.idle(max(0.0, deadline - time.monotonic())) if self._threads else True

    async def run(self, op: str, moves: Moves, *, timeout: float | None) -> dict[str, KVFlowError]:
        """Moves every entry (op "write": local -> remote, "read": remote ->
        local); returns the holders whose batch failed, with their error."""
        if op != "write":
            return await self._run(op, moves, timeout)
        # counted from here, which a put reaches from its put_start's reply
        # with no await between: idle() sees every write a master allowed
        self.writing += 1
        try:
            return await self._run(op, moves, timeout)
        finally:
            self.writing -= 1
            if not self.writing and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def _run(self, op: str, moves: Moves, timeout: float | None) -> dict[str, KVFlowError]:
        own = self.engine.address
        groups: dict[str, list[int]] = {}
        distinct = set(moves.holder)
        if len(distinct) == 1:          # one holder (the common case): every row
            groups[distinct.pop()] = range(len(moves))
        else:
            for j, h in enumerate(moves.holder):
                g = groups.get(h)
                if g is None:
                    groups[h] = [j]
                else:
                    g.append(j)
        mine = groups.pop(own, None)
        if mine and self.device:
            # GPU rows of the own segment: a batch through the engine's Peer
            # of itself (its one-process GPU copy), as any holder's
            mine, gpu = split_rows(DeviceRanges(self.engine), moves.local, moves.length, mine)
            if gpu:
                groups[own] = gpu
        if self.shm is not None and groups and not self.device:
            # (a memmove through the mapping: host memory only; a client that
            # named GPU memory moves its bytes through the engine)
            await self.shm.move_groups(op, moves, groups)     # copies (and removes) the holders mapped here
        if mine and not groups:
            await self._copy_own(op, moves, mine)
            return {}
        jobs = []
        if mine:
            jobs.append(self._copy_own(op, moves, mine))
        holders = list(groups)
        if holders:
            cols = (np.array(moves.local, np.uint64), np.array(moves.remote, np.uint64),
                    np.array(moves.length, np.uint64))
            jobs += [self._batch(op, h, cols, None if len(groups[h]) == len(moves) else groups[h], timeout)
                     for h in holders]
        if not jobs:
            return {}
        if len(jobs) == 1:
            # one holder (the common case): no task and no gather
            try:
                await jobs[0]
                results = [None]
            except (KVFlowError, asyncio.CancelledError) as e:
                results = [e]
        else:
            results = await asyncio.gather(*jobs, return_exceptions=True)
        if mine:
            own_result, results = results[0], results[1:]
            if isinstance(own_result, BaseException):
                raise own_result
        failed: dict[str, KVFlowError] = {}
        me = asyncio.current_task()
        for h, r in zip(holders, results):
            if isinstance(r, KVFlowError):
                failed[h] = r
            elif isinstance(r, asyncio.CancelledError) and not (me and me.cancelling()):
                # not our cancel: this engine closed under the transfer (its
                # close cancels what is in flight on it)
                failed[h] = PeerLostError(f"transfer to {h} cancelled: this client's engine closed", peer=h)
            elif isinstance(r, BaseException):
                raise r
        return failed

    async def _copy_own(self, op: str, moves: Moves, rows: list[int]) -> None:
        """The client's own segment is this process's memory (the caller
        checked every local range is registered memory, _run kept GPU
        memory out of `rows`, and the master
        gave remote ranges inside our segment): memmove. Up to COPY_INLINE
        bytes on the loop's thread; more on a worker thread (memmove
        through ctypes releases the GIL), and then, as kvflow's transfers
        do, a cancel waits for the copy to finish before it is raised, so
        nothing lands after the caller gave the space back."""
        def copy() -> None:
            for j in rows:
                if op == "write":
                    ctypes.memmove(moves.remote[j], moves.local[j], moves.length[j])
                else:
                    ctypes.memmove(moves.local[j], moves.remote[j], moves.length[j])

        if sum(moves.length[j] for j in rows) <= COPY_INLINE:
            copy()
            return
        await finish_before_cancel(asyncio.get_running_loop().run_in_executor(None, copy))

    async def _batch(self, op: str, holder: str, cols: tuple, rows: list[int] | None,
                     timeout: float | None) -> None:
        peer = await self.engine.connect(holder, timeout=self.connect_timeout)
        if self.device:
            groups = by_memory(DeviceRanges(self.engine), cols[0], range(len(cols[0])) if rows is None else rows)
            if len(groups) > 1:
                # host and GPU memory (or two GPUs) on the local side: one
                # batch each, and every one over before the first error is
                # raised (nothing of a failed call lands later)
                done = await asyncio.gather(*(self._batch_of(op, peer, cols, g, timeout) for g in groups),
                                            return_exceptions=True)
                for r in done:
                    if isinstance(r, BaseException):
                        raise r
                return
        await self._batch_of(op, peer, cols, rows, timeout)

    @staticmethod
    async def _batch_of(op: str, peer: kvflow.Peer, cols: tuple, rows: list[int] | None,
                        timeout: float | None) -> None:
        local, remote, lengths = cols if rows is None else (c[rows] for c in cols)
        if op == "write":
            await peer.write(local, remote, lengths, timeout=timeout)
        else:
            await peer.read(local, remote, lengths, timeout=timeout)
