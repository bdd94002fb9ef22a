"""Host topology: NICs (RDMA devices and netdevs), NUMA nodes, GPUs and the
PCI paths between them; which NICs should serve a memory location; the
preference an engine publishes to its peers; and how two ends pair rails.

Discovery reads sysfs (and /proc), never a device: it costs a few hundred
small file reads and works without libibverbs or a GPU driver. A JSON file
(`Topology.load`, or the environment variable KVFLOW_TOPOLOGY) overrides
what discovery found, for hosts whose sysfs lies (VMs, containers) or
whose operators want fixed rails.

Memory locations are strings: "cpu" (host memory, no particular node),
"cpu:N" (host memory on NUMA node N), "cuda:N" (GPU N).
"""
from __future__ import annotations

import fcntl
import ipaddress
import functools
import json
import os
import re
import socket
import struct
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from kvflow.errors import InvalidArgumentError, ProtocolError, TopologyError

__all__ = [
    "TOPOLOGY_ENV",
    "Gid",
    "Gpu",
    "Nic",
    "NicKind",
    "NumaNode",
    "RdmaPort",
    "Route",
    "Topology",
    "discover",
    "gid_text",
    "host_topology",
    "ib_mtu",
    "live_addresses",
    "match_rails",
    "on_subnet",
    "pair_tcp_rails",
    "parse_location",
    "rail_order",
    "route_to",
]

TOPOLOGY_ENV = "KVFLOW_TOPOLOGY"
WIRE_VERSION = 1
# Bounds on what a peer may publish: a descriptor is read before anything
# about the peer is trusted, so every list it carries is capped.
MAX_WIRE_NICS = 64
MAX_WIRE_LOCATIONS = 256
MAX_NAME = 64                      # IB_DEVICE_NAME_MAX; netdev names are 15
LOCAL_DISTANCE, REMOTE_DISTANCE = 10, 20   # the kernel's defaults (node/distance)
# Bytes of RoCE v2 headers the kernel takes off the netdev MTU to get the
# RDMA path MTU (iboe_get_mtu: GRH, UDP, BTH, XRC, AtomicETH, ICRC).
ROCE_OVERHEAD = 96
IB_MTUS = (256, 512, 1024, 2048, 4096)   # enum ibv_mtu 1..5

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_LOCATION = re.compile(r"^(cpu|cuda)(?::(\d{1,4}))?$")
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")       # VGA, 3D controller


class NicKind(str, Enum):
    """What a NIC is to kvflow: an RDMA device (verbs) or a netdev (tcp)."""

    RDMA = "rdma"
    NETDEV = "netdev"


@dataclass(frozen=True)
class Gid:
    """One GID table entry of an RDMA port. `gid` is the address in IPv6
    text form (IPv4-mapped ones as ::ffff:a.b.c.d); `type` is sysfs's
    ("IB/RoCE v1", "RoCE v2"), "" where it has none."""

    index: int
    gid: str
    type: str = ""
    netdev: str | None = None

    @property
    def packed(self) -> bytes:
        return ipaddress.IPv6Address(self.gid).packed


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device. `active_mtu` (bytes) is derived from the
    netdev's MTU on RoCE (sysfs has no MTU file) and None on InfiniBand."""

    number: int
    state: str = ""               # ACTIVE, DOWN, INIT, ARMED
    phys_state: str = ""          # LinkUp, Disabled, Polling, ...
    link_layer: str = ""          # Ethernet, InfiniBand
    active_mtu: int | None = None
    rate: str | None = None
    gids: tuple[Gid, ...] = ()


@dataclass(frozen=True)
class Nic:
    """A network device. `numa` is -1 where unknown; `pci` is the PCI path
    below /sys/devices ("pci0000:00/0000:00:01.0/0000:01:00.0"), None for a
    virtual device (lo, veth, dummy, rxe); `netdev` names an RDMA device's
    Ethernet/IPoIB interface; `addresses` are "ip/prefixlen"; `speed` is in
    Mb/s; `ports` are an RDMA device's."""

    name: str
    kind: NicKind
    numa: int = -1
    pci: str | None = None
    netdev: str | None = None
    addresses: tuple[str, ...] = ()
    mtu: int | None = None
    speed: int | None = None
    state: str | None = None
    loopback: bool = False
    ports: tuple[RdmaPort, ...] = ()


