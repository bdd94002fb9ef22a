"""Bytes of a timed-out tcp write still queued at a stopped holder
(kvflow/_native/tcp_server.c, sockio.c; kvflow/store/put_timeouts.py,
model.py's put_end): a real master, a holder in a process of its own,
SIGSTOP and SIGCONT.

A writer's put over tcp to a stopped holder times out; the writer resets
its connections (kvflow/engine/transfer.py: after the drain grace), but
what the holder's kernel had already received stays in its receive queue
(Linux reads it back before reporting the reset: the first test shows
it). The space is then given to another object, written while the holder
is still stopped by a same-host client (cross-memory attach needs nothing
of the holder's process). The holder, resumed, must not apply the stale
bytes over it."""
from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import sys
import time

import numpy as np
import pytest

from kvflow.store import NoSpaceError, ObjectBusyError, StoreClient
from kvflow.store.calls import all_ok, item_result
from kvflow.store.datapath import Moves

from _store_master import ROOT, standalone_master, store_env
from test_store_shmseg import _data, _holder

MiB = 1 << 20
STALE = 0xEE


def test_linux_keeps_received_bytes_readable_after_a_reset():
    # the premise: a reset (what kvflow's initiator sends when it gives a
    # batch up: connect(AF_UNSPEC), tcp_disconnect) does not discard what
    # the receiver's kernel already holds; recv() returns it, then the error
    a = socket.create_server(("127.0.0.1", 0))
    with a, socket.create_connection(a.getsockname()) as w:
        r, _ = a.accept()
        with r:
            w.sendall(b"x" * 50_000)
            time.sleep(0.1)
            unspec = (ctypes.c_char * 16)()         # sa_family 0: AF_UNSPEC
            assert ctypes.CDLL(None, use_errno=True).connect(w.fileno(), unspec, 16) == 0
            time.sleep(0.1)
            got = 0
            with pytest.raises(ConnectionResetError):
                while chunk := r.recv(65536):
                    got += len(chunk)
            assert got == 50_000


async def _warm(w: StoreClient, v: StoreClient) -> None:
    """Both clients connected to the holder (a stopped holder answers no
    handshake), the object used for it removed: its segment all free."""
    await w.put("warm", b"w" * 4096)
    assert await v.get("warm") == b"w" * 4096
    await v.remove("warm")


