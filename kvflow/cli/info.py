"""kvflow-info: what this host offers kvflow (built features, NUMA nodes,
NICs, GPUs, the NIC preference per memory location); with --peer,
whether a kvflow engine is reachable from here and what to fix if not;
with --store, the KVCache pool a kvflow.store master keeps (segments,
capacity and use, objects, clients, leases, evictions).

    kvflow-info [--json]
    kvflow-info --peer HOST:PORT [--protocol auto|local|rdma|tcp]
                [--secret TEXT] [--timeout S] [--location LOC] [--json]
    kvflow-info --store HOST:PORT|etcd://HOST:PORT/CLUSTER [--timeout S] [--json]

In a process that holds a StoreClient or a Master, `await
kvflow.cli.info.store_report(client_or_master)` gives the same report
(an embedded master included) and `format_store()` its text.

The peer check connects with a real Engine (so it sees what a transfer
would see), then checks each address the peer publishes: the route and
source address chosen for it, a tcp connection to it, and for rdma the
peer's devices against this host's (port state, link layer, GID subnets,
active MTU). Exit status 0 when the peer is reachable, 1 when it is not,
2 for a usage error.
"""
from __future__ import annotations

import argparse
import asyncio
import errno as errno_mod
import ipaddress
import json
import logging
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvflow.errors import (
    AuthenticationError,
    InvalidArgumentError,
    KVFlowError,
    PeerUnreachableError,
    ProtocolError,
    ProviderUnavailableError,
)
from kvflow.topology import (
    Nic,
    NicKind,
    RdmaPort,
    Route,
    Topology,
    gid_text,
    host_topology,
    ib_mtu,
    match_rails,
    on_subnet,
    parse_location,
    route_to,
)

__all__ = ["Check", "Level", "PeerReport", "check_peer", "check_rdma", "format_store", "local_report", "main",
           "route_to", "store_report"]

SECRET_ENV = "KVFLOW_SECRET"
LINK_LAYERS = {1: "InfiniBand", 2: "Ethernet"}     # enum ibv_link_layer


class Level(str, Enum):
    """How a check came out. FAIL makes the peer unreachable."""

    OK = "ok"
    NOTE = "note"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass
class Check:
    """One finding: what was seen and, for a problem, what to do about it."""

    level: Level
    message: str
    fix: str | None = None


@dataclass
class PeerReport:
    address: str
    checks: list[Check] = field(default_factory=list)
    transport: str | None = None
    descriptor: dict[str, Any] | None = None

    @property
    def reachable(self) -> bool:
        return self.transport is not None and not any(c.level is Level.FAIL for c in self.checks)

    def add(self, level: Level, message: str, fix: str | None = None) -> None:
        self.checks.append(Check(level, message, fix))

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.address, "reachable": self.reachable, "transport": self.transport,
                "checks": [{"level": c.level.value, "message": c.message, "fix": c.fix} for c in self.checks],
                "descriptor": self.descriptor}


# ------------------------------------------------------------ this host
def _ranges(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8"."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out) or "-"


def local_report(topology: Topology) -> dict[str, Any]:
    """What `kvflow-info --json` prints: version, features, the topology in
    the schema of a topology file, and the preference per location."""
    import kvflow
    prefs = {}
    for loc in topology.locations():
        prefs[loc] = {}
        for kind in NicKind:
            p, f = topology.preferred(loc, kind)
            prefs[loc][kind.value] = {"preferred": p, "fallback": f}
    return {"version": kvflow.__version__, "features": dict(kvflow.features), "source": topology.source,
            "topology": topology.to_json(), "preferences": prefs}