@dataclass(frozen=True)
class NumaNode:
    """A NUMA node: its CPUs and its distance to every node (by node id)."""

    id: int
    cpus: tuple[int, ...] = ()
    distances: Mapping[int, int] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU found on the PCI bus; `index` is its CUDA ordinal."""

    index: int
    pci: str | None
    numa: int = -1
    model: str | None = None


def parse_location(location: str) -> tuple[str, int | None]:
    """("cpu", None), ("cpu", N) or ("cuda", N). Raises InvalidArgumentError
    for anything else (a bare "cuda" too: say which GPU)."""
    m = _LOCATION.match(location) if isinstance(location, str) else None
    if m is None or (m.group(1) == "cuda" and m.group(2) is None):
        raise InvalidArgumentError(f"memory location {location!r} is not 'cpu', 'cpu:N' or 'cuda:N'")
    return m.group(1), int(m.group(2)) if m.group(2) is not None else None


def ib_mtu(code: int) -> int | None:
    """Bytes of an ibv_mtu code (1..5), None for another value."""
    return IB_MTUS[code - 1] if isinstance(code, int) and 1 <= code <= 5 else None


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key that puts mlx5_2 before mlx5_10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name))


def _shared_depth(a: str | None, b: str | None) -> int:
    """Components two PCI paths share: 0 on different root complexes, 1
    under the same root, more below a common bridge or switch."""
    if not a or not b:
        return 0
    n = 0
    for x, y in zip(a.split("/"), b.split("/")):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Topology:
    """What discovery (or a topology file, or a peer) says about a host.

    `preferences` pins the preferred NICs of a location ({"cpu:0":
    ["mlx5_0"]}) over the computed ones; `source` says where this came from
    ("sysfs", a file path, "peer")."""

    nics: list[Nic] = field(default_factory=list)
    numa: list[NumaNode] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    preferences: dict[str, list[str]] = field(default_factory=dict)
    source: str = "sysfs"
    # A peer's topology carries the orders it computed, per (location,
    # kind), so that this side sees exactly the peer's choice.
    _published: dict[tuple[str, NicKind], tuple[list[str], list[str]]] = field(
        default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------ queries
    def nic(self, name: str) -> Nic:
        """The NIC called `name`; InvalidArgumentError when there is none."""
        for n in self.nics:
            if n.name == name:
                return n
        raise InvalidArgumentError(f"no NIC named {name!r} (have: {', '.join(n.name for n in self.nics)})")

    def locations(self) -> list[str]:
        """Every location this host has memory at: "cpu", "cpu:N" per NUMA
        node, "cuda:N" per GPU (a peer's: those it published)."""
        found = (["cpu"] + [f"cpu:{n.id}" for n in sorted(self.numa, key=lambda n: n.id)]
                 + [f"cuda:{g.index}" for g in sorted(self.gpus, key=lambda g: g.index)])
        return list(dict.fromkeys(found + [loc for loc, _ in self._published]))

    def distance(self, a: int, b: int) -> int:
        """NUMA distance between nodes a and b (the kernel's table, else 10
        for a node to itself and 20 between two)."""
        for n in self.numa:
            if n.id == a and b in n.distances:
                return n.distances[b]
        return LOCAL_DISTANCE if a == b else REMOTE_DISTANCE

    def preferred(self, location: str, kind: NicKind = NicKind.RDMA) -> tuple[list[str], list[str]]:
        """(preferred, fallback) names of the NICs of `kind` to serve memory
        at `location`; loopback devices are never listed.

        Rule: a NIC on the location's NUMA node ranks first, then one whose
        node is unknown, then the others by NUMA distance; `preferred` is
        the best-ranked group, `fallback` the rest in rank order. For
        "cuda:N" the node is the GPU's and, within a rank, a NIC sharing a
        deeper PCI bridge or switch with the GPU comes first. Ties go by name
        (mlx5_2 before mlx5_10), so both ends of a connection order the same
        way. "cpu", a GPU that was not found and a node that is not known
        rank every NIC alike. A pin in `preferences` replaces the computed
        preferred list (names of other kinds in it are skipped); a peer's
        topology answers with the orders it published. Link state plays no
        part: a rail that is down is the scheduler's to avoid.
        Raises InvalidArgumentError for a malformed location."""
        what, index = parse_location(location)
        key = what if index is None else f"{what}:{index}"
        try:
            kind = NicKind(kind)
        except ValueError:
            raise InvalidArgumentError(f"NIC kind {kind!r} is not 'rdma' or 'netdev'") from None
        published = self._published.get((key, kind))
        if published is not None:
            return list(published[0]), list(published[1])
        node: int | None = index if what == "cpu" else None
        near: str | None = None
        if what == "cuda":
            gpu = next((g for g in self.gpus if g.index == index), None)
            if gpu is not None:
                node, near = (gpu.numa if gpu.numa >= 0 else None), gpu.pci
        if node is not None and (node < 0 or (self.numa and all(n.id != node for n in self.numa))):
            node = None

        def rank(n: Nic) -> int:
            if node is None or n.numa == node:
                return 0
            if n.numa < 0:
                return 1
            return 1 + self.distance(node, n.numa)

        candidates = sorted((n for n in self.nics if n.kind == kind and not n.loopback),
                            key=lambda n: (rank(n), -_shared_depth(near, n.pci), _natural(n.name)))
        order = [n.name for n in candidates]
        pinned = [name for name in self.preferences.get(key, ()) if name in order]
        if pinned:
            return pinned, [name for name in order if name not in pinned]
        if not candidates:
            return [], []
        best = rank(candidates[0])
        return ([n.name for n in candidates if rank(n) == best],
                [n.name for n in candidates if rank(n) != best])

    def interface_of(self, ip: str) -> tuple[str, str] | None:
        """(netdev name, "ip/prefixlen") of the netdev holding address `ip`,
        None when no netdev (that this topology knows) holds it."""
        want = ipaddress.ip_address(ip.split("%")[0])       # a link-local IPv6 may carry its scope
        for n in self.nics:
            if n.kind != NicKind.NETDEV:
                continue
            for a in n.addresses:
                try:
                    if ipaddress.ip_interface(a).ip == want:
                        return n.name, a
                except ValueError:
                    continue
        return None

    def tcp_rails(self, location: str, *, exclude: Sequence[str] = ()) -> list[tuple[str, str]]:
        """The tcp rails of an engine whose memory is at `location`, for an
        engine told to pick them itself (Engine(rails="auto")): (netdev,
        "ip/prefixlen") for each netdev of preferred(location, NETDEV) that
        has an IPv4 address (its first; not link-local), else of the
        fallback ones, in preference order. Safety first: a netdev holding
        an address of `exclude` (the control address: it stays on a link of
        its own) is skipped unless nothing else is left, and virtual devices
        (veth, bridges, dummies: no PCI path of their own nor below them;
        a bond or VLAN over a PCI NIC counts as physical, discover() gives
        it its lower device's path) count only on a host that has no
        physical netdev with an address. [] when nothing qualifies.
        Raises InvalidArgumentError for a malformed location."""
        preferred, fallback = self.preferred(location, NicKind.NETDEV)
        skip = {str(ipaddress.ip_address(a)) for a in exclude}
        found: list[tuple[Nic, str, bool]] = []
        for name in preferred + fallback:
            nic = self.nic(name)
            v4 = [a for a in nic.addresses if _rail_address(a)]
            if v4:
                excluded = any(str(ipaddress.ip_interface(a).ip) in skip for a in nic.addresses)
                found.append((nic, v4[0], excluded))
        if any(n.pci for n, _, _ in found):
            found = [f for f in found if f[0].pci]
        if any(not excluded for _, _, excluded in found):
            found = [f for f in found if not f[2]]
        best = [f for f in found if f[0].name in preferred] or found
        return [(n.name, a) for n, a, _ in best]

    # ------------------------------------------------------------ wire form
    def to_wire(self) -> dict[str, Any]:
        """The compact form an engine publishes in its descriptor:
        {"v": 1, "nics": [[name, kind, numa], ...], "pref": {location:
        {kind: [[preferred...], [fallback...]]}}}, NICs named by their index
        in "nics" (a descriptor goes to every peer; names once). Every
        location of locations() is published, so the peer needs neither
        this host's PCI paths nor its NUMA distances."""
        nics = [n for n in self.nics if not n.loopback][:MAX_WIRE_NICS]
        index = {n.name: i for i, n in enumerate(nics)}
        pref: dict[str, dict[str, list[list[int]]]] = {}
        kinds = [k for k in NicKind if any(n.kind == k for n in nics)]
        for loc in self.locations()[:MAX_WIRE_LOCATIONS]:
            entry = {}
            for k in kinds:
                p, f = self.preferred(loc, k)
                entry[k.value] = [[index[x] for x in p if x in index], [index[x] for x in f if x in index]]
            pref[loc] = entry
        return {"v": WIRE_VERSION, "nics": [[n.name, n.kind.value, n.numa] for n in nics], "pref": pref}

    @classmethod
    def from_wire(cls, v: Any) -> Topology:
        """A peer's published topology, checked. Raises ProtocolError for
        anything malformed: a wrong version, oversized lists, unknown kinds,
        duplicate names, indices out of range or of another kind, a NIC
        listed twice for one location."""
        try:
            if not isinstance(v, dict) or v.get("v") != WIRE_VERSION:
                raise ValueError(f"not a version {WIRE_VERSION} topology")
            raw_nics, raw_pref = v["nics"], v["pref"]
            if not isinstance(raw_nics, list) or len(raw_nics) > MAX_WIRE_NICS:
                raise ValueError(f"nics is not a list of at most {MAX_WIRE_NICS}")
            nics = []
            for item in raw_nics:
                name, kind, numa = item
                if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME and isinstance(numa, int)
                        and not isinstance(numa, bool) and -1 <= numa < 1 << 16):
                    raise ValueError(f"malformed nic {item!r}")
                nics.append(Nic(name, NicKind(kind), numa=numa))
            if len({n.name for n in nics}) != len(nics):
                raise ValueError("duplicate nic names")
            if not isinstance(raw_pref, dict) or len(raw_pref) > MAX_WIRE_LOCATIONS:
                raise ValueError(f"pref is not a map of at most {MAX_WIRE_LOCATIONS} locations")
            published: dict[tuple[str, NicKind], tuple[list[str], list[str]]] = {}
            for loc, kinds in raw_pref.items():
                parse_location(loc)
                if not isinstance(kinds, dict):
                    raise ValueError(f"pref[{loc!r}] is not a map")
                for kname, lists in kinds.items():
                    kind = NicKind(kname)
                    p, f = lists
                    seen = list(p) + list(f)
                    if len(set(seen)) != len(seen) or not all(
                            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(nics)
                            and nics[i].kind == kind for i in seen):
                        raise ValueError(f"pref[{loc!r}][{kname!r}] has bad or repeated indices")
                    published[(loc, kind)] = ([nics[i].name for i in p], [nics[i].name for i in f])
        except (KeyError, TypeError, ValueError, InvalidArgumentError) as e:
            raise ProtocolError(f"descriptor: malformed topology ({e})") from None
        return cls(nics=nics, source="peer", _published=published)

    # ------------------------------------------------------------ JSON file
    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON types, in the schema load() reads: edit
        `kvflow-info --json`'s "topology" into a topology file."""
        out = asdict(self)
        out.pop("_published", None)
        out.pop("source", None)
        for n in out["numa"]:
            n["distances"] = {str(k): d for k, d in n["distances"].items()}
        return json.loads(json.dumps(out))

    @classmethod
    def load(cls, path: str, *, base: Topology | None = None) -> Topology:
        """`base` (default: discover()) overridden by the JSON file at
        `path`: {"nics": [...], "numa": [...], "gpus": [...], "preferences":
        {"cpu:0": ["mlx5_0"], ...}}. Each key is optional; one that is present
        replaces what discovery found (a NIC needs "name" and "kind"; a node
        "id"). Raises TopologyError for a file that cannot be read, is not
        JSON, does not follow the schema, or pins a NIC that does not exist."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise TopologyError(f"cannot read topology file {path}: {e.strerror or e}", errno=e.errno) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TopologyError(f"topology file {path} is not JSON: {e}") from None
        base = base if base is not None else discover()
        return _from_document(doc, base, path)


# ------------------------------------------------------------ the JSON schema
_NIC_KEYS = {"name", "kind", "numa", "pci", "netdev", "addresses", "mtu", "speed", "state", "loopback", "ports"}
_PORT_KEYS = {"number", "state", "phys_state", "link_layer", "active_mtu", "rate", "gids"}
_GID_KEYS = {"index", "gid", "type", "netdev"}


class _Schema:
    """Typed reads from a parsed JSON document; every error names the path
    to the offending value."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> TopologyError:
        return TopologyError(f"topology file {self.path}: {where}: {message}")

    def obj(self, v: Any, where: str, keys: set[str]) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"expected an object, got {type(v).__name__}")
        unknown = sorted(set(v) - keys)
        if unknown:
            raise self.fail(where, f"unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(keys))})")
        return v

    def map(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"expected an object, got {type(v).__name__}")
        return v

    def list(self, v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(where, f"expected a list, got {type(v).__name__}")
        return v

    def get(self, d: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...,
            *, optional: bool = False) -> Any:
        if key not in d or (optional and d[key] is None):
            if default is ...:
                raise self.fail(where, f"missing {key!r}")
            return default
        v = d[key]
        if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, (int, type(None)))):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(f"{where}.{key}", f"expected {names}, got {v!r}")
        return v


