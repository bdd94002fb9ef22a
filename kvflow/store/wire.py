"""The master's wire format: msgpack values in frames prefixed by a 4-byte
big-endian length (as kvflow's control connection frames its messages).

request: [id, method, [args...]]
reply:   [id, 0, result]  or  [id, 1, [code, message, key]]

A batch call is one request and one reply, whatever its size: its items'
own failures travel inside the result as [1, code, message] beside the
items that succeeded ([0, value]).
"""
from __future__ import annotations

import asyncio
import struct

import msgpack

from kvflow.errors import ProtocolError

__all__ = ["HEAD", "MAX_FRAME", "FrameBuffer", "decode", "encode", "read_frame", "item_ok", "item_error"]

# A batch of 100k keys of 100 bytes is ~10 MiB; anything past this is a bug
# or an attack, and is refused before its body is read.
MAX_FRAME = 64 << 20
HEAD = struct.Struct(">I")          # a frame's length


def encode(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEAD.pack(len(body)) + body


def decode(body: bytes | memoryview) -> object:
    """One frame's body (without its length) as its message."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:          # msgpack raises several unrelated types
        raise ProtocolError(f"malformed frame: {e}") from None


async def read_frame(reader: asyncio.StreamReader) -> object:
    """The next message; asyncio.IncompleteReadError at a clean end of stream."""
    head = await reader.readexactly(4)
    (n,) = HEAD.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return decode(await reader.readexactly(n))


class FrameBuffer:
    """Bytes received so far; yields each complete message (for
    asyncio.Protocol.data_received, which the master and the link use:
    no task and no await per message, unlike streams)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        buf = self._buf
        if not buf and len(data) >= 4:
            (n,) = HEAD.unpack_from(data)
            if len(data) == 4 + n:      # one whole frame, a call's usual read: decoded in place, no copy
                return [decode(memoryview(data)[4:])]
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = HEAD.unpack_from(buf, pos)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(buf) - pos - 4 < n:
                break
            out.append(decode(memoryview(buf)[pos + 4:pos + 4 + n]))
            pos += 4 + n
        if pos:
            del buf[:pos]
        return out


def item_ok(value: object) -> list:
    return [0, value]


def item_error(code: str, message: str) -> list:
    return [1, code, message]
