"""The failover write fence (kvflow/store/fence.py) and copy/move tasks
journaled in etcd (tasks.py, durable.py): first the model alone (no
processes), then a real etcd, masters and holders in processes of their
own, SIGKILL. Without etcd on PATH the process tests skip (under CI they
fail: tests/_metadata_servers.py)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

import kvflow
from kvflow.store import Allocator, DurabilityError, MasterUnavailableError, StoreClient, StoreModel, TaskStatus
from kvflow.store.allocator import ALIGN
from kvflow.store.errors import SpaceFencedError
from kvflow.store.fence import DEFAULT_WRITE_WINDOW, write_window
from kvflow.store.rpc import TcpMasterLink
from kvflow.store.tasks import TaskType
from test_store_durable import ROOT, _data, _env, _masters, _stop_member, _until
from test_store_durable import etcd  # noqa: F401 (a fixture)

MiB = 1 << 20


# -- the model ---------------------------------------------------------------
def test_an_allocators_fence_takes_its_free_space_out_of_use_until_lifted():
    a = Allocator(64 * ALIGN)
    x = a.allocate(8 * ALIGN)
    y = a.allocate(8 * ALIGN)
    a.release(x)
    assert a.fence() == 56 * ALIGN and a.fenced == 56 * ALIGN and a.free == 0
    a.check()
    assert a.allocate(ALIGN) is None and a.largest_free == 0
    a.release(y)                        # space freed after the fence is usable at once
    a.check()
    assert a.allocate(8 * ALIGN) == y and a.allocate(ALIGN) is None
    a.release(y)
    assert a.unfence() == 56 * ALIGN and a.fenced == 0
    a.check()
    assert a.extents == 1 and a.largest_free == a.capacity      # coalesced with its neighbours


def _recovered(old: StoreModel, now: float) -> StoreModel:
    """A new leader's model rebuilt from what etcd holds of `old`: its
    segments and COMPLETE objects (what durable.py records), not its puts
    in progress."""
    new = StoreModel(seed=2)
    for sid, seg in old.segments.items():
        c = old.clients[seg.client]
        new.restore_segment(sid, seg.client, c.host, c.engine, seg.name, seg.base, seg.size, now)
    for key, obj in old.objects.items():
        if obj.state.value == "complete":
            new.restore_object(key, obj.size, [[r.segment, r.offset, r.length] for r in obj.replicas],
                               writer=obj.writer, token=obj.token, want=obj.want)
    return new


def test_recovered_free_space_is_fenced_for_the_write_window():
    old = StoreModel(seed=1)
    old.register_client("h", "host", "e-h", 0.0)
    seg = old.mount("h", "seg-h", 1 << 30, 8 * MiB)
    old.put_start("h", "kept", MiB, 1, 0.0, token=1)
    old.put_end("h", "kept")
    old.put_start("h", "other", MiB, 1, 0.0, token=2)
    old.put_end("h", "other")
    inflight = old.put_start("h", "inflight", MiB, 1, 0.0, token=3)[0]       # its writer is still writing
    new = _recovered(old, 10.0)
    assert "inflight" not in new.objects
    window = write_window(2.0)
    assert new.fence_free(10.0, window) == 6 * MiB and new.fenced == 6 * MiB
    new.register_client("w", "host", "e-w", 10.0)
    # only fenced space could hold it: a typed error to retry, and no eviction
    with pytest.raises(SpaceFencedError):
        new.put_start("w", "victim", MiB, 1, 10.5, token=1)
    assert new.evictions == 0 and set(new.objects) == {"kept", "other"}
    # space freed since the recovery was a recorded object's: usable at once
    new.remove("other", 11.0)
    got = new.put_start("w", "small", MiB, 1, 11.0, token=2)
    assert got and got[0].offset != inflight.offset
    new.put_end("w", "small")
    # other free space first: a segment mounted since is not fenced
    new.register_client("n", "host", "e-n", 11.0)
    fresh = new.mount("n", "seg-n", 2 << 30, 4 * MiB)
    got = new.put_start("w", "elsewhere", MiB, 1, 11.0, preferred=seg, token=3)
    assert got[0].segment == fresh
    new.put_end("w", "elsewhere")
    # the fence's end: the in-flight put's space is handed out again
    got = new.put_start("w", "victim", 4 * MiB, 1, 10.0 + window, preferred=seg, token=4)
    assert got[0].segment == seg and new.fenced == 0
    for s in new.segments.values():
        s.alloc.check()


def test_the_write_window_is_the_longest_reported():
    m = StoreModel()
    m.note_write_window(write_window(2.0))
    m.note_write_window(write_window(1.0))
    assert m.write_window == write_window(2.0) == 7.0
    m.note_write_window(None)           # a client that does not say: the default client's
    assert m.write_window == DEFAULT_WRITE_WINDOW == 15.0


def test_tasks_are_restored_from_their_records():
    old = StoreModel(seed=1)
    for c in ("a", "b"):
        old.register_client(c, "host", f"e-{c}", 0.0)
        old.mount(c, f"seg-{c}", (1 << 30) * (1 + (c == "b")), 4 * MiB)
    for i, key in enumerate(("x", "y", "z")):
        old.put_start("a", key, 4096, 1, 0.0, preferred="seg-a", token=i + 1)
        old.put_end("a", key)
    done = old.create_copy_task("x", ["seg-a"])                 # held there already: SUCCESS
    copy = old.create_copy_task("y", ["seg-b"])
    move = old.create_move_task("z", "seg-a", "seg-b")
    jobs, _ = old.repair_start("a", 0.0, 8)                     # the copies in flight at the crash
    assert {j[0] for j in jobs} == {"y", "z"}
    new = _recovered(old, 1.0)
    new.remove("z", 1.0)
    new.put_start("a", "z", 4096, 1, 1.0, preferred="seg-a", token=99)     # put again: not the task's object
    new.put_end("a", "z")
    new.track()
    for tid in sorted(old.tasks, key=lambda t: old.tasks[t].created_ms):
        new.restore_task(tid, old.tasks[tid].record())
    assert new.query_task(done).status is TaskStatus.SUCCESS
    assert new.query_task(copy).status is TaskStatus.PENDING and new.query_task(copy).type is TaskType.REPLICA_COPY
    assert new.query_task(move).status is TaskStatus.FAILED
    assert new.dirty_tasks == {move}                            # its failure is written back
    assert new.repairable("a") == 1
    assert new.repair_start("a", 2.0, 8)[0] == []               # seg-b's holder is not back yet
    assert new.query_task(copy).status is TaskStatus.PENDING
    for c in ("a", "b"):                                        # the holders come back
        new.register_client(c, "host", f"e-{c}", 2.0)
        new.mount(c, f"seg-{c}", (1 << 30) * (1 + (c == "b")), 4 * MiB)
    jobs, lease = new.repair_start("a", 2.0, 8)
    assert [j[0] for j in jobs] == ["y"]
    new.repair_end("a", "y", True)
    assert new.query_task(copy).status is TaskStatus.SUCCESS
    assert len(new.objects["y"].replicas) == 2


# -- processes: a real etcd, masters killed ---------------------------------
async def _member(spec: str, key: str, size: int, seed: int, name: str, timeout: float = 2.0,
                  segment_size: int = 16 * MiB):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "_store_member.py"), spec, str(segment_size), key, str(size),
        str(seed), str(timeout), name, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        cwd=ROOT, env=_env())
    info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    assert info["ready"] and info["replicas"] == 1
    return proc, info


async def test_a_late_write_of_a_dead_masters_put_never_lands_in_another_object(etcd):  # noqa: F811
    # A writer's put_start succeeded on m1, which is then killed; m2 recovers
    # from etcd. The writer's bytes land only now, late, where m1 allocated:
    # a put made through m2 meanwhile must not be there (the old code gave
    # it exactly that space, and its bytes were overwritten).
    spec = f"etcd://{etcd}/f"
    size = 2 * MiB
    async with _masters() as start:
        m1 = await start(etcd, cluster="f")
        a1 = await m1.ready()
        h1, i1 = await _member(spec, "from-h1", 4096, 41, "seg-h1")
        try:
            async with kvflow.Engine(protocols=["tcp"]) as eng, \
                    StoreClient(spec, segment_size=0, protocols=("tcp",), timeout=2.0,
                                local_buffer_size=8 * MiB) as c:
                w = await TcpMasterLink.open(a1)
                await w.call("register", "late-writer", "h", eng.address, write_window(2.0))
                started = await w.call("batch_put_start", [["late", size, 1, None, False]], 7)
                (sid, addr), = started["items"][0][1]
                holder = started["segments"][sid][1]
                m1.kill()
                await m1.proc.wait()
                m2 = await start(etcd, cluster="f")
                await m2.ready()
                t_ready = time.monotonic()
                assert (await c.stats())["fenced"] > 0      # h1's free space, for the write window
                victim = _data(size, 5)
                put = asyncio.ensure_future(c.put("victim", victim, preferred_segment=i1["segment"]))
                await asyncio.sleep(0.5)                    # the put has reached m2 (the old code: stored)
                junk = np.full(size, 0xEE, np.uint8)
                r = eng.register(junk)
                peer = await eng.connect(holder)
                await peer.write(np.array([r.addr], np.uint64), np.array([addr], np.uint64),
                                 np.array([size], np.uint64))
                assert await put == 1
                waited = time.monotonic() - t_ready
                assert await c.get("victim") == victim
                assert await c.get("from-h1") == _data(4096, 41)
                assert not await c.exists("late")
                assert (await c.stats())["fenced"] == 0
                print(f"the put waited {waited:.2f} s after the new leader was ready (window "
                      f"{write_window(2.0):.1f} s)")
                await w.close()
        finally:
            await _stop_member(h1)


async def _segments_of(c: StoreClient, key: str) -> set[str]:
    return {d.segment for d in await c.replica_desc(key) if d.in_memory}


async def test_tasks_in_flight_survive_a_master_restart(etcd):  # noqa: F811
    spec = f"etcd://{etcd}/g"
    async with _masters() as start:
        m1 = await start(etcd, cluster="g")
        await m1.ready()
        ha, ia = await _member(spec, "from-a", 4096, 51, "seg-a")
        hb, ib = await _member(spec, "from-b", 4096, 52, "seg-b")
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), timeout=2.0,
                                   local_buffer_size=8 * MiB) as c:
                values = {"obj": _data(MiB, 7), "moved": _data(MiB // 2, 8)}
                for k, v in values.items():
                    assert await c.put(k, v, preferred_segment="seg-a") == 1
                assert await _segments_of(c, "obj") == {"seg-a"}
                # a task finished before the crash: its status is still known after
                done = await c.create_copy_task("from-a", ["seg-b"])
                assert (await c.wait_task(done, timeout=20)).status is TaskStatus.SUCCESS
                # tasks unfinished at the crash: their copier (seg-a's holder) is stopped
                os.kill(ha.pid, signal.SIGSTOP)
                copy = await c.create_copy_task("obj", ["seg-b"])
                move = await c.create_move_task("moved", "seg-a", "seg-b")
                assert (await c.query_task(copy)).status is TaskStatus.PENDING
                m1.kill()
                await m1.proc.wait()
                os.kill(ha.pid, signal.SIGCONT)
                m2 = await start(etcd, cluster="g")
                await m2.ready()
                assert (await c.query_task(done)).status is TaskStatus.SUCCESS
                assert (await c.query_task(copy)).status in (TaskStatus.PENDING, TaskStatus.PROCESSING)
                infos = [await c.wait_task(t, timeout=40) for t in (copy, move)]
                assert [i.status for i in infos] == [TaskStatus.SUCCESS] * 2, infos
                assert await _segments_of(c, "obj") == {"seg-a", "seg-b"}
                assert await _segments_of(c, "moved") == {"seg-b"}
                # the replicas made: read from seg-b once seg-a's holder is gone
                ha.kill()
                await ha.wait()
                await _until(lambda: _only_b(c))
                assert await c.batch_get(list(values)) == list(values.values())
        finally:
            await _stop_member(ha)
            await _stop_member(hb)


async def _only_b(c: StoreClient) -> bool:
    return await _segments_of(c, "obj") == {"seg-b"}



async def test_a_leader_stopped_past_its_lease_hands_out_no_space(etcd):  # noqa: F811
    # The new leader's fence covers writes the old one allowed before its
    # lease ran out. One stopped past its lease (SIGSTOP) and woken must not
    # allow more: its put_start waits for a keep-alive, which finds the
    # lease gone (the old code replied from memory, and its client wrote).
    spec = f"etcd://{etcd}/s"
    async with _masters() as start:
        m1 = await start(etcd, cluster="s")
        a1 = await m1.ready()
        m2 = await start(etcd, cluster="s")
        assert "standby" in await m2.line()
        async with StoreClient(a1, segment_size=4 * MiB, protocols=("tcp",), timeout=2.0):
            w = await TcpMasterLink.open(a1)
            await w.call("register", "w", "h", "127.0.0.1:1", write_window(2.0))
            assert (await w.call("batch_put_start", [["before", 4096, 1, None, False]], 1))["items"][0][0] == 0
            os.kill(m1.proc.pid, signal.SIGSTOP)
            await m2.ready()
            os.kill(m1.proc.pid, signal.SIGCONT)
            with pytest.raises((DurabilityError, MasterUnavailableError)):
                await w.call("batch_put_start", [["after", 4096, 1, None, False]], 2)
            assert await asyncio.wait_for(m1.proc.wait(), 15) == 3
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), timeout=2.0) as c:
                assert not await c.exists("after") and not await c.exists("before")
            await w.close()


def test_the_fence_lifts_once_every_recorded_client_says_its_writes_are_over():
    old = StoreModel(seed=1)
    for c in ("h", "w"):
        old.register_client(c, "host", f"e-{c}", 0.0)
    old.mount("h", "seg-h", 1 << 30, 4 * MiB)
    new = _recovered(old, 1.0)
    new.track()
    new.restore_client("w", 7.0, "host", "e-w", 1.0)       # a writer with no segment, recorded
    assert new.fence_free(1.0, 7.0, {"h", "w"}) == 4 * MiB
    new.register_client("h", "host", "e-h", 1.5)
    new.note_client("h", 7.0, True)
    assert new.fenced == 4 * MiB                           # w may still be writing
    new.register_client("w", "host", "e-w", 1.6)
    new.note_client("w", 7.0, False)                       # it is: the fence stays
    assert new.fenced == 4 * MiB
    new.client_lost("w")                                   # its process is gone, and its writes with it
    assert new.fenced == 0 and new.put_start("h", "k", MiB, 1, 1.7, token=1)
    assert new.dirty_clients == {"h", "w"}                 # h's record written, w's deleted


async def test_the_fence_lifts_when_every_client_is_back(etcd):  # noqa: F811
    # every client alive: the fence ends when the last one re-attaches with
    # no write in progress, well before the window (15 s here)
    spec = f"etcd://{etcd}/l"
    async with _masters() as start:
        m1 = await start(etcd, cluster="l")
        await m1.ready()
        h1, i1 = await _member(spec, "from-h1", 4096, 61, "seg-h1", timeout=10.0)
        try:
            async with StoreClient(spec, segment_size=0, protocols=("tcp",), local_buffer_size=4 * MiB) as c:
                assert c.write_window == 15.0
                await c.put("before", b"b" * 1000)
                m1.kill()
                await m1.proc.wait()
                m2 = await start(etcd, cluster="l")
                await m2.ready()
                t0 = time.monotonic()
                await _until(lambda: _stat_is(c, "fenced", 0), timeout=10)
                lifted = time.monotonic() - t0
                assert await c.put("after", b"a" * 1000) == 1
                assert await c.get("before") == b"b" * 1000 and await c.get("after") == b"a" * 1000
                print(f"fence lifted {lifted:.2f} s after the new leader was ready (window 15 s)")
        finally:
            await _stop_member(h1)


async def _stat_is(c: StoreClient, name: str, value) -> bool:
    return (await c.stats())[name] == value
