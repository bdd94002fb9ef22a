"""A StoreClient's gets (a mixin of StoreClient, client.py): the funnel
of every get into registered memory (replicas and a lease from the master,
the nearest complete replica read, another one if its holder is gone, SSD
copies), gets of bytes through the local buffer."""
from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from kvflow.errors import InvalidArgumentError, KVFlowError

from .calls import (Parts, all_ok, item_result, lease_outlasted, one_part, replica_rows, single_parts,
                    with_timeout)
from .datapath import Moves, holders_of
from .errors import BufferTooSmallError, ReplicaUnavailableError
from .metrics import counted
from .model import check_key
from .ssd_agent import SsdCopies, promote, read_copies

__all__ = ["Gets"]


class Gets:
    # -- gets ------------------------------------------------------------------
    @with_timeout
    async def get_into(self, key: str, addr: int, size: int) -> int:
        """Reads `key` into `size` bytes at `addr` (registered memory).
        Returns the object's size. Raises ObjectNotFoundError,
        BufferTooSmallError, UnregisteredMemoryError, InvalidKeyError,
        ReplicaUnavailableError (no replica's holder could be read),
        LeaseExpiredError, MasterUnavailableError."""
        return self._one(await self.batch_get_into_parts([key], [[(addr, size)]]))

    @with_timeout
    async def get_into_parts(self, key: str, parts: Parts) -> int:
        return self._one(await self.batch_get_into_parts([key], [parts]))

    @with_timeout
    async def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list:
        if not (len(keys) == len(addrs) == len(sizes)):
            raise InvalidArgumentError("keys, addrs and sizes must have the same length")
        return await self.batch_get_into_parts(keys, [[(a, s)] for a, s in zip(addrs, sizes)])

    @with_timeout
    @counted("get")
    async def batch_get_into_parts(self, keys: Sequence[str], parts: Sequence[Parts]) -> list:
        """The funnel of every get into registered memory."""
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        keys = self._ns(keys)
        results: list[Any] = [None] * len(keys)
        regions = self._regions()
        starts, ends = regions
        # every object one part of registered memory under a plain key (the
        # common case): the batch's columns checked at once
        cols = single_parts(keys, parts, starts, ends)
        if cols is not None:
            todo: Sequence[int] = range(len(keys))
            asked = list(keys)
        else:
            todo = []
            for i, (key, ps) in enumerate(zip(keys, parts)):
                if one_part(key, ps, starts, ends):       # one object of the common case
                    todo.append(i)
                    continue
                try:
                    self._checked_parts(key, ps, regions)
                    todo.append(i)
                except KVFlowError as e:
                    results[i] = e
            if not todo:
                return results
            asked = [keys[i] for i in todo]
        t0 = time.monotonic()       # before the lease is granted: a safe bound on its age
        reply = await self._call("batch_get_replicas", asked)
        try:
            found, segs = replica_rows(reply)
            if cols is not None:
                reading = self._all_found(found, segs, cols)
                if reading is not None:     # every object found in DRAM, one replica, fitting its buffer
                    await self._read(keys, reading[0], parts, results, t0, first=reading[1])
                    return results
            holders = self._holders(segs)
            reading = []
            for i, item in zip(todo, found):
                r = item_result(item, keys[i])
                if isinstance(r, KVFlowError):
                    results[i] = r
                    continue
                size, reps = r[0], r[1]
                room = sum(int(s) for _, s in parts[i])
                if room < size:
                    results[i] = BufferTooSmallError(f"{keys[i]!r} is {size} bytes, the buffer {room}",
                                                     key=keys[i])
                    continue
                reading.append((i, size, self._nearest(reps, holders) if reps or len(r) < 3 else SsdCopies(r[2])))
            await self._read(keys, reading, parts, results, t0)
        finally:
            self._release(reply)
        return results

    def _release(self, reply: dict) -> None:
        """Nothing of the call's reads is in flight any more (kvflow drains a
        failed or cancelled batch before raising): its lease may go, so the
        objects can be removed and evicted again at once."""
        lease = reply.get("lease")
        if lease and self._link is not None:
            self._link.notify("release_lease", lease)

    @staticmethod
    def _all_found(found: list, segs: dict, cols: tuple[list, list]) -> tuple[list, Moves] | None:
        """The reads of a get whose objects were all found with one DRAM
        replica each, no larger than their one-part buffers (the common
        case), built as columns: (reading, the first attempt's moves); None
        otherwise (the per-key path then sorts each object out)."""
        values = all_ok(found)
        if values is None or set(map(len, values)) != {2}:     # a third column: SSD copies
            return None
        sizes, reps = list(map(itemgetter(0), values)), list(map(itemgetter(1), values))
        if set(map(len, reps)) != {1} or not all(map(operator.le, sizes, cols[1])):
            return None
        sids, remotes = zip(*map(itemgetter(0), reps))
        holders = holders_of(sids, segs)
        reading = list(zip(range(len(sizes)), sizes, ([h] for h in zip(holders, remotes))))
        return reading, Moves.of(cols[0], holders, list(remotes), sizes)

    def _holders(self, segs: dict) -> dict:
        """segment id -> (rank, holder engine): 0 this process, 1 this host, 2 elsewhere."""
        me = self.engine.address
        return {int(sid): (0 if engine == me else 1 if host == self.host else 2, engine)
                for sid, (_, engine, host) in segs.items()}

    @staticmethod
    def _nearest(reps: list, holders: dict) -> list[tuple[str, int]]:
        """[(holder engine, address), ...], nearest first."""
        out = [(holders[sid], addr) for sid, addr in reps]
        if len(out) > 1:
            out.sort(key=lambda x: x[0][0])
        return [(h[1], addr) for h, addr in out]

    async def _read(self, keys: Sequence[str], reading: list, parts: Sequence[Parts], results: list,
                    t0: float, first: Moves | None = None) -> None:
        """Reads each of `reading` ((index, size, [(holder, address), ...]
        nearest first, or SsdCopies)) into its parts, going on to the next
        replica where a holder failed. `first`: the moves of the first
        attempt, built already (then no entry is SsdCopies)."""
        if first is None and any(type(e[2]) is SsdCopies for e in reading):
            ssd = [e for e in reading if type(e[2]) is SsdCopies]
            read = await read_copies(self, keys, ssd, parts, results)
            if self.ssd_promote:
                await promote(self, keys, read, parts)
            reading = [e for e in reading if type(e[2]) is not SsdCopies]
        attempt: dict[int, int] = {}        # index -> the replica being tried, when not the first
        last: dict[int, list[str]] = {}
        pending = reading
        while pending:
            if first is not None:
                moves, first = first, None
            else:
                moves = Moves()
                for i, size, reps in pending:
                    holder, addr = reps[attempt.get(i, 0)]
                    ps = parts[i]
                    if len(ps) == 1:
                        moves.add(int(ps[0][0]), holder, addr, size)
                        continue
                    off = 0
                    for a, s in ps:
                        n = min(int(s), size - off)
                        if n <= 0:
                            break
                        moves.add(int(a), holder, addr + off, n)
                        off += n
            failed = await self._mover.run("read", moves, timeout=self.timeout)
            if not failed:
                for i, size, _ in pending:
                    results[i] = size
                break
            again = []
            for i, size, reps in pending:
                tried = attempt.get(i, 0)
                h = reps[tried][0]
                if h not in failed:
                    results[i] = size
                    continue
                last.setdefault(i, []).append(f"{h}: {failed[h]}")
                attempt[i] = tried = tried + 1
                if tried < len(reps):
                    self.replica_fallbacks += 1
                    again.append((i, size, reps))
                else:
                    results[i] = ReplicaUnavailableError(
                        f"no replica of {keys[i]!r} could be read ({'; '.join(last[i])})", key=keys[i])
            pending = again
        if time.monotonic() - t0 >= self.lease_ttl:
            for i, _, _ in reading:
                if isinstance(results[i], int):
                    results[i] = lease_outlasted(keys[i], self.lease_ttl)

    @with_timeout
    async def get(self, key: str) -> bytes:
        """The object's bytes, through the local buffer. get_into's errors."""
        return self._one(await self.batch_get([key]))

    @with_timeout
    @counted("get")
    async def batch_get(self, keys: Sequence[str]) -> list:
        keys = self._ns(keys)
        results: list[Any] = [None] * len(keys)
        todo = []
        for i, key in enumerate(keys):
            try:
                check_key(key)
                todo.append(i)
            except KVFlowError as e:
                results[i] = e
        if not todo:
            return results
        t0 = time.monotonic()
        reply = await self._call("batch_get_replicas", [keys[i] for i in todo])
        try:
            return await self._get_staged(keys, todo, reply, results, t0)
        finally:
            self._release(reply)

    async def _get_staged(self, keys: Sequence[str], todo: list[int], reply: dict, results: list,
                          t0: float) -> list:
        found, segs = replica_rows(reply)
        holders = self._holders(segs)
        sized = []
        for i, item in zip(todo, found):
            r = item_result(item, keys[i])
            if isinstance(r, KVFlowError):
                results[i] = r
            else:
                sized.append((i, r[0], self._nearest(r[1], holders) if r[1] or len(r) < 3 else SsdCopies(r[2])))
        sizes = [s for _, s, _ in sized]
        sub: list[Any] = [None] * len(sized)
        for chunk in self._chunks(sizes, sub):
            addrs = await self._stage([sizes[j] for j in chunk])
            try:
                parts = {sized[j][0]: [(a, sizes[j])] for j, a in zip(chunk, addrs)}
                await self._read(keys, [sized[j] for j in chunk], parts, results, t0)
                for j, a in zip(chunk, addrs):
                    i = sized[j][0]
                    if isinstance(results[i], int):
                        results[i] = bytes(self._staging_view(a, sizes[j]))
            finally:
                await self._unstage(addrs)
        for j, r in enumerate(sub):
            if r is not None:
                results[sized[j][0]] = r
        return results
