"""The descriptor: what an engine tells its peers about itself (its
segment), and how each part of it is checked when it comes off the wire."""
from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from typing import Any, Callable, Mapping

from kvflow._core import MAX_DEVS
from kvflow.control.wire import field
from kvflow.errors import InvalidArgumentError, ProtocolError
from kvflow.memory import CUDA, Access, RemoteRegion
from kvflow.topology import Topology, parse_location

__all__ = ["Descriptor", "parts_from_wire", "register_part", "regions_from_wire", "regions_to_wire",
           "relay_from_wire"]


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
    topology: Topology | None = None       # its NICs and their order per memory location
    location: str | None = None            # where its registered memory lives ("cpu:0", "cuda:1")
    rail_nics: list[str] | None = None     # the NIC of each data endpoint ("" unknown); None: no rails
    relay: dict[str, Any] | None = None    # its relay group, rank and rail (kvflow.paths.relay)
    # each provider's own part, by provider name: checked by the decoder its
    # package registered (register_part), carried under that name on the wire
    providers: dict[str, Any] = dataclass_field(default_factory=dict)

    @property
    def rdma(self) -> dict[str, Any] | None:
        """The rdma provider's part (devices and probe), when the engine has rdma."""
        return self.providers.get("rdma")

    def to_wire(self) -> dict[str, Any]:
        return {
            "address": self.address, "incarnation": self.incarnation, "host": self.host,
            "pid": self.pid, "process": self.process, "probe": [self.probe_addr, self.probe_cookie],
            "data": [list(d) for d in self.data], "generation": self.generation,
            "regions": regions_to_wire(self.regions),
            "topology": self.topology.to_wire() if self.topology is not None else None,
            "location": self.location, "rail_nics": self.rail_nics, "relay": self.relay,
            **self.providers,
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
            generation=field(d, "generation", int), providers=parts_from_wire(d),
            topology=Topology.from_wire(d["topology"]) if d.get("topology") is not None else None,
            location=_location_from_wire(d.get("location")),
            rail_nics=_rail_nics_from_wire(d.get("rail_nics"), len(endpoints)),
            relay=relay_from_wire(d.get("relay")),
        )


# A provider's own part: the decoder that checks it (raising ProtocolError),
# by the provider's name, which is also the part's key on the wire
_PARTS: dict[str, Callable[[Any], Any]] = {}
_FIELDS = frozenset(("t", "address", "incarnation", "host", "pid", "process", "probe", "data", "generation",
                     "regions", "topology", "location", "rail_nics", "relay"))


def register_part(name: str, decode: Callable[[Any], Any]) -> None:
    """Provider `name` owns the descriptor's part under `name`: `decode`
    checks a received one and returns what Descriptor.providers[name]
    holds (None: absent). Called by the provider's package when imported;
    a part that no imported provider registered is left out (nothing here
    could read it)."""
    if name in _FIELDS:
        raise ValueError(f"descriptor part {name!r} would shadow a field of the descriptor")
    _PARTS[name] = decode


def parts_from_wire(d: Mapping[str, Any]) -> dict[str, Any]:
    """The providers' parts found in a descriptor or a "regions" push,
    each checked by its provider's decoder."""
    out = {}
    for name, decode in _PARTS.items():
        part = decode(d.get(name))
        if part is not None:
            out[name] = part
    return out


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