def _from_document(doc: Any, base: Topology, path: str) -> Topology:
    s = _Schema(path)
    doc = s.obj(doc, "top level", {"nics", "numa", "gpus", "preferences"})
    nics, numa, gpus = list(base.nics), list(base.numa), list(base.gpus)
    if "nics" in doc:
        nics = [_nic(s, item, f"nics[{i}]") for i, item in enumerate(s.list(doc["nics"], "nics"))]
        names = [n.name for n in nics]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise s.fail("nics", f"NIC {dup!r} is listed twice")
    if "numa" in doc:
        numa = []
        for i, item in enumerate(s.list(doc["numa"], "numa")):
            where = f"numa[{i}]"
            d = s.obj(item, where, {"id", "cpus", "distances"})
            node = s.get(d, "id", where, int)
            cpus = s.get(d, "cpus", where, list, [])
            dist = s.get(d, "distances", where, dict, {})
            try:
                numa.append(NumaNode(node, tuple(int(c) for c in cpus), {int(k): int(x) for k, x in dist.items()}))
            except (TypeError, ValueError):
                raise s.fail(where, "cpus must be integers and distances a map of node id to integer") from None
    if "gpus" in doc:
        gpus = []
        for i, item in enumerate(s.list(doc["gpus"], "gpus")):
            where = f"gpus[{i}]"
            d = s.obj(item, where, {"index", "pci", "numa", "model"})
            gpus.append(Gpu(s.get(d, "index", where, int), s.get(d, "pci", where, (str, type(None)), None),
                            s.get(d, "numa", where, int, -1), s.get(d, "model", where, (str, type(None)), None)))
    preferences: dict[str, list[str]] = {}
    known = {n.name for n in nics}
    for loc, names in s.map(doc.get("preferences", {}), "preferences").items():
        where = f"preferences[{loc!r}]"
        try:
            what, index = parse_location(loc)
        except InvalidArgumentError as e:
            raise s.fail(where, str(e)) from None
        names = s.list(names, where)
        missing = [n for n in names if n not in known]
        if missing or not all(isinstance(n, str) for n in names):
            raise s.fail(where, f"no NIC named {', '.join(map(repr, missing or names))} "
                                f"(known: {', '.join(sorted(known, key=_natural)) or 'none'})")
        preferences[what if index is None else f"{what}:{index}"] = list(names)
    return Topology(nics=nics, numa=numa, gpus=gpus, preferences=preferences, source=path)


