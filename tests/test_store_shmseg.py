"""kvflow.store's same-host segments (kvflow/store/shmseg.py): a holder in
a process of its own, a client here that maps its segment and puts and
gets with one memcpy per object (or run of them); the holder killed, an object's space
reused, a reader of another user, a segment not in shared memory."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvflow.store import ObjectLeasedError, ObjectNotFoundError, ReplicaUnavailableError, StoreClient, direct
from kvflow.store.shmsock import socket_name

from _store_master import ROOT, standalone_master, stop_member, store_env


@pytest.fixture(autouse=True)
def shm_on(monkeypatch):
    """The path is opt-in (KVFLOW_STORE_SHM=1): on for this module's
    in-process readers; the holders' processes get it in their environment."""
    from kvflow.store import shmseg
    monkeypatch.setattr(shmseg, "ENABLED", hasattr(os, "memfd_create"))


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.asynccontextmanager
async def _holder(master: str, *, shm: bool = True, segment_size: int = 64 << 20):
    env = store_env() | {"KVFLOW_STORE_SHM": "1" if shm else "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "_store_shm_holder.py"), master, str(segment_size),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
    try:
        info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert info["ready"]
        yield proc, info
    finally:
        await stop_member(proc)


async def _put(c: StoreClient, keys: list[str], sizes: list[int], seed: int) -> np.ndarray:
    """Puts keys[i] with sizes[i] bytes (from a seed) into the holder (the
    reader mounts no segment); the source buffer."""
    src = _data(sum(sizes), seed)
    c.register_buffer(src)
    offs = np.cumsum([0] + sizes[:-1])
    assert await c.batch_put_from(keys, [src.ctypes.data + int(o) for o in offs], sizes) == [1] * len(keys)
    return src


async def test_gets_read_the_same_host_segment_through_the_mapping():
    async with standalone_master() as (address, _), _holder(address):
        async with StoreClient(address, segment_size=0, local_buffer_size=32 << 20) as c:
            n = 64
            keys = [f"m/{i}" for i in range(n)]
            sizes = [1000 + 997 * i for i in range(n)]
            src = await _put(c, keys, sizes, 1)
            offs = [int(o) for o in np.cumsum([0] + sizes[:-1])]
            total = sum(sizes)
            # the put wrote through the mapping: a tcp-only client (no mapping)
            # reads the holder's memory with kvflow, and finds every byte
            assert (c.metrics()["shm_writes"], c.metrics()["shm_write_bytes"]) == (n, total)
            async with StoreClient(address, segment_size=0, local_buffer_size=8 << 20, protocols=("tcp",)) as t:
                assert b"".join(await t.batch_get(keys)) == src.tobytes()
                assert "shm_reads" not in t.metrics()
            # the loop's get into registered memory, objects in reverse order
            # (no two consecutive: one copy each), every byte compared
            dst = np.zeros(total + 4096, np.uint8)
            c.register_buffer(dst)
            where = {}
            at = 0
            for i in reversed(range(n)):
                where[i] = at
                at += sizes[i]
            got = await c.batch_get_into(keys, [dst.ctypes.data + where[i] for i in range(n)], sizes)
            assert got == sizes
            for i in range(n):
                assert np.array_equal(dst[where[i]:where[i] + sizes[i]], src[offs[i]:offs[i] + sizes[i]]), i
            assert not dst[total:].any()            # nothing past the objects
            assert c.metrics()["shm_reads"] == n
            assert c.metrics()["shm_read_bytes"] == total
            # bytes through the local buffer
            assert await c.batch_get(keys[:8]) == [src[offs[i]:offs[i] + sizes[i]].tobytes() for i in range(8)]
            assert c.metrics()["shm_reads"] == n + 8
            # the caller's-thread path (the Mooncake API's): in order, so runs join
            dst[:] = 0
            res = await asyncio.get_running_loop().run_in_executor(
                None, direct.get_into, c, keys, [dst.ctypes.data + o for o in offs], sizes)
            assert res == sizes
            assert np.array_equal(dst[:total], src[:total])
            assert c.metrics()["shm_reads"] == 2 * n + 8
            # a batch past what the loop copies on its own thread (a worker copies it)
            big = [f"big/{i}" for i in range(6)]
            bsrc = await _put(c, big, [1 << 20] * 6, 2)
            bdst = np.zeros(6 << 20, np.uint8)
            c.register_buffer(bdst)
            assert await c.batch_get_into(big, [bdst.ctypes.data + (i << 20) for i in range(6)],
                                          [1 << 20] * 6) == [1 << 20] * 6
            assert np.array_equal(bdst, bsrc)
            assert c.metrics()["shm_reads"] == 2 * n + 8 + 6
            assert c.metrics()["shm_maps_dropped"] == 0


def test_mooncake_batch_get_into_reads_through_the_mapping():
    from kvflow.compat.mooncake.store import MooncakeDistributedStore

    async def run() -> None:
        async with standalone_master() as (address, _), _holder(address):
            await asyncio.get_running_loop().run_in_executor(None, mooncake, address)

    def mooncake(address: str) -> None:
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 1 << 20, "auto", "", address) == 0
        try:
            n, size = 32, 65536
            src, dst = _data(n * size, 3), np.zeros(n * size, np.uint8)
            assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
            assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            keys = [f"mc/{i}" for i in range(n)]
            assert s.batch_put_from(keys, [src.ctypes.data + i * size for i in range(n)], [size] * n) == [0] * n
            assert s.batch_get_into(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n) == [size] * n
            assert np.array_equal(dst, src)
            assert s._client.metrics()["shm_reads"] == n
        finally:
            s.close()

    asyncio.run(run())