def format_local(report: dict[str, Any]) -> str:
    t = report["topology"]
    lines = [f"kvflow {report['version']}",
             "features: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["features"].items()),
             f"topology: {report['source']}", "", "NUMA nodes"]
    for n in t["numa"]:
        lines.append(f"  node {n['id']}: cpus {_ranges(n['cpus'])}")
    lines += ["", "RDMA devices"]
    rdma = [n for n in t["nics"] if n["kind"] == "rdma"]
    for n in rdma:
        lines.append(f"  {n['name']}  netdev {n['netdev'] or '-'}  numa {n['numa']}  pci {n['pci'] or '- (virtual)'}")
        for p in n["ports"]:
            mtu = f"{p['active_mtu']} B" if p["active_mtu"] else "unknown (see ibv_devinfo)"
            lines.append(f"    port {p['number']}: {p['state'] or '?'} ({p['phys_state'] or '?'}), "
                         f"link layer {p['link_layer'] or '?'}, active MTU {mtu}, rate {p['rate'] or '?'}")
            for g in p["gids"]:
                lines.append(f"      gid {g['index']:<3} {g['gid']:<40} {g['type'] or '-':<12} {g['netdev'] or ''}")
    if not rdma:
        lines.append("  (none: no RDMA driver loaded, or none in this container)")
    lines += ["", "Netdevs"]
    for n in t["nics"]:
        if n["kind"] != "netdev":
            continue
        extra = "loopback" if n["loopback"] else f"numa {n['numa']}  pci {n['pci'] or '- (virtual)'}"
        speed = f"  {n['speed']} Mb/s" if n["speed"] else ""
        lines.append(f"  {n['name']}  {n['state'] or '?'}  mtu {n['mtu']}{speed}  {extra}")
        if n["addresses"]:
            lines.append(f"    {' '.join(n['addresses'])}")
    lines += ["", "GPUs"]
    for g in t["gpus"]:
        lines.append(f"  cuda:{g['index']}  {g['model'] or 'NVIDIA GPU'}  numa {g['numa']}  pci {g['pci']}")
    if not t["gpus"]:
        lines.append("  (none found)")
    lines += ["", "NIC preference per memory location (preferred | fallback)"]
    for loc, kinds in report["preferences"].items():
        parts = [f"{kind}: {', '.join(v['preferred']) or '-'} | {', '.join(v['fallback']) or '-'}"
                 for kind, v in kinds.items()]
        lines.append(f"  {loc:<8} " + "   ".join(parts))
    for loc, names in t["preferences"].items():
        lines.append(f"  (pinned by the topology file: {loc} -> {', '.join(names)})")
    return "\n".join(lines)


# ------------------------------------------------------------ routes
def _check_route(report: PeerReport, what: str, ip: str, topology: Topology) -> Route:
    r = route_to(ip, topology)
    if r.error is not None:
        report.add(Level.FAIL, f"no route to {ip} ({what}) from any local address ({r.error.strerror or r.error})",
                   "add an address in that subnet (ip addr add ADDR/LEN dev IFACE) "
                   "or a route to it (ip route add NET/LEN via GATEWAY)")
    else:
        via = f"{r.netdev}, " if r.netdev else ""
        hop = "on-link" if r.on_link else "through a gateway"
        report.add(Level.OK, f"route to {ip} ({what}): via {via}source {r.source} ({hop})")
    return r


