"""Host discovery: NICs, NUMA nodes and GPUs read from sysfs and /proc
(never from a device), and the cached host topology an engine starts with."""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
from collections.abc import Mapping, Sequence

from kvflow.config import env_str
from kvflow.topology.model import (_BDF, _GPU_CLASSES, _NVIDIA, IB_MTUS, ROCE_OVERHEAD, TOPOLOGY_ENV, Gid,
                                   Gpu, Nic, NicKind, NumaNode, RdmaPort, Topology, _natural, gid_text)

__all__ = ["cached_host_topology", "discover", "host_topology", "live_addresses"]


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
    path = env_str(TOPOLOGY_ENV)
    base = discover(sysfs_root, procfs, addresses=addresses)
    return Topology.load(path, base=base) if path else base


def cached_host_topology(fresh_addresses: bool = False) -> Topology:
    """host_topology(), discovered once per process and KVFLOW_TOPOLOGY
    value (engines start often; NICs and NUMA nodes do not change under
    them). fresh_addresses: with this machine's addresses as they are now
    (live_addresses(), one `ip` call: an address added or moved since is
    seen), for callers that pick addresses from it (rails="auto")."""
    path = env_str(TOPOLOGY_ENV)
    if not fresh_addresses:
        return _cached(path, None)
    return _cached(path, json.dumps(live_addresses(), sort_keys=True))


@functools.lru_cache(maxsize=4)
def _cached(path: str | None, addresses: str | None) -> Topology:
    return host_topology(addresses=None if addresses is None else json.loads(addresses))


