"""PeerContext: what a Peer may use of its engine (kvflow.engine.peer),
as a ProviderContext is what a provider may use (kvflow.providers.base)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from kvflow.engine.router import Router

__all__ = ["INLINE_TURN_NS", "PeerContext"]

# Awaited batches that finish without suspending give the loop a turn at
# least this often (PeerContext.inline_turn).
INLINE_TURN_NS = 1_000_000


class PeerContext:
    """What a Peer may use of its engine, and nothing else (never the
    Engine: a Peer holds no reference to it, tests/test_layers.py checks).
    One per engine, shared by its peers; the engine builds it in start().

    loop, core (the native core: detached waits and cancels), batches (the
    BatchTable), router (each batch's path: kvflow.engine.router),
    keepalive; the hooks: redial(peer) -> bool (dial a lapsed peer again:
    the same incarnation?), forget(peer) (drop it from the engine's peers),
    connect(address) -> Peer (a relay member); `closed`, set by the engine
    when it closes (a lost peer is then not dialled again)."""

    __slots__ = ("loop", "core", "batches", "router", "keepalive", "redial", "forget", "connect", "closed",
                 "_turn_ns")

    def __init__(self, loop: asyncio.AbstractEventLoop, core: Any, batches: Any, router: "Router",
                 keepalive: float, *, redial: Callable[[Any], Awaitable[bool]],
                 forget: Callable[[Any], None], connect: Callable[..., Awaitable[Any]]) -> None:
        # (the hooks take and give Peers: typed Any, so that this module,
        # which peer.py imports, imports nothing of peer.py)
        self.loop = loop
        self.core = core
        self.batches = batches
        self.router = router
        self.keepalive = keepalive
        self.redial = redial
        self.forget = forget
        self.connect = connect
        self.closed = False
        self._turn_ns = 0      # when awaited batches that finished inline last yielded

    def inline_turn(self) -> bool:
        """True when an awaited write()/read() that finished without
        suspending (inline, or polled to completion) should yield to the
        loop: at most once per INLINE_TURN_NS. A caller awaiting small
        same-host writes in a loop would otherwise never let the loop run."""
        now = time.monotonic_ns()
        if now - self._turn_ns < INLINE_TURN_NS:
            return False
        self._turn_ns = now
        return True