async def test_holder_killed_mapping_dropped_and_gets_fail_typed():
    async with standalone_master() as (address, _), _holder(address) as (proc, _info):
        async with StoreClient(address, segment_size=0, local_buffer_size=8 << 20, timeout=5.0) as c:
            keys = [f"k/{i}" for i in range(8)]
            src = await _put(c, keys, [50_000] * 8, 4)
            assert b"".join(await c.batch_get(keys)) == src.tobytes()
            assert c.metrics()["shm_reads"] == 8
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            # the mapping goes as soon as the holder's end of its connection
            # does (its memory is freed only then), before any call needs it
            for _ in range(200):
                if c.metrics()["shm_maps_dropped"]:
                    break
                await asyncio.sleep(0.01)
            assert c.metrics()["shm_maps_dropped"] == 1
            dst = np.full(50_000, 7, np.uint8)
            c.register_buffer(dst)
            for k in keys:
                # the master may still list the holder (its heartbeats not missed yet):
                # the mapping is dropped, the kvflow read fails: a typed error, no bytes
                with pytest.raises((ReplicaUnavailableError, ObjectNotFoundError)):
                    await c.get_into(k, dst.ctypes.data, dst.nbytes)
            assert (dst == 7).all()
            m = c.metrics()
            assert m["shm_maps_dropped"] == 1 and m["shm_reads"] == 8


async def test_a_removed_objects_reused_space_is_never_read_under_its_old_key():
    async with standalone_master() as (address, _), _holder(address):
        async with StoreClient(address, segment_size=0, local_buffer_size=0) as c:
            size = 200_000
            old, new = _data(size, 5), _data(size, 6)
            c.register_buffer(old)
            c.register_buffer(new)
            dst = np.zeros(size, np.uint8)
            c.register_buffer(dst)
            assert await c.put_from("old", old.ctypes.data, size) == 1
            (rep,) = await c.get_replicas("old")
            assert await c.get_into("old", dst.ctypes.data, size) == size
            assert np.array_equal(dst, old)
            # the get's lease is released by a message after it returned: the
            # remove may come first, and is refused until it arrives
            for _ in range(500):
                try:
                    await c.remove("old")
                    break
                except ObjectLeasedError:
                    await asyncio.sleep(0.01)
            assert await c.put_from("new", new.ctypes.data, size) == 1
            (rep2,) = await c.get_replicas("new")
            assert (rep2.segment, rep2.addr) == (rep.segment, rep.addr)    # the same bytes of the segment
            dst[:] = 0
            with pytest.raises(ObjectNotFoundError):
                await c.get_into("old", dst.ctypes.data, size)
            assert not dst.any()
            assert await c.get_into("new", dst.ctypes.data, size) == size
            assert np.array_equal(dst, new)
            assert c.metrics()["shm_reads"] == 2


async def test_a_segment_not_in_shared_memory_is_read_the_kvflow_way():
    async with standalone_master() as (address, _), _holder(address, shm=False):
        async with StoreClient(address, segment_size=0, local_buffer_size=8 << 20) as c:
            keys = [f"p/{i}" for i in range(4)]
            src = await _put(c, keys, [30_000] * 4, 7)
            assert b"".join(await c.batch_get(keys)) == src.tobytes()
            assert c.metrics()["shm_reads"] == 0


# a process of another user asks the holder's socket for the segment
_OTHER_USER = textwrap.dedent("""
    import os, socket, sys
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(bytes.fromhex(sys.argv[1]))
    s.sendall(b"kvflow-store-shm/1\\n")
    msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    print(len(fds), msg.decode())
""")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
async def test_a_reader_of_another_user_is_refused():
    async with standalone_master() as (address, _), _holder(address) as (_proc, info):
        run = await asyncio.get_running_loop().run_in_executor(None, lambda: subprocess.run(
            [sys.executable, "-c", _OTHER_USER, socket_name(info["engine"]).hex()], capture_output=True,
            text=True, timeout=30, cwd="/"))
        assert run.returncode == 0, run.stderr
        n_fds, msg = run.stdout.split(" ", 1)
        assert n_fds == "0" and "its own user only" in msg
        # a peer of the same user that does not speak the protocol: closed, no descriptor
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(socket_name(info["engine"]))
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            msg, fds, _, _ = await asyncio.get_running_loop().run_in_executor(None, socket.recv_fds, s, 4096, 1)
            assert (msg, fds) == (b"", [])
