"""BlockingQuery polls for a small call's reply before it sleeps in recv
(rpc.SPIN_S): the answers are the same polled or not, a reply later than
the polling still arrives, and a master that does not answer still times
the call out (against a real master process)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import kvflow.store.rpc as rpc
from kvflow.store.errors import MasterUnavailableError
from kvflow.store.rpc import BlockingQuery

from _store_master import standalone_master


def _asked(q: BlockingQuery, keys: list) -> list:
    return q.call("batch_exists", keys)


@pytest.mark.parametrize("spin_s", [0.0, 200e-6, 0.5])
async def test_answers_are_the_same_polled_or_asleep(monkeypatch, spin_s):
    monkeypatch.setattr(rpc, "SPIN_S", spin_s)
    async with standalone_master() as (addr, _):
        q = BlockingQuery(addr, 5.0)
        try:
            keys = [f"k/{i}" for i in range(300)]
            assert await asyncio.to_thread(_asked, q, keys) == [False] * 300
            # a reply of several recv()s (a 20,000-key answer) after the polled first one
            many = [f"long/key/{i:08d}" for i in range(20000)]
            assert await asyncio.to_thread(_asked, q, many) == [False] * 20000
            bad = await asyncio.to_thread(_asked, q, ["", "k/1"])
            assert bad[1] is False and bad[0][0] == 1      # an empty key fails alone
        finally:
            q.close()


async def test_a_reply_later_than_the_polling_arrives_and_a_silent_master_times_out(monkeypatch):
    monkeypatch.setattr(rpc, "SPIN_S", 200e-6)
    async with standalone_master() as (addr, proc):
        q = BlockingQuery(addr, 1.0)
        try:
            assert await asyncio.to_thread(_asked, q, ["a"]) == [False]
            os.kill(proc.pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(0.3, os.kill, proc.pid, signal.SIGCONT)
            t0 = time.perf_counter()
            assert await asyncio.to_thread(_asked, q, ["a", "b"]) == [False, False]
            assert time.perf_counter() - t0 >= 0.25         # it slept in recv after polling, and woke
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                t0 = time.perf_counter()
                with pytest.raises(MasterUnavailableError):
                    await asyncio.to_thread(_asked, q, ["a"])
                assert 0.9 <= time.perf_counter() - t0 < 3.0     # the call's own 1 s timeout
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert await asyncio.to_thread(_asked, q, ["a"]) == [False]    # a fresh connection
        finally:
            q.close()
