"""Topology discovery on fake sysfs trees (two NUMA nodes, four PCI NICs
with RoCE, Soft-RoCE on a veth, two NVIDIA GPUs and a VGA that is not
one), NIC preference per memory location, the JSON override and its
errors, the wire form and its validation, rail matching, and kvflow-info
(local report, --json, --peer against a live engine and a closed port)."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

import kvflow
import kvflow.cli.info
from kvflow.errors import (
    InvalidArgumentError,
    KVFlowError,
    ProtocolError,
    TopologyError,
)
from kvflow.control.descriptor import Descriptor
from kvflow.cli.info import Level, PeerReport, check_rdma, route_to
from kvflow.providers.tcp import bind_source, control_addresses
from kvflow.schedule.rails import RailPlan
from kvflow.topology import (
    TOPOLOGY_ENV,
    Gid,
    Nic,
    NicKind,
    RdmaPort,
    Topology,
    discover,
    host_topology,
    match_rails,
    on_subnet,
    pair_tcp_rails,
    parse_location,
    rail_order,
)

ROOT = Path(__file__).resolve().parent.parent
RDMA, NETDEV = NicKind.RDMA, NicKind.NETDEV

GPU0 = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"      # below a PCIe switch
GPU1 = "pci0000:80/0000:80:02.0/0000:82:00.0"
VGA = "pci0000:00/0000:00:1f.0"                                             # not NVIDIA
NICS = {  # rdma name: (netdev, pci path, numa, GID IPv4)
    "mlx5_0": ("ens1f0", "pci0000:00/0000:00:02.0/0000:05:00.0", 0, "10.0.0.1"),
    "mlx5_1": ("ens2f0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0, "10.0.1.1"),
    "mlx5_2": ("ens3f0", "pci0000:80/0000:80:01.0/0000:81:00.0", 1, "10.0.2.1"),
    "mlx5_3": ("ens3f1", "pci0000:80/0000:80:01.0/0000:81:00.1", 1, "10.0.3.1"),
}
ADDRESSES = {nd: [f"{ip}/24"] for nd, _, _, ip in NICS.values()} | {
    "lo": ["127.0.0.1/8"], "veth0": ["10.9.0.1/24"]}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, at.parent), at)


def _sysfs_gid(ip: str) -> str:
    """A GID as sysfs prints it: eight groups of four hex digits."""
    h = ipaddress.IPv6Address(ip).packed.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _pci(sysfs: Path, path: str, numa: int, **files: str) -> Path:
    """Creates the device directories of a PCI path (each with numa_node)
    and its /sys/bus/pci/devices link; `files` go in the last one."""
    d = sysfs / "devices"
    for part in path.split("/"):
        d = d / part
        if not part.startswith("pci"):
            _write(d / "numa_node", str(numa))
    for name, text in files.items():
        _write(d / name, text)
    bdf = path.rsplit("/", 1)[1]
    if not (sysfs / "bus/pci/devices" / bdf).exists():
        _link(sysfs / "bus/pci/devices" / bdf, d)
    return d


def _netdev(sysfs: Path, name: str, parent: Path | None, mtu: int, kind: int = 1, speed: str = "100000") -> None:
    d = (parent / "net" / name) if parent is not None else sysfs / "devices/virtual/net" / name
    for f, text in {"mtu": str(mtu), "operstate": "up", "speed": speed, "type": str(kind)}.items():
        _write(d / f, text)
    if parent is not None:
        _link(d / "device", parent)
    _link(sysfs / "class/net" / name, d)


def _port(d: Path, state: str, gids: list[tuple[str, str, str]]) -> None:
    p = d / "ports" / "1"
    _write(p / "state", state)
    _write(p / "phys_state", "5: LinkUp" if "ACTIVE" in state else "3: Disabled")
    _write(p / "link_layer", "Ethernet")
    _write(p / "rate", "100 Gb/sec (4X EDR)")
    for i, (ip, kind, netdev) in enumerate(gids):
        _write(p / "gids" / str(i), _sysfs_gid(ip))
        _write(p / "gid_attrs/types" / str(i), kind)
        _write(p / "gid_attrs/ndevs" / str(i), netdev)
    _write(p / "gids" / str(len(gids)), _sysfs_gid("::"))      # unused entries are zero


@pytest.fixture
def fake_host(tmp_path: Path) -> tuple[str, str]:
    return build_fake_host(tmp_path)


def build_fake_host(root: Path) -> tuple[str, str]:
    """(sysfs root, procfs root) of a made-up two-socket host below `root`."""
    sysfs, proc = root / "sys", root / "proc"
    for node, cpus, distance in ((0, "0-3,8", "10 21"), (1, "4-7", "21 10")):
        _write(sysfs / f"devices/system/node/node{node}/cpulist", cpus)
        _write(sysfs / f"devices/system/node/node{node}/distance", distance)
    _write(sysfs / "devices/system/node/online", "0-1")
    gpu = _pci(sysfs, GPU0, 0, vendor="0x10de", **{"class": "0x030200"})
    _pci(sysfs, GPU1, 1, vendor="0x10de", **{"class": "0x030200"})
    _pci(sysfs, VGA, 0, vendor="0x8086", **{"class": "0x030000"})
    _write(proc / "driver/nvidia/gpus" / gpu.name / "information", "Model: \t NVIDIA H100 80GB HBM3\nIRQ: 42")
    for name, (netdev, path, numa, ip) in NICS.items():
        dev = _pci(sysfs, path, numa, vendor="0x15b3", **{"class": "0x020000"})
        _netdev(sysfs, netdev, dev, 9000)
        ib = dev / "infiniband" / name
        _link(ib / "device", dev)
        _link(sysfs / "class/infiniband" / name, ib)
        _port(ib, "4: ACTIVE", [("fe80::1", "IB/RoCE v1", netdev), (f"::ffff:{ip}", "RoCE v2", netdev)])
    _netdev(sysfs, "lo", None, 65536, kind=772, speed="")
    _netdev(sysfs, "veth0", None, 1500, speed="10000")
    rxe = sysfs / "devices/virtual/infiniband/rxe0"
    _write(rxe / "parent", "veth0")
    _port(rxe, "1: DOWN", [("::ffff:10.9.0.1", "RoCE v2", "veth0")])
    _link(sysfs / "class/infiniband/rxe0", rxe)
    return str(sysfs), str(proc)


def _discover(fake_host: tuple[str, str], visible: str = "") -> Topology:
    # "" is CUDA's "no GPU"; the tests that want GPUs say which
    return discover(*fake_host, addresses=ADDRESSES, cuda_visible_devices=visible or "0,1")


# ---------------------------------------------------------------- discovery
def test_discover_fake_host(fake_host):
    t = _discover(fake_host)
    assert [(n.id, n.cpus) for n in t.numa] == [(0, (0, 1, 2, 3, 8)), (1, (4, 5, 6, 7))]
    assert t.distance(0, 1) == 21 and t.distance(1, 1) == 10
    assert [n.name for n in t.nics if n.kind is RDMA] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"]
    assert [n.name for n in t.nics if n.kind is NETDEV] == ["ens1f0", "ens2f0", "ens3f0", "ens3f1", "lo", "veth0"]
    m1 = t.nic("mlx5_1")
    assert (m1.pci, m1.numa, m1.netdev, m1.addresses) == (NICS["mlx5_1"][1], 0, "ens2f0", ("10.0.1.1/24",))
    assert (m1.state, m1.mtu, m1.speed) == ("ACTIVE", 4096, 100000)      # RoCE MTU from the netdev's 9000
    port = m1.ports[0]
    assert (port.number, port.state, port.phys_state, port.link_layer) == (1, "ACTIVE", "LinkUp", "Ethernet")
    assert [(g.index, g.gid, g.type, g.netdev) for g in port.gids] == [
        (0, "fe80::1", "IB/RoCE v1", "ens2f0"), (1, "::ffff:10.0.1.1", "RoCE v2", "ens2f0")]
    assert t.nic("mlx5_3").numa == 1
    rxe = t.nic("rxe0")                   # virtual: no PCI path, lives where its netdev does
    assert (rxe.pci, rxe.netdev, rxe.numa, rxe.state, rxe.mtu) == (None, "veth0", -1, "DOWN", 1024)
    assert t.nic("ens3f1").pci == NICS["mlx5_3"][1] and t.nic("ens3f1").speed == 100000
    lo, veth = t.nic("lo"), t.nic("veth0")
    assert lo.loopback and lo.pci is None and lo.speed is None and not veth.loopback and veth.pci is None
    assert [(g.index, g.pci, g.numa, g.model) for g in t.gpus] == [
        (0, GPU0, 0, "NVIDIA H100 80GB HBM3"), (1, GPU1, 1, None)]      # the Intel VGA is not one
    assert t.locations() == ["cpu", "cpu:0", "cpu:1", "cuda:0", "cuda:1"]


def test_cuda_visible_devices_renumbers(fake_host):
    t = discover(*fake_host, addresses={}, cuda_visible_devices="1")
    assert [(g.index, g.pci) for g in t.gpus] == [(0, GPU1)]
    assert discover(*fake_host, addresses={}, cuda_visible_devices="").gpus == []
    assert len(discover(*fake_host, addresses={}, cuda_visible_devices="GPU-1234").gpus) == 2   # UUIDs: all


def test_discover_empty_tree(tmp_path):
    t = discover(str(tmp_path), str(tmp_path), addresses={}, cuda_visible_devices="")
    assert t.nics == [] and t.gpus == [] and [n.id for n in t.numa] == [0]
    assert t.preferred("cpu:0") == ([], [])


def test_discover_this_machine():
    t = discover()
    names = [n.name for n in t.nics]
    assert len(names) == len(set(names)) and t.numa and "cpu" in t.locations()
    for loc in t.locations():
        for kind in NicKind:
            p, f = t.preferred(loc, kind)
            assert not set(p) & set(f)
    Topology.from_wire(msgpack.unpackb(msgpack.packb(t.to_wire())))


# ---------------------------------------------------------------- preference
def test_preferred_by_numa_and_pci(fake_host):
    t = _discover(fake_host)
    # rxe0's node is unknown: after the local node's NICs, before the far node's
    assert t.preferred("cpu:0") == (["mlx5_0", "mlx5_1"], ["rxe0", "mlx5_2", "mlx5_3"])
    assert t.preferred("cpu:1", RDMA) == (["mlx5_2", "mlx5_3"], ["rxe0", "mlx5_0", "mlx5_1"])
    # cuda:0 shares a PCIe switch with mlx5_1 (and only the root with mlx5_0)
    assert t.preferred("cuda:0") == (["mlx5_1", "mlx5_0"], ["rxe0", "mlx5_2", "mlx5_3"])
    assert t.preferred("cuda:1") == (["mlx5_2", "mlx5_3"], ["rxe0", "mlx5_0", "mlx5_1"])
    assert t.preferred("cpu") == (["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"], [])
    assert t.preferred("cuda:9")[1] == []          # a GPU that is not there: no preference
    assert t.preferred("cpu:7") == t.preferred("cpu")      # nor a node
    # netdevs the same way; loopback never
    assert t.preferred("cpu:0", NETDEV) == (["ens1f0", "ens2f0"], ["veth0", "ens3f0", "ens3f1"])
    assert t.preferred("cuda:0", "netdev")[0] == ["ens2f0", "ens1f0"]


def test_preferred_nearest_node_when_none_local():
    nics = [Nic("b", RDMA, numa=2), Nic("a", RDMA, numa=1), Nic("mlx5_10", RDMA, numa=3), Nic("mlx5_2", RDMA, numa=3)]
    from kvflow.topology import NumaNode
    numa = [NumaNode(0, (0,), {0: 10, 1: 30, 2: 20, 3: 20}), NumaNode(1), NumaNode(2), NumaNode(3)]
    t = Topology(nics=nics, numa=numa)
    assert t.preferred("cpu:0") == (["b", "mlx5_2", "mlx5_10"], ["a"])    # natural order: 2 before 10


def test_bad_location():
    for bad in ["gpu0", "cuda", "cpu:x", "cpu:-1", "", "CPU:0", "cuda:12345", None]:
        with pytest.raises(InvalidArgumentError):
            Topology().preferred(bad)
        with pytest.raises(InvalidArgumentError):
            parse_location(bad)
    assert parse_location("cpu") == ("cpu", None) and parse_location("cuda:3") == ("cuda", 3)


# ---------------------------------------------------------------- JSON file
def test_json_override(fake_host, tmp_path, monkeypatch):
    base = _discover(fake_host)
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({"preferences": {"cpu:0": ["mlx5_1", "ens1f0"], "cuda:1": ["rxe0"]}}))
    t = Topology.load(str(path), base=base)
    assert t.source == str(path) and t.nics == base.nics
    assert t.preferred("cpu:0") == (["mlx5_1"], ["mlx5_0", "rxe0", "mlx5_2", "mlx5_3"])
    assert t.preferred("cpu:0", NETDEV)[0] == ["ens1f0"]
    assert t.preferred("cuda:1") == (["rxe0"], ["mlx5_2", "mlx5_3", "mlx5_0", "mlx5_1"])
    assert t.preferred("cpu:1") == base.preferred("cpu:1")            # not pinned: computed

    # the whole topology from a file: kvflow-info --json's "topology", edited
    doc = base.to_json()
    doc["nics"] = [n for n in doc["nics"] if n["name"] in ("mlx5_2", "mlx5_3")]
    doc["nics"][0]["numa"] = 0
    doc["preferences"] = {}
    path.write_text(json.dumps(doc))
    t = Topology.load(str(path), base=Topology())
    assert t.nic("mlx5_2").ports == base.nic("mlx5_2").ports and t.gpus == base.gpus and t.numa == base.numa
    assert t.preferred("cpu:0") == (["mlx5_2"], ["mlx5_3"])

    # KVFLOW_TOPOLOGY
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv(TOPOLOGY_ENV, str(path))
    assert host_topology(*fake_host).preferred("cpu:0") == (["mlx5_2"], ["mlx5_3"])


JSON_ERRORS = [
    ("{nope", "is not JSON"),
    ("[]", "top level: expected an object"),
    ('{"nic": []}', "unknown key(s) 'nic'"),
    ('{"nics": {}}', "nics: expected a list"),
    ('{"nics": [{"name": "x"}]}', "nics[0]: missing 'kind'"),
    ('{"nics": [{"name": "x", "kind": "eth"}]}', "nics[0].kind: expected 'rdma' or 'netdev'"),
    ('{"nics": [{"name": "x", "kind": "rdma", "numa": "0"}]}', "nics[0].numa: expected int"),
    ('{"nics": [{"name": "x", "kind": "rdma", "numa": true}]}', "nics[0].numa: expected int"),
    ('{"nics": [{"name": "x", "kind": "rdma"}, {"name": "x", "kind": "netdev"}]}', "listed twice"),
    ('{"nics": [{"name": "x", "kind": "netdev", "addresses": ["10.0.0.300/24"]}]}', "not an address"),
    ('{"nics": [{"name": "x", "kind": "rdma", "ports": [{"number": 1, "gids": [{"index": 0, "gid": "zz"}]}]}]}',
     "is not a GID"),
    ('{"numa": [{"cpus": [0]}]}', "numa[0]: missing 'id'"),
    ('{"preferences": {"cpu:0": ["mlx5_9"]}}', "no NIC named 'mlx5_9'"),
    ('{"preferences": {"gpu:0": ["mlx5_0"]}}', "preferences['gpu:0']"),
    ('{"preferences": ["mlx5_0"]}', "preferences: expected an object"),
]


def test_json_override_errors(fake_host, tmp_path):
    # one test, not one per case: each case takes microseconds, a test's
    # fixtures a tenth of a second
    base = _discover(fake_host)
    path = tmp_path / "bad.json"
    for text, expect in JSON_ERRORS:
        path.write_text(text)
        with pytest.raises(TopologyError) as info:
            Topology.load(str(path), base=base)
        assert expect in str(info.value) and str(path) in str(info.value), text
        assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, KVFlowError)


def test_json_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read topology file") as info:
        Topology.load(str(tmp_path / "absent.json"), base=Topology())
    assert info.value.errno is not None


# ---------------------------------------------------------------- wire form
def test_wire_round_trip(fake_host):
    t = _discover(fake_host)
    wire = t.to_wire()
    packed = msgpack.packb(wire, use_bin_type=True)
    assert len(packed) < 1024                                # it rides in every descriptor
    peer = Topology.from_wire(msgpack.unpackb(packed, raw=False))
    assert peer.source == "peer" and "lo" not in [n.name for n in peer.nics]
    for loc in t.locations():
        for kind in NicKind:
            assert peer.preferred(loc, kind) == t.preferred(loc, kind), (loc, kind)
    assert peer.to_wire() == wire and peer.locations() == t.locations()


def test_wire_carries_pins(fake_host, tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"preferences": {"cpu:1": ["mlx5_0"]}}')
    t = Topology.load(str(path), base=_discover(fake_host))
    assert Topology.from_wire(t.to_wire()).preferred("cpu:1") == (["mlx5_0"], ["mlx5_2", "mlx5_3", "rxe0", "mlx5_1"])


def _wire() -> dict:
    return {"v": 1, "nics": [["mlx5_0", "rdma", 0], ["eth0", "netdev", -1]],
            "pref": {"cpu:0": {"rdma": [[0], []], "netdev": [[], [1]]}}}


def _mutate(path, value):
    def f(w):
        d = w
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
        return w
    return f


WIRE_ERRORS = [
    lambda w: None,
    lambda w: [],
    lambda w: {k: v for k, v in w.items() if k != "pref"},
    _mutate(["v"], 2),
    _mutate(["nics"], {}),
    _mutate(["nics"], [["x", "rdma", 0]] * 2),                        # duplicate name
    _mutate(["nics"], [[f"n{i}", "rdma", 0] for i in range(65)]),      # too many
    _mutate(["nics", 0], ["mlx5_0", "rdma"]),
    _mutate(["nics", 0], ["mlx5_0", "verbs", 0]),
    _mutate(["nics", 0], ["", "rdma", 0]),
    _mutate(["nics", 0], ["x" * 65, "rdma", 0]),
    _mutate(["nics", 0], [b"mlx5_0", "rdma", 0]),
    _mutate(["nics", 0], ["mlx5_0", "rdma", True]),
    _mutate(["nics", 0], ["mlx5_0", "rdma", -2]),
    _mutate(["pref"], []),
    _mutate(["pref", "gpu:0"], {}),
    _mutate(["pref", "cpu:0"], [[0], []]),
    _mutate(["pref", "cpu:0", "rdma"], [[2], []]),                    # out of range
    _mutate(["pref", "cpu:0", "rdma"], [[1], []]),                    # a netdev listed as rdma
    _mutate(["pref", "cpu:0", "rdma"], [[0], [0]]),                   # twice
    _mutate(["pref", "cpu:0", "rdma"], [[True], []]),
    _mutate(["pref", "cpu:0", "rdma"], [[0]]),
    _mutate(["pref", "cpu:0", "tcp"], [[0], []]),
    _mutate(["pref"], {f"cpu:{i}": {} for i in range(257)}),
]


def test_wire_rejects_malformed():
    assert Topology.from_wire(_wire()).preferred("cpu:0") == (["mlx5_0"], [])
    for i, mutate in enumerate(WIRE_ERRORS):
        with pytest.raises(ProtocolError, match="malformed topology"):
            Topology.from_wire(mutate(_wire()))
            pytest.fail(f"case {i} accepted")


# ---------------------------------------------------------------- rails
def test_match_rails():
    assert match_rails(["a0", "a1"], ["b0", "b1"]) == [("a0", "b0"), ("a1", "b1")]
    assert match_rails(["a0"], ["b0", "b1", "b2"]) == [("a0", "b0"), ("a0", "b1"), ("a0", "b2")]
    assert match_rails(["a0", "a1", "a2", "a3"], ["b0", "b1"]) == [
        ("a0", "b0"), ("a1", "b1"), ("a2", "b0"), ("a3", "b1")]
    assert match_rails(["b0", "b1"], ["a0", "a1", "a2", "a3"]) == [
        (b, a) for a, b in match_rails(["a0", "a1", "a2", "a3"], ["b0", "b1"])]     # both ends agree
    assert match_rails([], ["b0"]) == [] and match_rails(["a0"], []) == []
    with pytest.raises(InvalidArgumentError):
        match_rails(["a0", "a0"], ["b0"])


def test_tcp_rails_from_topology(fake_host):
    t = _discover(fake_host)
    # the location's netdevs (PCI ones: this host has them, so not veth0),
    # one IPv4 address each, in preference order; loopback never
    assert t.tcp_rails("cpu:0") == [("ens1f0", "10.0.0.1/24"), ("ens2f0", "10.0.1.1/24")]
    assert t.tcp_rails("cuda:0") == [("ens2f0", "10.0.1.1/24"), ("ens1f0", "10.0.0.1/24")]
    assert t.tcp_rails("cpu:1") == [("ens3f0", "10.0.2.1/24"), ("ens3f1", "10.0.3.1/24")]
    # the control address's link is left out...
    assert t.tcp_rails("cpu:0", exclude=["10.0.0.1"]) == [("ens2f0", "10.0.1.1/24")]
    # ...down to the fallback NICs where the preferred ones are all excluded
    assert t.tcp_rails("cpu:0", exclude=["10.0.0.1", "10.0.1.1"]) == [("ens3f0", "10.0.2.1/24"),
                                                                      ("ens3f1", "10.0.3.1/24")]
    assert t.interface_of("10.0.1.1") == ("ens2f0", "10.0.1.1/24") and t.interface_of("10.0.1.9") is None
    # a host of virtual links only (a namespace): they count; link-local,
    # IPv6-only and loopback addresses do not; the control link only when
    # nothing else is left
    v = Topology(nics=[Nic("lo", NETDEV, loopback=True, addresses=("127.0.0.1/8",)),
                       Nic("ctl", NETDEV, addresses=("198.19.20.2/24",)),
                       Nic("rail0", NETDEV, addresses=("fe80::1/64", "198.19.21.2/24", "198.19.21.9/24")),
                       Nic("rail1", NETDEV, addresses=("198.19.22.2/24",)),
                       Nic("ll", NETDEV, addresses=("169.254.3.3/16", "fd00::3/64"))])
    assert v.tcp_rails("cpu", exclude=["198.19.20.2"]) == [("rail0", "198.19.21.2/24"), ("rail1", "198.19.22.2/24")]
    assert Topology(nics=v.nics[:2]).tcp_rails("cpu", exclude=["198.19.20.2"]) == [("ctl", "198.19.20.2/24")]
    assert Topology(nics=[v.nics[0], v.nics[4]]).tcp_rails("cpu") == []


def test_rail_order_by_published_preference(fake_host):
    t = _discover(fake_host)
    peer = Topology.from_wire(msgpack.unpackb(msgpack.packb(t.to_wire())))
    nics = ["ens3f0", "ens1f0", "", "ens2f0"]         # "": a rail whose NIC is not known
    assert rail_order(nics, peer, "cpu:0") == [1, 3, 0, 2]
    assert rail_order(nics, peer, "cuda:0") == [3, 1, 0, 2]
    assert rail_order(nics, None, "cpu:0") == rail_order(nics, peer, None) == [0, 1, 2, 3]


def test_pair_tcp_rails():
    two = ["10.0.0.1/24", "10.0.1.1/24"]
    assert pair_tcp_rails(two, ["10.0.0.2", "10.0.1.2"]) == [(0, 0), (1, 1)]
    # the peer ordered its NICs the other way: each still on its subnet
    assert pair_tcp_rails(two, ["10.0.1.2", "10.0.0.2"]) == [(1, 0), (0, 1)]
    # more local rails than remote ones: each local rail carries a pair
    four = two + ["10.0.0.3/24", "10.0.1.3/24"]
    assert pair_tcp_rails(four, ["10.0.0.2", "10.0.1.2"]) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    # two local rails, one remote one on the first's subnet: one pair, not
    # the same endpoint twice from the same source
    assert pair_tcp_rails(two, ["10.0.0.2"]) == [(0, 0)]
    # one local rail, two remote subnets, the second reached by another
    # interface of this host: the kernel chooses that connection's source
    assert pair_tcp_rails(two[:1], ["10.0.0.2", "192.168.5.2"], ["192.168.5.1/24"]) == [(0, 0), (None, 1)]
    assert pair_tcp_rails(["10.0.0.1"], ["10.0.0.2"], ["10.0.0.1/24"]) == [(None, 0)]   # prefix unknown
    # an address of this very host: over loopback, no rail to pick
    assert pair_tcp_rails(two, ["10.0.0.1", "10.0.1.2"], two) == [(None, 0), (1, 1)]
    # routed rails (no local subnet holds the peer's): without a route
    # probe nothing is bound (the kernel's route decides the egress link)
    assert pair_tcp_rails(two, ["10.7.0.2", "10.7.1.2"]) == [(None, 0), (None, 1)]
    nics = ["eth0", "eth1"]
    # ...each pair keeps its rail where the route to the peer leaves by it
    by_subnet = {"10.7.0.2": "eth0", "10.7.1.2": "eth1"}
    assert pair_tcp_rails(two, ["10.7.0.2", "10.7.1.2"], nics=nics, route=by_subnet.get) == [(0, 0), (1, 1)]
    # ...and only there: a peer on an unrelated subnet, routed via rail 0
    # only, is not reached from rail 1's address (its replies would come
    # back by rail 1's NIC, and strict rp_filter drops them)
    asked: list[str] = []

    def via_eth0(ip: str) -> str:
        asked.append(ip)
        return "eth0"
    assert pair_tcp_rails(two, ["172.16.9.2"], two, nics=nics, route=via_eth0) == [(0, 0), (None, 0)]
    assert asked == ["172.16.9.2"]                                              # probed once per address
    assert pair_tcp_rails(two, ["10.7.0.2"], nics=nics, route=lambda ip: None) == [(None, 0)]   # no route
    assert pair_tcp_rails(two, ["fd00::2"], nics=nics, route=lambda ip: "eth0") == [(None, 0)]  # nor across families
    assert pair_tcp_rails([], ["10.0.0.2"]) == [] and pair_tcp_rails(two, []) == []
    assert on_subnet("10.0.0.9", "10.0.0.1/24") and not on_subnet("10.0.0.9", "10.0.0.1")
    assert not on_subnet("fd00::1", "10.0.0.1/24") and not on_subnet("10.0.0.9", "junk/24")


def _descriptor(data: list[tuple[str, int]], rail_nics: list[str] | None) -> Descriptor:
    return Descriptor(address="peer:1", incarnation=1, host="peer", pid=1, process=b"", probe_addr=0,
                      probe_cookie=b"", data=data, regions=[], generation=0, rail_nics=rail_nics)


def test_rail_plan_binds_each_group_to_its_rail():
    """The tcp provider's RailPlan on a topology made for the test (two PCI
    rails on 198.18.0/24 and 198.18.1/24): which local rail each group of
    data connections is bound to."""
    t = Topology(nics=[Nic("lo", NETDEV, loopback=True, addresses=("127.0.0.1/8",)),
                       Nic("rail0", NETDEV, pci="pci0000:00/0000:00:02.0", addresses=("198.18.0.1/24",)),
                       Nic("rail1", NETDEV, pci="pci0000:00/0000:00:03.0", addresses=("198.18.1.1/24",))])
    eng = kvflow.Engine(protocols=("tcp",), rails=iter(["198.18.0.1", "198.18.1.1"]))    # any iterable, once
    plan = RailPlan(eng._tcp_options.rails)
    plan.use_topology(t)
    assert plan.nics == ["rail0", "rail1"] and plan.ifaces == ["198.18.0.1/24", "198.18.1.1/24"]
    # the peer lists its rails the other way round: each still bound on its subnet
    peer = _descriptor([("198.18.1.2", 7001), ("198.18.0.2", 7000)], ["p1", "p0"])
    assert plan.plan(peer) == [("198.18.1.1", "198.18.1.2", 7001), ("198.18.0.1", "198.18.0.2", 7000)]
    # one peer rail: one group, not two on the same endpoint
    assert plan.plan(_descriptor([("198.18.0.2", 7000)], ["p0"])) == [("198.18.0.1", "198.18.0.2", 7000)]
    # a peer on this host (its endpoint an address of ours): the kernel's choice
    assert plan.plan(_descriptor([("198.18.1.1", 7002)], ["rail1"])) == [(None, "198.18.1.1", 7002)]
    # a peer without rails, or one on a routed subnet whose route leaves by
    # neither rail's netdev (this machine's real route: not rail0 or rail1)
    assert plan.plan(_descriptor([("198.18.9.2", 7000)], None)) == [(None, "198.18.9.2", 7000)]
    assert plan.plan(_descriptor([("203.0.113.7", 7000)], ["p0"])) == [(None, "203.0.113.7", 7000)]


async def test_auto_rails_leave_the_control_links_out():
    assert set(await control_addresses("localhost", "127.0.0.2")) >= {"127.0.0.1", "127.0.0.2"}
    assert await control_addresses("127.0.0.3", "127.0.0.2") == ["127.0.0.3", "127.0.0.2"]
    # a wildcard listen: only what is advertised
    assert await control_addresses("0.0.0.0", "127.0.0.2") == ["127.0.0.2"]
    assert await control_addresses("0.0.0.0", None) == []
    assert await control_addresses("::", None) == []
    assert kvflow.Engine(protocols=("tcp",), rails=iter(["auto"]))._tcp_options.auto    # any iterable, once


def test_bind_source_reserves_no_port():
    with socket.socket() as server, socket.socket() as s:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        bind_source(s, "127.0.0.1")
        assert s.getsockname() == ("127.0.0.1", 0)          # the port waits for connect()
        s.connect(server.getsockname())
        assert s.getsockname()[0] == "127.0.0.1" and s.getsockname()[1] != 0


def test_bond_and_vlan_live_where_their_nic_is(fake_host):
    sysfs = Path(fake_host[0])
    _netdev(sysfs, "bond0", None, 9000)
    _netdev(sysfs, "bond0.7", None, 9000)
    bond, vlan = (sysfs / "class/net/bond0").resolve(), (sysfs / "class/net/bond0.7").resolve()
    _link(bond / "lower_ens3f0", (sysfs / "class/net/ens3f0").resolve())
    _link(vlan / "lower_bond0", bond)
    t = discover(*fake_host, addresses={"bond0.7": ["10.0.7.1/24"], "veth0": ["10.9.0.1/24"]},
                 cuda_visible_devices="")
    for name in ("bond0", "bond0.7"):
        assert (t.nic(name).pci, t.nic(name).numa) == (NICS["mlx5_2"][1], 1), t.nic(name)
    assert t.nic("veth0").pci is None
    # physical, so the rail (veth0, virtual, is not where a physical one has an address)
    assert t.tcp_rails("cpu:1") == [("bond0.7", "10.0.7.1/24")]
    assert t.tcp_rails("cpu:0") == [("bond0.7", "10.0.7.1/24")]      # its fallback


async def test_engine_rails_published_and_auto():
    with pytest.raises(InvalidArgumentError, match="auto"):
        kvflow.Engine(rails="eth0")
    async with kvflow.Engine(protocols=("tcp",)) as plain, \
            kvflow.Engine(protocols=("tcp",), rails=["127.0.0.1"]) as given, \
            kvflow.Engine(protocols=("tcp",), rails="auto") as auto:
        assert plain.descriptor().rail_nics is None            # no rails: nothing to pair with
        assert given.descriptor().rail_nics == ["lo"]
        d = auto.descriptor()
        if not auto.topology.tcp_rails("cpu", exclude=["127.0.0.1"]):       # a host with only loopback
            assert d.rail_nics is None and d.data[0][0] == "127.0.0.1"
            return
        assert len(d.rail_nics) == len(d.data) >= 1
        for (host, _), nic in zip(d.data, d.rail_nics):
            assert ipaddress.ip_address(host).version == 4 and (not nic or auto.topology.interface_of(host))
        wire = msgpack.unpackb(msgpack.packb(d.to_wire()))
        assert Descriptor.from_wire(wire).rail_nics == d.rail_nics
        for bad in (["x"] * (len(d.data) + 1), "eth0", [7] * len(d.data)):
            with pytest.raises(ProtocolError, match="rail_nics"):
                Descriptor.from_wire({**wire, "rail_nics": bad})
        # auto rails to a peer whose one rail is on loopback (this host's
        # own address): no rail to bind to, the kernel picks the source;
        # data moves (binding on made-up topologies: test_rail_plan_*)
        a = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[:1 << 20]
        b = np.zeros(1 << 20, np.uint8)
        src, dst = auto.register(a), given.register(b)
        peer = await auto.connect(given.address)
        await peer.write([src.addr], [dst.addr], [1 << 20])
        assert np.array_equal(a, b)
        conns = peer.connections()
        assert conns and all(c["source"] is None and c["local"] == "127.0.0.1" for c in conns), conns


def test_rdma_rails_follow_both_ends_published_preferences(fake_host):
    """The rdma provider pairs the initiator's devices for its memory with
    the devices the peer published for its memory (kvflow.providers.rdma.provider._pairs)."""
    from kvflow.providers.rdma.provider import _ordered, _pairs
    t = _discover(fake_host)
    peer = Topology.from_wire(msgpack.unpackb(msgpack.packb(t.to_wire())))   # as a descriptor carries it
    local = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    remote = ["mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0"]          # another order of opening
    mine = _ordered(local, t, "cuda:0")
    theirs = _ordered(remote, peer, "cpu:1")
    assert mine == ["mlx5_1", "mlx5_0"] and theirs == ["mlx5_2", "mlx5_3"]
    assert _pairs(local, mine, remote, theirs) == [(1, 1), (0, 0)]   # mlx5_1-mlx5_2, mlx5_0-mlx5_3
    assert _ordered(local, None, "cpu:0") == local                  # a peer that published nothing
    assert _ordered(["rxe9"], t, "cpu:0") == ["rxe9"]               # devices the topology does not know


async def test_engine_publishes_topology_and_location():
    async with kvflow.Engine(protocols=("tcp",), location="cpu:0") as a, kvflow.Engine(protocols=("tcp",)) as b:
        peer = await a.connect(b.address)
        assert peer.descriptor.location == "cpu" and isinstance(peer.descriptor.topology, Topology)
        assert b.descriptor().location == "cpu"
        back = await b.connect(a.address)
        assert back.descriptor.location == "cpu:0"
    with pytest.raises(InvalidArgumentError):
        kvflow.Engine(location="gpu:0")


# ---------------------------------------------------------------- rdma checks
def _rdma_topology(state: str = "ACTIVE", mtu: int = 1024) -> Topology:
    port = RdmaPort(1, state, "LinkUp", "Ethernet", mtu, None, (Gid(1, "::ffff:10.9.0.1", "RoCE v2", "veth0"),))
    return Topology(nics=[Nic("rxe0", RDMA, netdev="veth0", addresses=("10.9.0.1/24",), ports=(port,)),
                          Nic("veth0", NETDEV, addresses=("10.9.0.1/24",))])


def _remote(ip: str, mtu: int = 5, link: int = 2) -> dict:
    return {"devices": [{"name": "mlx5_0", "gid": ipaddress.IPv6Address(f"::ffff:{ip}").packed, "lid": 0,
                         "mtu": mtu, "link": link, "port": 1}], "probe": [1, [1], b"x"]}


def test_rdma_checks_subnet_and_mtu():
    report = PeerReport("x:1", transport="tcp")
    check_rdma(report, _remote("10.9.0.2"), _rdma_topology(), transport="tcp")
    text = [(c.level, c.message) for c in report.checks]
    assert (Level.OK, "rdma: the peer's mlx5_0 GID 10.9.0.2 shares a subnet with rxe0 port 1 (veth0)") in text
    mtu = next(c for c in report.checks if "MTU differs" in c.message)
    assert mtu.level is Level.WARN and "4096 B" in mtu.message and "1024 B" in mtu.message and "mtu" in mtu.fix
    assert any("rails for cpu memory: rxe0<->mlx5_0" in m for _, m in text)
    assert report.reachable


def test_rdma_checks_port_down_and_no_subnet():
    report = PeerReport("x:1", transport="tcp")
    check_rdma(report, _remote("198.51.100.9", mtu=3), _rdma_topology("DOWN"), required=True)
    down = next(c for c in report.checks if "port 1 of rxe0" in c.message)
    assert down.level is Level.FAIL and down.message == "rdma: port 1 of rxe0 is DOWN"
    assert "ip link set veth0 up" in down.fix
    assert not report.reachable
    # with its port up, the GID is in no local subnet: a route or an address is the fix
    report = PeerReport("x:1", transport="tcp")
    check_rdma(report, _remote("198.51.100.9", mtu=3), _rdma_topology())
    gid = next(c for c in report.checks if "198.51.100.9" in c.message)
    assert gid.level is Level.WARN and "add an address in that subnet" in gid.fix
    assert report.reachable                        # rdma not required: tcp still works


def test_rdma_checks_link_layer_and_no_device():
    report = PeerReport("x:1", transport="tcp")
    check_rdma(report, _remote("10.9.0.2", link=1), _rdma_topology(), required=True)
    assert any(c.level is Level.FAIL and "InfiniBand" in c.message for c in report.checks)
    report = PeerReport("x:1", transport="tcp")
    check_rdma(report, _remote("10.9.0.2"), Topology(), required=True)
    missing = next(c for c in report.checks if "no RDMA device" in c.message)
    assert missing.level is Level.FAIL and "rdma link add" in missing.fix


def test_route_to_loopback():
    r = route_to("127.0.0.1", discover())
    assert r.error is None and r.source == "127.0.0.1" and r.netdev == "lo" and r.on_link


# ---------------------------------------------------------------- kvflow-info
def _info_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (TOPOLOGY_ENV, "KVFLOW_SECRET")}
    return env | extra


async def _info(*args: str, **env: str) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvflow.cli.info", *args, env=_info_env(**env),
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode, out.decode(), err.decode()


def test_console_script_declared():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["kvflow-info"] == "kvflow.cli.info:main"


async def test_info_prints_and_parses():
    rc, out, err = await _info()
    assert rc == 0, err
    for heading in ("features: tcp yes", "NUMA nodes", "RDMA devices", "Netdevs", "GPUs",
                    "NIC preference per memory location"):
        assert heading in out
    rc, out, err = await _info("--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["features"] == dict(kvflow.features) and doc["version"] == kvflow.__version__
    assert "cpu" in doc["preferences"] and {"nics", "numa", "gpus", "preferences"} <= set(doc["topology"])


def test_info_topology_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "t.json"
    doc = kvflow.cli.info.local_report(discover())["topology"]
    doc["preferences"] = {"cpu": [n["name"] for n in doc["nics"] if not n["loopback"]][:1]}
    path.write_text(json.dumps(doc))
    monkeypatch.setenv(TOPOLOGY_ENV, str(path))
    assert kvflow.cli.info.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == str(path) and out["topology"]["preferences"] == doc["preferences"]
    path.write_text('{"nics": [{"name": "x", "kind": "eth"}]}')
    assert kvflow.cli.info.main([]) == 2
    assert "nics[0].kind" in capsys.readouterr().err
    assert kvflow.cli.info.main(["--peer", "no-port-here"]) == 2


async def test_info_peer_live_engine():
    async with kvflow.Engine(secret="s3") as engine:
        engine.register(bytearray(1 << 16), name="kv")
        rc, out, err = await _info("--peer", engine.address, "--secret", "s3")
        assert rc == 0, out + err
        assert f"tcp: handshake port {engine.address} reachable" in out
        assert "tcp: data endpoint" in out and "1 region(s)" in out and "reachable (transport" in out
        rc, out, err = await _info("--peer", engine.address, "--protocol", "tcp", "--json", KVFLOW_SECRET="s3")
        assert rc == 0, out + err
        doc = json.loads(out)
        assert doc["reachable"] and doc["transport"] == "tcp" and doc["descriptor"]["regions"] == 1
        assert all(c["level"] != "FAIL" for c in doc["checks"])


async def test_info_peer_wrong_secret():
    async with kvflow.Engine(secret="right") as engine:
        rc, out, _ = await _info("--peer", engine.address, KVFLOW_SECRET="wrong")
        assert rc == 1 and "secret mismatch" in out and "--secret" in out


async def test_info_peer_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # closed again before the check runs
    rc, out, err = await _info("--peer", f"127.0.0.1:{port}")
    assert rc == 1, out + err
    assert f"nothing listens on 127.0.0.1:{port}" in out and "fix: start the engine" in out
    assert "NOT reachable" in out
