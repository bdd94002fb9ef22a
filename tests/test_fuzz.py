"""Property-based fuzzing (hypothesis) of the two parsers that face the network.

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
import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvflow
from _batches import TIME_SCALE, KiB, bounded, sha256
from _target import pattern
from kvflow.errors import ProtocolError
from kvflow.control.wire import (
    DATA_HEADER,
    DATA_HELLO,
    DATA_HELLO_ACK,
    DATA_MAGIC,
    DATA_ROLE_ACK,
    DATA_ROLE_DATA,
    DATA_WIRE_VERSION,
    MAX_FRAME,
    VERSION,
    encode,
    read_message,
)
from kvflow.control.auth import NONCE_BYTES, check_proof, proof
from kvflow.control.descriptor import Descriptor, regions_from_wire
from kvflow.providers.rdma.part import rdma_from_wire
from kvflow.memory import Access, RemoteRegion

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


@pytest.fixture(params=[None, SECRET], ids=["open", "secret"])
async def rig(request, loop_exception_guard):
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


# ---------------------------------------------------------------- msgpack strategies

scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), U64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=40))
# Integers at the limits the decoders check (ports, QP numbers, keys, mtu,
# 64-bit addresses and their sums), and byte strings at the lengths they check.
edge_ints = st.sampled_from([-(1 << 63), -2, -1, 0, 1, 2, 5, 6, 8, 9, 65535, 65536, (1 << 24) - 1, 1 << 24,
                             (1 << 31) - 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, U64 - 4096,
                             U64 - 1])
edge_bytes = st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65]).map(lambda n: b"\x5a" * n)
keys = st.text(max_size=8) | st.binary(max_size=4)
junk = st.recursive(
    scalars | edge_ints,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)


def wire(value: Any) -> Any:
    """`value` as the other side decodes it (lists, not tuples; str or bytes keys)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """`value` with one or two of its parts (or itself) replaced by junk
    or by a value of the same type at a checked limit, removed, or grown:
    mostly almost right, so each check gets its turn."""
    value = wire(value)                            # a deep copy
    for _ in range(draw(st.integers(1, 2))):
        # the whole value last: hypothesis favours the first choices
        paths = _paths(value)
        path = draw(st.sampled_from(paths[1:] + paths[:1]))
        parent, node = None, value
        for step in path:
            parent, node = node, node[step]
        op = draw(st.sampled_from(["junk", "limit", "limit", "drop", "grow"]))
        if op == "limit":
            if isinstance(node, bool) or node is None:
                new = draw(junk)
            elif isinstance(node, int):
                new = draw(edge_ints)
            elif isinstance(node, bytes):
                new = draw(edge_bytes)
            elif isinstance(node, str):
                new = draw(st.text(max_size=3))
            else:
                new = draw(junk)
        elif op == "grow" and isinstance(node, (list, dict)):
            if isinstance(node, list):
                # a copy of the last element (lists of checked length), or junk
                node += wire(node[-1:]) * draw(st.integers(1, 8)) if node and draw(st.booleans()) else [draw(junk)]
            else:
                node[draw(keys)] = draw(junk)
            continue
        elif op == "drop" and parent is not None:
            del parent[path[-1]]
            continue
        else:
            new = draw(junk)
        if parent is None:
            value = new
        else:
            parent[path[-1]] = new
    return value


def good_descriptor_wire() -> dict[str, Any]:
    return {
        "address": "127.0.0.1:7000", "incarnation": 5, "host": "boot/1", "pid": 4242,
        "process": b"\x01" * 16, "probe": [0x7F0000001000, b"c" * 16], "data": [["127.0.0.1", 7001]],
        "generation": 3,
        "regions": [[0x7F0000100000, 4096, 3, "kv", [1, 2]], [0x7F0000200000, 8192, 1, None, []]],
        "rdma": {"devices": [{"name": "mlx5_0", "gid": b"g" * 16, "lid": 0, "mtu": 5, "link": "Ethernet",
                              "port": 1}],
                 "probe": [0x7F0000300000, [77], b"p" * 16]},
    }


def check_regions(regions: Any) -> None:
    assert isinstance(regions, list)
    for r in regions:
        assert isinstance(r, RemoteRegion)
        assert type(r.addr) is int and type(r.length) is int
        assert 0 < r.addr and 0 < r.length and r.addr + r.length <= U64
        assert r.name is None or isinstance(r.name, str)
        assert isinstance(r.access, Access) and len(r.rkeys) <= 8
        assert all(isinstance(k, int) and 0 <= k < 1 << 32 for k in r.rkeys)


def check_rdma(rd: Any) -> None:
    if rd is None:
        return
    devices = rd["devices"]
    addr, rkeys, cookie = rd["probe"]
    assert 0 < len(devices) <= 8 and len(rkeys) == len(devices)
    assert all(isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys)
    assert isinstance(addr, int) and 0 < addr < U64 and isinstance(cookie, bytes) and 0 < len(cookie) <= 64
    for d in devices:
        assert isinstance(d["name"], str) and isinstance(d["gid"], bytes) and len(d["gid"]) == 16
        assert isinstance(d["lid"], int) and isinstance(d["mtu"], int) and 1 <= d["mtu"] <= 5
        assert isinstance(d.get("up", True), bool)          # False: the device is gone


# Wire values with at most one fault: one leaf (named by `fault`) is drawn
# from values at or just past the limit its decoder checks, every other leaf
# is well formed. So an example either must be accepted or fails exactly one
# check, and each check gets its turn.
def sized_bytes(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo, hi).map(lambda n: b"\x5a" * n)


