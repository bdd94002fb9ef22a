"""A master made durable by etcd (kvflow/store/durable.py, election.py,
follow.py): a real etcd started by the test, masters and holders in
processes of their own, SIGKILL. Without etcd on PATH the tests skip (under
CI they fail: tests/_metadata_servers.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import signal
import sys
import time

import msgpack
import numpy as np
import pytest

from _metadata_servers import MetadataServer, _unavailable, free_port
from _store_master import stop_member
from kvflow.errors import KVFlowError
from kvflow.store import DurabilityError, MasterUnavailableError, ObjectNotFoundError, StoreClient, record_form
from kvflow.store.errors import QuotaExceededError
from kvflow.store.etcd import EtcdClient, b64
from kvflow.store.rpc import TcpMasterLink

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ("--leader-ttl", "1", "--heartbeat-interval", "0.2")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        _unavailable("etcd is not installed (Debian: etcd-server)")
    s = MetadataServer("etcd", tmp_path)
    s.start()
    yield f"127.0.0.1:{s.port}"
    s.kill()


class MasterProc:
    """`python -m kvflow.store master --etcd ...` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.address: str | None = None

    async def line(self, timeout: float = 30) -> str:
        return (await asyncio.wait_for(self.proc.stdout.readline(), timeout)).decode()

    async def ready(self, timeout: float = 30) -> str:
        while True:
            line = await self.line(timeout)
            assert line, "the master exited before it was ready"
            if "ready" in line:
                self.address = line.split()[-1]
                return self.address

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def stop(self) -> int:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
        return await asyncio.wait_for(self.proc.wait(), 15)


async def _start_master(etcd: str, *args: str, cluster: str = "t") -> MasterProc:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0", "--etcd", etcd,
        "--cluster", cluster, *FAST, *args, "-v", stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
    return MasterProc(proc)


@contextlib.asynccontextmanager
async def _masters():
    made: list[MasterProc] = []

    async def start(*a, **kw) -> MasterProc:
        m = await _start_master(*a, **kw)
        made.append(m)
        return m
    try:
        yield start
    finally:
        for m in made:
            await m.stop()


async def _member(spec: str, key: str, size: int, seed: int, segment_size: int = 32 << 20):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "_store_member.py"), spec, str(segment_size), key, str(size),
        str(seed), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
    info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    assert info["ready"] and info["replicas"] == 1
    return proc, info


_stop_member = stop_member


async def _until(cond, timeout: float = 20.0, step: float = 0.05) -> float:
    """Seconds until `cond()` is true (a typed error counts as not yet)."""
    t0 = time.monotonic()
    while not await _quiet(cond):
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(step)
    return time.monotonic() - t0


async def test_restarted_master_recovers_the_index(etcd):
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd, "--client-grace", "3")
        await m1.ready()
        h1, i1 = await _member(spec, "from-h1", 300_000, 11)
        h2, i2 = await _member(spec, "from-h2", 200_000, 12)
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), local_buffer_size=64 << 20) as c:
                values = {f"k/{i}": _data(50_000 + 13 * i, 100 + i) for i in range(48)}
                keys = list(values)
                # half on h1 only, half on h2 only: the h2 half goes when h2 does not come back
                on1 = [c.batch_put(keys[:24], [values[k] for k in keys[:24]], preferred_segment=i1["segment"]),
                       c.batch_put(keys[24:], [values[k] for k in keys[24:]], preferred_segment=i2["segment"])]
                assert [n for r in await asyncio.gather(*on1) for n in r] == [1] * 48
                used = (await c.stats())["used"]
                m1.kill()
                await m1.proc.wait()                    # gone first: it never sees h2 go
                h2.kill()                               # h2 dies with the master and never comes back
                await h2.wait()
                m2 = await start(etcd, "--client-grace", "3")
                await m2.ready()
                # c follows the new leader by itself; h1 re-attaches by its heartbeats
                got = await c.batch_get(keys[:24] + ["from-h1"])
                assert got[:24] == [values[k] for k in keys[:24]]   # every byte
                assert got[24] == _data(300_000, 11)
                st = await c.stats()
                assert st["objects"] == 50 and st["used"] == used
                # a put needs an attached segment: h1 mounts its segment again
                await _until(lambda: c.put("after", b"x" * 1000, preferred_segment=i1["segment"]))
                assert await c.get("after") == b"x" * 1000
                # h2's objects go after the grace; h1's stay
                await _until(lambda: _gone(c, keys[24:]), timeout=15)
                assert all(await c.batch_exists(keys[:24]))
                assert await c.batch_get(keys[:24]) == [values[k] for k in keys[:24]]
                # etcd holds exactly what is left: h2's objects left their records
                left = set(keys[:24]) | {"from-h1", "after"}
                await _until(lambda: _same(_recorded(etcd, "t"), left), timeout=5)
        finally:
            await _stop_member(h1)
            await _stop_member(h2)


