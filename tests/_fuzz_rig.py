"""The shared parts of the fuzz tests (test_fuzz_decoders.py,
test_fuzz_control.py, test_fuzz_data.py): the wire's constants, the example
budget, the rig (a real Engine whose memory is modelled byte for byte) and
the socket helpers and the control server's model.

Property-based fuzzing (hypothesis) of the two parsers that face the network.

* The handshake/control server (msgpack frames, ``kvflow/handshake.py`` and
  ``Engine._serve_control``): random bytes, frames of random bodies, oversized
  and lying length prefixes, random msgpack, and messages of the right types
  with wrong, missing, huge or nested fields; before and after authentication.
  The descriptor decoders (``Descriptor.from_wire``, ``regions_from_wire``,
  ``rdma_from_wire``), ``read_message`` and rdma's ``accept`` are fuzzed as
  functions too: they return a checked value or raise ProtocolError, nothing
  else.
* The tcp data server (``kvflow/_native/tcp_server.c``): raw sockets sending
  random bytes, hellos with random, stale or mutated tokens, and, over an
  authenticated hello, frame sequences with addresses and lengths around and
  outside the regions, truncated headers and payloads, oversized lengths. A
  model predicts every ack, every read response and every byte of memory.

Everything runs against a real Engine (tcp only, with and without a secret).
After every example: the server has let go of every connection (native
sockets and threads back to their baseline), the registered memory and the
unregistered guards around it hold exactly what the model says, nothing
reached the loop's exception handler, and a second engine connects afresh and
moves a checksummed 64 KiB write and read through it.

KVFLOW_FUZZ_SCALE multiplies the example counts (default 1: about 30 s on two cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import kvflow
from _batches import KiB, bounded, sha256
from _target import pattern
from kvflow.control.wire import (
    MAX_FRAME,
    VERSION,
    encode,
    read_message,
)
from kvflow.control.auth import NONCE_BYTES, check_proof, proof
from kvflow.memory import Access

FUZZ_SCALE = float(os.environ.get("KVFLOW_FUZZ_SCALE", "1"))
SECRET = b"fuzz-secret"
U64 = 1 << 64
PRE_AUTH_FRAME = 64 << 10        # engine.PRE_AUTH_FRAME
LEN = struct.Struct(">I")

# kvflow/_native/wire.h and kvf.h
F_WRITE, F_WRITE_ACK, F_READ_REQ, F_READ_RESP, F_FENCE = 3, 4, 5, 6, 10
HDR_FLUSH = 1
MAX_PAYLOAD = 64 << 20
ST_OK, ST_EREMOTE, ST_EPROTO = 0, 3, 6

# What the control server may ever send.
SERVER_TYPES = {"challenge", "welcome", "error", "pong", "descriptor", "rdma_error", "rdma_accept", "regions"}


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """A choice between strategies with integer weights (one_of() treats
    repeated branches as one)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


def fuzz_settings(n: int, **kw: Any) -> settings:
    return settings(
        max_examples=max(1, int(n * FUZZ_SCALE)),
        deadline=None,
        # One engine pair per test, shared by its examples on purpose.
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large],
        **kw,
    )


# ---------------------------------------------------------------- the rig

GUARD = 4096
# name, length, access: the target's regions, laid out in one arena with an
# unregistered guard before, between and after them.
LAYOUT = (
    ("rw", 64 * KiB, Access.READ | Access.WRITE),
    ("ro", 16 * KiB, Access.READ),
    ("wo", 16 * KiB, Access.WRITE),
    ("check", 64 * KiB, Access.READ | Access.WRITE),   # the still-works transfer's target
)
CHECK_BYTES = 64 * KiB


@dataclasses.dataclass(frozen=True)
class Span:
    offset: int     # in the arena
    length: int
    access: Access


