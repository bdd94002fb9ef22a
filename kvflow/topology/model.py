"""The topology's types: NICs (RDMA devices and netdevs) and their ports
and GIDs, NUMA nodes, GPUs, and Topology, which says which NICs should
serve a memory location ("cpu", "cpu:N", "cuda:N") and is what an engine
publishes to its peers. Read from sysfs by kvflow.topology.discover, from
a file by kvflow.topology.schema."""
from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
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
    "Topology",
    "gid_text",
    "ib_mtu",
    "parse_location",
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
        from kvflow.topology.discover import discover
        from kvflow.topology.schema import from_document
        base = base if base is not None else discover()
        return from_document(doc, base, path)


# ------------------------------------------------------------ the JSON schema


def _rail_address(a: str) -> bool:
    """An "ip/prefixlen" a tcp rail may listen on: IPv4, not loopback or
    link-local (169.254/16 is the same on every link: not a rail's)."""
    try:
        ip = ipaddress.ip_interface(a).ip
    except ValueError:
        return False
    return ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def gid_text(packed: bytes) -> str:
    """A 16-byte GID as text: ::ffff:a.b.c.d for an IPv4-mapped one (as
    every Python version prints it), compressed IPv6 otherwise."""
    a = ipaddress.IPv6Address(packed)
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped is not None else a.compressed