async def _recorded(etcd: str, cluster: str) -> set[str]:
    """The object keys in the cluster's records in etcd (durable.py's layout)."""
    e = EtcdClient(etcd)
    try:
        kvs = await e.range_prefix(f"kvflow/store/{cluster}/r/".encode())
    finally:
        await e.close()
    return {entry[0] for kv in kvs for entry in _record_entries(kv["value"])}


def _record_entries(value: bytes) -> list[list]:
    """A record's entries, whichever form it is in (record_form.py)."""
    v = msgpack.unpackb(value, raw=False)
    if isinstance(v, list):
        return v
    cols = record_form.from_packed([(0, v)])
    return [cols.entry(i) for i in range(len(cols.keys))]


async def _same(got, want) -> bool:
    return await got == want


async def _quiet(cond) -> bool:
    try:
        return bool(await cond())
    except KVFlowError:
        return False


async def _gone(c: StoreClient, keys: list[str]) -> bool:
    return not any(await c.batch_exists(keys))


async def test_leader_killed_standby_takes_over(etcd):
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd)
        a1 = await m1.ready()
        m2 = await start(etcd)
        assert "standby" in await m2.line()
        h1, i1 = await _member(spec, "from-h1", 100_000, 31)
        h2, i2 = await _member(spec, "from-h2", 100_000, 32)
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), local_buffer_size=64 << 20) as c:
                assert c.master_address == a1
                values = {f"p/{i}": _data(64 << 10, 200 + i) for i in range(64)}
                keys = list(values)
                assert await c.batch_put(keys, list(values.values()), replica_num=2) == [2] * 64
                hits_before = sum(g == values[k] for k, g in zip(keys, await c.batch_get(keys)))
                stop = asyncio.Event()
                times: list[tuple[float, float]] = []       # (start, end) of each get call

                async def reader():
                    while not stop.is_set():
                        t = time.monotonic()
                        got = await c.batch_get(keys)
                        assert got == [values[k] for k in keys]     # never an error, never wrong bytes
                        times.append((t, time.monotonic()))

                put_ok: dict[str, bytes] = {}
                put_failed: list[KVFlowError] = []

                async def putter():
                    # puts straddle the kill: each one is stored or fails with a typed error
                    i = 0
                    while not stop.is_set():
                        k, v = f"during/{i}", _data(20_000, 5000 + i)
                        i += 1
                        try:
                            if await c.put(k, v) == 1:
                                put_ok[k] = v
                        except KVFlowError as e:
                            put_failed.append(e)

                task = asyncio.create_task(reader())
                ptask = asyncio.create_task(putter())
                await asyncio.sleep(0.3)
                t_kill = time.monotonic()
                m1.kill()
                a2 = await m2.ready()
                t_ready = time.monotonic()
                await _until(lambda: _after(times, t_kill))
                await asyncio.sleep(0.3)
                stop.set()
                await task
                await ptask
                print(f"\nputs during the failover: {len(put_ok)} stored, {len(put_failed)} failed: "
                      f"{sorted({type(e).__name__ for e in put_failed})}")
                assert len(put_ok) > 5 and not put_failed, put_failed
                assert await c.batch_get(list(put_ok)) == list(put_ok.values())
                # the gap: from the kill to the end of the first get that began after it
                first = min(e for s, e in times if s >= t_kill)
                stalled = max(e - s for s, e in times)
                hits_after = sum(g == values[k] for k, g in zip(keys, await c.batch_get(keys)))
                print(f"\nfailover: leader SIGKILLed, standby ready after {t_ready - t_kill:.3f} s, "
                      f"first get after the kill done at {first - t_kill:.3f} s, longest get call "
                      f"{stalled:.3f} s; hit rate before {hits_before}/64, after {hits_after}/64")
                assert hits_before == hits_after == 64
                assert c.master_address == a2 != a1
                # the client goes on: puts (two replicas once both holders are back), and gets
                n = 0

                async def put_two() -> bool:
                    nonlocal n
                    n += 1
                    return await c.put(f"after/{n}", b"still here", replica_num=2) == 2
                await _until(put_two, timeout=10)
                assert await c.get(f"after/{n}") == b"still here"
                assert (await c.stats())["clients"] == 3
        finally:
            await _stop_member(h1)
            await _stop_member(h2)