def _nic(s: _Schema, item: Any, where: str) -> Nic:
    d = s.obj(item, where, _NIC_KEYS)
    name = s.get(d, "name", where, str)
    kind = s.get(d, "kind", where, str)
    if kind not in {k.value for k in NicKind}:
        raise s.fail(f"{where}.kind", f"expected 'rdma' or 'netdev', got {kind!r}")
    if not 0 < len(name) <= MAX_NAME:
        raise s.fail(f"{where}.name", f"must be 1..{MAX_NAME} characters")
    addresses = s.get(d, "addresses", where, list, [])
    for a in addresses:
        try:
            ipaddress.ip_interface(a)
        except (TypeError, ValueError):
            raise s.fail(f"{where}.addresses", f"{a!r} is not an address/prefix") from None
    ports = []
    for j, p in enumerate(s.get(d, "ports", where, list, [])):
        pw = f"{where}.ports[{j}]"
        pd = s.obj(p, pw, _PORT_KEYS)
        gids = []
        for k, g in enumerate(s.get(pd, "gids", pw, list, [])):
            gw = f"{pw}.gids[{k}]"
            gd = s.obj(g, gw, _GID_KEYS)
            text = s.get(gd, "gid", gw, str)
            try:
                text = gid_text(ipaddress.IPv6Address(text).packed)
            except ValueError:
                raise s.fail(f"{gw}.gid", f"{text!r} is not a GID (IPv6 form)") from None
            gids.append(Gid(s.get(gd, "index", gw, int), text, s.get(gd, "type", gw, str, ""),
                            s.get(gd, "netdev", gw, (str, type(None)), None)))
        ports.append(RdmaPort(
            s.get(pd, "number", pw, int), s.get(pd, "state", pw, str, ""), s.get(pd, "phys_state", pw, str, ""),
            s.get(pd, "link_layer", pw, str, ""), s.get(pd, "active_mtu", pw, (int, type(None)), None),
            s.get(pd, "rate", pw, (str, type(None)), None), tuple(gids)))
    return Nic(
        name=name, kind=NicKind(kind), numa=s.get(d, "numa", where, int, -1),
        pci=s.get(d, "pci", where, (str, type(None)), None),
        netdev=s.get(d, "netdev", where, (str, type(None)), None), addresses=tuple(addresses),
        mtu=s.get(d, "mtu", where, (int, type(None)), None), speed=s.get(d, "speed", where, (int, type(None)), None),
        state=s.get(d, "state", where, (str, type(None)), None), loopback=s.get(d, "loopback", where, bool, False),
        ports=tuple(ports))


