"""The descriptor: what an engine tells its peers about itself (its
segment), and how each part of it is checked when it comes off the wire."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow._core import MAX_DEVS
from kvflow.control.wire import field
from kvflow.errors import InvalidArgumentError, ProtocolError
from kvflow.memory import CUDA, Access, RemoteRegion
from kvflow.topology import Topology, parse_location

__all__ = ["Descriptor", "rdma_from_wire", "regions_from_wire", "regions_to_wire", "relay_from_wire"]


@dataclass
class Descriptor:
    """What an engine tells its peers about itself (its "segment")."""

    address: str
    incarnation: int
    host: str
    pid: int
    process: bytes
    probe_addr: int
    probe_cookie: bytes
    data: list[tuple[str, int]]
    regions: list[RemoteRegion]
    generation: int
    rdma: dict[str, Any] | None = None     # devices and probe, when the engine has rdma
    topology: Topology | None = None       # its NICs and their order per memory location
    location: str | None = None            # where its registered memory lives ("cpu:0", "cuda:1")
    rail_nics: list[str] | None = None     # the NIC of each data endpoint ("" unknown); None: no rails
    relay: dict[str, Any] | None = None    # its relay group, rank and rail (kvflow.paths.relay)

    def to_wire(self) -> dict[str, Any]:
        return {
            "address": self.address, "incarnation": self.incarnation, "host": self.host,
            "pid": self.pid, "process": self.process, "probe": [self.probe_addr, self.probe_cookie],
            "data": [list(d) for d in self.data], "generation": self.generation,
            "regions": regions_to_wire(self.regions), "rdma": self.rdma,
            "topology": self.topology.to_wire() if self.topology is not None else None,
            "location": self.location, "rail_nics": self.rail_nics, "relay": self.relay,
        }

    @classmethod
    def from_wire(cls, d: Any) -> "Descriptor":
        if not isinstance(d, dict):
            raise ProtocolError("descriptor is not a map")
        probe = field(d, "probe", list)
        data = field(d, "data", list)
        try:
            probe_addr, cookie = probe
            endpoints = [(h, p) for h, p in data]
            if not (isinstance(probe_addr, int) and 0 < probe_addr < 1 << 64 and isinstance(cookie, bytes)
                    and len(cookie) <= 64):
                raise ValueError
            if not all(isinstance(h, str) and isinstance(p, int) and 0 < p < 65536 for h, p in endpoints):
                raise ValueError
        except (TypeError, ValueError):
            raise ProtocolError("descriptor: malformed probe or data endpoints") from None
        return cls(
            address=field(d, "address", str), incarnation=field(d, "incarnation", int),
            host=field(d, "host", str), pid=field(d, "pid", int), process=field(d, "process", bytes),
            probe_addr=probe_addr, probe_cookie=cookie, data=endpoints,
            regions=regions_from_wire(field(d, "regions", list)),
            generation=field(d, "generation", int), rdma=rdma_from_wire(d.get("rdma")),
            topology=Topology.from_wire(d["topology"]) if d.get("topology") is not None else None,
            location=_location_from_wire(d.get("location")),
            rail_nics=_rail_nics_from_wire(d.get("rail_nics"), len(endpoints)),
            relay=relay_from_wire(d.get("relay")),
        )


def _rail_nics_from_wire(v: Any, endpoints: int) -> list[str] | None:
    """One NIC name (at most 64 characters, "" unknown) per data endpoint."""
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == endpoints
            and all(isinstance(n, str) and len(n) <= 64 for n in v)):
        raise ProtocolError("descriptor: malformed rail_nics (one NIC name per data endpoint)")
    return list(v)


def relay_from_wire(v: Any) -> dict[str, Any] | None:
    """A descriptor's relay part: {"group": name, "rank": n, "rail": n,
    "members": [[rail, address], ...]} (members: optional, at most 256)."""
    if v is None:
        return None
    if not (isinstance(v, dict) and isinstance(v.get("group"), str) and 0 < len(v["group"]) <= 128
            and all(_small(v.get(k)) for k in ("rank", "rail"))):
        raise ProtocolError("descriptor: malformed relay part")
    members = v.get("members", [])
    if not (isinstance(members, list) and len(members) <= 256 and all(
            isinstance(m, list) and len(m) == 2 and _small(m[0]) and isinstance(m[1], str) and 0 < len(m[1]) <= 256
            for m in members)):
        raise ProtocolError("descriptor: malformed relay members")
    return {"group": v["group"], "rank": v["rank"], "rail": v["rail"], "members": [(m[0], m[1]) for m in members]}


def _small(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16


def _location_from_wire(v: Any) -> str | None:
    if v is None:
        return None
    try:
        if not isinstance(v, str):
            raise InvalidArgumentError("not a string")
        parse_location(v)
    except InvalidArgumentError:
        raise ProtocolError("descriptor: malformed memory location") from None
    return v


def rdma_from_wire(v: Any) -> dict[str, Any] | None:
    """The rdma part of a descriptor: {"devices": [{name, gid, lid, mtu,
    link, port}], "probe": [addr, [rkey per device], cookie]}, checked."""
    if v is None:
        return None
    try:
        devices = v["devices"]
        addr, rkeys, cookie = v["probe"]
        ok = (isinstance(devices, list) and 0 < len(devices) <= MAX_DEVS and isinstance(addr, int)
              and 0 < addr < 1 << 64 and isinstance(rkeys, list) and len(rkeys) == len(devices)
              and all(isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys)
              and isinstance(cookie, bytes) and 0 < len(cookie) <= 64)
        for d in devices:
            ok = ok and (isinstance(d.get("name"), str) and isinstance(d.get("gid"), bytes)
                         and len(d["gid"]) == 16 and isinstance(d.get("lid"), int)
                         and isinstance(d.get("mtu"), int) and 1 <= d["mtu"] <= 5
                         and isinstance(d.get("up", True), bool))
        if not ok:
            raise ValueError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ProtocolError("descriptor: malformed rdma section") from None
    return {"devices": devices, "probe": [addr, rkeys, cookie]}


IPC_HANDLE_BYTES = 64          # a CUipcMemHandle (kvflow._cuda.driver)


def regions_to_wire(regions: list[RemoteRegion]) -> list[list[Any]]:
    # host regions: [addr, length, access, name, rkeys]; GPU memory adds its device
    # (and, where it has one, its CUDA IPC handle, offset in that allocation and GPU UUID)
    return [[r.addr, r.length, int(r.access), r.name, list(r.rkeys)] +
            ([r.device] + (list(r.ipc) if r.ipc else []) if r.kind == CUDA else []) for r in regions]


def regions_from_wire(v: Any) -> list[RemoteRegion]:
    out = []
    try:
        for item in v:
            addr, length, access, name, *rest = item
            rkeys = rest[0] if rest else []
            device = rest[1] if len(rest) > 1 else None
            if device is not None and not (isinstance(device, int) and 0 <= device < 1 << 16):
                raise ValueError
            ipc = None
            if len(rest) > 2:
                if len(rest) != 5 or not isinstance(rest[2], bytes) or len(rest[2]) != IPC_HANDLE_BYTES or \
                        not isinstance(rest[3], int) or not 0 <= rest[3] < 1 << 48 or \
                        not isinstance(rest[4], bytes) or len(rest[4]) != 16:
                    raise ValueError
                ipc = (rest[2], rest[3], rest[4])
            if len(rest) > 5 or not isinstance(rkeys, list) or len(rkeys) > MAX_DEVS or not all(
                    isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys):
                raise ValueError
            if not (isinstance(addr, int) and isinstance(length, int) and isinstance(access, int)):
                raise TypeError
            if not (0 < addr < 1 << 64 and 0 < length < 1 << 64 and addr + length <= 1 << 64):
                raise ValueError
            if name is not None and not isinstance(name, str):
                raise TypeError
            out.append(RemoteRegion(addr, length, name, Access(access & 3), tuple(rkeys),
                                    *((CUDA, device, ipc) if device is not None else ())))
    except (TypeError, ValueError):
        raise ProtocolError("descriptor: malformed region list") from None
    return out