async def _tcp_probe(ip: str, port: int, timeout: float) -> OSError | None:
    """None when a tcp connection to ip:port opens (it is closed at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except asyncio.TimeoutError:
        return TimeoutError(errno_mod.ETIMEDOUT, "timed out")
    except OSError as e:
        return e
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


async def _check_tcp(report: PeerReport, what: str, ip: str, port: int, timeout: float, fix_refused: str) -> bool:
    e = await _tcp_probe(ip, port, timeout)
    if e is None:
        report.add(Level.OK, f"tcp: {what} {ip}:{port} reachable")
        return True
    if isinstance(e, ConnectionRefusedError):
        report.add(Level.FAIL, f"tcp: nothing listens on {ip}:{port} ({what})", fix_refused)
    elif isinstance(e, TimeoutError) or e.errno == errno_mod.ETIMEDOUT:
        report.add(Level.FAIL, f"tcp: no answer from {ip}:{port} ({what}) within {timeout:g} s",
                   f"a firewall drops the packets or the host is down: allow tcp port {port} "
                   "(iptables/nft, security groups) and check that the host is up")
    elif e.errno in (errno_mod.EHOSTUNREACH, errno_mod.ENETUNREACH):
        report.add(Level.FAIL, f"tcp: {ip} unreachable ({what}): {e.strerror}",
                   "the host does not answer on its network: check that it is up, that the address is its own, "
                   "and the route (ip route get " + ip + ")")
    else:
        report.add(Level.FAIL, f"tcp: cannot connect to {ip}:{port} ({what}): {e.strerror or e}")
    return False


async def _reach(report: PeerReport, what: str, host: str, port: int, topology: Topology, timeout: float,
                 fix_refused: str) -> Route | None:
    """Resolves `host`, then checks the route to and a tcp connection to
    each of its addresses until one works (as a client's connect would).
    The route used, or None after adding what failed to `report`."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        report.add(Level.FAIL, f"cannot resolve {host!r} ({what}): {e.strerror}",
                   "check the name (DNS, /etc/hosts) or give an IP address")
        return None
    tried: list[PeerReport] = []
    for ip in dict.fromkeys(str(info[4][0]) for info in infos):
        sub = PeerReport(report.address)
        if ip != host:
            sub.add(Level.OK, f"{host} ({what}) resolves to {ip}")
        r = _check_route(sub, what, ip, topology)
        if r.error is None and await _check_tcp(sub, what, ip, port, timeout, fix_refused):
            for earlier in tried:         # another address answered: what failed is only a note
                report.checks += [Check(Level.NOTE, c.message) for c in earlier.checks if c.level is Level.FAIL]
            report.checks += sub.checks
            return r
        tried.append(sub)
    for sub in tried:
        report.checks += sub.checks
    return None


