"""EngineOptions: everything an Engine is configured with but its listen
address, in one frozen record, with the environment's defaults and the
checks applied in one place (resolved()) and the parts' own options made
from it (tcp(): kvflow.providers.tcp.TcpOptions, rdma():
kvflow.providers.rdma.RdmaOptions). `Engine(listen, options=...)` takes
one; the flat keyword arguments (`Engine(protocols=["tcp"], ...)`) are
its fields and are still accepted, alone or on top of `options`."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from kvflow.config import env_bool, env_float, env_list, env_str
from kvflow.control.server import MAX_KEEPALIVE, MIN_KEEPALIVE
from kvflow.engine.router import STAGING_BYTES, STAGING_SLOT, RelayGroup
from kvflow.errors import InvalidArgumentError
from kvflow.metadata import check_name
from kvflow.providers.rdma.provider import RdmaOptions
from kvflow.providers.tcp import TcpOptions
from kvflow.schedule.credits import window_bytes
from kvflow.schedule.qos import AGING, SCHEDULING
from kvflow.topology import parse_location

__all__ = ["EngineOptions", "is_address", "split_address"]


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an empty host or "[]": 127.0.0.1)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(f"address {address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_address(text: str) -> bool:
    try:
        split_address(text)
    except InvalidArgumentError:
        return False
    return True


@dataclass(frozen=True)
class EngineOptions:
    """An engine's options (all keyword arguments of Engine()).

    protocols: provider names to allow ("local", "rdma", "tcp"); None
    chooses automatically (local where the peer is on this host and permits
    it, else rdma where both ends have devices that reach each other, else
    tcp); secret: shared secret, required of every peer when set;
    tcp_connections: data connections per tcp peer and rail;
    rails: local IP addresses of this engine's tcp rails (one per NIC;
    default: env KVFLOW_TCP_RAILS, comma-separated, else one rail on the
    listen host), or "auto" (also KVFLOW_TCP_RAILS=auto): the IPv4
    addresses of the netdevs the topology prefers for `location`, the
    links of the control addresses left out (the listen host and the
    `advertise` host, literal or resolved; a wildcard listen host leaves
    nothing out unless `advertise` names the address) (Topology.tcp_rails;
    one rail on the listen host when there are none); each gets a data
    listener, all are published with their NICs, and a peer opens
    tcp_connections to each, its slices spread over all; a peer that has
    rails too pairs its rails with these by both topologies
    (kvflow.topology.pair_tcp_rails) and binds each connection to its local
    rail where that rail reaches the peer's (same subnet, or a route that
    leaves by the rail's netdev; else the kernel picks the source); a connection
    that fails (rail down: its peer's kernel answered nothing for about
    `keepalive` seconds) hands its slices to the others and is rebuilt when its rail
    answers again; location: where this engine's registered memory
    lives ("cpu", "cpu:N" for a NUMA node, "cuda:N"; default: env
    KVFLOW_LOCATION, else "cpu"): the NICs near it are preferred, and
    published with the host's topology (kvflow.topology: discovered from
    sysfs, or the JSON file KVFLOW_TOPOLOGY names) so that both ends of an
    rdma connection pair matching rails; rdma_devices: RDMA
    device names to use (default: env KVFLOW_RDMA_DEVICES, else all);
    rdma_gid_index: GID index override (default: env KVFLOW_GID_INDEX, else
    a RoCE v2 IPv4-mapped GID); rdma_qps: QPs per device pair;
    rdma_ack_timeout: RC ACK timeout exponent, 1..31 (4.096 us * 2^n; default:
    env KVFLOW_RDMA_ACK_TIMEOUT, else 14 (67 ms) for hardware NICs and 17
    (537 ms) for software devices such as rxe and siw, whose ACKs can be
    late under load; InvalidArgumentError otherwise). On software devices
    the device's worker thread posts unpolled batches, not the submitting
    thread (their ibv_post_send does the transfer inside the system call);
    env KVFLOW_RDMA_WORKER_POSTS=0/1 decides for every device;
    keepalive: seconds a peer's host may leave its connections unanswered
    (the kernel's acknowledgements and keepalive probes: no ACK while our
    bytes or probes wait for one) before the peer is declared lost and its
    transfers fail with PeerLostError (0 disables; default: env
    KVFLOW_KEEPALIVE, else 5). A peer that is only slow (stopped, starved,
    its event loop or GIL held for any time) is never lost for that: its
    kernel still answers; transfers to it wait, bounded by their own
    timeouts. A peer whose process exits is lost at once (its sockets close);
    docs/api.md, "Peer loss and keepalive";
    metadata: None or "p2p" (peers connect by address only),
    "redis://[[user]:password@]host:port[/db]" or "etcd://host:port": at
    start() the engine publishes a record under kvflow/engines/<name> (name:
    default the engine's address; not of the form host:port) that expires
    metadata_ttl seconds after its last refresh (every metadata_ttl/3), and
    connect() resolves names through that server;
    qos_aging: the starvation bound of the transfer scheduler, seconds: a
    priority class with queued slices is served at least once per interval
    whatever runs above it (kvflow.schedule.qos; default 0.02);
    scheduling: "qos" (priority classes, deadlines, fair share between
    batches) or "fifo" (batches in arrival order, whole: priorities and
    deadlines ignored; the baseline the QoS benchmark compares with);
    tcp_express: one more tcp data connection per peer for HIGH batches:
    while the others carry lower classes' bytes, a HIGH batch goes whole
    on it and never queues behind those bytes in the kernel's socket
    buffers; on idle connections it spreads over all of them (default: env
    KVFLOW_TCP_EXPRESS, else on; docs/qos.md has the numbers);
    tcp_send_buffer, tcp_receive_buffer: SO_SNDBUF of the tcp data
    connections it opens (512 KiB) and SO_RCVBUF of those it accepts
    (0: the kernel's autotuning, the default there; kvflow.providers.tcp.TcpOptions);
    receive_window: receiver credits: the most write payload bytes that
    all initiators together may have in flight toward this engine (None:
    no cap; at least 256 KiB): they send only against credit it grants,
    so N senders toward it stop at the window instead of overrunning its
    link (tcp and rdma; kvflow.schedule.credits, receive_window_stats());
    tcp_busy_poll: seconds a thread serving a tcp data connection keeps
    looking for the next frame (yielding the CPU) before it sleeps (50 us;
    0: at once; env KVFLOW_TCP_BUSY_POLL): small writes back to back find
    it awake instead of paying a wake-up (TcpOptions);
    tcp_congestion: the tcp data connections' congestion control: "auto"
    (default; env KVFLOW_TCP_CONGESTION): a pacing one (BBR) is replaced
    by cubic on connections within this host, where pacing only costs;
    "system": the host's; or an algorithm the kernel offers;
    staging_bytes: the host memory (pinned) that transfers of GPU memory
    are staged through, half for this engine's outgoing slices and half
    lent to peers writing into its GPU memory (64 MiB; allocated once, when
    GPU memory is first moved; kvflow.paths.staged);
    relay: a kvflow.RelayGroup(name, rank, rail, side="send"): this
    engine's place in its node's PXN relay group; a write to a destination
    on another rail goes through the group's member on that rail, which
    posts it on its own NIC (side="receive": over this engine's rail to the
    destination node's member on it, which copies it over inside its node);
    host and GPU memory (RelayGroup(device=N): this member's device lanes,
    into which senders copy their GPU batches; never run on a GPU yet);
    kvflow.paths.relay, relay_stats();
    rdma_ibgda: every rdma channel also gets one IBGDA endpoint per device
    pair, a QP a GPU drives itself (peer.ibgda_endpoints(); mlx5 only,
    never run on one: kvflow.providers.rdma.ibgda).
    """

    protocols: Sequence[str] | None = None
    secret: bytes | str | None = None
    tcp_connections: int = 2
    local_workers: int = 2
    slice_size: int = 1 << 20
    inline_limit: int = 1 << 20
    advertise: str | None = None
    rdma_devices: Sequence[str] | None = None
    rdma_gid_index: int | None = None
    rdma_qps: int = 2
    rdma_slice_size: int = 256 << 10
    rdma_ack_timeout: int | None = None
    keepalive: float | None = None
    metadata: str | None = None
    name: str | None = None
    metadata_ttl: float = 10.0
    rails: Sequence[str] | None = None
    location: str | None = None
    qos_aging: float = AGING
    scheduling: str = "qos"
    tcp_express: bool | None = None
    tcp_send_buffer: int = TcpOptions.send_buffer
    tcp_receive_buffer: int = TcpOptions.receive_buffer
    receive_window: int | None = None
    tcp_busy_poll: float | None = None
    tcp_congestion: str | None = None
    staging_bytes: int = STAGING_BYTES
    relay: RelayGroup | None = None
    rdma_ibgda: bool = False

    @classmethod
    def of(cls, options: "EngineOptions | None", flat: dict[str, Any]) -> "EngineOptions":
        """`options` (default: all defaults) with the flat keyword arguments
        on top; TypeError names one that is no option."""
        unknown = sorted(set(flat) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"Engine() got an unexpected keyword argument {unknown[0]!r}")
        if options is not None and not isinstance(options, EngineOptions):
            raise InvalidArgumentError("options= takes a kvflow.engine.options.EngineOptions")
        return replace(options if options is not None else cls(), **flat)

    def resolved(self) -> "EngineOptions":
        """These options with the environment's defaults filled in (rails,
        tcp_express, tcp_busy_poll, tcp_congestion, keepalive, secret as
        bytes, location) and every value checked; raises
        InvalidArgumentError for the first that is wrong."""
        tcp_express = self.tcp_express
        if tcp_express is None:
            tcp_express = env_bool("KVFLOW_TCP_EXPRESS")
            tcp_express = TcpOptions.express if tcp_express is None else tcp_express
        tcp_busy_poll = self.tcp_busy_poll
        if tcp_busy_poll is None:
            tcp_busy_poll = env_float("KVFLOW_TCP_BUSY_POLL")
            tcp_busy_poll = TcpOptions.busy_poll if tcp_busy_poll is None else tcp_busy_poll
        keepalive = self.keepalive
        if keepalive is None:
            keepalive = env_float("KVFLOW_KEEPALIVE")
            keepalive = 5.0 if keepalive is None else keepalive
        if not (keepalive == 0 or MIN_KEEPALIVE <= keepalive <= MAX_KEEPALIVE):
            raise InvalidArgumentError(f"keepalive must be 0 (off) or {MIN_KEEPALIVE:g}..{MAX_KEEPALIVE:g} seconds")
        if self.name is not None:
            check_name(self.name)
            if is_address(self.name):
                raise InvalidArgumentError(f"name {self.name!r} has the form host:port, which connect() "
                                           "takes for an address; choose another name")
        if not 0.2 <= self.metadata_ttl <= 86400:
            raise InvalidArgumentError("metadata_ttl must be 0.2..86400 seconds")
        secret = self.secret if self.secret is not None else env_str("KVFLOW_SECRET")
        location = self.location or env_str("KVFLOW_LOCATION") or "cpu"
        parse_location(location)
        if self.scheduling not in SCHEDULING:
            raise InvalidArgumentError(f"scheduling must be one of {', '.join(SCHEDULING)}, not "
                                       f"{self.scheduling!r}")
        window_bytes(self.receive_window)
        if self.staging_bytes < 2 * STAGING_SLOT:
            raise InvalidArgumentError(f"staging_bytes must be at least {2 * STAGING_SLOT} (two slots)")
        if self.relay is not None and not isinstance(self.relay, RelayGroup):
            raise InvalidArgumentError("relay= takes a kvflow.RelayGroup")
        return replace(self, rails=self.rails if self.rails is not None else env_list("KVFLOW_TCP_RAILS"),
                       tcp_express=bool(tcp_express), tcp_busy_poll=tcp_busy_poll,
                       tcp_congestion=self.tcp_congestion or env_str("KVFLOW_TCP_CONGESTION")
                       or TcpOptions.congestion, keepalive=float(keepalive),
                       secret=secret.encode() if isinstance(secret, str) else secret, location=location)

    def tcp(self) -> TcpOptions:
        """The tcp provider's options (of resolved options)."""
        return TcpOptions(self.tcp_connections, self.rails, self.slice_size, bool(self.tcp_express),
                          self.tcp_send_buffer, self.tcp_receive_buffer, self.tcp_busy_poll, self.tcp_congestion)

    def rdma(self) -> RdmaOptions:
        """The rdma provider's options."""
        return RdmaOptions(list(self.rdma_devices) if self.rdma_devices is not None else None,
                           self.rdma_gid_index, self.rdma_qps, self.rdma_slice_size, self.rdma_ack_timeout,
                           bool(self.rdma_ibgda))