async def _after(times, t: float) -> bool:
    return any(s >= t for s, _ in times)


async def test_put_in_progress_at_the_crash_is_revoked(etcd):
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd, "--client-grace", "5")
        a1 = await m1.ready()
        h1, i1 = await _member(spec, "from-h1", 4096, 41)
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",)) as c:
                before = (await c.stats())["used"]
                # a writer of its own on the raw link: allocate, never commit
                w = await TcpMasterLink.open(a1)
                await w.call("register", "writer-1", "h", "127.0.0.1:1")
                started = await w.call("batch_put_start", [["half", 1 << 20, 1, None, False]], 7)
                assert started["items"][0][0] == 0           # allocated
                assert (await c.stats())["used"] == before + (1 << 20)
                assert not await c.exists("half")             # invisible while in progress
                m1.kill()
                await m1.proc.wait()
                m2 = await start(etcd, "--client-grace", "5")
                a2 = await m2.ready()
                assert not await c.exists("half")
                with pytest.raises(ObjectNotFoundError):
                    await c.get("half")
                assert (await c.stats())["used"] == before    # its space came back
                # the writer's commit on the new master: nothing to commit
                w2 = await TcpMasterLink.open(a2)
                await w2.call("register", "writer-1", "h", "127.0.0.1:1")
                ended = await w2.call("batch_put_end", [["half", []]])
                assert ended[0][:2] == [1, "not_found"]
                await w2.close()
                await w.close()
                # and the key is free for a whole put
                await _until(lambda: c.put("half", _data(1 << 20, 5), preferred_segment=i1["segment"]))
                assert await c.get("half") == _data(1 << 20, 5)
                assert await c.get("from-h1") == _data(4096, 41)
        finally:
            await _stop_member(h1)


async def test_a_fenced_leader_stops(etcd):
    # a leader stopped past its lease: the standby leads; the old one, woken,
    # may not write (its txn is fenced), and exits with status 3
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd)
        a1 = await m1.ready()
        m2 = await start(etcd)
        assert "standby" in await m2.line()
        async with StoreClient(a1, segment_size=1 << 20, protocols=("tcp",)) as old:
            os.kill(m1.proc.pid, signal.SIGSTOP)
            a2 = await m2.ready()
            async with StoreClient(spec, segment_size=1 << 20, protocols=("tcp",)) as c:
                assert c.master_address == a2
                os.kill(m1.proc.pid, signal.SIGCONT)
                with pytest.raises((DurabilityError, MasterUnavailableError)):
                    await old.put("stale", b"from the old leader")
                assert await asyncio.wait_for(m1.proc.wait(), 15) == 3
                assert not await c.exists("stale")


async def test_etcd_down_at_start_is_a_typed_error():
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0", "--etcd", dead,
        "--etcd-timeout", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1 and b"DurabilityError" in err and dead.encode() in err and b"ready" not in out
    assert time.monotonic() - t0 < 15
    with pytest.raises(DurabilityError):
        await EtcdClient(dead, timeout=1).post("/v3/maintenance/status", {})
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailableError):
        await StoreClient(f"etcd://{dead}/t", segment_size=0, timeout=1.0).start()
    assert time.monotonic() - t0 < 5
    with pytest.raises(Exception) as e:
        StoreClient(["not an address"])
    assert "host:port" in str(e.value)