class Rig:
    """A target engine whose registered memory is modelled byte for byte, and
    a second engine that proves the target still works."""

    def __init__(self, eng: kvflow.Engine, client: kvflow.Engine, secret: bytes | None,
                 calls: list[dict]) -> None:
        self.eng = eng
        self.client = client
        self.secret = secret
        self.calls = calls
        self.host, port = eng.address.rsplit(":", 1)
        self.port = int(port)
        data = eng.descriptor().data[0]
        self.data_host, self.data_port = data[0], int(data[1])
        total = GUARD + sum(n + GUARD for _, n, _ in LAYOUT)
        self.arena = pattern(11, total)
        self.base = int(self.arena.ctypes.data)
        self.spans: dict[str, Span] = {}
        off = GUARD
        for name, n, access in LAYOUT:
            eng.register(self.arena[off:off + n], name=name, access=access)
            self.spans[name] = Span(off, n, access)
            off += n + GUARD
        self.expected = self.arena.copy()
        self.src = np.zeros(CHECK_BYTES, np.uint8)
        self.dst = np.zeros(CHECK_BYTES, np.uint8)
        self.src_region = client.register(self.src)
        self.dst_region = client.register(self.dst)
        self.round = 0
        self.baseline = eng.counters()

    def addr(self, name: str, offset: int = 0) -> int:
        return self.base + self.spans[name].offset + offset

    def find(self, addr: int, length: int, need: Access) -> int | None:
        """Arena offset of [addr, addr+length) if it lies inside one region
        with `need` access (the data server's rule), else None."""
        for span in self.spans.values():
            off = addr - (self.base + span.offset)
            if 0 <= off < span.length and length <= span.length - off:
                return span.offset + off if span.access & need else None
        return None

    async def settle(self) -> None:
        """Waits until the server has dropped every connection: its native
        sockets and threads are back at their baseline and no control
        session is left. A leak fails here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            c = self.eng.counters()
            if (c["sockets"] == self.baseline["sockets"] and c["threads"] == self.baseline["threads"]
                    and not self.eng._server._tasks):
                return
            if loop.time() > deadline:
                pytest.fail(f"the server kept connections: counters {c} (baseline {self.baseline}), "
                            f"{len(self.eng._server._tasks)} control sessions")
            await asyncio.sleep(0.002)

    def check_memory(self) -> None:
        if np.array_equal(self.arena, self.expected):
            return
        diff = np.flatnonzero(self.arena != self.expected)
        where = []
        for off in (int(diff[0]), int(diff[-1])):
            what = "a guard"
            for name, span in self.spans.items():
                if span.offset <= off < span.offset + span.length:
                    what = f"region {name!r} +{off - span.offset}"
            where.append(f"arena +{off} ({what})")
        pytest.fail(f"{len(diff)} bytes of the target's memory changed unexpectedly: first at "
                    f"{where[0]}, last at {where[1]}")

    async def still_works(self) -> None:
        """A fresh connection from the second engine, a 64 KiB write and a
        read back, both checksummed."""
        self.round += 1
        self.src[:] = pattern(1000 + self.round, CHECK_BYTES)
        peer = await bounded(self.client.connect(self.eng.address, timeout=10), 15)
        try:
            assert peer.transport == "tcp"
            target = self.addr("check")
            await bounded(peer.write([self.src_region.addr], [target], [CHECK_BYTES]), 15)
            off = self.spans["check"].offset
            self.expected[off:off + CHECK_BYTES] = self.src
            assert sha256(self.arena[off:off + CHECK_BYTES]) == sha256(self.src), "write did not land"
            self.dst[:] = 0
            await bounded(peer.read([self.dst_region.addr], [target], [CHECK_BYTES]), 15)
            assert sha256(self.dst) == sha256(self.src), "read back differs"
        finally:
            await peer.close()

    async def after_example(self) -> None:
        await self.settle()
        assert not self.calls, f"the loop's exception handler fired: {self.calls}"
        self.check_memory()
        await self.still_works()
        assert not self.calls, f"the loop's exception handler fired: {self.calls}"


# (named rig_fixture here so that the tests importing it may take `rig`)
@pytest.fixture(name="rig", params=[None, SECRET], ids=["open", "secret"])
async def rig_fixture(request, loop_exception_guard):
    secret = request.param
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",), secret=secret, keepalive=0) as eng, \
            kvflow.Engine("127.0.0.1:0", protocols=("tcp",), secret=secret, keepalive=0) as client:
        r = Rig(eng, client, secret, loop_exception_guard)
        await r.still_works()
        yield r
        await r.settle()
        r.check_memory()


# ---------------------------------------------------------------- sockets


async def exchange(host: str, port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Sends `data`, half-closes, and returns everything the server sent
    until it closed the connection (it must close: every parser path ends at
    end of stream). A server that stops reading early may reset the
    connection; what arrived before the reset is returned."""
    reader, writer = await bounded(asyncio.open_connection(host, port), timeout)

    async def send() -> None:
        try:
            writer.write(data)
            await writer.drain()
            writer.write_eof()
        except (ConnectionError, OSError):
            pass              # the server closed early (oversized, garbage)

    async def receive() -> bytes:
        chunks = []
        try:
            while chunk := await reader.read(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)

    try:
        _, got = await bounded(asyncio.gather(send(), receive()), timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"the server neither answered nor closed within {timeout} s after end of stream")
    finally:
        writer.close()
    return got


