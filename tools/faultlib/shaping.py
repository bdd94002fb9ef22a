"""The cases that are not faults: fair share and incast behind a shaped
bottleneck (tbf), with what queues and drops there."""
from __future__ import annotations

import asyncio
import hashlib
import re
import subprocess

import numpy as np

import kvflow
import kvflow.control.wire
from faultlib.netns import Topology, _tc
from faultlib.channel import REGION
from faultlib.workload import Report, _all_or_none
from faultlib.procs import Target, _initiator


async def _stream(peer: kvflow.Peer, laddr: int, raddr: int, size: int, depth: int, stop: asyncio.Event,
                  done: list[tuple[float, int, float]]) -> None:
    """Keeps `depth` writes of `size` bytes in flight until `stop`; `done`
    gets (loop time, bytes, seconds) of each completed write."""
    loop = asyncio.get_running_loop()

    async def one() -> None:
        while not stop.is_set():
            t0 = loop.time()
            await peer.write([laddr], [raddr], [size], timeout=60)
            done.append((loop.time(), size, loop.time() - t0))

    await asyncio.gather(*(one() for _ in range(depth)))


def _window(done: list[tuple[float, int, float]], t0: float, t1: float) -> tuple[float, float]:
    """(B/s, the slowest write's seconds) of the writes that ended in [t0, t1)."""
    inside = [(n, s) for t, n, s in done if t0 <= t < t1]
    return sum(n for n, _ in inside) / (t1 - t0), max((s for _, s in inside), default=0.0)


async def case_fair(topo: Topology, seconds: float, keepalive: float, rate: str = "400mbit") -> Report:
    """Two peers of one engine behind one bottleneck (tbf at `rate` on this
    host's side of each rail): B streams 1 MiB writes (16 in flight) alone,
    then while A streams 16 MiB writes (4 in flight, 64 MiB queued at any
    time: a huge request). Fair share: B keeps about half the link, and no
    write of B's waits for A's backlog. The targets' copies are checked at
    the end. throughput: B alone, A and B together; notes: Jain's index of
    the two together, and B's slowest write alone and with A."""
    report = Report(f"fair share: two peers behind one {rate} bottleneck")
    loop = asyncio.get_running_loop()
    a, b = Target(topo, keepalive, host=0), Target(topo, keepalive, host=1)
    eng: kvflow.Engine | None = None
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    shaped = [topo.links[1], topo.links[2]]
    try:
        for dev in shaped:
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb", "latency", "20ms")
        await _all_or_none(a.start(), b.start())
        eng, src, laddr = await _initiator(topo, keepalive)
        src[:] = np.random.default_rng(9).integers(0, 256, REGION, dtype=np.uint8)
        peer_a, peer_b = await asyncio.gather(eng.connect(a.address), eng.connect(b.address))
        done_a: list[tuple[float, int, float]] = []
        done_b: list[tuple[float, int, float]] = []
        tasks.append(loop.create_task(_stream(peer_b, laddr, b.addr, 1 << 20, 16, stop_b, done_b)))
        third = seconds / 3
        await asyncio.sleep(third / 3)                   # B's ramp-up
        t1 = loop.time()
        await asyncio.sleep(third)
        t2 = loop.time()
        tasks.append(loop.create_task(_stream(peer_a, laddr, a.addr, 16 << 20, 4, stop_a, done_a)))
        await asyncio.sleep(third / 3)                   # A's ramp-up
        t3 = loop.time()
        await asyncio.sleep(third)
        t4 = loop.time()
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        b_alone, b_slow_alone = _window(done_b, t1, t2)
        b_both, b_slow_both = _window(done_b, t3, t4)
        a_both, a_slow = _window(done_a, t3, t4)
        report.throughput = {"B alone": b_alone, "B with A": b_both, "A with B": a_both}
        jain = (a_both + b_both) ** 2 / (2 * (a_both ** 2 + b_both ** 2)) if a_both + b_both else 0.0
        report.notes.append(f"MB/s: B alone {b_alone / 1e6:.1f}; together A {a_both / 1e6:.1f}, "
                            f"B {b_both / 1e6:.1f} (B keeps {b_both / b_alone:.2f} of its rate alone); "
                            f"Jain's index {jain:.3f}" if b_alone else "B moved nothing alone")
        report.notes.append(f"slowest write: B alone {b_slow_alone * 1e3:.0f} ms, B with A "
                            f"{b_slow_both * 1e3:.0f} ms, A (16 MiB) {a_slow * 1e3:.0f} ms")
        report.throughput["jain"] = jain
        report.throughput["B slowest with A s"] = b_slow_both
        report.transfers = len(done_a) + len(done_b)
        report.slowest_s = max(b_slow_both, a_slow, b_slow_alone)
        for target, size in ((a, 16 << 20), (b, 1 << 20)):
            report.bytes_sent += size
            got = (await target.shas([(0, size)]))[0]
            if got == hashlib.sha256(src[:size]).hexdigest():
                report.bytes_verified += size
            else:
                report.corrupted += 1
    finally:
        stop_a.set()
        stop_b.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for dev in shaped:
            _tc("qdisc", "del", "dev", dev, "root", check=False)
        if eng is not None:
            await eng.close()
        await asyncio.gather(a.stop(), b.stop())
    return report