addr64 = weighted((3, st.integers(1, 1 << 47)), (1, st.sampled_from([1, 1 << 63, U64 - 4096, U64 - 1])))
u32 = st.integers(0, (1 << 32) - 1)
REGION_FAULTS = ["addr", "length", "name", "rkeys", "shape"]
RDMA_FAULTS = ["devices", "name", "gid", "lid", "mtu", "up", "addr", "rkeys", "cookie", "shape"]
# (the region and rdma checks have tests of their own: two of each here)
DESCRIPTOR_FAULTS = ["address", "incarnation", "host", "pid", "process", "probe", "cookie", "data", "generation",
                     "missing", "region.length", "region.rkeys", "rdma.devices", "rdma.mtu"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """Which leaf sits at an edge (`name`, "" for none) and which of its edge
    values (`index`; None: hypothesis picks one)."""

    name: str = ""
    index: int | None = None

    def inner(self, scope: str) -> Fault:
        """This fault as seen inside `scope` ("region.mtu" is "mtu" there)."""
        where, _, name = self.name.partition(".")
        return Fault(name if where == scope else "", self.index)


def pick(draw: st.DrawFn, fault: Fault, options: list[Any]) -> Any:
    return options[fault.index % len(options)] if fault.index is not None else draw(st.sampled_from(options))


def leaf(draw: st.DrawFn, fault: Fault, name: str, good: st.SearchStrategy, *edges: Any) -> Any:
    return pick(draw, fault, list(edges)) if fault.name == name else draw(good)


# Regions at the top of the address space: (addr, length) on both sides of 2^64.
REGION_ENDS = [(1, 0), (1, -1), (1 << 63, 1 << 63), (1 << 63, (1 << 63) + 1), (U64 - 4096, 4096),
               (U64 - 4096, 4097), (U64 - 1, 1), (U64 - 1, 2), (1, U64 - 1), (2, U64 - 1)]


@st.composite
def wire_region(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    if fault.name == "length":
        addr, length = pick(draw, fault, REGION_ENDS)
    else:
        addr = leaf(draw, fault, "addr", addr64, 0, -1, 1, U64 - 1, "1")
        room = U64 - addr if isinstance(addr, int) and 0 < addr < U64 else 4096
        length = draw(weighted((3, st.integers(1, min(1 << 30, room))), (1, st.just(room))))
    name = leaf(draw, fault, "name", st.none() | st.text(max_size=6), b"kv", 5, [])
    keys = leaf(draw, fault, "rkeys", st.lists(u32, max_size=8), [0] * 8, [0] * 9, [-1], [1 << 32],
                [(1 << 32) - 1], "k", [None])
    item = [addr, length, draw(st.integers(0, 3)), name, keys]
    if fault.name == "shape":
        return pick(draw, fault, [item[:3], item + [[]], "item", item[:4]])    # item[:4] is allowed
    return item


@st.composite
def wire_regions(draw: st.DrawFn, fault: Fault = Fault()) -> list[Any]:
    first = [draw(wire_region(fault))] if fault.name else []
    return first + draw(st.lists(wire_region(), max_size=2))


@st.composite
def wire_rdma(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    n = pick(draw, fault, [0, 8, 9]) if fault.name == "devices" else draw(st.integers(1, 3))
    devices = []
    for i in range(n):
        f = fault if i == 0 else Fault()
        devices.append({
            "name": leaf(draw, f, "name", st.text(max_size=8), b"mlx5_0", None),
            "gid": leaf(draw, f, "gid", sized_bytes(16, 16), b"g" * 15, b"g" * 17, "g" * 16),
            "lid": leaf(draw, f, "lid", st.integers(0, 65535), "1", None, 1.0),
            "mtu": leaf(draw, f, "mtu", st.integers(1, 5), 0, 1, 5, 6, -1, 5.0, "5"),
            "link": "Ethernet", "port": 1,
            "up": leaf(draw, f, "up", st.booleans(), 1, 0, "true", None),
        })
    keys = leaf(draw, fault, "rkeys", st.lists(u32, min_size=n, max_size=n), [0] * (n + 1), [0] * (n - 1),
                [-1] * n, [1 << 32] * n, [(1 << 32) - 1] * n, None)
    probe = [leaf(draw, fault, "addr", addr64, 0, -1, 1, U64 - 1),
             keys, leaf(draw, fault, "cookie", sized_bytes(1, 64), b"", b"c" * 64, b"c" * 65, "c")]
    out: Any = {"devices": devices, "probe": probe}
    if fault.name == "shape":
        out = pick(draw, fault, [{"devices": devices}, {"probe": probe}, {**out, "probe": probe[:2]},
                                 {**out, "probe": probe + [1]}, [devices, probe], "rdma"])
    return out


@st.composite
def wire_descriptor(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    d = {
        "address": leaf(draw, fault, "address", st.text(max_size=12), b"a", None),
        "incarnation": leaf(draw, fault, "incarnation", st.integers(0, (1 << 63) - 1), True, 1.5, None, -1,
                            U64 - 1),
        "host": leaf(draw, fault, "host", st.text(max_size=12), b"h", 1),
        "pid": leaf(draw, fault, "pid", st.integers(1, 1 << 22), "1", False, 0),
        "process": leaf(draw, fault, "process", sized_bytes(16, 16), "p", None, b""),
        "probe": [draw(addr64), leaf(draw, fault, "cookie", sized_bytes(0, 64), b"", b"c" * 64, b"c" * 65, "c")],
        "data": leaf(draw, fault, "data", st.lists(st.tuples(st.text(max_size=9), st.integers(1, 65535)).map(list),
                                                   max_size=2),
                     [["h", 0]], [["h", 65535]], [["h", 65536]], [["h", "80"]], [[b"h", 1]], [["h"]], ["h", 1]),
        "generation": leaf(draw, fault, "generation", st.integers(0, 1 << 40), 1.0, None, -1),
        "regions": draw(wire_regions(fault.inner("region"))),
        "rdma": draw(wire_rdma(fault.inner("rdma"))) if fault.name.startswith("rdma.")
        else draw(st.none() | wire_rdma()),
    }
    if fault.name == "probe":
        a, c = d["probe"]
        d["probe"] = pick(draw, fault, [[0, c], [-1, c], [1, c], [U64 - 1, c], [None, c], [a], [a, c, 3], "p", {}])
    if fault.name == "missing":
        del d[pick(draw, fault, sorted(d))]
    return d


def faults(make: Any, names: list[str]) -> st.SearchStrategy:
    """Wire values with one fault (or none), the same with random damage
    (mutated), and junk."""
    one = st.sampled_from([""] + names).flatmap(lambda name: make(Fault(name)))
    return weighted((6, one), (2, make().flatmap(mutated)), (1, junk))


# ---------------------------------------------------------------- decoders as functions


def check_descriptor(d: Descriptor) -> None:
    for name in ("incarnation", "pid", "generation"):
        assert type(getattr(d, name)) is int
    assert isinstance(d.address, str) and isinstance(d.host, str) and isinstance(d.process, bytes)
    assert isinstance(d.probe_addr, int) and 0 < d.probe_addr < U64
    assert isinstance(d.probe_cookie, bytes) and len(d.probe_cookie) <= 64
    assert all(isinstance(h, str) and type(p) is int and 0 < p < 65536 for h, p in d.data)
    check_regions(d.regions)
    check_rdma(d.rdma)


# decoder, its checks of what it accepts, the wire values to feed it, their faults
DECODERS = {
    "descriptor": (Descriptor.from_wire, check_descriptor, wire_descriptor, DESCRIPTOR_FAULTS),
    "regions": (regions_from_wire, check_regions, wire_regions, REGION_FAULTS),
    "rdma": (rdma_from_wire, check_rdma, wire_rdma, RDMA_FAULTS),
}


def decode(name: str, value: Any) -> None:
    """The decoder returns a value that passes its checks, or raises
    ProtocolError; any other exception fails the test."""
    decoder, check, _, _ = DECODERS[name]
    try:
        out = decoder(wire(value))
    except ProtocolError:
        return
    check(out)


@fuzz_settings(150)
@given(faults(wire_descriptor, DESCRIPTOR_FAULTS))
def test_descriptor_from_wire(value):
    decode("descriptor", value)


@fuzz_settings(100)
@given(faults(wire_regions, REGION_FAULTS))
def test_regions_from_wire(value):
    decode("regions", value)


@fuzz_settings(100)
@given(faults(wire_rdma, RDMA_FAULTS))
def test_rdma_from_wire(value):
    decode("rdma", value)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_every_edge(name):
    """Every edge value of every checked leaf (the fuzz tests draw them at
    random), the rest of the value well formed and drawn by hypothesis."""
    _, _, make, faults_of = DECODERS[name]
    for fault in faults_of:
        for index in range(10):           # no leaf has more edge values
            @settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(make(Fault(fault, index)))
            def one(value):
                decode(name, value)

            one()


def test_descriptor_round_trip():
    d = Descriptor.from_wire(good_descriptor_wire())
    assert Descriptor.from_wire(wire(d.to_wire())) == d


@fuzz_settings(150)
@given(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda body: LEN.pack(len(body)) + body, st.binary(max_size=200)),
    st.builds(lambda v: frame(msgpack.packb(v)), junk),
    st.builds(lambda m: frame(msgpack.packb(m)), st.deferred(lambda: almost_messages())),
))
async def test_read_message(data):
    """read_message returns a versioned message with a str type, or raises
    ProtocolError, or IncompleteReadError for a stream that ends early."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        msg = await read_message(reader, max_size=150)
    except (ProtocolError, asyncio.IncompleteReadError):
        return
    assert isinstance(msg, dict) and isinstance(msg["t"], str) and msg["v"] == VERSION


def _qp_entry() -> st.SearchStrategy:
    good = [0, 0x11, 0x22, b"g" * 16, 0, 5]
    return st.one_of(mutated(good), junk)


@fuzz_settings(100)
@given(st.fixed_dictionaries(
    {"t": st.just("rdma_connect")},
    optional={"qps": st.one_of(st.lists(_qp_entry(), max_size=4), junk),
              "replace": st.one_of(st.lists(st.one_of(st.lists(junk, min_size=2, max_size=2), junk), max_size=3),
                                   junk),
              "rid": junk}))
def test_rdma_accept_rejects_malformed(msg):
    """An authenticated peer's rdma_connect reaches RdmaProvider.on_control
    (kvflow/providers/rdma/provider.py) on an engine with rdma devices. Its checks run before
    any device is touched; with no device every QP entry is out of range,
    so the only outcome is ProtocolError (never TypeError and the like,
    which would escape the control session into the loop)."""
    from kvflow.providers.rdma.provider import RdmaProvider

    provider = RdmaProvider.__new__(RdmaProvider)      # the checks only, no devices
    provider.devices, provider._session_qps, provider._targets = [], {}, {}
    with pytest.raises(ProtocolError):
        provider.on_control("fuzz:1", object(), wire(msg))


# ---------------------------------------------------------------- control server, live

MESSAGE_TYPES = ["hello", "auth", "ping", "notify", "describe", "rdma_connect", "bye", "error", "challenge",
                 "welcome", "pong", "regions", ""]
SESSION_TYPES = ["ping", "notify", "describe", "rdma_connect", "bye"]
FIELDS = ["nonce", "address", "proof", "data", "rid", "qps", "replace", "descriptor", "token",
          "code", "message"]


@st.composite
def almost_messages(draw: st.DrawFn, types: list[str] = MESSAGE_TYPES) -> dict[str, Any]:
    """Messages meant as one of `types`, with the fields that type needs:
    mostly right, sometimes of the wrong type or size, missing, or joined
    by junk; the type itself sometimes another or junk."""
    meant = draw(st.sampled_from(types))
    msg: dict[str, Any] = {
        "v": draw(weighted((10, st.just(VERSION)), (1, junk))),
        "t": draw(weighted((8, st.just(meant)), (1, st.sampled_from(MESSAGE_TYPES)), (1, junk))),
    }
    if meant == "hello":
        msg["nonce"] = draw(weighted((12, st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES)),
                                     (1, sized_bytes(NONCE_BYTES - 1, NONCE_BYTES + 1)),
                                     (1, st.binary(max_size=40)), (1, junk)))
        msg["address"] = draw(weighted((6, st.just("fuzz:1")), (1, junk)))
        # (none from 0.05 s to 1 s: a session that idles out while the
        # exchange is still on the wire would make the replies depend on
        # timing; under 0.05 s the server ignores it)
        msg["keepalive"] = draw(st.sampled_from([None, -1, 0, 1e-9, 0.01, 5.0, 3600, 3601, float("inf"),
                                                 float("nan"), "5", True, [1]]))
    elif meant == "auth":
        msg["proof"] = draw(weighted((2, st.binary(min_size=32, max_size=32)), (1, junk)))
    elif meant == "notify":
        msg["data"] = draw(weighted((3, st.binary(max_size=40)), (1, junk)))
    elif meant == "rdma_connect":
        msg["qps"] = draw(st.lists(junk, max_size=3) | junk)
        msg["replace"] = draw(junk)
        msg["rid"] = draw(junk)
    if draw(st.integers(0, 9)) == 0:
        del msg[draw(st.sampled_from(sorted(msg, key=str)))]
    if draw(st.integers(0, 3)) == 0:
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2)):
            msg[name] = draw(junk)
    return msg


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def deep(depth: int) -> bytes:
    """msgpack of a rdma_connect whose rid nests `depth` arrays (msgpack's
    own limits are around 1024)."""
    head = msgpack.packb({"v": VERSION, "t": "rdma_connect", "qps": []})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("rid") + b"\x91" * depth + b"\xc0"


def frames_of(messages: list[Any]) -> bytes:
    return b"".join(frame(msgpack.packb(m)) for m in messages)


control_inputs = weighted(
    (1, st.binary(max_size=300)),
    (1, st.builds(frame, st.binary(max_size=300))),
    # oversized length prefixes, with a little of the promised body
    (1, st.builds(lambda n, b: LEN.pack(n) + b, st.integers(PRE_AUTH_FRAME + 1, (1 << 32) - 1),
                  st.binary(max_size=64))),
    # lying length prefixes: the body is longer or shorter than announced
    (1, st.builds(lambda v, d: LEN.pack(max(0, len(p := msgpack.packb(v)) + d)) + p, junk, st.integers(-8, 8))),
    (1, st.builds(lambda v: frame(msgpack.packb(v)), junk)),
    (1, st.lists(almost_messages(), min_size=1, max_size=6).map(frames_of)),
    # shaped like a handshake and a session, each step sometimes wrong
    (6, st.builds(lambda hello, auth, session, tail: frames_of([hello, auth] + session) + tail,
                  almost_messages(["hello"]), almost_messages(["auth"]),
                  st.lists(almost_messages(SESSION_TYPES), max_size=4), st.binary(max_size=8))),
)


@fuzz_settings(80)
@given(data=control_inputs)
async def test_control_server_rejects_garbage(rig, data):
    """Whatever a client sends, the control server answers with well-formed
    frames, exactly the replies control_model() predicts (a challenge to a
    valid hello and to nothing else, a session only with the proof where
    there is a secret, an error frame for anything malformed or oversized),
    and closes the connection at end of stream."""
    reply = parse_frames(await exchange(rig.host, rig.port, data))
    types = [m["t"] for m in reply]
    event(f"reply: {' '.join(types[:3]) or 'none'}")
    want, notes = control_model(data, secret=bool(rig.secret))
    assert types == want
    await check_notifications(rig, notes)
    if rig.secret:
        assert "welcome" not in types and "descriptor" not in types, types
    await rig.after_example()


@st.composite
def session_inputs(draw: st.DrawFn) -> bytes:
    """Session messages, then perhaps one thing that ends the session."""
    data = frames_of(draw(st.lists(almost_messages(SESSION_TYPES), max_size=6)))
    end = draw(st.integers(0, 6))
    if end == 1:
        data += frame(msgpack.packb(draw(junk)))
    elif end == 2:
        data += frame(draw(st.binary(max_size=100)))
    elif end == 3:
        data += LEN.pack(draw(st.integers(MAX_FRAME + 1, (1 << 32) - 1)))
    elif end == 4:
        data += frame(deep(draw(st.integers(1018, 1028))))
    elif end == 5:
        data += draw(st.binary(max_size=50))
    return data


@fuzz_settings(40)
@given(data=session_inputs())
async def test_control_session_rejects_garbage(rig, data):
    """After a correct (authenticated) handshake, fuzzed session messages
    get exactly the replies and notifications control_model() predicts."""
    reader, writer, _ = await open_session(rig)
    try:
        writer.write(data)
        writer.write_eof()
        chunks = []
        try:
            while chunk := await bounded(reader.read(1 << 16), 10):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        except asyncio.TimeoutError:
            pytest.fail("the control session neither answered nor closed after end of stream")
        types = [m["t"] for m in parse_frames(b"".join(chunks))]
        event(f"reply: {' '.join(types[-2:]) or 'none'}")
        want, notes = control_model(data, secret=bool(rig.secret), state="session")
        assert types == want
        await check_notifications(rig, notes)
    finally:
        await close_session(writer)
    await rig.after_example()


async def test_tiny_client_keepalive_does_not_spin(monkeypatch):
    """A client's hello keepalive becomes its session's idle timeout; one
    under the 0.05 s that Engine(keepalive=) allows made an idle session
    wake the loop continuously (about 1,500 reads in 0.5 s). It must be
    ignored: an authenticated client cannot make an idle server busy."""
    import kvflow.control.server

    reads = 0
    real = kvflow.control.server.read_message

    loop = asyncio.get_running_loop()

    async def counting(*args: Any, **kw: Any) -> dict[str, Any]:
        nonlocal reads
        # only this test's server: an engine another test left running on its
        # own thread reads here too (13 leaked NIXL agents once did)
        if asyncio.get_running_loop() is loop:
            reads += 1
        return await real(*args, **kw)

    monkeypatch.setattr(kvflow.control.server, "read_message", counting)
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",), keepalive=0) as eng:
        host, port = eng.address.rsplit(":", 1)
        reader, writer = await bounded(asyncio.open_connection(host, int(port)))
        try:
            writer.write(encode({"t": "hello", "nonce": os.urandom(NONCE_BYTES), "address": "fuzz:1",
                                 "keepalive": 1e-9}))
            assert (await bounded(read_message(reader)))["t"] == "challenge"
            writer.write(encode({"t": "auth", "proof": b""}))
            assert (await bounded(read_message(reader)))["t"] == "welcome"
            before, t0 = reads, time.monotonic()
            await asyncio.sleep(0.5)
            idle_reads, idle_s = reads - before, time.monotonic() - t0
            writer.write(encode({"t": "ping"}))
            assert (await bounded(read_message(reader)))["t"] == "pong"
        finally:
            await close_session(writer)
    # Absent, one read waits all along; the shortest keepalive allowed
    # (0.05 s) reads once per 0.05 s of the silence actually slept; 1e-9
    # reads about 1,500 times in 0.5 s.
    assert idle_reads <= idle_s / 0.05 + 1, f"{idle_reads} reads in {idle_s:.2f} s of silence"


# ---------------------------------------------------------------- data server, live


def data_header(magic: int, kind: int, status: int, tag: int, addr: int, length: int, aux: int) -> bytes:
    return DATA_HEADER.pack(magic & 0xFFFF, kind & 0xFF, status & 0xFF, tag & 0xFFFFFFFF, addr % U64,
                            length % U64, aux % U64)


def data_hello(token: bytes, *, role: int = DATA_ROLE_DATA, index: int = 0, magic: int = DATA_MAGIC,
               kind: int = DATA_HELLO, version: int = DATA_WIRE_VERSION) -> bytes:
    return data_header(magic, kind, index, role, int.from_bytes(token[:8], "little"), version,
                       int.from_bytes(token[8:], "little"))


def parse_headers(data: bytes, count_payload: bool = True) -> list[tuple[tuple[int, ...], bytes]]:
    """The data server's output: headers, each with the payload a read
    response carries."""
    out = []
    while data:
        assert len(data) >= DATA_HEADER.size, f"server sent a truncated header {data!r}"
        h = DATA_HEADER.unpack_from(data)
        assert h[0] == DATA_MAGIC, f"server sent a header with magic {h[0]:#x}"
        n = h[5] if (count_payload and h[1] == F_READ_RESP) else 0
        assert len(data) >= DATA_HEADER.size + n, "server sent a truncated read response"
        out.append((h, data[DATA_HEADER.size:DATA_HEADER.size + n]))
        data = data[DATA_HEADER.size + n:]
    return out


def assert_refused(reply: bytes, sent: int) -> None:
    """A refused hello: one HELLO_ACK with status EPROTO once 32 bytes
    arrived, nothing at all before."""
    if sent < DATA_HEADER.size:
        assert reply == b"", f"server answered an incomplete hello with {reply!r}"
        return
    heads = parse_headers(reply)
    assert len(heads) == 1, f"server sent {len(heads)} headers to a refused hello"
    (_, kind, status, *_), _ = heads[0]
    assert kind == DATA_HELLO_ACK and status == ST_EPROTO, f"hello not refused: type {kind} status {status}"


@fuzz_settings(50)
@given(kind=st.sampled_from(["random", "zero", "stale", "flipped"]),
       role=st.sampled_from([DATA_ROLE_DATA, DATA_ROLE_ACK]), index=st.integers(0, 255),
       flip=st.integers(0, 127), raw=st.binary(max_size=100),
       frames=st.lists(st.tuples(st.sampled_from(["rw", "wo", "check"]), st.integers(0, 1024),
                                 st.integers(0, 4096)), max_size=4))
async def test_data_server_refuses_unauthenticated(rig, kind, role, index, flip, raw, frames):
    """Hellos with a random, all-zero, stale (its control session has ended)
    or one-bit-off token, followed by well-formed writes into writable
    regions: refused, and not one byte of memory changes."""
    if kind == "stale":
        _, writer, token = await open_session(rig)
        await close_session(writer)
        await rig.settle()                   # the session, and its token, are gone
    elif kind == "flipped":
        _, writer, token = await open_session(rig)
        token = bytearray(token)
        token[flip // 8] ^= 1 << (flip % 8)
        token = bytes(token)
    else:
        token = os.urandom(16) if kind == "random" else bytes(16)
    try:
        data = data_hello(token, role=role, index=index)
        for name, off, n in frames:
            data += data_header(DATA_MAGIC, F_WRITE, HDR_FLUSH, 7, rig.addr(name, off), n, 0)
            data += b"\xee" * n
        reply = await exchange(rig.data_host, rig.data_port, data)
        assert_refused(reply, len(data))
        # and bytes that are not a hello at all
        reply = await exchange(rig.data_host, rig.data_port, raw)
        if len(raw) >= DATA_HEADER.size:
            assert_refused(reply, len(raw))
        else:
            assert reply == b""
    finally:
        if kind == "flipped":
            await close_session(writer)
    await rig.after_example()


async def _data_connection(rig: Rig, token: bytes, index: int):
    reader, writer = await bounded(asyncio.open_connection(rig.data_host, rig.data_port))
    writer.write(data_hello(token, index=index))
    (h, _), = parse_headers(await bounded(reader.readexactly(DATA_HEADER.size)))
    assert h[1] == DATA_HELLO_ACK and h[2] == ST_OK, h
    return reader, writer


@pytest.mark.parametrize("fence", [False, True], ids=["no-fence", "fence"])
async def test_a_fence_keeps_a_failed_connections_bytes_from_landing_over_their_resend(rig, fence):
    """What a failed connection still delivers must not land over its work
    sent again on another connection. An initiator (this test, on the
    wire) has connection 0 stop halfway through a 64 KiB write of 0x11:
    the target's thread for it waits in the payload. The same write goes
    again as 0x22 on connection 1 and is acknowledged; then the rest of
    connection 0's payload arrives. Without a fence (KVF_F_FENCE) in front
    of the resend, that rest lands over the acknowledged newer bytes
    (which is what a kvflow initiator before the fence could cause: bytes
    the target's kernel held on a failed connection). With it, the target
    stops connection 0 first, and the range holds 0x22 only."""
    _, session, token = await open_session(rig)
    fenced0 = rig.eng.counters()["fenced"]
    n, half = 64 * KiB, 32 * KiB
    addr, off = rig.addr("rw"), rig.spans["rw"].offset
    writers = []
    try:
        _, w0 = await _data_connection(rig, token, 0)
        r1, w1 = await _data_connection(rig, token, 1)
        writers += [w0, w1]
        w0.write(data_header(DATA_MAGIC, F_WRITE, HDR_FLUSH, 1, addr, n, 0) + b"\x11" * half)
        await w0.drain()
        deadline = time.monotonic() + 10
        while not (rig.arena[off:off + half] == 0x11).all():      # it lands as it arrives
            assert time.monotonic() < deadline, "the first half never landed"
            await asyncio.sleep(0.001)
        resend = data_header(DATA_MAGIC, F_WRITE, HDR_FLUSH, 2, addr, n, 0) + b"\x22" * n
        if fence:
            resend = data_header(DATA_MAGIC, F_FENCE, 0, 0, 0, 0, 0) + resend
        w1.write(resend)
        (ack, _), = parse_headers(await bounded(r1.readexactly(DATA_HEADER.size)))
        assert ack[1] == F_WRITE_ACK and ack[2] == ST_OK and ack[3] == 2, ack
        assert (rig.arena[off:off + n] == 0x22).all()
        try:
            w0.write(b"\x11" * (n - half))     # the rest of the old connection's bytes
            await w0.drain()
        except (ConnectionError, OSError):
            assert fence                        # the fence shut it
    finally:
        for w in writers:
            w.close()
        await close_session(session)
    await rig.settle()
    landed = rig.arena[off + half:off + n]
    if fence:
        assert (rig.arena[off:off + n] == 0x22).all(), f"{int((landed == 0x11).sum())} old bytes landed"
        assert rig.eng.counters()["fenced"] == fenced0 + 1
    else:
        # the hazard the fence removes: the old bytes landed over the acknowledged write
        assert (landed == 0x11).all()
        assert rig.eng.counters()["fenced"] == fenced0
    rig.expected[off:off + n] = rig.arena[off:off + n]
    await rig.after_example()



async def _stalled_write(rig: Rig, token: bytes, addr: int, n: int, view: np.ndarray):
    """A data connection that sends a write header for n bytes at addr and
    the first half of its payload, then stops: the target's thread for it
    waits in the middle of the payload. Returns (reader, writer) once the
    half has landed in `view` (the target memory at addr)."""
    reader, w = await _data_connection(rig, token, 0)
    half = n // 2
    w.write(data_header(DATA_MAGIC, F_WRITE, HDR_FLUSH, 1, addr, n, 0) + b"\x11" * half)
    await w.drain()
    deadline = time.monotonic() + 10
    while not (view[:half] == 0x11).all():           # it lands as it arrives
        assert time.monotonic() < deadline, "the first half never landed"
        await asyncio.sleep(0.001)
    return reader, w


async def test_register_does_not_wait_for_a_peer_stalled_mid_frame(rig):
    """A peer that stops in the middle of a write payload (the target's
    thread waits for the rest, up to the 10 s frame deadline) holds up
    neither register() nor the deregister() of another region on the
    target's event loop: the region table is locked only to find a region,
    never while bytes move."""
    _, session, token = await open_session(rig)
    n = 64 * KiB
    off = rig.spans["rw"].offset
    w = None
    try:
        _, w = await _stalled_write(rig, token, rig.addr("rw"), n, rig.arena[off:])
        extra = np.zeros(4096, np.uint8)
        t0 = time.perf_counter()
        region = rig.eng.register(extra, name="extra")
        rig.eng.deregister(region)
        took = time.perf_counter() - t0
        assert took < 1.0 * TIME_SCALE, f"register() and deregister() of another region took {took:.2f} s"
        # the stalled write is still there and completes when its peer goes on
        w.write(b"\x11" * (n - n // 2))
        await w.drain()
        deadline = time.monotonic() + 10
        while not (rig.arena[off:off + n] == 0x11).all():
            assert time.monotonic() < deadline, "the rest of the stalled write never landed"
            await asyncio.sleep(0.001)
        rig.expected[off:off + n] = 0x11
    finally:
        if w is not None:
            w.close()
        await close_session(session)
    await rig.after_example()


@pytest.mark.parametrize("op", ["write", "read"])
async def test_deregister_cuts_off_a_peer_stalled_mid_frame(rig, op):
    """deregister() of a region that a stalled peer is writing into (it
    stopped halfway through a payload) or reading from (it stopped reading
    a 64 MiB response) returns within a fraction of a second, not after
    the 10 s frame deadline: the payload's connection is cut off, and the
    region's memory is not touched after deregister() returned (no byte
    lands in it; none is read from it: the region is filled with 0x77
    right after, and nothing the peer receives holds that)."""
    _, session, token = await open_session(rig)
    victim = np.zeros(64 << 20, np.uint8)
    region = rig.eng.register(victim, name="victim")
    cut0 = rig.eng.counters()["cut_off"]
    w = None
    got = bytearray()
    try:
        if op == "write":
            n = 64 * KiB
            reader, w = await _stalled_write(rig, token, region.addr, n, victim)
        else:
            reader, w = await _data_connection(rig, token, 0)
            w.write(data_header(DATA_MAGIC, F_READ_REQ, HDR_FLUSH, 1, region.addr, victim.nbytes, 0))
            await w.drain()
            # the target is inside the response once its first bytes arrive;
            # then this peer stops reading and the sockets' buffers fill
            got += await bounded(reader.readexactly(DATA_HEADER.size + 4096), 10)
            await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        rig.eng.deregister(region)
        took = time.perf_counter() - t0
        victim[:] = 0x77                            # anything read from it from now on shows
        after = victim.copy()
        assert took < 1.0 * TIME_SCALE, f"deregister() took {took:.2f} s"
        assert rig.eng.counters()["cut_off"] == cut0 + 1
        if op == "write":
            try:
                w.write(b"\x22" * (n - n // 2))    # the rest: must not land
                await w.drain()
            except (ConnectionError, OSError):
                pass
        try:                                        # the target closed the connection
            while chunk := await bounded(reader.read(1 << 20), 10):
                got += chunk
        except ConnectionError:
            pass
        if op == "read":
            assert len(got) < DATA_HEADER.size + victim.nbytes, "the whole response went out"
            assert b"\x77" not in got, "bytes were read from the region after deregister() returned"
        deadline = time.monotonic() + 10              # its connection and thread are gone
        while rig.eng.counters()["threads"] != rig.baseline["threads"]:
            assert time.monotonic() < deadline, rig.eng.counters()
            await asyncio.sleep(0.002)
        assert np.array_equal(victim, after), "bytes landed in the region after deregister() returned"
    finally:
        if w is not None:
            w.close()
        await close_session(session)
    await rig.after_example()

ANCHORS = ["rw", "ro", "wo", "check", "arena", "arena_end", "zero", "top"]
PAYLOAD_CAP = 80 * KiB


@dataclasses.dataclass(frozen=True)
class Frame:
    """One data frame as the fuzz draws it; `anchor` + `offset` make its
    address (resolve())."""

    magic: int
    kind: int
    status: int
    tag: int
    anchor: str
    offset: int
    length: int
    aux: int
    cut: int          # < 0: send it whole; else bytes of header+payload sent before end of stream
    seed: int
    end_delta: int | None   # not None: the length ends this many bytes past the anchor region's end


# Mostly frames that parse, so that sequences go on; each field sometimes wrong.
frame_kinds = weighted((6, st.just(F_WRITE)), (3, st.just(F_READ_REQ)), (1, st.integers(0, 255)))
lengths = weighted(
    (4, st.integers(0, 4096)),
    (2, st.integers(0, 64)),
    (1, st.integers(0, 70 * KiB)),
    (1, st.sampled_from([0, 1, 16 * KiB - 1, 16 * KiB, 16 * KiB + 1, 64 * KiB, 64 * KiB + 1, MAX_PAYLOAD,
                         MAX_PAYLOAD + 1, 1 << 32, 1 << 63, U64 - 1])),
    (1, st.integers(0, U64 - 1)),
)
offsets = weighted(
    (4, st.integers(0, 16 * KiB)),
    (2, st.integers(-64, 64)),
    (1, st.sampled_from([16 * KiB - 1, 16 * KiB, 64 * KiB - 1, 64 * KiB, -GUARD, -1])),
    (1, st.integers(-GUARD, 70 * KiB)),
    (1, st.integers(-U64 + 1, U64 - 1)),
)
frames_strategy = st.builds(
    Frame,
    magic=weighted((9, st.just(DATA_MAGIC)), (1, st.integers(0, 0xFFFF))),
    kind=frame_kinds,
    status=st.integers(0, 255),
    tag=st.integers(0, (1 << 32) - 1),
    anchor=weighted((3, st.sampled_from(["rw", "ro", "wo", "check"])), (1, st.sampled_from(ANCHORS))),
    offset=offsets,
    length=lengths,
    aux=st.integers(0, U64 - 1),
    cut=weighted((9, st.just(-1)), (1, st.integers(0, DATA_HEADER.size + 200))),
    seed=st.integers(0, 1 << 30),
    end_delta=weighted((4, st.none()), (1, st.integers(-2, 2))),
)


def resolve(rig: Rig, f: Frame) -> tuple[int, int]:
    """The frame's address and length."""
    base = {"arena": rig.base, "arena_end": rig.base + len(rig.arena), "zero": 0, "top": U64}.get(f.anchor)
    length = f.length
    if base is None:
        base = rig.addr(f.anchor)
        if f.end_delta is not None:
            length = max(0, rig.spans[f.anchor].length - f.offset + f.end_delta)
    return (base + f.offset) % U64, length % U64


@fuzz_settings(80)
@given(frames=st.lists(frames_strategy, min_size=1, max_size=8), index=st.integers(0, 255),
       ack_conn=st.booleans(), second_ack=st.booleans(),
       hello_fault=st.sampled_from([None] * 10 + ["magic", "type", "version", "role", "token"]))
async def test_data_server_frames_match_model(rig, frames, index, ack_conn, second_ack, hello_fault):
    """Over an authenticated hello (or one with a single field wrong), a
    sequence of frames: every ack, every read response and every byte of
    memory is what the model says. The model: a frame with a bad magic, a
    length over the payload limit or an unknown type ends the connection; a
    WRITE lands iff [addr, addr+len) lies inside one region with WRITE
    access (else EREMOTE, payload skipped); a READ_REQ answers iff inside
    one region with READ access; a frame cut short ends the connection
    (a cut payload of a good WRITE lands as far as it arrived)."""
    _, session, token = await open_session(rig)
    ack_writer: asyncio.StreamWriter | None = None
    ack_task: asyncio.Future[bytes] | None = None
    try:
        if ack_conn:
            ack_reader, ack_writer = await bounded(asyncio.open_connection(rig.data_host, rig.data_port))
            ack_writer.write(data_hello(token, role=DATA_ROLE_ACK))
            (h, _), = parse_headers(await bounded(ack_reader.readexactly(DATA_HEADER.size)))
            assert h[1] == DATA_HELLO_ACK and h[2] == ST_OK, h
            if second_ack:   # one ack connection per session
                second = data_hello(token, role=DATA_ROLE_ACK)
                assert_refused(await exchange(rig.data_host, rig.data_port, second), len(second))
            ack_task = asyncio.ensure_future(ack_reader.read(-1))

        fields: dict[str, int] = {"role": DATA_ROLE_DATA, "index": index}
        hello_ok = hello_fault is None
        if hello_fault == "magic":
            fields["magic"] = DATA_MAGIC ^ 0x100
        elif hello_fault == "type":
            fields["kind"] = DATA_HELLO_ACK
        elif hello_fault == "version":
            fields["version"] = DATA_WIRE_VERSION + 1
        elif hello_fault == "role":
            fields["role"] = 2 + index
        elif hello_fault == "token":
            token = token[:15] + bytes([token[15] ^ 0x80])
        stream = data_hello(token, **fields)

        # Run the model over the frames; send them up to the first one that
        # ends the connection, which is sent last.
        expected = rig.expected.copy()
        want_data: list[tuple[int, int, int, bytes]] = []     # (type, status, tag, payload)
        want_acks: list[tuple[int, int]] = []                 # (status, tag)
        for f in frames:
            addr, length = resolve(rig, f)
            head = data_header(f.magic, f.kind, f.status, f.tag, addr, length, f.aux)
            fatal = f.magic != DATA_MAGIC or length > MAX_PAYLOAD or \
                f.kind not in (F_WRITE, F_READ_REQ, F_FENCE) or (f.kind == F_FENCE and length != 0)
            if f.kind == F_WRITE and not fatal:
                n = min(length, PAYLOAD_CAP)
                payload = pattern(f.seed, n).tobytes()
                whole = head + payload
                cut = f.cut if 0 <= f.cut < len(whole) else len(whole)
                stream += whole[:cut]
                landed = max(0, cut - DATA_HEADER.size)
                at = rig.find(addr, length, Access.WRITE)
                if at is not None:
                    expected[at:at + landed] = np.frombuffer(payload[:landed], np.uint8)
                if cut < len(whole) or n < length:
                    event(f"ends: write payload cut short (inside a region: {at is not None})")
                    break
                event(f"write {'lands' if at is not None else 'refused'}")
                want_acks.append((ST_OK if at is not None else ST_EREMOTE, f.tag))
            else:
                if 0 <= f.cut < DATA_HEADER.size:
                    event("ends: header cut short")
                    stream += head[:f.cut]
                    break
                stream += head
                if fatal:
                    event("ends: bad magic, length or type")
                    break
                if f.kind == F_FENCE:
                    # names no other connection of the session (this is its
                    # only data connection): nothing happens
                    event("fence")
                    continue
                at = rig.find(addr, length, Access.READ)
                event(f"read {'answered' if at is not None else 'refused'}")
                if at is not None:
                    want_data.append((F_READ_RESP, ST_OK, f.tag, expected[at:at + length].tobytes()))
                else:
                    want_data.append((F_READ_RESP, ST_EREMOTE, f.tag, b""))
        if not hello_ok:
            expected = rig.expected
            want_data, want_acks = [], []

        reply = await exchange(rig.data_host, rig.data_port, stream)
        if not hello_ok:
            assert_refused(reply, len(stream))
        else:
            heads = parse_headers(reply)
            assert heads and heads[0][0][1] == DATA_HELLO_ACK and heads[0][0][2] == ST_OK, heads[:1]
            got_acks = []
            got_data = []
            for h, payload in heads[1:]:
                if h[1] == F_WRITE_ACK:
                    assert not ack_conn, "a write ack on the data connection while the session has an ack one"
                    assert h[6] == index, f"ack names data connection {h[6]}, not {index}"
                    got_acks.append((h[2], h[3]))
                else:
                    assert h[1] == F_READ_RESP, f"unexpected frame type {h[1]}"
                    got_data.append((h[1], h[2], h[3], payload))
            if ack_conn:
                ack_writer.write_eof()
                try:
                    raw_acks = await bounded(ack_task, 10)
                except ConnectionResetError:
                    pytest.fail("the ack connection was reset")
                for h, _ in parse_headers(raw_acks, count_payload=False):
                    assert h[1] == F_WRITE_ACK and h[6] == index, h
                    got_acks.append((h[2], h[3]))
            assert got_acks == want_acks
            assert got_data == want_data
        rig.expected = expected
    finally:
        if ack_task is not None:
            ack_task.cancel()
            await asyncio.gather(ack_task, return_exceptions=True)
        if ack_writer is not None:
            ack_writer.close()
        await close_session(session)
    await rig.after_example()