def parse_frames(data: bytes) -> list[dict[str, Any]]:
    """The control server's output: well-formed kvflow frames only."""
    out = []
    while data:
        assert len(data) >= 4, f"server sent a truncated length prefix {data!r}"
        (n,) = LEN.unpack_from(data)
        assert n <= MAX_FRAME and len(data) >= 4 + n, f"server sent a truncated frame ({n} bytes announced)"
        msg = msgpack.unpackb(data[4:4 + n], raw=False, strict_map_key=True)
        assert isinstance(msg, dict) and msg.get("v") == VERSION, f"server sent {msg!r:.200}"
        assert msg.get("t") in SERVER_TYPES, f"server sent an unknown message {msg.get('t')!r:.100}"
        if msg["t"] == "error":
            assert msg.get("code") in ("protocol", "auth") and isinstance(msg.get("message"), str), msg
        out.append(msg)
        data = data[4 + n:]
    return out


def control_model(data: bytes, *, secret: bool, state: str = "hello") -> tuple[list[str], list[bytes]]:
    """What the control server must answer to a client that sends `data`
    and then ends the stream: the message types of its replies, and the
    notifications it delivers. `state`: "hello" (a new connection) or
    "session" (after a correct handshake). A frame the server cannot read
    whole ends the exchange without an answer; a malformed or unexpected one
    with an error frame."""
    out: list[str] = []
    notes: list[bytes] = []
    pos = 0
    while len(data) - pos >= LEN.size:
        (n,) = LEN.unpack_from(data, pos)
        if n > (MAX_FRAME if state == "session" else PRE_AUTH_FRAME):
            return out + ["error"], notes
        if len(data) - pos - LEN.size < n:
            break
        body = data[pos + LEN.size:pos + LEN.size + n]
        pos += LEN.size + n
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception:  # noqa: BLE001 (msgpack raises several unrelated types)
            return out + ["error"], notes
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str) or msg.get("v") != VERSION:
            return out + ["error"], notes
        t = msg["t"]
        if state == "hello":
            nonce = msg.get("nonce")
            if t != "hello" or not isinstance(nonce, bytes) or not isinstance(msg.get("address"), str) \
                    or len(nonce) != NONCE_BYTES:
                return out + ["error"], notes
            out.append("challenge")
            state = "auth"
        elif state == "auth":
            if t != "auth" or secret:              # the fuzz never knows the proof
                return out + ["error"], notes
            out.append("welcome")
            state = "session"
        elif t == "ping":
            out.append("pong")
        elif t == "notify":
            if not isinstance(msg.get("data"), bytes):
                return out + ["error"], notes
            notes.append(msg["data"])
        elif t == "describe":
            out.append("descriptor")
        elif t == "rdma_connect":
            out.append("rdma_error")               # the rig's engines run tcp only
        elif t == "bye":
            break
        else:
            return out + ["error"], notes
    return out, notes


async def check_notifications(rig: Rig, want: list[bytes]) -> None:
    """The notifications the model expects arrived, in order, and no others."""
    it = rig.eng.notifications()
    for data in want:
        peer, got = await bounded(it.__anext__(), 5)
        assert (peer, got) == ("fuzz:1", data)
    # (no public way to ask "nothing pending" without waiting)
    assert rig.eng._notifications.empty(), "a notification the model did not expect"


async def open_session(rig: Rig) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A correct client handshake (with the rig's secret): the control
    stream and the session token it earned."""
    reader, writer = await bounded(asyncio.open_connection(rig.host, rig.port))
    cnonce = os.urandom(NONCE_BYTES)
    writer.write(encode({"t": "hello", "nonce": cnonce, "address": "fuzz:1"}))
    ch = await bounded(read_message(reader))
    assert ch["t"] == "challenge" and bool(ch["auth"]) == bool(rig.secret), ch
    if rig.secret:
        check_proof(rig.secret, b"server", cnonce, ch["nonce"], ch["proof"])
    writer.write(encode({"t": "auth", "proof": proof(rig.secret, b"client", ch["nonce"], cnonce)
                         if rig.secret else b""}))
    welcome = await bounded(read_message(reader))
    assert welcome["t"] == "welcome", welcome
    assert len(welcome["token"]) == 16
    return reader, writer, welcome["token"]


async def close_session(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
