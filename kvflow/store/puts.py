"""A StoreClient's puts (a mixin of StoreClient, client.py): the funnel
of every put (allocate at the master, one kvflow batch per holder, commit),
the put again of what an eager SSD tier holds back, revokes."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError, KVFlowError

from .calls import Parts, all_ok, item_result, one_part, replica_rows, single_parts, with_timeout, writes_failed
from .datapath import Moves, holders_of
from .errors import MasterUnavailableError, ObjectNotFoundError, SpaceFencedError, SsdBusyError
from .metrics import counted

__all__ = ["Puts", "wire_pin"]


def wire_pin(pin: bool, soft_pin: float | bool | None) -> bool | list:
    """A put's pin as put_start takes it: a bool (a hard pin), or ["soft",
    seconds or None] (None: the master's soft_pin_ttl)."""
    if soft_pin is None or soft_pin is False or pin:
        return bool(pin)
    if soft_pin is not True and (isinstance(soft_pin, bool) or not isinstance(soft_pin, (int, float))
                                 or not soft_pin > 0):
        raise InvalidArgumentError(f"soft_pin must be True or seconds > 0, not {soft_pin!r}")
    return ["soft", None if soft_pin is True else float(soft_pin)]


class Puts:
    # -- puts ------------------------------------------------------------------
    @with_timeout
    async def put_from(self, key: str, addr: int, size: int, **kw: Any) -> int:
        """Puts `size` bytes at `addr` (registered memory) as `key`.
        Returns the number of replicas stored (0 when the key existed
        already: a no-op). Raises InvalidKeyError, InvalidArgumentError,
        UnregisteredMemoryError, ObjectBusyError, ObjectExistsError (the key
        exists with another size), NoSpaceError, ReplicaUnavailableError
        (every replica's write failed), MasterUnavailableError."""
        return self._one(await self.batch_put_from_parts([key], [[(addr, size)]], **kw))

    @with_timeout
    async def put_from_parts(self, key: str, parts: Parts, **kw: Any) -> int:
        """put_from of an object made of several buffers, concatenated in order."""
        return self._one(await self.batch_put_from_parts([key], [parts], **kw))

    @with_timeout
    async def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                             **kw: Any) -> list:
        if not (len(keys) == len(addrs) == len(sizes)):
            raise InvalidArgumentError("keys, addrs and sizes must have the same length")
        return await self.batch_put_from_parts(keys, [[(a, s)] for a, s in zip(addrs, sizes)], **kw)

    @with_timeout
    @counted("put")
    async def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Parts], *,
                                   replica_num: int | None = None,
                                   preferred_segment: int | str | Sequence[str] | None = None,
                                   pin: bool = False, soft_pin: float | bool | None = None,
                                   _again: bool = False, _wait: bool = True) -> list:
        """The funnel of every put. One master round trip to allocate, one
        kvflow batch per holder, one round trip to commit. `pin`: never
        evicted (only removed); `soft_pin`: evicted only when nothing
        unpinned can go, for that many seconds (True: the master's
        soft_pin_ttl). `preferred_segment`: a segment id, or segment names
        (a str, or a list in order: StoreClient's segment_name) where the
        replicas go first when they fit; names not mounted are ignored. The keys of one call are a chained prefix, head
        first: the master evicts its tail before its head. A put whose
        commit reached a new leader that never saw its allocation (the old
        one died in between: follow.py) is put again, once."""
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        if not _again and _wait:
            keys = self._ns(keys)
        rn = self.replica_num if replica_num is None else replica_num
        if preferred_segment is None and self.prefer_local:
            preferred_segment = self.segment_id
        if not isinstance(rn, int) or isinstance(rn, bool) or rn < 1:
            raise InvalidArgumentError(f"replica_num must be an int >= 1, not {rn!r}")
        pinned = wire_pin(pin, soft_pin)
        results: list[Any] = [None] * len(keys)
        regions = self._regions()
        starts, ends_ = regions
        # every object one part of registered memory under a plain key (the
        # common case): the batch's columns checked at once
        cols = single_parts(keys, parts, starts, ends_)
        if cols is not None:
            todo: Sequence[int] = range(len(keys))
            sizes = cols[1]
            request = [[k, n, rn, preferred_segment, pinned] for k, n in zip(keys, sizes)]
        else:
            todo, sizes = [], []
            for i, (key, ps) in enumerate(zip(keys, parts)):
                n = one_part(key, ps, starts, ends_)
                if n:                                       # one object of the common case
                    todo.append(i)
                    sizes.append(n)
                    continue
                try:
                    sizes.append(self._checked_parts(key, ps, regions))
                    todo.append(i)
                except KVFlowError as e:
                    results[i] = e
            if not todo:
                return results
            request = [[keys[i], sizes[j], rn, preferred_segment, pinned] for j, i in enumerate(todo)]
        relinks = getattr(self._link, "reconnects", 0)
        token = next(self._put_tokens)
        try:
            reply = await self._call("batch_put_start", request, token)
        except (asyncio.CancelledError, MasterUnavailableError):
            # the request may have reached the master and allocated: undo this
            # call's allocations (queued behind the put_start on the same link)
            await asyncio.shield(self._revoke([keys[i] for i in todo], token))
            raise
        started, segs = replica_rows(reply)
        ssd_busy = False
        placed = all_ok(started)
        if placed is not None:                      # every object allocated (the common case)
            writing: list[tuple[int, list]] = list(zip(todo, placed))   # (index, [[segment, address], ...])
        else:
            writing = []
            for i, item in zip(todo, started):
                r = item_result(item, keys[i])
                if isinstance(r, KVFlowError):
                    results[i] = r
                    ssd_busy = ssd_busy or type(r) in (SsdBusyError, SpaceFencedError)     # both: wait
                elif r is None:
                    results[i] = 0                      # exists already: immutable, nothing to write
                else:
                    writing.append((i, r))
        if not writing:
            if _wait and ssd_busy:
                await self._wait_for_ssd(keys, parts, results, rn, preferred_segment, pin, soft_pin)
            return results
        try:
            if placed is not None and cols is not None and set(map(len, placed)) == {1}:
                # one replica each of one-part objects: the columns at once
                sids, remotes = zip(*map(itemgetter(0), placed))
                moves = Moves.of(cols[0], holders_of(sids, segs), list(remotes), sizes)
            else:
                moves = Moves()
                for i, reps in writing:
                    ps = parts[i]
                    for sid, addr in reps:
                        holder = segs[sid][1]
                        if len(ps) == 1:
                            moves.add(int(ps[0][0]), holder, addr, int(ps[0][1]))
                            continue
                        off = 0
                        for a, s in ps:
                            moves.add(int(a), holder, addr + off, int(s))
                            off += int(s)
            failed = await self._mover.run("write", moves, timeout=self.timeout)
        except BaseException:
            # cancelled, or a bug: nothing of the writes is in flight any more
            # (kvflow drains before raising); give the space back
            await asyncio.shield(self._revoke([keys[i] for i, _ in writing], token))
            raise
        if failed:
            ends = [[keys[i], [sid for sid, _ in reps if segs[sid][1] in failed]] for i, reps in writing]
        else:
            none: list = []
            ends = [[keys[i], none] for i, _ in writing]
        ended = await self._call("batch_put_end", ends)
        kept = all_ok(ended)
        if kept is not None and 0 not in kept:       # every object committed (the common case)
            if len(kept) == len(results):
                results = kept
            else:
                for (i, _), r in zip(writing, kept):
                    results[i] = r
            ended = ()
        again = []
        for (i, reps), item in zip(writing, ended):
            r = item_result(item, keys[i])
            if r == 0:
                r = writes_failed(keys[i], reps, segs, failed)
            elif isinstance(r, ObjectNotFoundError) and getattr(self._link, "reconnects", 0) != relinks \
                    and not _again:
                again.append(i)
            results[i] = r
        if self._ssd is not None and self._ssd.mode == "eager":
            self._ssd.wake()
        if again:
            redo = await self.batch_put_from_parts([keys[i] for i in again], [parts[i] for i in again],
                                                   replica_num=rn, preferred_segment=preferred_segment,
                                                   pin=pin, soft_pin=soft_pin, _again=True)
            for i, r in zip(again, redo):
                results[i] = r
        if _wait and ssd_busy:
            await self._wait_for_ssd(keys, parts, results, rn, preferred_segment, pin, soft_pin)
        return results

    async def _wait_for_ssd(self, keys: Sequence[str], parts: Sequence[Parts], results: list, rn: int,
                            preferred: int | None, pin: bool, soft_pin: float | bool | None) -> None:
        """Puts that met SsdBusyError (the pool is full of objects an eager
        SSD tier is still copying) are put again, backing off, until they
        fit or the client's timeout has passed: the disk's pace is the
        pool's, instead of objects lost. Those that met SpaceFencedError
        (only space fenced after a failover could hold them) the same, for
        the client's write window: the fence lasts at most that long when
        the pool's clients share this one's timeouts (fence.py)."""
        busy = [i for i, r in enumerate(results) if isinstance(r, (SsdBusyError, SpaceFencedError))]
        fenced = any(isinstance(results[i], SpaceFencedError) for i in busy)
        deadline = time.monotonic() + (self.write_window if fenced else self.timeout)
        delay = 0.002
        # the last try is at the deadline itself: a fence as long as this
        # client's window has ended by then
        while busy and (left := deadline - time.monotonic()) > 0:
            if self._ssd is not None:
                self._ssd.wake()
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.2 if fenced else 0.05)
            redo = await self.batch_put_from_parts([keys[i] for i in busy], [parts[i] for i in busy],
                                                   replica_num=rn, preferred_segment=preferred, pin=pin,
                                                   soft_pin=soft_pin, _wait=False)
            for i, r in zip(busy, redo):
                results[i] = r
            busy = [i for i in busy if isinstance(results[i], (SsdBusyError, SpaceFencedError))]

    async def _revoke(self, keys: list[str], token: int) -> None:
        try:
            await self._call("batch_put_revoke", keys, token)
        except KVFlowError:
            pass        # the master is gone or lost us: it dropped our puts itself

    @with_timeout
    async def put(self, key: str, value: Any, **kw: Any) -> int:
        """Puts bytes (anything with the buffer protocol) through the local
        buffer. Returns replicas stored (0: existed). put_from's errors, and
        InvalidArgumentError for a value larger than the local buffer."""
        return self._one(await self.batch_put([key], [value], **kw))

    @with_timeout
    async def batch_put(self, keys: Sequence[str], values: Sequence[Any], **kw: Any) -> list:
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values must have the same length")
        views = []
        for v in values:
            try:
                m = memoryview(v).cast("B")
            except TypeError:
                raise InvalidArgumentError(f"a value must support the buffer protocol, not "
                                           f"{type(v).__name__}") from None
            views.append(m)
        results: list[Any] = [None] * len(keys)
        for chunk in self._chunks([len(m) for m in views], results):
            addrs = await self._stage([len(views[i]) for i in chunk])
            try:
                for i, a in zip(chunk, addrs):
                    n = len(views[i])
                    np.frombuffer(self._staging_view(a, n), np.uint8)[:] = np.frombuffer(views[i], np.uint8)
                out = await self.batch_put_from_parts([keys[i] for i in chunk],
                                                      [[(a, len(views[i]))] for i, a in zip(chunk, addrs)], **kw)
            finally:
                await self._unstage(addrs)
            for i, r in zip(chunk, out):
                results[i] = r
        return results
