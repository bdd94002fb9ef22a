"""A client's side of read-lease renewal (the master's: read_leases.py):
a get whose reads are still in progress keeps its lease, so a slow but
live read returns its bytes instead of LeaseExpiredError.

Every get holds its lease here while it reads (`hold`, then `drop` when
its reads are over): one dict entry, no message and no wake-up, so a
get that ends within a third of the TTL (nearly all) costs nothing more.
One task on the client's loop, started by the first get and ending after
a few idle ticks, renews every lease held for a third of its TTL in one
`renew_leases` call, so that a renewal late by up to half the TTL (a
loaded host's loop: at 1/2 to 3/4 of a 2 s TTL, renewals came too late
in about 1 of 15 loaded test runs) still finds its lease running. Gets on a caller's thread (direct.py) hold theirs
the same way: their renewal comes from the loop, which is free while
their thread waits on its reads.

`Held.lapsed()` is the get's check at the end of its reads: the lease
ran out before they ended, so the bytes may be another object's. Its end
is counted from when each renewal was *sent* (the master's now, from
which the lease runs again, is later), the first from before the lookup
was sent: a safe bound, as the first lease's was. A renewal the master
refuses (the lease ran out, or reached its bound: the reader's write
window from the grant) leaves the end where it was.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from kvflow.errors import KVFlowError

__all__ = ["Held", "LeaseKeeper"]

log = logging.getLogger("kvflow.store.leases")

_IDLE_TICKS = 8         # ticks with nothing held before the task ends (a later get starts it again)


class Held:
    """One get's lease while it reads: `end` (monotonic s) is when it runs
    out for sure, `renew_at` when it is renewed next."""
    __slots__ = ("lease", "end", "renew_at")

    def __init__(self, lease: Any, t0: float, ttl: float) -> None:
        self.lease = lease
        self.end = t0 + ttl
        self.renew_at = t0 + ttl / 3

    def lapsed(self) -> bool:
        """The lease ran out (or may have): the bytes read are not returned."""
        return time.monotonic() >= self.end


class LeaseKeeper:
    """The leases of a client's gets in progress, renewed from its loop."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.held: dict[Any, Held] = {}     # lease id -> Held (dict ops are atomic: the loop's and callers' threads)
        self._task: asyncio.Task | None = None
        self._starting = False
        self.supported = True               # False once the master says it knows no renew_leases
        self.renewals = 0

    def hold(self, lease: Any, t0: float) -> Held:
        """The get's lease (from the lookup sent at `t0`), renewed while held."""
        client = self._client
        if type(lease) is not int or not self.supported:
            return Held(lease, t0, client.lease_ttl)
        held = self.held[lease] = Held(lease, t0, client.lease_ttl)
        if (self._task is None or self._task.done()) and not self._starting:
            self._starting = True
            loop = client._loop
            try:
                if loop is asyncio.get_running_loop():
                    self._start()
                    return held
            except RuntimeError:            # no loop on this thread: a caller's thread
                pass
            try:
                loop.call_soon_threadsafe(self._start)
            except (RuntimeError, AttributeError):  # the client's loop is closed: no renewal
                self._starting = False
        return held

    def drop(self, lease: Any) -> None:
        """The get's reads are over (done, failed or drained): not renewed any more."""
        self.held.pop(lease, None)

    def _start(self) -> None:
        self._starting = False
        if (self._task is None or self._task.done()) and not self._client._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """The client is closing: renewals stop (its gets are over)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        client = self._client
        idle = 0
        while not client._closed and idle < _IDLE_TICKS:
            tick = client.lease_ttl / 6     # a lease is renewed between 1/3 and 1/2 of its TTL
            await asyncio.sleep(tick)
            if not self.held:
                idle += 1
                continue
            idle = 0
            now = time.monotonic()
            # list(): one C call, atomic under the GIL while callers' threads add and drop
            due = [h for h in list(self.held.values()) if h.renew_at <= now]
            if due:
                await self._renew(due)
        self._task = None
        if self.held and not client._closed:    # a get held one as this task was ending
            self._start()

    async def _renew(self, due: list[Held]) -> None:
        sent = time.monotonic()
        try:
            left = await self._client._call("renew_leases", [h.lease for h in due])
        except KVFlowError as e:
            # an older master ("unknown method 'renew_leases'"): leases run their TTL, as before
            if "renew_leases" in str(e):
                self.supported = False
                self.held.clear()
            log.debug("kvflow.store: renewing %d read leases: %s", len(due), e)
            return          # tried again at the next tick, while the leases still run
        self.renewals += 1
        ttl = self._client.lease_ttl
        for h, secs in zip(due, left):
            if not isinstance(secs, (int, float)) or secs <= 0:
                h.renew_at = math.inf       # gone at the master: its end stands
                continue
            h.end = max(h.end, sent + secs)
            # capped at its bound (less than a full TTL given): no use asking again
            h.renew_at = sent + secs / 3 if secs >= ttl * 0.999 else math.inf
