"""The handshake/control protocol: msgpack frames over asyncio streams.

Frame: a 4-byte big-endian length, then a msgpack map with "v" (protocol
version) and "t" (message type). Lengths above the limit, undecodable bodies,
non-map bodies and unknown versions raise ProtocolError before anything else
is looked at, so a garbage client costs one short read and a closed socket.

Authentication (when the engines share a secret) is a mutual
challenge-response with HMAC-SHA256 over both nonces: the secret never
crosses the wire, and each side proves itself before the other hands out a
session token or a descriptor.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from kvflow.errors import AuthenticationError, InvalidArgumentError, ProtocolError
from kvflow.memory import Access, RemoteRegion
from kvflow.topology import Topology, parse_location

VERSION = 1
MAX_FRAME = 8 << 20          # a descriptor with ~200k regions still fits
NONCE_BYTES = 32
_LEN = struct.Struct(">I")

# Data-connection hello (kvflow/_native/wire.h): magic, type, status (= data
# connection index), tag (= role), addr, len (= wire version), aux.
DATA_HEADER = struct.Struct("<HBBIQQQ")
DATA_MAGIC = 0x464B
DATA_HELLO, DATA_HELLO_ACK = 1, 2
DATA_ROLE_DATA, DATA_ROLE_ACK = 0, 1
DATA_WIRE_VERSION = 1


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb({"v": VERSION, **msg}, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, *, max_size: int = MAX_FRAME,
                       idle_timeout: float | None = None) -> dict[str, Any]:
    """Reads one frame. Raises ProtocolError for malformed input and
    asyncio.IncompleteReadError / ConnectionError when the stream ends;
    asyncio.TimeoutError when no frame starts within idle_timeout (only the
    wait for the length prefix is bounded: readexactly consumes nothing
    until it has all its bytes, so a timeout never splits a frame)."""
    if idle_timeout is None:
        head = await reader.readexactly(_LEN.size)
    else:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), idle_timeout)
    (n,) = _LEN.unpack(head)
    if n > max_size:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_size}")
    body = await reader.readexactly(n)
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("frame is not a kvflow message")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {clip(msg.get('v'))} (this side speaks {VERSION})")
    return msg


def clip(value: Any, limit: int = 64) -> str:
    """repr(value), cut to `limit` characters: a peer's junk quoted in an
    error reply or a log line must not be as big as the junk."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """msg[name], checked to be of `kind`; ProtocolError otherwise."""
    v = msg.get(name)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ProtocolError(f"message {msg.get('t')!r}: field {name!r} missing or malformed")
    return v


def proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def check_proof(secret: bytes, label: bytes, first: bytes, second: bytes, got: Any) -> None:
    if not isinstance(got, bytes) or not hmac.compare_digest(proof(secret, label, first, second), got):
        raise AuthenticationError("secret mismatch: the peer could not prove it knows the secret")


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

    def to_wire(self) -> dict[str, Any]:
        return {
            "address": self.address, "incarnation": self.incarnation, "host": self.host,
            "pid": self.pid, "process": self.process, "probe": [self.probe_addr, self.probe_cookie],
            "data": [list(d) for d in self.data], "generation": self.generation,
            "regions": regions_to_wire(self.regions), "rdma": self.rdma,
            "topology": self.topology.to_wire() if self.topology is not None else None,
            "location": self.location, "rail_nics": self.rail_nics,
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
        )


def _rail_nics_from_wire(v: Any, endpoints: int) -> list[str] | None:
    """One NIC name (at most 64 characters, "" unknown) per data endpoint."""
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == endpoints
            and all(isinstance(n, str) and len(n) <= 64 for n in v)):
        raise ProtocolError("descriptor: malformed rail_nics (one NIC name per data endpoint)")
    return list(v)


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
        ok = (isinstance(devices, list) and 0 < len(devices) <= 8 and isinstance(addr, int)
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


def regions_to_wire(regions: list[RemoteRegion]) -> list[list[Any]]:
    return [[r.addr, r.length, int(r.access), r.name, list(r.rkeys)] for r in regions]


def regions_from_wire(v: Any) -> list[RemoteRegion]:
    out = []
    try:
        for item in v:
            addr, length, access, name, *rest = item
            rkeys = rest[0] if rest else []
            if len(rest) > 1 or not isinstance(rkeys, list) or len(rkeys) > 8 or not all(
                    isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys):
                raise ValueError
            if not (isinstance(addr, int) and isinstance(length, int) and isinstance(access, int)):
                raise TypeError
            if not (0 < addr < 1 << 64 and 0 < length < 1 << 64 and addr + length <= 1 << 64):
                raise ValueError
            if name is not None and not isinstance(name, str):
                raise TypeError
            out.append(RemoteRegion(addr, length, name, Access(access & 3), tuple(rkeys)))
    except (TypeError, ValueError):
        raise ProtocolError("descriptor: malformed region list") from None
    return out