# ------------------------------------------------------------ discovery
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):    # EINVAL from speed of a down link, absent files
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path), key=_natural)
    except OSError:
        return []


def _cpulist(text: str | None) -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            cpus.extend(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
    return tuple(cpus)


def _pci_path(devices_root: str, link: str) -> str | None:
    """The PCI part of a device link's real path below /sys/devices:
    "pci0000:00/0000:00:01.0/0000:01:00.0" (the device itself last; a
    virtio or other child below it is cut off). None for a virtual device."""
    if not os.path.exists(link):
        return None
    rel = os.path.relpath(os.path.realpath(link), devices_root).split(os.sep)
    if not rel or not rel[0].startswith("pci"):
        return None
    last = max((i for i, p in enumerate(rel) if _BDF.match(p)), default=0)
    return "/".join(rel[:last + 1]) if last else None


def _numa_of(devices_root: str, link: str) -> int:
    """The NUMA node of a device: its numa_node, or the nearest parent's
    (a virtio netdev's own directory has none). -1 where unknown."""
    if not os.path.exists(link):
        return -1
    path = os.path.realpath(link)
    while path.startswith(devices_root + os.sep):
        node = _read_int(os.path.join(path, "numa_node"))
        if node is not None:
            return node
        path = os.path.dirname(path)
    return -1


def gid_text(packed: bytes) -> str:
    """A 16-byte GID as text: ::ffff:a.b.c.d for an IPv4-mapped one (as
    every Python version prints it), compressed IPv6 otherwise."""
    a = ipaddress.IPv6Address(packed)
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped is not None else a.compressed


def live_addresses(procfs: str = "/proc") -> dict[str, list[str]]:
    """This machine's addresses per netdev ("ip/prefixlen"): from `ip -j
    addr` where iproute2 is installed, else IPv6 from /proc/net/if_inet6 and
    each interface's primary IPv4 address by ioctl."""
    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, timeout=5, check=True).stdout
        result: dict[str, list[str]] = {}
        for link in json.loads(out):
            result[link["ifname"]] = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                                      if "local" in a and "prefixlen" in a]
        return result
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        pass
    result = {}
    for line in (_read(os.path.join(procfs, "net", "if_inet6")) or "").splitlines():
        parts = line.split()
        if len(parts) == 6:
            try:
                addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
                result.setdefault(parts[5], []).append(f"{addr}/{int(parts[2], 16)}")
            except ValueError:
                continue
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])   # SIOCGIFADDR
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])   # SIOCGIFNETMASK
            except OSError:
                continue
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
            result.setdefault(name, []).insert(0, f"{addr}/{prefix}")
    return result


