"""tcp failover on one rail: the kernel destroys one data connection
(`ss -K`) while writes and reads are in flight. Its slices move to the
other connections, every batch completes and verifies, and the connection
is rebuilt (new epoch: acks of the old one, still on the ack connection,
cannot be mistaken for the new one's).
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import kvflow

from _batches import bounded

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                                reason="needs root and ss(8) to destroy a socket")


def data_sockets(port: int) -> dict[str, int]:
    """Local port -> bytes sent, of the established connections to the data port."""
    out = subprocess.run(["ss", "-tniH", "state", "established", "dst", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, check=True).stdout
    socks: dict[str, int] = {}
    sport = ""
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():                # the socket line; its info line follows
            sport = line.split()[2].rsplit(":", 1)[1]
            socks[sport] = 0
        elif (m := re.search(r"bytes_acked:(\d+)", line)):
            socks[sport] = int(m.group(1))
    return socks


def kill_socket(port: int, sport: str) -> None:
    subprocess.run(["ss", "-K", "dst", f"127.0.0.1:{port}", "sport", "=", f":{sport}"],
                   capture_output=True, text=True)


async def test_a_destroyed_data_connection_moves_its_slices_and_is_rebuilt():
    n = 16 << 20
    async with kvflow.Engine(protocols=("tcp",)) as b, kvflow.Engine(protocols=("tcp",), tcp_connections=3,
                                                                         tcp_express=False) as a:
        dst = np.zeros(n, np.uint8)
        src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
        back = np.zeros(n, np.uint8)
        r, l, lb = b.register(dst), a.register(src), a.register(back)
        peer = await bounded(a.connect(b.address))
        await bounded(peer.write([l.addr], [r.addr], [n]))
        port = b.descriptor().data[0][1]
        before = data_sockets(port)
        assert len(before) == 4          # 3 data + the ack connection
        # The one that has carried the most: a data connection. The ack connection
        # has sent only its hello, and ss lists sockets in hash order, so "the
        # last one listed" was the ack connection now and then (the peer is lost
        # then, rightly: its acks have nowhere to go).
        victim = max(before, key=before.__getitem__)
        assert before[victim] >= n // 4
        rng = np.random.default_rng(2)
        killed = False
        for i in range(12):
            src[:] = rng.integers(0, 255, n, dtype=np.uint8)
            w = peer.write_nowait([l.addr], [r.addr], [n])
            if i == 3:
                # a data connection (not the ack one, opened first) dies
                # mid-write: the same write queued 8 times over, so that
                # some of it is still on the connection when ss has started
                more = [peer.write_nowait([l.addr], [r.addr], [n]) for _ in range(8)]
                kill_socket(port, victim)
                killed = True
                for m in more:
                    await bounded(m)
            await bounded(w)
            assert np.array_equal(dst, src), f"write {i}"
            await bounded(peer.read([lb.addr], [r.addr], [n]))
            assert np.array_equal(back, src), f"read {i}"
        assert killed
        conns = peer.connections()
        if not any(c["failures"] for c in conns):
            pytest.skip("ss -K did not destroy the socket (kernel without CONFIG_INET_DIAG_DESTROY)")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not all(c["up"] for c in peer.connections()):
            assert loop.time() < deadline, peer.connections()
            await asyncio.sleep(0.1)
        assert sum(c["rebuilt"] for c in peer.connections()) >= 1
        # the connections that took its work fenced it at the target first
        # (what the target still held of it cannot land over the resend)
        assert sum(c["moved"] for c in conns) >= 1, conns
        assert sum(c["fences"] for c in conns) >= 1, conns
        for i in range(4):               # the rebuilt connection carries data and acks again
            src[:] = rng.integers(0, 255, n, dtype=np.uint8)
            await bounded(peer.write([l.addr], [r.addr], [n]))
            assert np.array_equal(dst, src)
        assert peer.alive
        assert a.counters()["slices_inflight"] == 0