async def test_an_address_list_follows_a_master_restarted_in_memory():
    # no etcd: the master keeps everything in memory as before; a client
    # given a list of addresses reconnects to whichever answers, mounts its
    # segment again and goes on (what the lost master held is gone)
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"

    async def master() -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvflow.store", "master", "--listen", f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
        assert "ready" in (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        return proc

    m = await master()
    try:
        async with StoreClient([dead, f"127.0.0.1:{port}"], segment_size=1 << 20, protocols=("tcp",)) as c:
            await c.put("k", b"value")
            assert await c.get("k") == b"value"
            m.kill()
            await m.wait()
            m = await master()
            assert not await c.exists("k")               # retried on the new master: in memory, gone
            assert await c.put("k", b"again") == 1       # its segment was mounted again
            assert await c.get("k") == b"again"
            assert (await c.stats())["clients"] == 1
    finally:
        m.kill()
        await m.wait()


# -- what a put asked for survives a failover: its want count, its pins, its namespace's quota


async def _entries(etcd: str, cluster: str) -> dict[str, list]:
    """Each recorded object's entry (durable.py's layout), by key."""
    e = EtcdClient(etcd)
    try:
        kvs = await e.range_prefix(f"kvflow/store/{cluster}/r/".encode())
    finally:
        await e.close()
    return {entry[0]: entry for kv in kvs for entry in _record_entries(kv["value"])}


async def _write_old_records(etcd: str, cluster: str, keys: set[str]) -> int:
    """Rewrites the records holding `keys` as the code before want and
    soft pins wrote them: 6 fields an entry. Returns the records rewritten."""
    e = EtcdClient(etcd)
    n = 0
    try:
        for kv in await e.range_prefix(f"kvflow/store/{cluster}/r/".encode()):
            entries = _record_entries(kv["value"])
            if any(entry[0] in keys for entry in entries):
                old = [entry[:6] if entry[0] in keys else entry for entry in entries]
                await e.txn([], [{"request_put": {"key": b64(kv["key"]),
                                                  "value": b64(msgpack.packb(old, use_bin_type=True))}}])
                n += 1
    finally:
        await e.close()
    return n


async def _whole(etcd: str, keys: list[str], lost_segment: int) -> bool:
    got = await _entries(etcd, "t")
    return all(k in got and len(got[k][2]) == 2 and all(r[0] != lost_segment for r in got[k][2]) for k in keys)


async def test_want_count_survives_a_restart_and_lost_replicas_are_made_again(etcd):
    # two replicas asked for; the master restarts (SIGKILL); then a holder
    # is lost: the new leader knows the objects wanted two (from the records,
    # and for records in the old 6-field format, from the replicas they
    # name) and the surviving holders copy them again
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd, "--client-grace", "3")
        await m1.ready()
        members = [await _member(spec, f"from-h{i}", 4096, 50 + i) for i in range(3)]
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), local_buffer_size=64 << 20) as c:
                values = {f"w/{i}": _data(40_000 + 7 * i, 300 + i) for i in range(32)}
                keys = list(values)
                assert await c.batch_put(keys, list(values.values()), replica_num=2) == [2] * 32
                got = await _entries(etcd, "t")
                assert all(got[k][6] == 2 and got[k][7] == 0 for k in keys)
                m1.kill()
                await m1.proc.wait()
                # half the records as the code before this one wrote them: still recovered
                old = set(keys[:16])
                assert await _write_old_records(etcd, "t", old) >= 1
                got = await _entries(etcd, "t")
                assert all(len(got[k]) == 6 for k in old)
                m2 = await start(etcd, "--client-grace", "3")
                await m2.ready()
                assert await c.batch_get(keys) == list(values.values())
                await _until(lambda: _stat_is(c, "clients", 4))      # every holder re-attached
                # a holder lost after the failover: its replicas are made again elsewhere
                h, info = members[1]
                lost = [k for k, e in (await _entries(etcd, "t")).items()
                        if k in values and any(r[0] == info["segment"] for r in e[2])]
                assert lost and set(lost) & old and set(lost) - old
                h.kill()
                await h.wait()
                await _until(lambda: _whole(etcd, keys, info["segment"]), timeout=20)
                assert await c.batch_get(keys) == list(values.values())
                got = await _entries(etcd, "t")
                assert all(got[k][6] == 2 for k in keys)   # old records rewritten with the count
        finally:
            for h, _ in members:
                await _stop_member(h)


async def _stat_is(c: StoreClient, name: str, value) -> bool:
    return (await c.stats())[name] == value


async def _pressure(c: StoreClient, tag: str, n: int, size: int) -> None:
    """`n` unpinned puts of `size` bytes, 8 a call: more than the pool holds."""
    for i in range(0, n, 8):
        keys = [f"fill/{tag}/{j}" for j in range(i, min(n, i + 8))]
        await c.batch_put(keys, [b"f" * size] * len(keys))