def _netdevs(sysfs: str, devices_root: str, addresses: Mapping[str, Sequence[str]]) -> list[Nic]:
    out = []
    base = os.path.join(sysfs, "class", "net")
    for name in _listdir(base):
        p = os.path.join(base, name)
        dev = _physical_device(p)
        speed = _read_int(os.path.join(p, "speed"))
        out.append(Nic(
            name=name, kind=NicKind.NETDEV, numa=_numa_of(devices_root, dev), pci=_pci_path(devices_root, dev),
            addresses=tuple(addresses.get(name, ())), mtu=_read_int(os.path.join(p, "mtu")),
            speed=speed if speed is not None and speed > 0 else None, state=_read(os.path.join(p, "operstate")),
            loopback=_read(os.path.join(p, "type")) == "772"))     # ARPHRD_LOOPBACK
    return out


def _physical_device(netdir: str, depth: int = 0) -> str:
    """The `device` link of a netdev's directory, or for one without (a
    bond, a VLAN, a bridge) that of its first lower device that has one
    (lower_* links, followed down: a VLAN over a bond over a NIC), so that
    it lives where its hardware does. A missing path where none has."""
    own = os.path.join(netdir, "device")
    if os.path.exists(own) or depth >= 8:
        return own
    for entry in sorted(_listdir(netdir)):
        if entry.startswith("lower_"):
            dev = _physical_device(os.path.realpath(os.path.join(netdir, entry)), depth + 1)
            if os.path.exists(dev):
                return dev
    return own


def _rail_address(a: str) -> bool:
    """An "ip/prefixlen" a tcp rail may listen on: IPv4, not loopback or
    link-local (169.254/16 is the same on every link: not a rail's)."""
    try:
        ip = ipaddress.ip_interface(a).ip
    except ValueError:
        return False
    return ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def _after_colon(text: str | None) -> str:
    """"4: ACTIVE" -> "ACTIVE"."""
    return (text or "").partition(":")[2].strip() or (text or "")


def _rdma_port(p: str, number: int, netdev_mtu: int | None) -> RdmaPort:
    gids = []
    for i in _listdir(os.path.join(p, "gids")):
        text = _read(os.path.join(p, "gids", i))
        if not i.isdigit() or not text:
            continue
        try:
            packed = ipaddress.IPv6Address(text).packed
        except ValueError:
            continue
        if not any(packed):
            continue
        gids.append(Gid(int(i), gid_text(packed), _read(os.path.join(p, "gid_attrs", "types", i)) or "",
                        _read(os.path.join(p, "gid_attrs", "ndevs", i)) or None))
    link = _read(os.path.join(p, "link_layer")) or ""
    mtu = None
    if link == "Ethernet" and netdev_mtu:
        # RoCE: the largest IB MTU that fits the netdev's, less headers.
        mtu = max((m for m in IB_MTUS if m <= netdev_mtu - ROCE_OVERHEAD), default=None)
    return RdmaPort(number, _after_colon(_read(os.path.join(p, "state"))),
                    _after_colon(_read(os.path.join(p, "phys_state"))), link, mtu,
                    _read(os.path.join(p, "rate")), tuple(gids))


def _rate_mbps(rate: str | None) -> int | None:
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return int(float(m.group(1)) * 1000) if m else None


def _rdma_devices(sysfs: str, devices_root: str, netdevs: dict[str, Nic]) -> list[Nic]:
    out = []
    base = os.path.join(sysfs, "class", "infiniband")
    for name in _listdir(base):
        p = os.path.join(base, name)
        dev = os.path.join(p, "device")
        # The Ethernet/IPoIB interface: rxe and siw name it in "parent", a
        # PCI device lists it under device/net, any RoCE device in its GIDs.
        netdev = _read(os.path.join(p, "parent"))
        if not netdev:
            netdev = next(iter(_listdir(os.path.join(dev, "net"))), None)
        if not netdev:
            ndevs = (_read(os.path.join(p, "ports", "1", "gid_attrs", "ndevs", i))
                     for i in _listdir(os.path.join(p, "ports", "1", "gid_attrs", "ndevs")))
            netdev = next((n for n in ndevs if n), None)
        nd = netdevs.get(netdev or "")
        ports = tuple(_rdma_port(os.path.join(p, "ports", n), int(n), nd.mtu if nd else None)
                      for n in _listdir(os.path.join(p, "ports")) if n.isdigit())
        numa = _numa_of(devices_root, dev)
        if numa < 0 and nd is not None:
            numa = nd.numa                     # a virtual device lives where its netdev does
        first = ports[0] if ports else None
        out.append(Nic(
            name=name, kind=NicKind.RDMA, numa=numa, pci=_pci_path(devices_root, dev), netdev=netdev,
            addresses=nd.addresses if nd else (), mtu=first.active_mtu if first else None,
            speed=_rate_mbps(first.rate) if first else None, state=first.state if first else None,
            ports=ports))
    return out


