"""Moving an operation's bytes: one batch per holder engine, all holders at
once. The client's own segment is in this process, so its share is a plain
memmove; every other holder gets one kvflow Peer.write (puts) or Peer.read
(gets) with the whole call's entries for it as address arrays.

A holder's batch that fails (the holder was lost or is unreachable, its
memory is gone, the timeout elapsed) fails only that holder's entries: the
caller learns which holders failed and decides (another replica, or fewer
replicas). kvflow drains a failed batch before raising, so nothing of it
lands afterwards and the space may be reused at once.
"""
from __future__ import annotations

import asyncio
import ctypes
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

import kvflow
from kvflow.errors import KVFlowError, PeerLostError

__all__ = ["Entry", "Mover"]


@dataclass(slots=True)
class Entry:
    local: int          # address in this engine's registered memory
    holder: str         # the holder's engine address
    remote: int         # address in the holder's segment
    length: int


class Mover:
    def __init__(self, engine: kvflow.Engine, *, connect_timeout: float = 5.0) -> None:
        self.engine = engine
        self.connect_timeout = connect_timeout

    @property
    def own(self) -> str:
        return self.engine.address

    async def run(self, op: str, entries: list[Entry], *, timeout: float | None) -> dict[str, KVFlowError]:
        """Moves every entry (op "write": local -> remote, "read": remote ->
        local); returns the holders whose batch failed, with their error."""
        groups: dict[str, list[Entry]] = defaultdict(list)
        for e in entries:
            groups[e.holder].append(e)
        own = groups.pop(self.own, None)
        if own:
            # same process: the segment is our own memory (the caller checked
            # every local range is registered, and the master gave the
            # remote ranges inside our segment)
            for e in own:
                if op == "write":
                    ctypes.memmove(e.remote, e.local, e.length)
                else:
                    ctypes.memmove(e.local, e.remote, e.length)
        if not groups:
            return {}
        holders = list(groups)
        results = await asyncio.gather(*(self._batch(op, h, groups[h], timeout) for h in holders),
                                       return_exceptions=True)
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

    async def _batch(self, op: str, holder: str, entries: list[Entry], timeout: float | None) -> None:
        peer = await self.engine.connect(holder, timeout=self.connect_timeout)
        n = len(entries)
        local = np.fromiter((e.local for e in entries), np.uint64, n)
        remote = np.fromiter((e.remote for e in entries), np.uint64, n)
        lengths = np.fromiter((e.length for e in entries), np.uint64, n)
        if op == "write":
            await peer.write(local, remote, lengths, timeout=timeout)
        else:
            await peer.read(local, remote, lengths, timeout=timeout)
