"""Topology files: the JSON document that overrides what discovery found
(Topology.load, KVFLOW_TOPOLOGY), checked against its schema."""
from __future__ import annotations

import ipaddress
from typing import Any

from kvflow.errors import InvalidArgumentError, TopologyError
from kvflow.topology.model import (MAX_NAME, Gid, Gpu, Nic, NicKind, NumaNode, RdmaPort, Topology,
                                   _natural, gid_text, parse_location)

__all__ = ["from_document"]

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


def from_document(doc: Any, base: Topology, path: str) -> Topology:
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