def _numa_nodes(sysfs: str) -> list[NumaNode]:
    base = os.path.join(sysfs, "devices", "system", "node")
    ids = [int(n[4:]) for n in _listdir(base) if n.startswith("node") and n[4:].isdigit()]
    nodes = []
    for i in ids:
        dist = (_read(os.path.join(base, f"node{i}", "distance")) or "").split()
        distances = {j: int(d) for j, d in zip(ids, dist) if d.isdigit()} if len(dist) == len(ids) else {}
        nodes.append(NumaNode(i, _cpulist(_read(os.path.join(base, f"node{i}", "cpulist"))), distances))
    if not nodes:        # a kernel without NUMA: one node with every CPU
        nodes.append(NumaNode(0, _cpulist(_read(os.path.join(sysfs, "devices", "system", "cpu", "online")))))
    return nodes


def _gpus(sysfs: str, procfs: str, devices_root: str, visible: str | None) -> list[Gpu]:
    """NVIDIA GPUs in PCI bus order, which is CUDA's order under
    CUDA_DEVICE_ORDER=PCI_BUS_ID (what nvidia-smi and every multi-GPU
    launcher assume); CUDA_VISIBLE_DEVICES, when it is a list of ordinals,
    selects and renumbers them as CUDA does. UUID or MIG forms are not
    mapped: all GPUs are listed then."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    found = []
    for bdf in _listdir(base):
        p = os.path.join(base, bdf)
        cls = _read(os.path.join(p, "class")) or ""
        if _read(os.path.join(p, "vendor")) != _NVIDIA or not cls.startswith(_GPU_CLASSES):
            continue
        info = _read(os.path.join(procfs, "driver", "nvidia", "gpus", bdf, "information")) or ""
        model = next((line.partition(":")[2].strip() for line in info.splitlines() if line.startswith("Model:")),
                     None)
        found.append((_pci_path(devices_root, p), _numa_of(devices_root, p), model))
    if visible is not None and re.fullmatch(r"\s*(\d+\s*(,\s*\d+\s*)*)?", visible):
        ordinals = [int(x) for x in visible.split(",") if x.strip()]
        found = [found[i] for i in ordinals if i < len(found)]
    return [Gpu(i, pci, numa, model) for i, (pci, numa, model) in enumerate(found)]


def discover(sysfs_root: str = "/sys", procfs: str = "/proc", *,
             addresses: Mapping[str, Sequence[str]] | None = None,
             cuda_visible_devices: str | None = None) -> Topology:
    """This host's topology from sysfs and procfs (both roots may be a fake
    tree). `addresses` maps netdev names to "ip/prefixlen" strings; None
    reads this machine's (live_addresses()). `cuda_visible_devices`
    defaults to the environment's. Never raises for a missing or odd sysfs
    entry: what cannot be read is left unknown."""
    sysfs = os.path.realpath(sysfs_root)
    devices_root = os.path.join(sysfs, "devices")
    if addresses is None:
        addresses = live_addresses(procfs)
    if cuda_visible_devices is None:
        cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    netdevs = _netdevs(sysfs, devices_root, addresses)
    rdma = _rdma_devices(sysfs, devices_root, {n.name: n for n in netdevs})
    return Topology(nics=rdma + netdevs, numa=_numa_nodes(sysfs),
                    gpus=_gpus(sysfs, procfs, devices_root, cuda_visible_devices), source="sysfs")


def host_topology(sysfs_root: str = "/sys", procfs: str = "/proc", *,
                  addresses: Mapping[str, Sequence[str]] | None = None) -> Topology:
    """discover() (with `addresses`, as there), overridden by the file
    KVFLOW_TOPOLOGY names when it is set. Raises TopologyError for a bad
    file."""
    path = os.environ.get(TOPOLOGY_ENV)
    base = discover(sysfs_root, procfs, addresses=addresses)
    return Topology.load(path, base=base) if path else base


def cached_host_topology(fresh_addresses: bool = False) -> Topology:
    """host_topology(), discovered once per process and KVFLOW_TOPOLOGY
    value (engines start often; NICs and NUMA nodes do not change under
    them). fresh_addresses: with this machine's addresses as they are now
    (live_addresses(), one `ip` call: an address added or moved since is
    seen), for callers that pick addresses from it (rails="auto")."""
    path = os.environ.get(TOPOLOGY_ENV)
    if not fresh_addresses:
        return _cached(path, None)
    return _cached(path, json.dumps(live_addresses(), sort_keys=True))


@functools.lru_cache(maxsize=4)
def _cached(path: str | None, addresses: str | None) -> Topology:
    return host_topology(addresses=None if addresses is None else json.loads(addresses))


def match_rails(local: Sequence[str], remote: Sequence[str]) -> list[tuple[str, str]]:
    """Pairs two ends' ordered NIC lists into rails: rail i is (local[i %
    nl], remote[i % nr]) for i in range(max(nl, nr)). Equal lists pair one
    to one in order (each side's first NIC with the other's first); the
    shorter side's NICs are reused round-robin, so every NIC of the longer
    side carries a rail. Each list is one end's preferred NICs for its
    memory location (its fallback where nothing is preferred). The rule is
    symmetric (match_rails(b, a) is match_rails(a, b) with each pair
    swapped), so both ends derive the same rails from the two published
    lists. Returns [] when either side has none; raises
    InvalidArgumentError for a list that names a NIC twice."""
    for side, names in (("local", local), ("remote", remote)):
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"{side} rail list names a NIC twice: {list(names)}")
    if not local or not remote:
        return []
    return [(local[i % len(local)], remote[i % len(remote)]) for i in range(max(len(local), len(remote)))]


def rail_order(nics: Sequence[str], topology: Topology | None, location: str | None) -> list[int]:
    """Indices of rails (each named by its NIC, "" where unknown) in the
    order `topology` prefers netdevs for memory at `location`: preferred,
    then fallback, then unknown, keeping the given order among equals (so
    without a topology or location it is the given order)."""
    if topology is None or location is None:
        return list(range(len(nics)))
    try:
        preferred, fallback = topology.preferred(location, NicKind.NETDEV)
    except InvalidArgumentError:
        return list(range(len(nics)))
    rank = {n: k for k, n in enumerate(preferred + fallback)}
    return sorted(range(len(nics)), key=lambda i: rank.get(nics[i], len(rank)))


def on_subnet(ip: str, interface: str) -> bool:
    """Whether address `ip` lies in the subnet of `interface` ("ip/prefixlen";
    False for a bare ip, whose prefix is unknown, for the other family, and
    for a malformed one)."""
    if "/" not in interface:
        return False
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_interface(interface).network
    except ValueError:
        return False


@dataclass
class Route:
    """Where the kernel sends packets for an address: the source it picks,
    the netdev holding that source, whether the address is on that
    source's subnet; `error` when there is no route at all."""
    source: str | None = None
    netdev: str | None = None
    on_link: bool = False
    error: OSError | None = None


