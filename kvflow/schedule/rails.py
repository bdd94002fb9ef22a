"""tcp rails: data connections spread over several address pairs (one per
NIC), kept alive by the kernel's timers, and rebuilt when they fail.

RailPlan says which local rail each group of data connections to a peer
leaves by (both ends' topologies pair the rails). A failed data connection
hands its slices to the live ones natively (kvflow/_native/tcp_conn.c);
RailWatcher fails a connection whose peer's kernel stopped answering (a
rail that is gone: TcpChannel.check_reach, from the kernel's own view of
the connection, so a peer that is only slow is never failed) and brings a
failed one back: it retries with exponential back-off
(the rail is "blacklisted" meanwhile: no slice is placed on a dead
connection) and probes the rail by connecting again.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from kvflow._core import WIRE
from kvflow.errors import InvalidArgumentError, PeerUnreachableError, ProtocolError
from kvflow.schedule.health import Backoff
from kvflow.topology import Topology, pair_tcp_rails, rail_order, route_to

if TYPE_CHECKING:
    import socket

    from kvflow.control.descriptor import Descriptor

__all__ = ["MAX_CONNECTIONS", "DataConn", "RailPlan", "RailWatcher", "check_rails"]

log = logging.getLogger("kvflow")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 8.0
WATCH_INTERVAL = 0.5
# wire.h: a data hello's index byte is index | epoch << KVF_CONN_EPOCH_SHIFT
EPOCH_SHIFT, EPOCH_MAX = WIRE["CONN_EPOCH_SHIFT"], WIRE["CONN_EPOCH_MAX"]
MAX_CONNECTIONS = WIRE["CONN_INDEX_MASK"] + 1      # data connections per channel (the index's bits)


def check_rails(rails: Sequence[str] | None) -> list[str]:
    """`rails` as a list of distinct IP addresses (1..64); InvalidArgumentError otherwise."""
    if rails is None:
        return []
    if isinstance(rails, str):
        raise InvalidArgumentError(f"rails: a list of addresses, or 'auto' (got {rails!r})")
    out = []
    for r in rails:
        try:
            out.append(str(ipaddress.ip_address(r)))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"rail {r!r} is not an IP address of this host") from None
    if not 1 <= len(out) <= MAX_CONNECTIONS or len(set(out)) != len(out):
        raise InvalidArgumentError(f"rails: 1..{MAX_CONNECTIONS} distinct addresses")
    return out


class RailPlan:
    """This engine's tcp rails (local addresses, one per NIC) and how the
    data connections to a peer are laid over them."""

    def __init__(self, rails: list[str]) -> None:
        self.rails = rails
        self.nics: list[str] = []      # per rail: its netdev ("" unknown)
        self.ifaces: list[str] = []    # per rail: "ip/prefixlen" (the bare address where unknown)
        self.topology: Topology | None = None
        self.location = "cpu"

    def use_topology(self, topology: Topology, location: str = "cpu") -> None:
        """Takes `topology` as this host's: each rail's netdev and
        "ip/prefixlen" come from it, for publishing and pairing."""
        self.topology, self.location = topology, location
        self.nics, self.ifaces = [], []
        for rail in self.rails:
            nic, iface = topology.interface_of(rail) or ("", rail)
            self.nics.append(nic)
            self.ifaces.append(iface)

    def plan(self, desc: "Descriptor") -> list[tuple[str | None, str, int]]:
        """(local source, host, port) of each group of data connections to
        a peer. With rails on both ends (the peer publishing its rails'
        NICs): each end's rails in the order its topology prefers for its
        memory, paired by pair_tcp_rails, each group bound to its local
        rail. Otherwise one group per peer endpoint, from where the kernel
        chooses (as before rails were paired)."""
        endpoints = desc.data[:MAX_CONNECTIONS]
        plain: list[tuple[str | None, str, int]] = [(None, h, p) for h, p in endpoints]
        if not self.rails or desc.rail_nics is None or self.topology is None:
            return plain
        topology = self.topology
        mine = rail_order(self.nics, topology, self.location)
        theirs = rail_order(desc.rail_nics[:len(endpoints)], desc.topology, desc.location)
        networks = [a for n in topology.nics for a in n.addresses]
        try:
            pairs = pair_tcp_rails([self.ifaces[i] for i in mine], [endpoints[j][0] for j in theirs],
                                   networks, nics=[self.nics[i] for i in mine],
                                   route=lambda ip: route_to(ip, topology).netdev)
        except ValueError:          # a peer endpoint that is not an IP address: nothing to pair
            return plain
        return [(None if li is None else self.rails[mine[li]], *endpoints[theirs[rj]])
                for li, rj in pairs][:MAX_CONNECTIONS]


@dataclass
class DataConn:
    """Where data connection `index` of a channel goes (from which local
    rail address: None lets the kernel choose), and its rebuild state."""
    index: int
    host: str
    port: int
    source: str | None = None
    local: str | None = None       # the address it left from, last time it was opened
    health: Backoff | None = None  # its rebuild back-off (RailWatcher sets it)
    rebuilt: int = 0


@dataclass
class RailWatcher:
    """Rebuilds a tcp peer's failed data connections (see the module doc).
    `alive()` says whether the peer is still in service; `open(conn, tag)`
    opens one data connection whose hello carries `tag` (its index and
    epoch) and returns the socket once the target accepted it. `grace`:
    seconds a connection's peer may leave it unanswered before it is
    failed (the engine's keepalive; 0: never, the kernel's timers only)."""
    address: str
    alive: Callable[[], bool]
    channel: Any
    conns: list[DataConn]
    open: Callable[[DataConn, int], Awaitable["socket.socket"]]
    grace: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        clock = asyncio.get_running_loop().time
        for c in self.conns:
            c.health = Backoff(BACKOFF_MIN, BACKOFF_MAX, clock)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def stats(self) -> list[dict[str, Any]]:
        """Per data connection: endpoint, source (the local rail it is
        bound to; None: the kernel's choice), local (the address it left
        from), up, bytes, slices moved, failures, fences, rebuilds."""
        out = []
        for c, n in zip(self.conns, self.channel.conn_stats()):
            out.append({"index": c.index, "endpoint": f"{c.host}:{c.port}", "source": c.source,
                        "local": c.local, **n,
                        "rebuilt": c.rebuilt})
        return out

    async def _run(self) -> None:
        channel = self.channel
        while self.alive():
            await asyncio.sleep(WATCH_INTERVAL)
            if self.grace and channel.check_reach(self.grace):
                log.warning("kvflow: %s: a data connection's peer answered nothing for %.3g s: its rail "
                            "is taken for down", self.address, self.grace)
            for i in channel.dead_conns():
                c = self.conns[i]
                health = c.health
                assert health is not None
                if health.failed():
                    log.warning("kvflow: %s: data connection %d (%s:%d) failed; its slices moved to "
                                "the other connections", self.address, i, c.host, c.port)
                if not health.due():
                    continue
                health.attempted()
                # the hello carries the connection's next epoch: the target
                # echoes it in acks, so acks of the connection it replaces
                # are told apart (wire.h, KVF_CONN_EPOCH_*)
                tag = i | (((c.rebuilt + 1) & EPOCH_MAX) << EPOCH_SHIFT)
                try:
                    s = await self.open(c, tag)
                except (PeerUnreachableError, ProtocolError, OSError) as e:
                    log.debug("kvflow: %s: rebuilding data connection %d: %s", self.address, i, e)
                    continue
                if not self.alive() or self.task is None:
                    s.close()
                    return
                local = s.getsockname()[0]
                if not channel.replace(i, s.detach()):
                    continue
                c.local = local
                log.warning("kvflow: %s: data connection %d (%s:%d) is back after %.1f s",
                            self.address, i, c.host, c.port, health.succeeded())
                c.rebuilt += 1
