"""The control protocol's frames: msgpack maps over asyncio streams.

Frame: a 4-byte big-endian length, then a msgpack map with "v" (protocol
version) and "t" (message type). Lengths above the limit, undecodable bodies,
non-map bodies and unknown versions raise ProtocolError before anything else
is looked at, so a garbage client costs one short read and a closed socket.
"""
from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from kvflow._core import WIRE
from kvflow.errors import ProtocolError

VERSION = 1
MAX_FRAME = 8 << 20          # a descriptor with ~200k regions still fits
_LEN = struct.Struct(">I")

# Data-connection hello (kvflow/_native/wire.h, whose values these are):
# magic, type, status (= data connection index), tag (= role), addr, len
# (= wire version), aux.
DATA_HEADER = struct.Struct("<HBBIQQQ")
DATA_MAGIC = WIRE["MAGIC"]
DATA_HELLO, DATA_HELLO_ACK = WIRE["F_HELLO"], WIRE["F_HELLO_ACK"]
DATA_ROLE_DATA, DATA_ROLE_ACK = WIRE["ROLE_DATA"], WIRE["ROLE_ACK"]
DATA_WIRE_VERSION = WIRE["VERSION"]


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