def _qdisc_backlog(ns: str, dev: str) -> tuple[int, int]:
    """(bytes queued now, packets dropped so far) of `dev`'s root qdisc in `ns`."""
    out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev], capture_output=True,
                         text=True).stdout
    backlog = re.search(r"backlog (\d+)([KM]?)b", out)
    dropped = re.search(r"dropped (\d+)", out)
    scale = {"": 1, "K": 1000, "M": 1000000}
    return (int(backlog.group(1)) * scale[backlog.group(2)] if backlog else 0,
            int(dropped.group(1)) if dropped else 0)


def _send_queued(dsts: list[str]) -> int:
    """Bytes this host's tcp sockets to `dsts` hold unacknowledged (Send-Q:
    queued in the kernel or on the wire toward the receiver)."""
    total = 0
    for dst in dsts:
        out = subprocess.run(["ss", "-tnH", "state", "established", "dst", dst], capture_output=True,
                             text=True).stdout
        total += sum(int(line.split()[1]) for line in out.splitlines() if line.strip())
    return total


async def case_incast(topo: Topology, seconds: float, keepalive: float, rate: str = "400mbit",
                      windows: tuple[int, ...] = (0, 4 << 20, 16 << 20), senders: int = 3) -> Report:
    """Incast behind a real bottleneck: `senders` engines on this host write
    to one target whose rails are shaped at `rate` toward it (tbf on the
    switch ports: the target's NIC), once per receive window (0: none).
    Each sender keeps 4 writes of 4 MiB in flight. throughput: aggregate
    B/s per window; notes: the ratio to no window, the most bytes the
    senders' sockets held unacknowledged toward the receiver (what a window
    bounds), the most queued at the bottleneck and the packets it dropped.
    The target's copy is checked after each round."""
    report = Report(f"incast: {senders} senders, one receiver behind {rate}")
    loop = asyncio.get_running_loop()
    ports = ["p0x1", "p0x2"]                   # the switch's ports toward host 0's rails
    size, depth = 4 << 20, 4
    try:
        for dev in ports:
            _tc("-n", topo.switch, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
                "latency", "50ms")
        for window in windows:
            target = Target(topo, keepalive, receive_window=window or None)
            engines: list[kvflow.Engine] = []
            stop = asyncio.Event()
            tasks: list[asyncio.Task[None]] = []
            try:
                await target.start()
                src = np.random.default_rng(window % 997).integers(0, 256, REGION, dtype=np.uint8)
                for _ in range(senders):
                    eng = kvflow.Engine(f"{topo.host(0)}:0", protocols=("tcp",), keepalive=keepalive)
                    await eng.start()
                    engines.append(eng)
                laddrs = [eng.register(src).addr for eng in engines]
                peers = await asyncio.gather(*(eng.connect(target.address) for eng in engines))
                drops0 = sum(_qdisc_backlog(topo.switch, d)[1] for d in ports)
                done: list[tuple[float, int, float]] = []
                tasks = [loop.create_task(_stream(p, la, target.addr, size, depth, stop, done))
                         for p, la in zip(peers, laddrs)]
                await asyncio.sleep(seconds / 6)            # ramp-up
                t0, peak, queued = loop.time(), 0, 0
                rails = [topo.target(1), topo.target(2)]
                while loop.time() - t0 < seconds / 3:
                    peak = max(peak, sum(_qdisc_backlog(topo.switch, d)[0] for d in ports))
                    queued = max(queued, await asyncio.to_thread(_send_queued, rails))
                    await asyncio.sleep(0.05)
                t1 = loop.time()
                stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                drops = sum(_qdisc_backlog(topo.switch, d)[1] for d in ports) - drops0
                rate_bps, slowest = _window(done, t0, t1)
                name = f"window {window >> 20} MiB" if window else "no window"
                report.throughput[name] = rate_bps
                report.notes.append(f"{name}: {rate_bps / 1e6:.1f} MB/s, senders' unacknowledged bytes peak "
                                    f"{queued / 2**20:.1f} MiB, bottleneck queue peak {peak / 1e3:.0f} kB, "
                                    f"{drops} packets dropped, slowest 4 MiB write {slowest:.2f} s")
                report.transfers += len(done)
                report.slowest_s = max(report.slowest_s, slowest)
                report.bytes_sent += size
                if (await target.shas([(0, size)]))[0] == hashlib.sha256(src[:size]).hexdigest():
                    report.bytes_verified += size
                else:
                    report.corrupted += 1
                report.rails[name] = {"peak_backlog": peak, "dropped": drops, "send_queued": queued}
            finally:
                stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for eng in engines:
                    await eng.close()
                await target.stop()
        base = report.throughput.get("no window")
        if base:
            report.notes.append("vs no window: " + ", ".join(f"{k} {v / base:.2f}"
                                                             for k, v in report.throughput.items()))
    finally:
        for dev in ports:
            _tc("-n", topo.switch, "qdisc", "del", "dev", dev, "root", check=False)
    return report