def route_to(ip: str, topology: Topology) -> Route:
    """The source address the kernel picks for `ip` (a UDP connect() sends
    nothing; getsockname() reads the routing decision), the netdev holding
    that address (in `topology`), and whether `ip` lies in that address's
    subnet. Never raises: a failed lookup is the Route's `error`."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            src = s.getsockname()[0]
    except OSError as e:
        return Route(error=e)
    found = topology.interface_of(src)
    if found is None:
        return Route(src)
    return Route(src, found[0], on_subnet(ip, found[1]))


def pair_tcp_rails(local: Sequence[str], remote: Sequence[str], networks: Sequence[str] = (), *,
                   nics: Sequence[str] = (),
                   route: Callable[[str], str | None] | None = None) -> list[tuple[int | None, int]]:
    """Which local tcp rail each data connection to a peer's rails leaves
    from: distinct (local index, remote index) pairs, in order, the local
    index None where the kernel should choose the source. `local` is this
    end's rail addresses ("ip/prefixlen", or a bare ip where the prefix is
    unknown), `remote` the peer's (ip), each in its end's preference order
    (rail_order); `networks` every "ip/prefixlen" of this host; `nics` the
    netdev of each local rail ("" unknown) and `route` the netdev the
    kernel's route to an address leaves by (None: unknown; route_to()).

    The orders pair rail i with rail i (match_rails); a pair whose local
    rail is not on the remote address's subnet is moved to a local rail
    that is (two hosts that order their NICs differently still get
    same-subnet pairs); where no rail is, but another interface of this
    host is, the source is left to the kernel (a rail's address bound to
    leave by another link would have the replies come back by the rail and
    strict rp_filter drop them); so it is for a remote address this host
    holds itself (it is reached over loopback: no rail to pick). Where
    nothing local is (routed rails), the ordered pair keeps its local rail
    only when the kernel's route to the remote address already leaves by
    that rail's netdev; otherwise the kernel chooses. Pairs that come out
    the same (more local rails than remote ones on a subnet) are listed
    once: a group of connections per pair, never two to one endpoint from
    one source."""
    if not local or not remote:
        return []
    own = {str(ipaddress.ip_interface(a).ip) for a in networks}
    routes: dict[str, str | None] = {}

    def leaves_by(ip: str) -> str | None:
        if route is None:
            return None
        if ip not in routes:
            routes[ip] = route(ip)
        return routes[ip]

    out: list[tuple[int | None, int]] = []
    for li, ri in match_rails([str(i) for i in range(len(local))], [str(j) for j in range(len(remote))]):
        i, j = int(li), int(ri)
        ip = str(ipaddress.ip_address(remote[j]))
        near = [k for k, a in enumerate(local) if on_subnet(ip, a)]
        if ip in own:
            out.append((None, j))
        elif near:
            out.append((i if i in near else near[j % len(near)], j))
        elif any(on_subnet(ip, a) for a in networks):
            out.append((None, j))
        else:
            nic = nics[i] if i < len(nics) else ""
            same_family = ipaddress.ip_interface(local[i]).ip.version == ipaddress.ip_address(ip).version
            out.append((i if same_family and nic and leaves_by(ip) == nic else None, j))
    return list(dict.fromkeys(out))
