"""The fault cases: rails down, kills, crashed hosts, garbage clients,
late landings, netem, and rails picked from the topology."""
from __future__ import annotations

import asyncio
import hashlib
import random
import socket

import numpy as np

import kvflow
import kvflow.control.wire
from faultlib.netns import NETEM, Topology
from faultlib.channel import REGION, TARGET_PORT
from faultlib.workload import Report, _after, _all_or_none, _merge, _rate, workload
from faultlib.procs import Initiator, Target, _initiator, _session


async def case_auto(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Rails from the topology on both ends: a target (KVFLOW_TCP_RAILS=auto)
    and an initiator (rails="auto") in two namespace hosts, each with a
    control link and two rails, pick their rails themselves (the rails, not
    the control link, whose address they listen on); the initiator pairs
    its rails with the target's and binds each data connection to its own
    rail on the same subnet. Then the initiator's rail 1 goes down and comes
    back: every write completes (rail 0 carries it), verified by the
    target's hashes."""
    report = Report("rails from the topology, initiator's rail 1 down and back")
    loop = asyncio.get_running_loop()
    target = Target(topo, keepalive, host=0, auto_rails=True, hash_port=True)
    init = Initiator(topo, keepalive, 1, target)
    try:
        await target.start()
        conns = await init.start()
        # the address each connection left from (its socket's), with the
        # rail it was bound to; one whose rail was down at connect has none
        opened = [c for c in conns if c["local"] is not None]
        pairs = [list(p) for p in sorted({(c["local"], c["endpoint"].rpartition(":")[0]) for c in opened})]
        if any(c["local"] != c["source"] for c in opened):
            report.notes.append(f"CONNECTIONS NOT FROM THEIR BOUND RAIL: {conns}")
        down = [c["endpoint"] for c in conns if c["local"] is None]
        if down:
            report.notes.append(f"CONNECTIONS DOWN AT CONNECT: {down}")
        report.rails = {"target": sorted(h for h, _ in target.data), "initiator": sorted(h for h, _ in init.data),
                        "pairs": pairs, "bound": [c["source"] for c in conns], "down": down}
        report.notes.append(f"target rails {report.rails['target']}, initiator rails {report.rails['initiator']}, "
                            f"connections (local, endpoint) {pairs}")
        rail1 = [c["index"] for c in conns if c["source"] == topo.target(2, 1)]
        await asyncio.sleep(seconds / 3)
        t_down = loop.time()
        await topo.set_rail(1, False, host=1)
        while report.detect_s is None and loop.time() - t_down < 3 * keepalive + 10:
            await asyncio.sleep(0.1)
            now = await init.connections()
            if rail1 and all(not now[i]["up"] for i in rail1):
                report.detect_s = loop.time() - t_down
        await asyncio.sleep(max(0.0, t_down + seconds / 3 - loop.time()))
        t_up = loop.time()
        await topo.set_rail(1, True, host=1)
        while report.recover_s is None and loop.time() - t_up < 20:
            await asyncio.sleep(0.1)
            if all(c["up"] for c in await init.connections()):
                report.recover_s = loop.time() - t_up
        await asyncio.sleep(max(0.0, t_up + seconds / 3 - loop.time()))
        now = await init.connections()
        report.notes.append(f"slices moved off rail 1: {sum(c['moved'] for c in now)}; rail 1 carried "
                            f"{sum(now[i]['bytes'] for i in rail1) >> 20} MiB; "
                            f"rebuilt connections: {sum(c['rebuilt'] for c in now)}")
        _merge(report, await init.finish(3 * keepalive + 30))
    finally:
        await topo.set_rail(1, True, host=1)
        await asyncio.gather(init.stop(), target.stop())
    return report


async def case_rail(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Rail 1 goes down for a third of the run, then comes back: every batch
    must complete (its slices move to rail 0), nothing may be corrupted."""
    report = Report("rail down and back")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        try:
            peer = await eng.connect(target.address)
            rail1 = [c["index"] for c in peer.connections() if c["endpoint"].startswith(topo.target(2))]
            if not rail1:
                raise RuntimeError(f"no connection on rail 1: {peer.connections()}")
            stop = asyncio.Event()
            work = loop.create_task(workload(peer, target, src, laddr, report, stop, seed=1,
                                             limit=3 * keepalive + 10))
            await asyncio.sleep(seconds / 3)
            t_down = loop.time()
            took = await topo.set_rail(1, False)
            report.notes.append(f"`ip link set down` took {took:.2f} s")
            while report.detect_s is None and loop.time() - t_down < 3 * keepalive + 10:
                await asyncio.sleep(0.05)
                if any(not peer.connections()[i]["up"] for i in rail1):
                    report.detect_s = loop.time() - t_down
            await asyncio.sleep(max(0.0, t_down + seconds / 3 - loop.time()))
            t_up = loop.time()
            await topo.set_rail(1, True)
            while report.recover_s is None and loop.time() - t_up < 20:
                await asyncio.sleep(0.05)
                if all(c["up"] for c in peer.connections()):
                    report.recover_s = loop.time() - t_up
            await asyncio.sleep(max(0.0, t_up + seconds / 3 - loop.time()))
            stop.set()
            await work
            conns = peer.connections()
            moved = sum(c["moved"] for c in conns)
            rail1_bytes = sum(conns[i]["bytes"] for i in rail1)
            report.notes.append(f"slices moved off rail 1: {moved}; rail 1 carried {rail1_bytes >> 20} MiB; "
                                f"rebuilt connections: {sum(c['rebuilt'] for c in conns)}")
        finally:
            await topo.set_rail(1, True)
    return report


async def case_kill(topo: Topology, seconds: float, keepalive: float) -> Report:
    """The target dies (SIGKILL) mid-transfer: the batch in flight fails with
    a typed error promptly; a restarted target is reached again, and the old
    peer (stale descriptor) can never write into the new process."""
    report = Report("target killed and restarted")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        old = await eng.connect(target.address)
        stop = asyncio.Event()
        work = loop.create_task(workload(old, target, src, laddr, report, stop, seed=2,
                                         limit=3 * keepalive + 10))
        await asyncio.sleep(seconds / 2)
        old_addr = target.addr
        target.kill()
        t_kill = loop.time()
        await asyncio.wait_for(work, 3 * keepalive + 15)    # ends at the first failure
        report.detect_s = loop.time() - t_kill
        await target.proc.wait()
        await target.start()                               # same control address, new incarnation
        stale = 0
        try:
            await old.write([laddr], [old_addr], [4096], timeout=5)
        except kvflow.PeerLostError:
            stale = 1
        report.notes.append("old peer refused after restart" if stale else "OLD PEER WROTE AFTER RESTART")
        if not stale:
            report.corrupted += 1
        peer = await eng.connect(target.address)
        if peer is old:
            report.notes.append("connect() returned the dead peer")
            report.corrupted += 1
        stop = asyncio.Event()
        again = loop.create_task(workload(peer, target, src, laddr, report, stop, seed=3, limit=30))
        await asyncio.sleep(seconds / 2)
        stop.set()
        await again
    return report


async def case_three(topo: Topology, seconds: float, keepalive: float, *, silent: bool = False) -> Report:
    """Three hosts: this one writes to targets A and B at once, each over its
    two rails, until B dies (SIGKILL; with `silent`, B's links are cut
    first, as when a host crashes, so that only the keepalive can tell).
    B's write in flight fails with PeerLostError within the keepalive bound;
    A's writes go on, their throughput must not collapse (no retry storm);
    B restarts on the same address (new incarnation): the old peer refuses
    to write, B's new memory stays untouched by it, and a new peer writes B
    again. Every completed write is verified. throughput: A's B/s before
    the kill, while B is dead, while B restarts and is written again."""
    report = Report("three hosts: B " + ("cut off and killed" if silent else "killed") + " and restarted, A written on")
    loop = asyncio.get_running_loop()
    a, b = Target(topo, keepalive, host=0), Target(topo, keepalive, host=1)
    eng: kvflow.Engine | None = None
    work: list[asyncio.Task[None]] = []
    stop_a = asyncio.Event()
    try:
        await _all_or_none(a.start(), b.start())
        eng, src_a, laddr_a = await _initiator(topo, keepalive)
        src_b = np.zeros(REGION, dtype=np.uint8)
        laddr_b = eng.register(src_b).addr
        peer_a, old = await asyncio.gather(eng.connect(a.address), eng.connect(b.address))
        lost_at: list[float] = []
        old.on_lost(lambda *_: lost_at.append(loop.time()))
        ra, rb = Report("A"), Report("B")
        written: list[tuple[float, int]] = []
        limit = 3 * keepalive + 10
        work_a = loop.create_task(workload(peer_a, a, src_a, laddr_a, ra, stop_a, seed=6, limit=limit,
                                           written=written))
        work_b = loop.create_task(workload(old, b, src_b, laddr_b, rb, asyncio.Event(), seed=7, limit=limit))
        work += [work_a, work_b]
        t_start = loop.time()
        await asyncio.sleep(seconds / 3)
        if silent:
            for link in range(3):
                await topo.set_link(link, False, host=1)
        old_addr = b.addr
        t_kill = loop.time()
        b.kill()
        await asyncio.wait_for(work_b, limit + 5)       # ends at its first failure
        t_failed = loop.time()
        while not lost_at and loop.time() - t_kill < limit:
            await asyncio.sleep(0.02)
        report.detect_s = (lost_at[0] if lost_at else t_failed) - t_kill
        report.notes.append(f"B's write in flight ended after {t_failed - t_kill:.2f} s "
                            f"({', '.join(rb.failed) or 'completed before the kill'}); "
                            f"peer lost after {report.detect_s:.2f} s")
        t0 = loop.time()
        try:
            await old.write([laddr_b], [old_addr], [4096], timeout=5)
            dead_write = "WROTE"
        except kvflow.KVFlowError as e:
            dead_write = type(e).__name__
        report.notes.append(f"a write to dead B: {dead_write} after {(loop.time() - t0) * 1e3:.1f} ms")
        await asyncio.sleep(max(0.0, t_kill + seconds / 3 - loop.time()))
        t_restart = loop.time()
        if silent:
            for link in range(3):
                await topo.set_link(link, True, host=1)
        await b.proc.wait()
        await b.start()                                   # same control address, new incarnation
        t0 = loop.time()
        try:
            await old.write([laddr_b], [old_addr], [4096], timeout=5)
            report.notes.append("OLD PEER WROTE AFTER RESTART")
            report.corrupted += 1
        except kvflow.PeerLostError:
            report.notes.append(f"old peer refused after restart ({(loop.time() - t0) * 1e3:.1f} ms)")
        untouched = (await b.shas([(0, REGION)]))[0] == hashlib.sha256(bytes(REGION)).hexdigest()
        if not untouched:
            report.notes.append("B'S NEW MEMORY CHANGED BEFORE ITS NEW PEER WROTE")
            report.corrupted += 1
        peer_b = await eng.connect(b.address)
        if peer_b is old or peer_b.descriptor.incarnation == old.descriptor.incarnation:
            report.notes.append("connect() returned the dead peer")
            report.corrupted += 1
        rb2 = Report("B again")
        await workload(peer_b, b, src_b, laddr_b, rb2, _after(seconds / 3), seed=8, limit=limit)
        t_end = loop.time()
        stop_a.set()
        await asyncio.wait_for(work_a, limit + 5)
        report.throughput = {"before": _rate(written, t_start, t_kill), "B dead": _rate(written, t_kill, t_restart),
                             "B restarting": _rate(written, t_restart, t_end)}
        report.notes.append("A's write rate MB/s: " + ", ".join(f"{k} {v / 1e6:.0f}"
                                                                for k, v in report.throughput.items()))
        report.notes.append(f"A: {ra.transfers} transfers, {ra.bytes_verified >> 20} MiB verified; "
                            f"B: {rb.transfers} before the kill, {rb2.transfers} after the restart "
                            f"({rb2.bytes_verified >> 20} MiB verified)")
        for part in (ra, rb, rb2):
            _merge(report, part)
    finally:
        # on an error above the workloads may still run: they end before
        # the engine they write with closes
        stop_a.set()
        for task in work:
            task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
        if silent:
            for link in range(3):
                await topo.set_link(link, True, host=1)
        if eng is not None:
            await eng.close()
        await asyncio.gather(a.stop(), b.stop())
    return report


async def _junk(host: str, port: int, stop: asyncio.Event, rng: random.Random, sent: list[int]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        s = socket.socket()
        s.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), 2)
            kind = rng.randrange(3)
            if kind == 0:
                data = rng.randbytes(rng.randrange(1, 4096))
            elif kind == 1:       # a data hello with a wrong token, then frames
                data = kvflow.control.wire.DATA_HEADER.pack(
                    kvflow.control.wire.DATA_MAGIC, kvflow.control.wire.DATA_HELLO, 0, 0,
                    rng.getrandbits(64), kvflow.control.wire.DATA_WIRE_VERSION, rng.getrandbits(64)) + rng.randbytes(256)
            else:                 # a huge length prefix
                data = (0xFFFFFFF0).to_bytes(4, "big") + rng.randbytes(64)
            await asyncio.wait_for(loop.sock_sendall(s, data), 2)
            sent[0] += len(data)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            s.close()
        await asyncio.sleep(0.005)


async def case_garbage(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Unauthenticated and garbage clients hammer every port of the target
    while a legitimate initiator transfers: nothing of it may fail."""
    report = Report("garbage clients")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        peer = await eng.connect(target.address)
        ports = [(h, p) for h, p in peer.descriptor.data] + [(topo.target(0), TARGET_PORT)]
        stop = asyncio.Event()
        sent = [0]
        rng = random.Random(4)
        junk = [loop.create_task(_junk(h, p, stop, rng, sent)) for h, p in ports for _ in range(2)]
        await workload(peer, target, src, laddr, report, _after(seconds), seed=4, limit=30)
        stop.set()
        await asyncio.gather(*junk)
        report.notes.append(f"junk sent: {sent[0] >> 10} KiB on {len(ports)} ports")
    return report


async def case_late(topo: Topology, seconds: float, keepalive: float) -> Report:
    """A timed-out write must never land after its error was raised: the
    connections that still hold it are reset after the drain grace."""
    report = Report("timed-out write during a rail outage, then rewritten")
    target = Target(topo, keepalive)
    await target.start()
    size, chunk = 16 << 20, 64 << 10
    eng = kvflow.Engine(f"{topo.host(0)}:0", protocols=("tcp",), keepalive=keepalive)
    await eng.start()
    old, new = np.full(size, 0xAA, np.uint8), np.full(size, 0xBB, np.uint8)
    lo, ln = eng.register(old), eng.register(new)
    loop = asyncio.get_running_loop()
    try:
        peer = await eng.connect(target.address)
        outage = min(0.75 * keepalive, 1.5)       # the rail's connections survive it
        await topo.set_rail(1, False)
        back = loop.call_later(outage, lambda: loop.create_task(topo.set_rail(1, True)))
        report.transfers += 1
        t0 = loop.time()
        try:
            await peer.write([lo.addr], [target.addr], [size], timeout=0.05)
        except kvflow.KVFlowError as e:
            report.failed[type(e).__name__] = 1
        report.slowest_s = loop.time() - t0
        for off in range(0, size, chunk):
            report.transfers += 1
            await asyncio.wait_for(peer.write([ln.addr + off], [target.addr + off], [chunk]), 30)
            report.bytes_sent += chunk
        await asyncio.sleep(outage + seconds / 2)     # the rail is back; anything late has landed by now
        back.cancel()
        want = hashlib.sha256(new[:1 << 20]).hexdigest()
        shas = await target.shas([(o, 1 << 20) for o in range(0, size, 1 << 20)])
        report.bytes_verified = sum(1 << 20 for s in shas if s == want)
        report.corrupted = sum(1 for s in shas if s != want)
    finally:
        await topo.set_rail(1, True)
        await eng.close()
        await target.stop()
    return report


async def case_netem(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Both rails lose and delay packets: slower, but every batch completes
    and verifies (tcp retransmits; nothing is declared dead)."""
    report = Report(f"netem {NETEM} on both rails")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        try:
            peer = await eng.connect(target.address)
            for rail in (0, 1):
                await topo.netem(rail, NETEM)
            await workload(peer, target, src, laddr, report, _after(seconds), seed=5, limit=3 * keepalive + 10)
            report.notes.append(f"failed connections: {sum(c['failures'] for c in peer.connections())}")
        finally:
            for rail in (0, 1):
                await topo.netem(rail, None)
    return report