@pytest.mark.parametrize("end", ["put_end", "revoked"])
async def test_a_timed_out_writes_queued_bytes_land_on_no_later_object(end):
    # put_end: the writer's put fails (transfer timeout, 1 s) and its put_end
    # gives the space back at once; revoked: the writer never commits, the
    # master revokes the put after its window (6 s) and holds the space one
    # more window. Either way the victim's put gets the same space while the
    # holder is still stopped, and the holder is resumed after that
    async with standalone_master() as (address, _), _holder(address, shm=False, segment_size=MiB + 65536) as (h, _):
        async with StoreClient(address, segment_size=0, protocols=("tcp",), timeout=1.0) as w, \
                StoreClient(address, segment_size=0, protocols=("local",)) as v:
            await _warm(w, v)
            stale = np.full(MiB, STALE, np.uint8)
            reg = w.register_buffer(stale)
            os.kill(h.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                # a put as StoreClient makes it (puts.py), its steps apart
                reply = await w._call("batch_put_start", [["stale", MiB, 1, None, False]], 7)
                ((_, [[sid, addr]]),) = reply["items"]
                moves = Moves()
                moves.add(reg.addr, reply["segments"][sid][1], addr, MiB)
                failed = await w._mover.run("write", moves, timeout=w.write_timeout)
                assert list(failed.values())[0].__class__.__name__ == "TransferTimeoutError", failed
                if end == "put_end":                # the space is free again at once
                    assert all_ok(await w._call("batch_put_end", [["stale", [sid]]])) == [0]
                else:                               # no put_end: the revoke, then a window of quarantine
                    while True:
                        assert time.monotonic() - t0 < 30
                        (item,) = (await v._call("batch_put_start", [["probe", MiB, 1, None, False]], 1))["items"]
                        if not isinstance(item_result(item, "probe"), (ObjectBusyError, NoSpaceError)):
                            await v._call("batch_put_revoke", ["probe"], 1)
                            break
                        await asyncio.sleep(0.2)
                victim = _data(MiB, 41)
                assert await v.put("victim", victim.tobytes()) == 1
                (rep,) = await v.get_replicas("victim")
                assert rep.addr == addr                 # the stale write's space
                took = time.monotonic() - t0
            finally:
                os.kill(h.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)                    # the holder's threads run again
            got = np.frombuffer(await v.get("victim"), np.uint8)
            landed = int(np.count_nonzero((got != victim) & (got == STALE)))
            assert landed == 0, f"{landed} stale bytes landed on the victim ({took:.1f} s after the stop)"
            assert np.array_equal(got, victim)
            # the holder serves on: a tcp put and get through it still work
            await w.put("after", b"a" * 8192)
            assert await v.get("after") == b"a" * 8192


@pytest.mark.parametrize("path", ["local", "mapped"])
async def test_a_same_host_write_to_a_stopped_holder_is_over_when_its_call_returns(path, monkeypatch):
    # the same-host paths copy on the writer's own threads, into the holder's
    # memory, without the holder's process: cross-memory attach (the local
    # provider, process_vm_writev) or a memcpy into the mapped segment
    # (shmseg.py). A put to a stopped holder completes in its call, so there
    # is nothing of it left to land when the holder runs again
    from kvflow.store import shmseg
    monkeypatch.setattr(shmseg, "ENABLED", path == "mapped" and hasattr(os, "memfd_create"))
    protocols = ("local",) if path == "local" else None
    async with standalone_master() as (address, _), \
            _holder(address, shm=path == "mapped", segment_size=4 * MiB) as (h, _):
        async with StoreClient(address, segment_size=0, protocols=protocols, timeout=1.0) as w:
            await w.put("warm", b"w" * 4096)
            assert await w.get("warm") == b"w" * 4096
            if path == "mapped":
                assert w._shm is not None and w._shm.writes > 0
            data = _data(MiB, 42).tobytes()
            os.kill(h.pid, signal.SIGSTOP)
            try:
                assert await w.put("k", data) == 1             # within its transfer timeout (1 s)
                assert await w.get("k") == data                 # read back while the holder is stopped
            finally:
                os.kill(h.pid, signal.SIGCONT)
            assert await w.get("k") == data


async def test_a_killed_writers_queued_bytes_land_on_no_later_object():
    # the writer's process is killed while its put to the stopped holder is
    # in flight: the master drops its put at once (client_lost: its process,
    # and with it its writes, gone), but its kernel closes its sockets, and
    # what the holder's kernel had received of them is still queued there
    async with standalone_master() as (address, _), _holder(address, shm=False, segment_size=MiB + 65536) as (h, _):
        writer = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "tests" / "_store_holder.py"), address, "0", str(MiB),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
        try:
            assert json.loads(await asyncio.wait_for(writer.stdout.readline(), 30))["ready"]
            async with StoreClient(address, segment_size=0, protocols=("local",)) as v:
                writer.stdin.write(b'["warm"]\n')       # connected to the holder (bytes 0: its first key's)
                await writer.stdin.drain()
                assert json.loads(await asyncio.wait_for(writer.stdout.readline(), 30))["put"] == [1]
                assert await v.get("warm") == bytes(MiB)
                await v.remove("warm")
                os.kill(h.pid, signal.SIGSTOP)
                try:
                    writer.stdin.write(b'["stale"]\n')
                    await writer.stdin.drain()
                    # its put_start's reply comes at once, its write stalls (its
                    # timeout is 10 s); its first bytes reach the holder's kernel
                    await asyncio.sleep(1.0)
                    assert writer.returncode is None
                    writer.kill()
                    await writer.wait()
                    victim = _data(MiB, 43)
                    t0 = time.monotonic()
                    while True:     # the master saw the writer go: the only room is its put's
                        assert time.monotonic() - t0 < 10
                        try:
                            assert await v.put("victim", victim.tobytes()) == 1
                            break
                        except NoSpaceError:
                            await asyncio.sleep(0.1)
                finally:
                    os.kill(h.pid, signal.SIGCONT)
                await asyncio.sleep(1.0)
                got = np.frombuffer(await v.get("victim"), np.uint8)
                landed = int(np.count_nonzero(got != victim))
                assert landed == 0, f"{landed} bytes of the killed writer landed on the victim"
        finally:
            if writer.returncode is None:
                writer.kill()
                await writer.wait()

