"""Engine pairs for tests, with the balance checked at close.

Shipped with kvflow so that a user's own tests and kvflow's check the same
thing the same way: `engine_pair(protocol)` opens two started engines on
loopback restricted to one provider, a registered source on the first, a
registered destination on the second and a connected peer; when the block
ends it checks that nothing is left in flight (batches, slices, staging
slots in use or leased: engine.staging_stats()), closes
both engines and checks that every native resource they made is gone
(sockets, threads, batches, slices, memory registrations, queue pairs),
raising `UnbalancedError` with what is left. `check_closed(engine)` and
`settled(engine)` are the two checks alone, for engines opened otherwise.

    async with engine_pair("tcp", size=1 << 20) as p:
        await p.peer.write([p.local.addr], [p.remote.addr], [p.size])
        assert (p.dst == p.src).all()
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from kvflow.engine.engine import Engine
from kvflow.engine.peer import Peer
from kvflow.memory import Region, RemoteRegion

__all__ = ["CLOSED_ZERO", "IDLE_ZERO", "Pair", "UnbalancedError", "check_closed", "closed_leaks",
           "engine_pair", "idle_leaks", "settled", "staging_leaks"]

# native resources (Engine.counters()) that are zero once an engine is closed
CLOSED_ZERO = ("sockets", "threads", "batches", "slices_inflight", "mrs", "qps")
# ... and those that are zero whenever nothing is being moved
IDLE_ZERO = ("batches", "slices_inflight")


class UnbalancedError(AssertionError):
    """An engine kept something it made: what, per engine, in the message."""


def closed_leaks(counters: dict[str, int]) -> dict[str, int]:
    """The counters of a closed engine that are not zero ({} when balanced)."""
    return {k: counters[k] for k in CLOSED_ZERO if counters.get(k, 0) != 0}


def idle_leaks(counters: dict[str, int], pending_batches: int = 0) -> dict[str, int]:
    """What an idle engine still has in flight ({} when balanced)."""
    off = {k: counters[k] for k in IDLE_ZERO if counters.get(k, 0) != 0}
    if pending_batches:
        off["pending_batches"] = pending_batches
    return off


def staging_leaks(staging: dict[str, dict[str, int] | None]) -> dict[str, int]:
    """The staging slots an idle engine still has in use, and the leases
    of its inboxes still held, as "pool.in_use" and "pool.leases" (from
    engine.staging_stats(); {} when every slot is back)."""
    return {f"{pool}.{key}": figures[key] for pool, figures in staging.items() if figures is not None
            for key in ("in_use", "leases") if figures.get(key, 0) != 0}


async def settled(engine: Engine, wait_s: float = 3.0) -> dict[str, int]:
    """Waits up to `wait_s` for an engine with no work of its own left to
    drain what is still in flight (batches, slices, staging slots and
    leases); returns what is left ({} when idle)."""
    deadline = time.monotonic() + wait_s
    while True:
        off = {**idle_leaks(engine.counters(), engine.pending_batches()), **staging_leaks(engine.staging_stats())}
        if not off or time.monotonic() > deadline:
            return off
        await asyncio.sleep(0.05)


def check_closed(engine: Engine) -> None:
    """Raises UnbalancedError when a closed engine left a native resource."""
    leak = closed_leaks(engine.counters())
    if leak:
        raise UnbalancedError(f"engine {engine.address}: native resources left after close: {leak}")


@dataclass
class Pair:
    """Two engines, `a` (the initiator) and `b`, and a's peer for b; `src`
    registered on a as `local`, `dst` registered on b, seen from a as
    `remote`; `size` bytes each."""

    a: Engine
    b: Engine
    peer: Peer
    src: np.ndarray
    dst: np.ndarray
    local: Region
    remote: RemoteRegion
    size: int


@contextlib.asynccontextmanager
async def engine_pair(protocol: str = "tcp", *, size: int = 1 << 20, seed: int = 0, secret: bytes | None = None,
                      listen: str = "127.0.0.1:0", idle_wait_s: float = 3.0,
                      **engine_options: Any) -> AsyncIterator[Pair]:
    """Two started engines restricted to `protocol` ("tcp", "local",
    "rdma"), `size` random bytes registered on the first and `size` zeros
    on the second, the first connected to the second; at the end of the
    block both are checked idle, closed and checked clean (UnbalancedError
    with everything left, after closing both whatever happened)."""
    engines: list[Engine] = []
    problems: list[str] = []
    try:
        for _ in range(2):
            e = Engine(listen=listen, protocols=(protocol,), secret=secret, **engine_options)
            engines.append(e)
            await e.start()
        a, b = engines
        src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        local = a.register(src)
        b.register(dst, name="dst")
        peer = await a.connect(b.address)
        remote = peer.region("dst")
        yield Pair(a, b, peer, src, dst, local, remote, size)
        for e in engines:
            left = await settled(e, idle_wait_s)
            if left:
                problems.append(f"engine {e.address}: still in flight at the end: {left}")
    finally:
        for e in reversed(engines):
            await e.close()
        for e in engines:
            try:
                check_closed(e)
            except UnbalancedError as err:
                problems.append(str(err))
    if problems:
        raise UnbalancedError("\n".join(problems))
