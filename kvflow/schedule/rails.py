"""tcp rails: data connections spread over several address pairs (one per
NIC), kept alive by the kernel's timers, and rebuilt when they fail.

A failed data connection hands its slices to the live ones natively
(kvflow/_native/tcp_client.c); this module runs the per-peer watcher that
brings a failed one back: it retries with exponential back-off (the rail is
"blacklisted" meanwhile: no slice is placed on a dead connection) and
probes the rail by connecting again.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow._core import WIRE
from kvflow.errors import PeerUnreachableError, ProtocolError
from kvflow.providers.tcp import open_data_socket

if TYPE_CHECKING:
    from kvflow.engine.peer import Peer

__all__ = ["DataConn", "RailWatcher"]

log = logging.getLogger("kvflow")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 8.0
WATCH_INTERVAL = 0.5
# wire.h: a data hello's index byte is index | epoch << KVF_CONN_EPOCH_SHIFT
EPOCH_SHIFT, EPOCH_MAX = WIRE["CONN_EPOCH_SHIFT"], WIRE["CONN_EPOCH_MAX"]


@dataclass
class DataConn:
    """Where data connection `index` of a channel goes (from which local
    rail address: None lets the kernel choose), and its rebuild state."""
    index: int
    host: str
    port: int
    source: str | None = None
    local: str | None = None       # the address it left from, last time it was opened
    backoff: float = BACKOFF_MIN
    next_try: float = 0.0
    down_since: float | None = None
    rebuilt: int = 0


@dataclass
class RailWatcher:
    """Rebuilds a tcp peer's failed data connections (see the module doc)."""
    peer: "Peer"
    conns: list[DataConn]
    token: bytes
    role: int
    keepalive: float
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def stats(self) -> list[dict[str, Any]]:
        """Per data connection: endpoint, source (the local rail it is
        bound to; None: the kernel's choice), local (the address it left
        from), up, bytes, slices moved, failures, rebuilds."""
        native = self.peer._channel.conn_stats() if hasattr(self.peer._channel, "conn_stats") else []
        out = []
        for c, n in zip(self.conns, native):
            out.append({"index": c.index, "endpoint": f"{c.host}:{c.port}", "source": c.source,
                        "local": c.local, **n,
                        "rebuilt": c.rebuilt})
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        peer = self.peer
        while not (peer._closed or peer._control_lost):
            await asyncio.sleep(WATCH_INTERVAL)
            channel = peer._channel
            if not hasattr(channel, "dead_conns"):
                return
            now = loop.time()
            for i in channel.dead_conns():
                c = self.conns[i]
                if c.down_since is None:
                    c.down_since, c.next_try, c.backoff = now, now + BACKOFF_MIN, BACKOFF_MIN
                    log.warning("kvflow: %s: data connection %d (%s:%d) failed; its slices moved to "
                                "the other connections", peer.address, i, c.host, c.port)
                if now < c.next_try:
                    continue
                c.next_try = loop.time() + c.backoff
                c.backoff = min(c.backoff * 2, BACKOFF_MAX)
                # the hello carries the connection's next epoch: the target
                # echoes it in acks, so acks of the connection it replaces
                # are told apart (wire.h, KVF_CONN_EPOCH_*)
                tag = i | (((c.rebuilt + 1) & EPOCH_MAX) << EPOCH_SHIFT)
                try:
                    s = await open_data_socket(loop, c.host, c.port, self.token, self.role, tag,
                                               keepalive=self.keepalive, peer=peer.address, source=c.source)
                except (PeerUnreachableError, ProtocolError, OSError) as e:
                    log.debug("kvflow: %s: rebuilding data connection %d: %s", peer.address, i, e)
                    continue
                if peer._closed or peer._channel is not channel:
                    s.close()
                    return
                local = s.getsockname()[0]
                if not channel.replace(i, s.detach()):
                    continue
                c.local = local
                log.warning("kvflow: %s: data connection %d (%s:%d) is back after %.1f s",
                            peer.address, i, c.host, c.port, loop.time() - c.down_since)
                c.down_since = None
                c.rebuilt += 1