# ------------------------------------------------------------ the peer
class _LogCapture(logging.Handler):
    """Collects what the engine logs while connecting: why it did not pick a
    provider ("rdma unavailable (...); using tcp") is logged, not raised."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "unavailable" in msg or "skipped" in msg:
            self.messages.append(msg.removeprefix("kvflow: "))


def _describe(desc: Any) -> dict[str, Any]:
    rdma = desc.rdma or {}
    return {"address": desc.address, "host": desc.host, "pid": desc.pid, "incarnation": desc.incarnation,
            "generation": desc.generation, "regions": len(desc.regions),
            "data": [f"{h}:{p}" for h, p in desc.data],
            "rdma": [{"name": d.get("name"), "gid": gid_text(d["gid"]), "lid": d.get("lid"),
                      "mtu": ib_mtu(d.get("mtu")), "link": LINK_LAYERS.get(d.get("link"), d.get("link")),
                      "port": d.get("port")} for d in rdma.get("devices", [])]}


async def _connect(report: PeerReport, address: str, listen: str, protocols: tuple[str, ...] | None,
                   secret: str | None, timeout: float) -> tuple[Any, list[str]]:
    """Connects a throwaway Engine; returns (descriptor or None, what the
    engine logged about providers it passed over)."""
    from kvflow.engine.engine import Engine

    capture = _LogCapture()
    logger = logging.getLogger("kvflow")
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    logger.propagate = False          # reported below, not printed as well
    try:
        try:
            engine = Engine(listen, protocols=protocols, secret=secret, keepalive=0)
            await engine.start()
        except KVFlowError:                     # e.g. a source address we cannot bind
            engine = Engine("127.0.0.1:0", protocols=protocols, secret=secret, keepalive=0)
            await engine.start()
        async with engine:
            try:
                peer = await engine.connect(address, timeout=timeout)
            except AuthenticationError as e:
                report.add(Level.FAIL, f"handshake: {e}",
                           f"give the peer's secret with --secret TEXT or ${SECRET_ENV}: both ends need the same "
                           "one, or neither")
                return None, capture.messages
            except ProviderUnavailableError as e:
                report.add(Level.FAIL, f"no provider reaches the peer: {e}",
                           "fix the problems below, or allow another protocol (--protocol auto)")
                if protocols != ("tcp",):   # the descriptor still helps: fetch it over tcp
                    desc, _ = await _connect(PeerReport(address), address, listen, ("tcp",), secret, timeout)
                    return desc, capture.messages
                return None, capture.messages
            except ProtocolError as e:
                report.add(Level.FAIL, f"handshake: {e}",
                           "run compatible kvflow versions on both ends (this is kvflow "
                           f"{__import__('kvflow').__version__})")
                return None, capture.messages
            except (PeerUnreachableError, KVFlowError) as e:
                report.add(Level.FAIL, f"handshake: {e}",
                           "check that this is a kvflow engine's handshake address (Engine.address), not its "
                           "data port, and that the engine is not stalled")
                return None, capture.messages
            report.transport = peer.transport
            desc = peer.descriptor
            report.add(Level.OK, f"handshake: kvflow engine {desc.address} (pid {desc.pid}, {len(peer.regions)} "
                                 f"region(s), generation {desc.generation}); transfers would use {peer.transport}")
            return desc, capture.messages
    finally:
        logger.removeHandler(capture)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def _check_local_ports(report: PeerReport, local: list[Nic], bad: Level) -> None:
    """Local RDMA ports that are not ACTIVE, each with its likely fix."""
    for nic in local:
        for p in nic.ports:
            if p.state == "ACTIVE":
                continue
            if p.link_layer == "Ethernet" and nic.netdev:
                fix = f"bring its netdev up (ip link set {nic.netdev} up) and check its cable or peer link"
            elif p.link_layer == "InfiniBand":
                fix = "check the cable, and that a subnet manager runs on the fabric (systemctl start opensm)"
            else:
                fix = "check its link"
            report.add(bad, f"rdma: port {p.number} of {nic.name} is {p.state or 'in an unknown state'}", fix)


def _check_remote_device(report: PeerReport, d: dict[str, Any], active: list[tuple[Nic, RdmaPort]],
                         topology: Topology, bad: Level) -> None:
    """What stands between one of the peer's RDMA devices and the active
    local ports: link layer, GID subnet or route, active MTU."""
    name = d.get("name", "?")
    link = LINK_LAYERS.get(d.get("link"), "Ethernet")
    same = [(n, p) for n, p in active if p.link_layer == link]
    if not same:
        report.add(bad, f"rdma: the peer's {name} is {link} and no active local RDMA port is",
                   "RoCE (Ethernet) and InfiniBand do not interconnect: use devices on the same fabric")
        return
    gid = ipaddress.IPv6Address(d["gid"])
    if not gid.packed.strip(b"\0"):
        report.add(bad, f"rdma: the peer's {name} publishes a zero GID",
                   f"give {name}'s netdev an address on the peer (RoCE GIDs follow netdev addresses)")
        return
    if link == "InfiniBand":
        prefix = gid.packed[:8]
        if not any(g.packed[:8] == prefix for _, p in same for g in p.gids):
            report.add(Level.WARN, f"rdma: no local InfiniBand GID shares the subnet prefix of the peer's "
                                   f"{name} ({gid_text(gid.packed)})", "the subnets must be joined by an InfiniBand router")
        else:
            report.add(Level.OK, f"rdma: the peer's {name} GID {gid_text(gid.packed)} is on a local subnet")
    else:
        target = str(gid.ipv4_mapped or gid)
        near = [(n, p) for n, p in same for a in n.addresses if on_subnet(target, a)]
        if near:
            n, p = near[0]
            report.add(Level.OK, f"rdma: the peer's {name} GID {target} shares a subnet with "
                                 f"{n.name} port {p.number} ({n.netdev})")
        else:
            r = route_to(target, topology)
            rails = {n.netdev: n.name for n, _ in same if n.netdev}
            if r.error is not None:
                report.add(bad, f"rdma: no route to {target} (GID of the peer's {name}) from any local address",
                           "add an address in that subnet to the netdev of an RDMA device "
                           f"({', '.join(rails) or 'none'}), or a route to it")
            elif r.netdev in rails:
                report.add(Level.NOTE, f"rdma: the peer's {name} GID {target} is reached through a router via "
                                       f"{r.netdev} ({rails[r.netdev]}): RoCE v2 routes, RoCE v1 does not")
            else:
                report.add(bad, f"rdma: traffic to {target} (GID of the peer's {name}) leaves via "
                                f"{r.netdev or r.source}, which has no RDMA device",
                           "add an address in that subnet to the netdev of an RDMA device "
                           f"({', '.join(rails) or 'none'}), or a route through one")
    rmtu = ib_mtu(d.get("mtu"))
    for n, p in same:
        if rmtu and p.active_mtu and p.active_mtu != rmtu:
            small = n.netdev if p.active_mtu < rmtu else f"the peer's {name}"
            report.add(Level.WARN, f"rdma: active MTU differs: the peer's {name} {rmtu} B, local {n.name} "
                                   f"port {p.number} {p.active_mtu} B; queue pairs use {min(rmtu, p.active_mtu)} B",
                       f"raise the netdev MTU of the smaller side ({small}), e.g. ip link set IFACE mtu 9000 "
                       "(4096 B needs 4192 or more)")


def check_rdma(report: PeerReport, remote: dict[str, Any] | None, topology: Topology, *,
               transport: str | None = None, required: bool = False, location: str = "cpu",
               remote_topology: Topology | None = None) -> None:
    """Adds to `report` what stands between this host's RDMA devices and
    the peer's (`remote`: its descriptor's rdma section): ports not ACTIVE,
    link layers that differ, GIDs in no shared subnet and without a route,
    active MTUs that differ; and the rails the two would pair. Problems are
    FAIL when `required` (rdma is the only protocol allowed), else WARN."""
    import kvflow

    bad = Level.FAIL if required else Level.WARN
    local = [n for n in topology.nics if n.kind is NicKind.RDMA]
    rdevs = (remote or {}).get("devices", [])
    _check_local_ports(report, local, bad)
    if not kvflow.features.get("rdma") and (rdevs or required):
        report.add(bad, "rdma: this kvflow was built without libibverbs",
                   "install libibverbs-dev (rdma-core) and reinstall kvflow")
    if not local and (rdevs or required):
        theirs = f"the peer has {', '.join(d['name'] for d in rdevs)} but " if rdevs else ""
        report.add(bad, f"rdma: {theirs}this host has no RDMA device",
                   "load the NIC's RDMA driver (ibv_devices should list it), or for tests add Soft-RoCE: "
                   "rdma link add rxe0 type rxe netdev IFACE")
    if not rdevs:
        report.add(bad if required else Level.NOTE,
                   "rdma: the peer publishes no rdma device (it has none, or its engine runs without rdma: "
                   "protocols, KVFLOW_RDMA_DEVICES)" + ("" if required else "; transfers to it use local or tcp"),
                   "give the peer an RDMA device and let its engine use it")
        return
    if not local:
        return
    active = [(n, p) for n in local for p in n.ports if p.state == "ACTIVE"]
    for d in rdevs:
        _check_remote_device(report, d, active, topology, bad)
    mine, theirs = topology.preferred(location, NicKind.RDMA)
    mine = mine or theirs
    if remote_topology is not None:
        rp, rf = remote_topology.preferred(location, NicKind.RDMA)
        peer_order = rp or rf
    else:
        peer_order = [d.get("name", "?") for d in rdevs]
    rails = match_rails(mine, peer_order)
    if rails:
        report.add(Level.NOTE, f"rdma: rails for {location} memory: " + ", ".join(f"{a}<->{b}" for a, b in rails))
    if transport is not None and transport != "rdma":
        report.add(Level.NOTE, f"rdma: not used for this pair (transport {transport})")


async def check_peer(address: str, *, topology: Topology, protocols: tuple[str, ...] | None = None,
                     secret: str | None = None, timeout: float = 5.0, location: str = "cpu") -> PeerReport:
    """Checks whether the kvflow engine at `address` (its handshake
    HOST:PORT) is reachable from here and how; never raises for a problem
    of the peer's or the network's, it reports it. Raises
    InvalidArgumentError for a malformed address or location."""
    parse_location(location)
    report = PeerReport(address)
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536 or not host:
        raise InvalidArgumentError(f"peer address {address!r} is not HOST:PORT")
    host, port = host.strip("[]"), int(port_text)
    r = await _reach(report, "handshake port", host, port, topology, timeout,
                     "start the engine, or use its handshake address (Engine.address), not its data port")
    if r is None:
        return report
    src = r.source or "127.0.0.1"
    listen = f"[{src}]:0" if ":" in src else f"{src}:0"
    desc, passed_over = await _connect(report, address, listen, protocols, secret, timeout)
    for msg in dict.fromkeys(passed_over):
        if not any(msg.partition(": ")[2] in c.message for c in report.checks):
            report.add(Level.NOTE, msg)
    if desc is None:
        return report
    report.descriptor = _describe(desc)
    for h, p in desc.data:
        await _reach(report, "data endpoint", h, p, topology, timeout,
                     "the engine's data listener is closed, or a firewall rejects the port: allow it, and check "
                     "that the engine advertises an address reachable from here (Engine(advertise=))")
    remote_topology = getattr(desc, "topology", None)
    check_rdma(report, desc.rdma, topology, transport=report.transport, required=protocols == ("rdma",),
               location=location, remote_topology=remote_topology if isinstance(remote_topology, Topology) else None)
    return report


def format_peer(report: PeerReport) -> str:
    lines = [f"peer {report.address}"]
    for c in report.checks:
        lines.append(f"  {c.level.value:<5} {c.message}")
        if c.fix and c.level in (Level.WARN, Level.FAIL):
            lines.append(f"        fix: {c.fix}")
    verdict = (f"reachable (transport {report.transport})" if report.reachable
               else "NOT reachable: see FAIL above")
    lines.append(f"{report.address}: {verdict}")
    return "\n".join(lines)


# ------------------------------------------------------------ the pool
async def store_report(source: Any, *, timeout: float = 5.0) -> dict[str, Any]:
    """The pool as its master sees it (kvflow.store.metrics.master_view):
    `source` is a master's "host:port" or "etcd://host:port/cluster" (the
    leader's), a StoreClient (its master, embedded or not) or a Master.
    MasterUnavailableError when no master answers."""
    from kvflow.store import Master, MasterUnavailableError, StoreClient
    from kvflow.store.follow import finder_for
    from kvflow.store.rpc import TcpMasterLink

    if isinstance(source, Master):
        return source.metrics()
    if isinstance(source, StoreClient):
        return await source.stats(detail=True, timeout=timeout)
    finder = finder_for(source)
    if finder is None:
        addresses = [source]
    else:
        try:
            addresses = await finder.candidates()
        finally:
            await finder.close()
        if not addresses:
            raise MasterUnavailableError(f"no master leads {source}")
    last: Exception | None = None
    for address in addresses:
        try:
            # no registration: the master answers stats to observers, who are no client
            link = await TcpMasterLink.open(address, timeout=timeout)
        except MasterUnavailableError as e:
            last = e
            continue
        try:
            return await link.call("stats", True, timeout=timeout)
        finally:
            await link.close()
    raise last or MasterUnavailableError(f"no master at {source}")


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def format_store(report: dict[str, Any]) -> str:
    cap, used = report["capacity"], report["used"]
    pct = f" ({100 * used / cap:.1f}%)" if cap else ""
    objects = sum(report["objects"].values())
    lines = [f"kvflow.store master {report.get('address') or 'in this process'}",
             (f"  capacity {_bytes(cap)}, used {_bytes(used)}{pct}; high/low watermark "
             f"{report['watermarks'][0]:g}/{report['watermarks'][1]:g}"),
             (f"  objects {objects} ({', '.join(f'{t} {n}' for t, n in sorted(report['objects'].items()))}), "
             f"puts in progress {report['puts_in_progress']}"),
             f"  leases {report['leases']} (ttl {report['lease_ttl']:g} s), lease waits "
             + ", ".join(f"{k} {v}" for k, v in sorted(report["lease_waits"].items()))
             + f"; quarantined {_bytes(report['quarantined_bytes'])}",
             (f"  evictions {sum(report['evictions'].values())} ({_bytes(sum(report['evicted_bytes'].values()))}); "
             f"calls served {report['calls']}"),
             "", f"segments ({len(report['segments'])})"]
    if report["segments"]:
        lines.append(f"  {'id':>4}  {'tier':<5} {'capacity':>10} {'used':>10} {'use':>6} {'replicas':>8}  "
                     f"{'client':<16}  engine")
    for s in report["segments"]:
        use = f"{100 * s['used'] / s['capacity']:.1f}%" if s["capacity"] else "-"
        lines.append(f"  {s['id']:>4}  {s['tier']:<5} {_bytes(s['capacity']):>10} {_bytes(s['used']):>10} {use:>6} "
                     f"{s['replicas']:>8}  {s['client']:<16}  {s['engine']}"
                     + (f"  (fenced {_bytes(s['fenced'])}: a failover's late writes)" if s.get("fenced") else "")
                     + ("" if s["attached"] else "  (detached: its owner has not come back)"))
    lines += ["", f"clients ({len(report['clients'])})"]
    for c in report["clients"]:
        lines.append(f"  {c['id']:<16}  host {c['host']}  engine {c['engine']}  segments "
                     f"{','.join(map(str, c['segments'])) or '-'}  silent {c['silent_s']:.1f} s"
                     + (f"  writing {c['writing']}" if c["writing"] else "")
                     + ("  (recovered, not registered again)" if c["recovered"] else ""))
    return "\n".join(lines)


# ------------------------------------------------------------ entry point
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow-info", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--peer", metavar="HOST:PORT", help="check that the kvflow engine there is reachable")
    p.add_argument("--store", metavar="MASTER",
                   help="show the KVCache pool whose kvflow.store master is at HOST:PORT "
                        "(or etcd://HOST:PORT/CLUSTER: its leader)")
    p.add_argument("--protocol", choices=("auto", "local", "rdma", "tcp"), default="auto",
                   help="with --peer: the provider to insist on (default: auto, as an Engine chooses)")
    p.add_argument("--secret", default=None, metavar="TEXT", help=f"with --peer: shared secret (or ${SECRET_ENV})")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="with --peer: per step; with --store: the query (default 5)")
    p.add_argument("--location", default="cpu", metavar="LOC",
                   help="with --peer: memory location whose rails to show (cpu, cpu:N, cuda:N)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvflow-info` and `python -m kvflow.cli.info`."""
    args = _parser().parse_args(argv)
    if args.store is not None:
        return _show_store(args)
    try:
        topology = host_topology()
        if args.peer is None:
            report = local_report(topology)
            print(json.dumps(report, indent=2) if args.json else format_local(report))
            return 0
        protocols = None if args.protocol == "auto" else (args.protocol,)
        peer = asyncio.run(check_peer(args.peer, topology=topology, protocols=protocols,
                                      secret=args.secret or None,     # None: $KVFLOW_SECRET
                                      timeout=args.timeout, location=args.location))
    except InvalidArgumentError as e:          # TopologyError too
        print(f"kvflow-info: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(peer.to_json(), indent=2) if args.json else format_peer(peer))
    return 0 if peer.reachable else 1


def _show_store(args: argparse.Namespace) -> int:
    from kvflow.store import StoreError
    try:
        report = asyncio.run(store_report(args.store, timeout=args.timeout))
    except InvalidArgumentError as e:
        print(f"kvflow-info: error: {e}", file=sys.stderr)
        return 2
    except StoreError as e:                     # MasterUnavailableError above all
        print(f"kvflow-info: {args.store}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_store(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
