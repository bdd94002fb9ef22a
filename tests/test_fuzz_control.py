"""Fuzzing (hypothesis) of the handshake/control server (msgpack frames,
``kvflow/handshake.py`` and ``Engine._serve_control``), live against a real
Engine: random bytes, frames of random bodies, oversized and lying length
prefixes, random msgpack, and messages of the right types with wrong,
missing, huge or nested fields; before and after authentication. The rig
and its checks after every example: tests/_fuzz_rig.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from _batches import bounded
from kvflow.control.wire import (
    MAX_FRAME,
    encode,
    read_message,
)
from kvflow.control.auth import NONCE_BYTES
from _fuzz_rig import (LEN, PRE_AUTH_FRAME, check_notifications, close_session, control_model, exchange,
                       fuzz_settings, open_session, parse_frames, rig_fixture, weighted)  # noqa: F401 (a fixture)
from _fuzz_wire import SESSION_TYPES, almost_messages, deep, frame, frames_of, junk


# ---------------------------------------------------------------- control server, live

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
