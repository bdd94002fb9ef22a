"""Cluster metadata (kvflow.metadata): engines publish records on a real Redis
or etcd server that the fixtures start (their own instances, on free ports,
killed at teardown) and connect to each other by name.

Without redis-server or etcd on PATH the tests that need it skip with the
reason; under CI (CI=true) they fail instead (.ci/setup installs both).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

import kvflow
from kvflow.metadata import STORE_TIMEOUT, open_store
from _batches import bounded
from _metadata_servers import BINARIES, free_port as _free_port, server  # noqa: F401 (a fixture)
from _target import pattern

TTL = 1.0
# An unreachable or silent metadata server must cost a caller about one
# store timeout, never more; the slack absorbs a loaded CI machine.
FAST = STORE_TIMEOUT + 1.5
@pytest.fixture
async def store(server):
    """The test's own view of the server (to check what engines left there)."""
    st = open_store(server.url)
    yield st
    await st.close()


async def _record(engine: kvflow.Engine, name: str, until=lambda r: True, wait: float = 5.0):
    """engine.lookup(name) once it exists and satisfies `until`."""
    deadline = time.monotonic() + wait
    while True:
        try:
            rec = await engine.lookup(name)
            if until(rec):
                return rec
        except kvflow.PeerUnreachableError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"no record {name!r} satisfying the condition within {wait} s")
        await asyncio.sleep(0.05)


async def _gone(store, name: str, wait: float) -> float:
    """Seconds until `name` is no longer on the server."""
    t0 = time.monotonic()
    while await store.lookup(name) is not None:
        if time.monotonic() - t0 > wait:
            pytest.fail(f"{name!r} still published {wait} s later")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def _write_and_check(peer, src, dst, seed: int) -> None:
    src.view[:] = pattern(seed, src.length)
    await bounded(peer.write([src.addr], [dst.addr], [src.length]))
    assert np.array_equal(dst.view, src.view)


# An engine in a child process (killed with SIGKILL by the tests): prints its
# address and incarnation, then lives until stdin closes.
CHILD = r"""
import asyncio, json, sys
import numpy as np
import kvflow

async def main(cfg):
    async with kvflow.Engine(cfg["listen"], protocols=["tcp"], metadata=cfg["url"], name=cfg["name"],
                             metadata_ttl=cfg["ttl"]) as eng:
        buf = np.zeros(1 << 16, np.uint8)
        eng.register(buf, name="kv")
        print(json.dumps({"address": eng.address, "incarnation": eng._incarnation}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main(json.loads(sys.argv[1])))
"""


class ChildEngine:
    def __init__(self, proc, info) -> None:
        self.proc, self.address, self.incarnation = proc, info["address"], info["incarnation"]

    @classmethod
    async def start(cls, url: str, name: str, listen: str = "127.0.0.1:0") -> "ChildEngine":
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        cfg = {"url": url, "name": name, "listen": listen, "ttl": TTL}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, json.dumps(cfg),
                                                    stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env)
        try:
            line = await bounded(proc.stdout.readline(), 30)
            return cls(proc, json.loads(line))
        except BaseException:
            proc.kill()
            await proc.wait()
            raise

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await bounded(self.proc.wait(), 10)


