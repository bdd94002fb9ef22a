"""The global KVCache pool as the live router sees it: one `batch_exists`
round trip per request to a running kvflow.store, over the keys the
servers name the request's pages by (`pool_keys`), and what came of it.

The router must serve whether or not the pool answers: a store that cannot
be reached at start, or that stops answering, turns the pool off (a
`PoolUnavailableWarning`, once per outage) and the router routes on what
its instances cache, as it does without a pool; a task reconnects every
`retry_s` and turns it back on. A lookup waits at most `timeout_s`: a
slow master costs each request that, not the store's own call timeout.

The conductor imports nothing of the store (tests/test_layers.py): the
client comes from `connect`, a coroutine function the caller supplies
(kvflow/cli/router.py's makes a kvflow.store StoreClient that contributes
no memory), used duck-typed: ``await batch_exists(keys)``, ``await close()``.
"""
from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvflow import KVFlowError

from .pool import HeldPrefix, PoolConfig, StorePoolIndex
from .pool_keys import KeyScheme
from .types import Decision, Request

__all__ = ["PoolUnavailableWarning", "PoolCounters", "RouterPool"]

log = logging.getLogger("kvflow.conductor.router")

#: what a lookup may raise when the store is down or slow: the store's own
#: errors (MasterUnavailableError, StoreTimeoutError: KVFlowErrors), a
#: socket's, or the lookup's own timeout
LOOKUP_ERRORS = (KVFlowError, OSError, asyncio.TimeoutError)


class PoolUnavailableWarning(RuntimeWarning):
    """The router routes without the global pool: its store could not be
    reached (at start, or a lookup failed). It keeps serving; the pool is
    used again once a reconnect succeeds."""


@dataclass
class PoolCounters:
    lookups: int = 0            # batch_exists round trips answered
    lookup_s: float = 0.0       # their time, in total
    held_blocks: int = 0        # blocks the store held, prefixes of the requests looked up
    hit_requests: int = 0       # requests whose first block the store held
    fetch_requests: int = 0     # requests routed to fetch their prefix from the pool
    fetch_blocks: int = 0       # blocks those fetch (not recomputed)
    errors: int = 0             # lookups that failed (the request routed without the pool)
    skipped: int = 0            # requests routed while the pool was off
    connects: int = 0
    outages: int = 0


class RouterPool:
    """The pool a `PDRouter` routes with. `connect`: returns a started store
    client; `scheme`: how the servers name pages; `address`: what the
    store's address is (for the stats and the warnings); `read_Bps`: one
    pool node's read bandwidth and `segments` how many nodes a fetch spreads
    over (the conductor's fetch estimate), `latency_s` a fetch's fixed cost."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], scheme: KeyScheme, *, address: str = "",
                 timeout_s: float = 0.5, connect_timeout_s: float = 5.0, retry_s: float = 5.0,
                 read_Bps: float = 2e9, segments: int = 1, latency_s: float = 1e-3) -> None:
        if not (timeout_s > 0 and connect_timeout_s > 0 and retry_s > 0):
            raise ValueError("timeouts and the retry interval must be positive")
        self._connect = connect
        self.scheme = scheme
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.read_Bps = read_Bps
        self.segments = segments
        self.latency_s = latency_s
        self.client: Any = None
        self.last_error = ""
        self.counters = PoolCounters()
        self._retry: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()    # clients of a lost store saying goodbye
        self._closed = False

    def __repr__(self) -> str:
        return f"<RouterPool {self.scheme.name} keys at {self.address or '?'}: {self.state}>"

    @property
    def state(self) -> str:
        return "closed" if self._closed else "connected" if self.client is not None else "unreachable"

    def pool_config(self, block_bytes: int) -> PoolConfig:
        """The conductor's model of this pool: unbounded (the store evicts on
        its own; a lookup says what it holds), read from `segments` nodes."""
        return PoolConfig(dram_blocks=None, ssd_blocks=0, segments=self.segments, block_bytes=max(1, block_bytes),
                          dram_Bps=self.read_Bps)

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> bool:
        """Connects once; if that fails, warns and keeps reconnecting in the
        background. Returns whether the pool is on."""
        if await self._try_connect():
            return True
        self._outage(self.last_error)
        return False

    async def close(self) -> None:
        """Stops reconnecting and closes the client. Idempotent."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            await asyncio.gather(self._retry, return_exceptions=True)
            self._retry = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        client, self.client = self.client, None
        if client is not None:
            await _close_quietly(client)

    async def _try_connect(self) -> bool:
        try:
            client = await asyncio.wait_for(self._connect(), self.connect_timeout_s)
        except LOOKUP_ERRORS as exc:
            self.last_error = _why(exc, self.connect_timeout_s)
            return False
        if self._closed:
            await _close_quietly(client)
            return False
        self.client = client
        self.counters.connects += 1
        log.info("kvflow router: the pool at %s is on (%s keys)", self.address, self.scheme.name)
        return True

    def _outage(self, why: str) -> None:
        self.counters.outages += 1
        msg = (f"the KVCache pool at {self.address or '?'} is unreachable ({why}): routing without it, "
               f"reconnecting every {self.retry_s:g} s")
        log.warning("kvflow router: %s", msg)
        warnings.warn(PoolUnavailableWarning(msg), stacklevel=2)
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closed and self.client is None:
            await asyncio.sleep(self.retry_s)
            if not self._closed:
                await self._try_connect()

    # -- per request -------------------------------------------------------------

    async def held(self, request: Request, tokens: Sequence[int]) -> HeldPrefix | None:
        """What the pool holds of the request's prefix, for
        `Conductor.route(pool=...)`; None when the pool is off or the
        lookup failed (then route without it)."""
        client = self.client
        if client is None:
            self.counters.skipped += 1
            return None
        if not request.keys:
            return HeldPrefix(request.keys, 0)
        names = self.scheme.object_keys(tokens, request.block_tokens)
        # a fresh index per request, with this request's names: no state
        # shared between requests looked up at the same time
        index = StorePoolIndex(client, key_of=dict(zip(request.keys, names)).__getitem__)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            blocks = await asyncio.wait_for(index.prefix_blocks(request.keys), self.timeout_s)
        except LOOKUP_ERRORS as exc:
            self.counters.errors += 1
            if self.client is client:
                # one warning per outage: the next requests route without
                # the pool until the reconnect task brings it back
                self.client = None
                self.last_error = _why(exc, self.timeout_s)
                self._outage(self.last_error)
                task = loop.create_task(_close_quietly(client))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            return None
        c = self.counters
        c.lookups += 1
        c.lookup_s += loop.time() - t0
        c.held_blocks += blocks
        c.hit_requests += blocks > 0
        return HeldPrefix(request.keys, blocks)

    def routed(self, decision: Decision) -> None:
        """Counts a decision that fetches from the pool."""
        if decision.pool_blocks:
            self.counters.fetch_requests += 1
            self.counters.fetch_blocks += len(decision.pool_blocks)

    def describe(self) -> dict:
        return {"state": self.state, "address": self.address, "keys": self.scheme.name,
                "last_error": self.last_error, **asdict(self.counters)}


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, asyncio.TimeoutError) and not str(exc):
        return f"TimeoutError: no answer in {timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}"


async def _close_quietly(client: Any) -> None:
    try:
        await client.close()
    except LOOKUP_ERRORS as exc:     # a client whose master is gone may fail to say goodbye
        log.debug("kvflow router: closing the pool's client: %r", exc)
