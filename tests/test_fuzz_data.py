"""Fuzzing (hypothesis) of the tcp data server (``kvflow/_native/tcp_server.c``),
live against a real Engine: raw sockets sending random bytes, hellos with
random, stale or mutated tokens, and, over an authenticated hello, frame
sequences with addresses and lengths around and outside the regions,
truncated headers and payloads, oversized lengths. A model predicts every
ack, every read response and every byte of memory. The rig and its checks
after every example: tests/_fuzz_rig.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from _batches import TIME_SCALE, KiB, bounded
from _target import pattern
from kvflow.control.wire import (
    DATA_HEADER,
    DATA_HELLO,
    DATA_HELLO_ACK,
    DATA_MAGIC,
    DATA_ROLE_ACK,
    DATA_ROLE_DATA,
    DATA_WIRE_VERSION,
)
from kvflow.memory import Access
from _fuzz_rig import (F_FENCE, F_READ_REQ, F_READ_RESP, F_WRITE, F_WRITE_ACK, GUARD, HDR_FLUSH, MAX_PAYLOAD,
                       ST_EPROTO, ST_EREMOTE, ST_OK, U64, Rig, close_session, exchange, fuzz_settings,
                       open_session, rig_fixture, weighted)  # noqa: F401 (a fixture)


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