@pytest.fixture
async def children():
    made: list[ChildEngine] = []

    async def make(*args, **kw) -> ChildEngine:
        c = await ChildEngine.start(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.kill()


# ---------------------------------------------------------------- with a server


async def test_publish_lookup_connect_by_name_and_write(server, make_engine, local_mem):
    target = await make_engine(metadata=server.url, name="decode-0", metadata_ttl=TTL)
    init = await make_engine(metadata=server.url, metadata_ttl=TTL)
    dst = local_mem(target, 256 << 10, name="kv")
    src = local_mem(init, 256 << 10)
    # registering after start() publishes the new region table too
    rec = await _record(init, "decode-0", lambda r: [x.name for x in r.descriptor.regions] == ["kv"])
    assert (rec.name, rec.address, rec.incarnation) == ("decode-0", target.address, target._incarnation)
    assert init.name == init.address                    # the default name
    if server.kind == "http":
        with pytest.raises(kvflow.KVFlowError, match="cannot list"):   # the protocol has no listing
            await init.directory()
    else:
        assert set(await init.directory()) >= {"decode-0", init.address}
    peer = await bounded(init.connect("decode-0"))
    assert peer is await init.connect(target.address)    # one peer per address, however reached
    assert peer.descriptor.incarnation == target._incarnation
    await _write_and_check(peer, src, dst, seed=11)


async def test_close_removes_the_record(server, store, make_engine):
    target = await make_engine(metadata=server.url, name="leaving", metadata_ttl=30)
    init = await make_engine(metadata=server.url)
    assert await store.lookup("leaving") is not None
    await target.close()
    assert await store.lookup("leaving") is None         # deleted, not left to expire (ttl 30 s)
    with pytest.raises(kvflow.PeerUnreachableError, match="leaving") as e:
        await bounded(init.connect("leaving"))
    assert f"127.0.0.1:{server.port}" in str(e.value)


async def test_killed_engine_record_expires(server, store, children):
    if server.kind == "http":
        pytest.skip("Mooncake's HTTP metadata protocol has no expiry: a killed engine's record stays "
                    "until the next engine of its name overwrites it (as with Mooncake's own engines)")
    child = await children(server.url, "doomed")
    rec = await _record_via(store, "doomed")
    assert rec.incarnation == child.incarnation
    await child.kill()
    # refreshed every TTL/3 until the kill, so it lives at most TTL more
    # (etcd: whole-second leases, expiry checked every 0.5 s)
    took = await _gone(store, "doomed", wait=TTL + 4)
    assert took < TTL + 2


async def _record_via(store, name: str, wait: float = 5.0):
    from kvflow.metadata import EngineRecord

    deadline = time.monotonic() + wait
    while (data := await store.lookup(name)) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{name!r} not published within {wait} s")
        await asyncio.sleep(0.05)
    return EngineRecord.from_bytes(name, data)


async def test_restarted_engine_gets_a_new_incarnation(server, make_engine, local_mem, children):
    init = await make_engine(metadata=server.url, metadata_ttl=TTL)
    old = await children(server.url, "prefill", listen=f"127.0.0.1:{_free_port()}")
    first = await bounded(init.connect("prefill"))
    assert first.descriptor.incarnation == old.incarnation
    await old.kill()
    # The successor listens on the very same address: only the incarnation
    # tells the two apart, and the old handshake's regions must not be used.
    new = kvflow.Engine(old.address, protocols=["tcp"], metadata=server.url, name="prefill", metadata_ttl=TTL)
    await bounded(new.start())
    try:
        dst = local_mem(new, 64 << 10, name="kv")
        src = local_mem(init, 64 << 10)
        await _record(init, "prefill", lambda r: r.incarnation == new._incarnation and r.descriptor.regions)
        peer = await bounded(init.connect("prefill"))
        assert peer is not first
        assert peer.descriptor.incarnation == new._incarnation != old.incarnation
        await _write_and_check(peer, src, dst, seed=23)
        await peer.close()
    finally:
        await new.close()


async def test_unknown_name_fails_fast(server, make_engine):
    init = await make_engine(metadata=server.url)
    t0 = time.monotonic()
    with pytest.raises(kvflow.PeerUnreachableError, match="'nobody'") as e:
        await init.connect("nobody")
    assert time.monotonic() - t0 < 1.0
    assert e.value.peer == "nobody" and f"127.0.0.1:{server.port}" in str(e.value)
    with pytest.raises(kvflow.PeerUnreachableError):
        await init.lookup("nobody")


async def test_server_down_fails_fast_and_p2p_still_works(server, make_engine, local_mem):
    target = await make_engine(metadata=server.url, name="t", metadata_ttl=TTL)
    init = await make_engine(metadata=server.url, metadata_ttl=TTL)
    dst = local_mem(target, 64 << 10)
    src = local_mem(init, 64 << 10)
    server.kill()
    calls = [lambda: init.connect("t"), lambda: init.lookup("t")] + ([init.directory] if server.kind != "http" else [])
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(kvflow.PeerUnreachableError):
            await bounded(call())
        assert time.monotonic() - t0 < FAST
    # an engine starts without its metadata server (it publishes once the server answers)
    t0 = time.monotonic()
    late = await make_engine(metadata=server.url, name="late", metadata_ttl=TTL)
    assert time.monotonic() - t0 < FAST and late.address
    peer = await bounded(init.connect(target.address))     # host:port never needs the server
    await _write_and_check(peer, src, dst, seed=5)


async def test_server_restart_republishes(server, store, make_engine):
    target = await make_engine(metadata=server.url, name="survivor", metadata_ttl=TTL)
    assert (await _record_via(store, "survivor")).incarnation == target._incarnation
    server.kill()
    late = await make_engine(metadata=server.url, name="late", metadata_ttl=TTL)
    await asyncio.sleep(TTL)                      # the keepers notice the outage
    server.restart()                              # empty: every key and lease is gone
    t0 = time.monotonic()
    rec = await _record_via(store, "survivor", wait=3 * TTL + 2)
    assert rec.incarnation == target._incarnation
    assert (await _record_via(store, "late", wait=3 * TTL + 2)).address == late.address
    assert time.monotonic() - t0 < 3 * TTL + 2


async def test_deleted_record_is_republished(server, store, make_engine):
    """A record deleted under a live engine (an operator, a failover that lost
    it) comes back at the next refresh, not only after a server outage."""
    target = await make_engine(metadata=server.url, name="stubborn", metadata_ttl=TTL)
    await _record_via(store, "stubborn")
    key = "kvflow/engines/stubborn"
    if server.kind == "redis":
        assert await store._call("DEL", key) == 1
    elif server.kind == "http":
        assert (await store._call("DELETE", "stubborn")).status == 200
    else:
        doc = await store._post("/v3/kv/deleterange", {"key": base64.b64encode(key.encode()).decode()})
        assert doc.get("deleted") == "1"
    assert await store.lookup("stubborn") is None
    t0 = time.monotonic()
    assert (await _record_via(store, "stubborn", wait=2 * TTL + 1)).incarnation == target._incarnation
    assert time.monotonic() - t0 < TTL + 1        # one refresh period (TTL/3) and a publish


async def test_malformed_records_are_rejected(server, store, make_engine):
    init = await make_engine(metadata=server.url, name="good")
    await store.publish("garbage", b"\xc1 not msgpack", 30)
    await store.publish("wrongshape", msgpack.packb({"address": 1, "incarnation": "x"}), 30)
    await store.publish("noregions", msgpack.packb({"address": "127.0.0.1:1", "incarnation": 1,
                                                    "descriptor": {"address": "127.0.0.1:1"}}), 30)
    for name in ("garbage", "wrongshape", "noregions"):
        with pytest.raises(kvflow.ProtocolError, match=name):
            await init.lookup(name)
        with pytest.raises(kvflow.ProtocolError):
            await init.connect(name)
    if server.kind != "http":                                # (no listing there)
        assert set(await init.directory()) == {"good"}     # the bad ones are left out, not fatal
    for name in ("garbage", "wrongshape", "noregions"):
        await store.remove(name)


# ---------------------------------------------------------------- without a server


@pytest.mark.parametrize("scheme", [*sorted(BINARIES), "http"])
async def test_silent_server_is_bounded(scheme, make_engine):
    """A server that accepts and never answers (a hung or black-holed host)
    costs one store timeout, in start(), connect() and close() alike."""
    conns: list[asyncio.StreamWriter] = []

    async def hold(reader, writer):
        conns.append(writer)
        await reader.read()

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    url = f"{scheme}://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        t0 = time.monotonic()
        eng = await make_engine(metadata=url, name="e", metadata_ttl=TTL)
        assert time.monotonic() - t0 < FAST
        t0 = time.monotonic()
        with pytest.raises(kvflow.PeerUnreachableError, match="did not answer"):
            await bounded(eng.connect("other"))
        assert time.monotonic() - t0 < FAST
        t0 = time.monotonic()
        await bounded(eng.close())
        assert time.monotonic() - t0 < FAST
    finally:
        for w in conns:
            w.close()
        silent.close()
        await silent.wait_closed()


@pytest.mark.parametrize("url", ["redis://", "redis://h", "etcd://h:1/x", "http://h", "http://u:p@h:1",
                                 "https://h:1", "redis://h:1/db", 7])
def test_bad_metadata_urls(url):
    with pytest.raises(kvflow.InvalidArgumentError):
        kvflow.Engine(metadata=url)


@pytest.mark.parametrize("name", ["", "a b", "x\n", "host:80", "10.0.0.1:5000"])
def test_bad_names(name):
    with pytest.raises(kvflow.InvalidArgumentError):
        kvflow.Engine(metadata="redis://127.0.0.1:1", name=name)


async def test_p2p_engine_has_no_directory(make_engine):
    eng = await make_engine(metadata="p2p")
    with pytest.raises(kvflow.InvalidArgumentError, match="no metadata server"):
        await eng.lookup("x")
    with pytest.raises(kvflow.InvalidArgumentError):
        await eng.connect("not-an-address")                # names need a metadata server


def test_import_stays_light():
    code = "import sys, kvflow; print(','.join(m for m in ('aiohttp',) if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