async def test_pins_and_a_soft_pins_deadline_survive_a_restart(etcd):
    # a hard pin, a long soft pin and a short one; the master restarts
    # (SIGKILL); the new leader, under pressure, evicts everything unpinned
    # but keeps the pinned, and the short soft pin ends at its put's
    # deadline (not restarted by the recovery): then it goes too
    spec = f"etcd://{etcd}/t"
    size, short = 256 << 10, 15.0
    async with _masters() as start:
        m1 = await start(etcd)
        await m1.ready()
        # timeout 2 s: the new leader fences its recovered free space for the
        # clients' write window (7 s then, fence.py), well inside the short pin
        async with StoreClient(spec, segment_size=8 << 20, protocols=("tcp",), local_buffer_size=16 << 20,
                               timeout=2.0) as c:
            t_put = time.time()
            assert await c.put("soft-short", _data(size, 1), soft_pin=short) == 1
            assert await c.put("hard", _data(size, 2), pin=True) == 1
            assert await c.put("soft-long", _data(size, 3), soft_pin=600) == 1
            await c.batch_put([f"plain/{i}" for i in range(4)], [_data(size, 10 + i) for i in range(4)])
            got = await _entries(etcd, "t")
            assert got["hard"][3] is True and got["hard"][7] == 0
            assert abs(got["soft-short"][7] - (t_put + short)) < 2       # a wall-clock deadline
            assert abs(got["soft-long"][7] - (t_put + 600)) < 2
            m1.kill()
            await m1.proc.wait()
            m2 = await start(etcd)
            await m2.ready()
            t_ready = time.time()
            await _until(lambda: _stat_is(c, "segments", 1))
            await _until(lambda: c.put("after", b"x"))     # the segment is mounted again
            await _pressure(c, "a", 64, size)                      # twice the pool
            assert not any(await c.batch_exists([f"plain/{i}" for i in range(4)]))
            assert time.time() < t_put + short, "the failover outlasted the short pin: test too slow"
            assert await c.batch_get(["hard", "soft-long", "soft-short"]) == [_data(size, i) for i in (2, 3, 1)]
            # past the put's deadline (sooner than the recovery's plus the ttl): the short pin is over
            await asyncio.sleep(t_put + short + 0.5 - time.time())
            assert time.time() < t_ready + short
            await _pressure(c, "b", 64, size)
            assert await c.batch_exists(["hard", "soft-long", "soft-short"]) == [True, True, False]
            assert await c.get("hard") == _data(size, 2)


async def test_a_quota_survives_a_restart(etcd):
    # the tenant that set the quota is gone before the master restarts
    # (SIGKILL): the new leader holds its namespace to the quota all the same
    spec = f"etcd://{etcd}/t"
    async with _masters() as start:
        m1 = await start(etcd)
        await m1.ready()
        async with StoreClient(spec, segment_size=16 << 20, protocols=("tcp",), local_buffer_size=8 << 20) as c:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), namespace="tenant",
                                   quota=1 << 20) as q:
                assert await q.batch_put([f"t/{i}" for i in range(3)], [b"q" * (256 << 10)] * 3) == [1] * 3
            m1.kill()
            await m1.proc.wait()
            m2 = await start(etcd)
            await m2.ready()
            await _until(lambda: _stat_is(c, "segments", 1))
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), namespace="tenant",
                                   local_buffer_size=8 << 20) as q2:        # says no quota of its own
                assert all(await q2.batch_exists([f"t/{i}" for i in range(3)]))
                with pytest.raises(QuotaExceededError):
                    await q2.put("big", b"b" * (2 << 20))
                # within the quota, its own oldest objects make room: at most 4 of 256 KiB
                for i in range(8):
                    assert await q2.put(f"more/{i}", b"m" * (256 << 10)) == 1
                held = await q2.batch_exists([f"t/{i}" for i in range(3)] + [f"more/{i}" for i in range(8)])
                assert sum(held) == 4 and all(held[-4:])
            # another namespace is not held to it
            assert await c.put("free", b"f" * (2 << 20)) == 1


async def test_a_range_is_read_in_pages_sized_by_bytes(etcd):
    """range_prefix: pages of about page_bytes (a first small one, then
    sized from the bytes per key seen), every key once, in order."""
    e = EtcdClient(etcd)
    try:
        values = {f"pg/{i:04d}".encode(): bytes([i % 251]) * (5000 + 300 * (i % 7)) for i in range(300)}
        items = list(values.items())
        for lo in range(0, len(items), 100):
            await e.txn([], [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in items[lo:lo + 100]])
        before = e.requests
        kvs = await e.range_prefix(b"pg/", page_bytes=64 << 10)
        pages = e.requests - before
        assert [(kv["key"], kv["value"]) for kv in kvs] == items
        total = sum(len(b64(v)) for v in values.values())      # about 2.4 MB in base64
        # the first page is 64 keys whatever their size; the others about 64 KiB each
        assert total // (64 << 10) // 2 <= pages <= 2 * total // (64 << 10) + 1
        assert len(await e.range_prefix(b"pg/")) == 300         # the default: a few large pages
    finally:
        await e.close()
