"""kvflow.store across processes: a standalone master (`python -m
kvflow.store master`), members in processes of their own, SIGKILL and
SIGSTOP of a holder."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from kvflow.store import MasterUnavailableError, ObjectNotFoundError, ReplicaUnavailableError, StoreClient

from _store_master import ROOT, standalone_master, stop_member, store_env



def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def _member(master: str, key: str, size: int, seed: int, segment_size: int = 32 << 20):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "_store_member.py"), master, str(segment_size), key,
        str(size), str(seed), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        cwd=ROOT, env=store_env())
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    info = json.loads(line)
    assert info["ready"] and info["replicas"] == 1
    return proc, info


_stop = stop_member


async def test_holder_killed_replicas_survive_and_lost_objects_are_typed_errors():
    async with standalone_master() as (address, master):
        h1, i1 = await _member(address, "from-h1", 300_000, 11)
        h2, i2 = await _member(address, "from-h2", 200_000, 12)
        try:
            async with StoreClient(address, segment_size=0, protocols=("tcp",),
                                   local_buffer_size=64 << 20) as c:
                # objects put by the other processes, read here: every byte
                assert await c.get("from-h1") == _data(300_000, 11).tobytes()
                assert await c.get("from-h2") == _data(200_000, 12).tobytes()
                values = {f"x/{i}": _data(100_000 + 7 * i, 100 + i).tobytes() for i in range(32)}
                assert await c.batch_put(list(values), list(values.values()), replica_num=2) == [2] * 32
                only_h1 = {f"h1/{i}": _data(5000, 200 + i).tobytes() for i in range(8)}
                for k, v in only_h1.items():
                    assert await c.put(k, v, preferred_segment=i1["segment"]) == 1
                    assert {r.client for r in await c.get_replicas(k)} == {i1["client"]}

                stop = asyncio.Event()
                seen = {"gets": 0}

                async def stream():
                    while not stop.is_set():
                        got = await c.batch_get(list(values))
                        for (k, v), g in zip(values.items(), got):
                            assert g == v, (k, g)      # never wrong bytes, never an error
                        seen["gets"] += len(got)

                put_during: dict[str, bytes] = {}

                async def putter():
                    i = 0
                    while not stop.is_set():
                        k, v = f"during/{i}", _data(20_000, 1000 + i).tobytes()
                        n = await c.put(k, v, replica_num=2)   # never fails: h2 lives
                        assert n in (1, 2), n
                        put_during[k] = v
                        i += 1

                reader = asyncio.create_task(stream())
                writer = asyncio.create_task(putter())
                await asyncio.sleep(0.2)
                h1.kill()                                   # SIGKILL mid-stream
                await h1.wait()
                await asyncio.sleep(0.5)
                stop.set()
                await reader
                await writer
                assert seen["gets"] >= 2 * len(values)
                assert len(put_during) > 5
                for k, v in put_during.items():             # every put during the kill reads back
                    assert await c.get(k) == v
                # objects whose only holder died: a typed error, never bytes
                for k in only_h1:
                    with pytest.raises((ReplicaUnavailableError, ObjectNotFoundError)):
                        await c.get(k)
                # the master saw the connection reset: h1's objects are gone
                for _ in range(50):
                    if not any(await c.batch_exists(list(only_h1))):
                        break
                    await asyncio.sleep(0.1)
                assert not any(await c.batch_exists(list(only_h1)))
                assert await c.exists("from-h2") and not await c.exists("from-h1")
                # puts keep succeeding, with what is left (one holder: one replica)
                assert await c.put("after-kill", b"still here", replica_num=2) == 1
                assert await c.get("after-kill") == b"still here"
                for k, v in values.items():
                    assert await c.get(k) == v
        finally:
            await _stop(h1)
            await _stop(h2)


@pytest.mark.parametrize("stopped_s", [3.0, pytest.param(15.0, marks=pytest.mark.slow)])
async def test_stopped_holder_is_not_dropped(stopped_s):
    # heartbeats every second; a holder stopped for 3 s (15 s: the issue's
    # case, marked slow) keeps its objects
    async with standalone_master() as (address, master):
        h, info = await _member(address, "held", 50_000, 21)
        try:
            async with StoreClient(address, segment_size=0, protocols=("tcp",)) as c:
                os.kill(h.pid, signal.SIGSTOP)
                await asyncio.sleep(stopped_s)
                assert await c.exists("held")
                os.kill(h.pid, signal.SIGCONT)
                assert await c.get("held") == _data(50_000, 21).tobytes()
                assert (await c.stats())["clients"] == 2
        finally:
            await _stop(h)


async def test_silent_past_the_grace_is_lost():
    # the other side of the rule: a client silent for longer than the grace
    # (here 1.5 s) is lost, and the objects only it held go with it
    async with standalone_master("--client-grace", "1.5", "--heartbeat-interval", "0.3") as (address, _):
        h, info = await _member(address, "held", 1000, 22)
        try:
            async with StoreClient(address, segment_size=0, protocols=("tcp",)) as c:
                os.kill(h.pid, signal.SIGSTOP)
                for _ in range(100):
                    if not await c.exists("held"):
                        break
                    await asyncio.sleep(0.1)
                assert not await c.exists("held")
                assert (await c.stats())["clients"] == 1      # c itself kept beating
                with pytest.raises(ObjectNotFoundError):
                    await c.get("held")
        finally:
            await _stop(h)


async def test_a_blocked_event_loop_does_not_lose_the_client():
    # the host application blocks the client's loop longer than the grace:
    # the heartbeat thread keeps the client (and its segment) in the pool
    async with standalone_master("--client-grace", "1.5", "--heartbeat-interval", "0.3") as (address, _):
        async with StoreClient(address, segment_size=1 << 20, protocols=("tcp",)) as c:
            await c.put("mine", b"still here", preferred_segment=c.segment_id)
            time.sleep(4.0)                                # blocks this loop: no loop heartbeats
            assert (await c.stats())["clients"] == 1
            assert await c.get("mine") == b"still here"


async def test_master_stopped_calls_time_out_and_the_client_recovers():
    async with standalone_master("--client-grace", "3", "--heartbeat-interval", "0.3") as (address, master):
        async with StoreClient(address, segment_size=1 << 20, protocols=("tcp",), timeout=0.5) as c:
            await c.put("k", b"value")
            proc_pid = master.pid
            os.kill(proc_pid, signal.SIGSTOP)
            try:
                with pytest.raises(MasterUnavailableError):
                    await c.exists("k")                  # times out after 0.5 s
                with pytest.raises(MasterUnavailableError):
                    await c.get("k")
            finally:
                os.kill(proc_pid, signal.SIGCONT)
            # the late replies are dropped; the link and the client still work
            assert await c.exists("k")
            assert await c.get("k") == b"value"
            await c.put("k2", b"more")
            assert await c.get("k2") == b"more"
            # heartbeats went on after the ones that timed out: still a member past the grace
            await asyncio.sleep(3.5)
            assert (await c.stats())["clients"] == 1 and await c.exists("k2")


async def test_master_cli_bad_listen_fails_cleanly():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "not-an-address",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1 and b"host:port" in err and b"ready" not in out
