"""kvflow.store's SSD tier: real engines, real files in a directory on the
host's disk (tmp_path), a tmpfs directory for the buffered fallback, and a
standalone master in a process of its own for the restart across
processes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import sys

import numpy as np
import pytest

from kvflow.errors import InvalidArgumentError
from kvflow.store import (
    Master,
    ObjectNotFoundError,
    ReplicaUnavailableError,
    StoreClient,
)
from kvflow.store.ssd import BLOCK, SsdTier, file_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEG = 4 << 20
OBJ = 512 << 10          # 8 objects fill a segment


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _in_dram(c: StoreClient, key: str) -> bool:
    """Whether the object has a DRAM replica (asked of the embedded master's
    model: get_replicas would lease it)."""
    return bool(c._embedded.model.objects[key].replicas)


def _files(d: pathlib.Path) -> list[pathlib.Path]:
    return sorted(d.glob("*/*.kvo"))


@contextlib.asynccontextmanager
async def _client(d, master=None, **kw):
    kw.setdefault("segment_size", SEG)
    async with StoreClient(master, ssd_path=str(d), **kw) as c:
        yield c


async def _fill(c: StoreClient, n: int, *, flush: bool = True, prefix: str = "k") -> dict[str, bytes]:
    vals = {}
    for i in range(n):
        k = f"{prefix}{i}"
        vals[k] = _data(OBJ, i)
        await c.put(k, vals[k])
        if flush:
            await c.ssd_flush()
    return vals


# -- the files ------------------------------------------------------------------
def test_tier_files_roundtrip_adoption_and_torn_files(tmp_path):
    t = SsdTier(str(tmp_path), 1 << 30)
    assert t.direct, t.direct_reason            # the host's disk takes O_DIRECT
    src = np.frombuffer(bytearray(_data(10_000, 1)), np.uint8)
    t.write("a", src.ctypes.data, 10_000)
    t.add("a", 10_000)
    # aligned destination (straight into it, the tail through a bounce) and an unaligned one
    buf = np.zeros(3 * BLOCK + BLOCK, np.uint8)
    off = (-buf.ctypes.data) % BLOCK
    t.read_into("a", 10_000, [(buf.ctypes.data + off, 3 * BLOCK)])
    assert bytes(buf[off:off + 10_000]) == bytes(src)
    odd = np.zeros(10_001, np.uint8)
    t.read_into("a", 10_000, [(odd.ctypes.data + 1, 4000), (odd.ctypes.data + 4001, 6000)])
    assert bytes(odd[1:]) == bytes(src)
    for key in ("b", "c", "d"):
        t.write(key, src.ctypes.data, 5000)
    # torn (truncated), corrupt (a payload byte flipped), a write that never ended, a misplaced file
    pb, pc = tmp_path / file_name("b"), tmp_path / file_name("c")
    os.truncate(pb, BLOCK + 512)
    raw = bytearray(pc.read_bytes())
    raw[BLOCK + 7] ^= 0xFF
    pc.write_bytes(raw)
    (pb.parent / ".tmp-deadbeef").write_bytes(b"x" * 100)
    os.makedirs(tmp_path / "zz", exist_ok=True)
    (tmp_path / "zz" / ("0" * 32 + ".kvo")).write_bytes((tmp_path / file_name("d")).read_bytes())
    with pytest.raises(InvalidArgumentError, match="in use"):
        SsdTier(str(tmp_path), 1 << 30)            # one tier per directory
    t.close()
    t2 = SsdTier(str(tmp_path), 1 << 30)
    assert sorted(k for k, _ in t2.scan()) == ["a", "d"]
    assert t2.discarded == 4 and len(_files(tmp_path)) == 2
    with pytest.raises(Exception, match="not 'x'|No such file"):
        t2.read_into("x", 10, [(buf.ctypes.data + off, BLOCK)])


def test_tier_where_o_direct_is_refused_says_why_and_buffers(tmp_path, monkeypatch):
    # tmpfs refused O_DIRECT until Linux 6.6 (EINVAL at open); this host's
    # kernel may take it, so the refusal is made here as that kernel makes it
    import errno

    from kvflow.store import ssd
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a)

    monkeypatch.setattr(ssd.os, "open", refusing_open)
    t = SsdTier(str(tmp_path), 1 << 20)
    assert not t.direct and "refuses O_DIRECT" in t.direct_reason
    with pytest.raises(InvalidArgumentError, match="direct I/O"):
        SsdTier(str(tmp_path), 1 << 20, direct=True)
    src = np.frombuffer(bytearray(_data(777, 3)), np.uint8)
    t.write("k", src.ctypes.data, 777)
    out = np.zeros(777, np.uint8)
    t.read_into("k", 777, [(out.ctypes.data, 777)])
    assert bytes(out) == bytes(src)
    monkeypatch.undo()
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir():                    # a real tmpfs: whatever the probe says, the tier works
        import shutil
        d = shm / f"kvflow-ssd-test-{os.getpid()}"
        try:
            t = SsdTier(str(d), 1 << 20)
            assert t.direct or "O_DIRECT" in t.direct_reason
            t.write("k", src.ctypes.data, 777)
            out[:] = 0
            t.read_into("k", 777, [(out.ctypes.data, 777)])
            assert bytes(out) == bytes(src)
        finally:
            shutil.rmtree(d, ignore_errors=True)


def test_tier_capacity_lru(tmp_path):
    t = SsdTier(str(tmp_path), 3 * SsdTier.file_bytes("k0", 1000))
    for i in range(3):
        assert t.make_room(SsdTier.file_bytes(f"k{i}", 1000)) == []
        t.add(f"k{i}", 1000)
    t.touch("k0")
    assert t.make_room(SsdTier.file_bytes("k3", 1000)) == ["k1"]
    assert t.make_room(10 * t.capacity) == []      # larger than the tier: nothing evicted for it


# -- through the pool -----------------------------------------------------------
async def test_offload_on_eviction_then_get_returns_the_same_bytes(tmp_path):
    async with _client(tmp_path, ssd_offload="evict", ssd_promote=False) as c:
        vals = await _fill(c, 24)                    # 3 segments' worth: most evicted from DRAM
        st = await c.stats()
        assert st["evictions"] > 0 and st["objects"] == 24 and st["ssd_missed"] == 0
        assert c.ssd.written < 24                    # only the objects nearest eviction were copied
        for k, v in vals.items():
            assert await c.get(k) == v
        ssd_only = [k for k in vals if not _in_dram(c, k)]
        assert len(ssd_only) >= 12
        assert all(await c.batch_exists(list(vals)))
        # get_into an aligned registered buffer: O_DIRECT straight into it
        buf = np.zeros(OBJ + BLOCK, np.uint8)
        reg = c.register_buffer(buf)
        a = reg.addr + (-reg.addr) % BLOCK
        assert await c.get_into(ssd_only[0], a, OBJ) == OBJ
        off = a - reg.addr
        assert bytes(buf[off:off + OBJ]) == vals[ssd_only[0]]


async def test_eager_mode_copies_every_put(tmp_path):
    async with _client(tmp_path, ssd_offload="eager") as c:
        vals = await _fill(c, 4, flush=False)
        for _ in range(100):                         # the cleaner, woken by the puts
            if c.ssd.written == 4:
                break
            await asyncio.sleep(0.05)
        assert c.ssd.written == 4 and len(_files(tmp_path)) == 4
        assert (await c.stats())["ssd_objects"] == 4
        vals.update(await _fill(c, 16, prefix="more"))
        for k, v in vals.items():
            assert await c.get(k) == v


async def test_promotion_on_hit(tmp_path):
    async with _client(tmp_path, ssd_offload="eager") as c:
        vals = await _fill(c, 16)
        cold = [k for k in vals if not _in_dram(c, k)]
        assert cold
        assert await c.get(cold[0]) == vals[cold[0]]
        assert _in_dram(c, cold[0])         # back in DRAM
        assert await c.get(cold[0]) == vals[cold[0]]  # now a DRAM hit
    async with _client(tmp_path / "np", ssd_offload="eager", ssd_promote=False) as c:
        vals = await _fill(c, 16)
        cold = [k for k in vals if not _in_dram(c, k)]
        assert await c.get(cold[0]) == vals[cold[0]]
        assert not _in_dram(c, cold[0])


async def test_restarted_client_readopts_and_discards_a_corrupt_file(tmp_path):
    master = Master(seed=1)
    await master.start("127.0.0.1:0")
    try:
        async with _client(tmp_path, master.address, ssd_offload="eager") as a:
            vals = await _fill(a, 6)
        await asyncio.sleep(0.05)
        assert master.model.objects == {}           # gone with its client
        bad = tmp_path / file_name("k2")
        raw = bytearray(bad.read_bytes())
        raw[BLOCK + 100] ^= 0x55
        bad.write_bytes(raw)
        async with _client(tmp_path, master.address, ssd_offload="eager") as b, \
                StoreClient(master.address, segment_size=0) as reader:
            assert b.ssd.adopted == 5 and b.ssd.tier.discarded == 1
            assert not bad.exists()
            for k, v in vals.items():
                if k == "k2":
                    with pytest.raises(ObjectNotFoundError):
                        await reader.get(k)
                else:
                    assert await reader.get(k) == v   # another client on this host: the file, read directly
    finally:
        await master.close()


async def test_ssd_full_evicts_its_lru(tmp_path):
    cap = 3 * SsdTier.file_bytes("k0", OBJ)
    async with _client(tmp_path, ssd_offload="eager", ssd_capacity=cap) as c:
        await _fill(c, 20)
        assert c.ssd.tier.used <= cap and len(c.ssd.tier.index) == 3 and len(_files(tmp_path)) == 3
        assert c.ssd.evicted == 17
        st = await c.stats()
        assert st["ssd_objects"] == 3
        # the oldest objects left DRAM and SSD: gone, never wrong bytes
        with pytest.raises(ObjectNotFoundError):
            await c.get("k0")


async def test_remove_and_remove_all_delete_the_files(tmp_path):
    async with _client(tmp_path, ssd_offload="eager") as c:
        vals = await _fill(c, 12)
        cold = [k for k in vals if not _in_dram(c, k)]
        await c.remove(cold[0])
        await c.remove(cold[-1] if cold[-1] != cold[0] else "k11")
        await c.ssd_flush()
        assert len(_files(tmp_path)) == 10
        with pytest.raises(ObjectNotFoundError):
            await c.get(cold[0])
        assert await c.remove_all() == 10
        await c.ssd_flush()
        assert _files(tmp_path) == [] and c.ssd.tier.used == 0
        assert (await c.stats())["objects"] == 0


async def test_bad_input_typed_errors(tmp_path):
    for kw in ({"ssd_offload": "sometimes"}, {"ssd_capacity": 0}, {"ssd_capacity": "1G"}, {"ssd_capacity": True}):
        with pytest.raises(InvalidArgumentError):
            StoreClient(ssd_path=str(tmp_path), **kw)
    with pytest.raises(InvalidArgumentError):
        StoreClient(ssd_path="")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError):
        await StoreClient(ssd_path=str(tmp_path / "file")).start()
    async with StoreClient(segment_size=SEG) as plain:
        with pytest.raises(InvalidArgumentError):
            await plain.ssd_flush()


async def test_reader_on_another_host_gets_the_holder_to_load_its_copy(tmp_path):
    """A copy only on another host's SSD: its holder reads the file into a
    DRAM replica in its own segment, the reader reads that over kvflow (tcp)."""
    async with _client(tmp_path, ssd_offload="eager", ssd_promote=False, protocols=("tcp",)) as c, \
            StoreClient(c._embedded, segment_size=0, host="elsewhere", protocols=("tcp",)) as far:
        vals = await _fill(c, 16)
        cold = [k for k in vals if not _in_dram(c, k)]
        assert len(cold) >= 8
        got = await far.batch_get(cold[:4])
        assert got == [vals[k] for k in cold[:4]]
        assert all(_in_dram(c, k) for k in cold[:4])        # loaded, by the holder, into its segment
        assert all(c._embedded.model.segments[r.segment].client == c.client_id
                   for k in cold[:4] for r in c._embedded.model.objects[k].replicas)
    async with _client(tmp_path / "gone", ssd_offload="eager", ssd_promote=False) as c, \
            StoreClient(c._embedded, segment_size=0, host="elsewhere", timeout=1.0) as far:
        vals = await _fill(c, 16)
        cold = next(k for k in vals if not _in_dram(c, k))
        await c.ssd.close()                          # a holder whose tier stopped serving
        with pytest.raises(ReplicaUnavailableError, match="did not load"):
            await far.get(cold)


async def test_a_disk_that_refuses_writes_does_not_stall_an_eager_pool(tmp_path, monkeypatch):
    import errno

    from kvflow.store import ssd as ssd_mod

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async with _client(tmp_path, ssd_offload="eager", timeout=5.0) as c:
        monkeypatch.setattr(ssd_mod.SsdTier, "write", full)
        vals = await _fill(c, 20)                    # every copy refused: declined, then evicted as usual
        assert c.ssd.written == 0 and _files(tmp_path) == []
        assert await c.get("k19") == vals["k19"]
        with pytest.raises(ObjectNotFoundError):
            await c.get("k0")


# -- processes ------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


async def _member(master: str, d, mode: str, n: int):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "_store_ssd_member.py"), master, str(d), mode, str(n), str(OBJ), "7",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
    info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
    assert info["ready"]
    return proc, info


async def test_process_killed_and_restarted_finds_its_ssd_objects(tmp_path):
    master = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=_env())
    try:
        line = (await asyncio.wait_for(master.stdout.readline(), 30)).decode()
        assert "ready" in line, line
        address = line.split()[-1]
        p1, info = await _member(address, tmp_path, "put", 12)
        assert info["written"] == 12
        os.kill(p1.pid, signal.SIGKILL)             # no close: the files are all it leaves
        await p1.wait()
        async with StoreClient(address, segment_size=0, protocols=("tcp",)) as c:
            for _ in range(100):
                if not await c.exists("ssd/0"):
                    break
                await asyncio.sleep(0.05)
            assert not await c.exists("ssd/0")      # its master forgot it with the process
            p2, info = await _member(address, tmp_path, "serve", 0)
            try:
                assert info["adopted"] == 12
                for i in range(12):
                    assert await c.get(f"ssd/{i}") == _data(OBJ, 7 + i)
            finally:
                p2.stdin.close()
                await asyncio.wait_for(p2.wait(), 30)
    finally:
        master.terminate()
        await master.wait()
