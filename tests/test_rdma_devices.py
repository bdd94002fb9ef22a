"""Device health of the rdma provider on real verbs (Soft-RoCE in the VM, or
a real NIC): the link under one of two devices taken down mid-transfer, a
device deleted mid-transfer and added again, a target device reopened, a
channel connected while a device was gone, a QP outliving its device, a
device retired during connect or repair, a peer whose only device goes, and
connect leaving out a port-down device. Every write completes and verifies
or fails typed; no QP or MR is left behind (docs/rdma.md#device-health).
"""
from __future__ import annotations

import asyncio
import os
import shutil

import numpy as np
import pytest

import kvflow
from kvflow.providers.rdma import provider as rdma

from _batches import TIME_SCALE, bounded
from _rdma_pair import close_released, connected, rdma_pair, rxe_counter, until

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not kvflow.features["rdma"], reason="kvflow built without libibverbs"),
    pytest.mark.skipif(not rdma.device_names(), reason="no RDMA device on this host (run in the Soft-RoCE VM)"),
]


def netdev_of(dev: str) -> str:
    with open(f"/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/1") as f:
        return f.read().strip()


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip(8) to take a link down")
async def test_a_device_whose_link_dies_costs_throughput_not_data():
    """The link under rxe1 goes down mid-transfer: its QPs break (retry
    exceeded), their slices move to rxe0, every write completes and
    verifies; repairs back off and probe, and once the link is back rxe1's
    QPs are in service again and carry data."""
    names = rdma.device_names()[:2]
    link = netdev_of(names[1])
    a, b = await rdma_pair(rdma_devices=names)
    try:
        n = 4 << 20
        dst, src, r, l, peer = await connected(a, b, n, 5)
        rng = np.random.default_rng(5)
        t_down = asyncio.get_running_loop().time()
        down = await asyncio.create_subprocess_exec("ip", "link", "set", link, "down")
        try:
            await down.wait()
            for i in range(4):
                src[:] = rng.integers(0, 255, n, dtype=np.uint8)
                await bounded(peer.write([l.addr], [r.addr], [n]), 120)
                assert np.array_equal(dst, src), f"write {i} while {link} is down"
            assert dev(a, 1)["errors"] > 0
            # the port error event took rxe1 out of service (not only its QPs' retries)
            assert dev(a, 1)["down_since"] is not None and dev(b, 1)["down_since"] is not None
            print(f"\n{link} down: initiator saw it after {dev(a, 1)['down_since'] - t_down:.3f} s")
            states = {s["device_index"]: set() for s in peer.connections()}
            for s in peer.connections():
                states[s["device_index"]].add(s["state"])
            assert "up" not in states[1] and states[0] == {"up"}, states
        finally:
            up = await asyncio.create_subprocess_exec("ip", "link", "set", link, "up")
            await up.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60 * TIME_SCALE
        while any(not s["up"] for s in peer.connections()):
            assert loop.time() < deadline, peer.connections()
            await asyncio.sleep(0.2)
        before = sum(s["bytes"] for s in peer.connections() if s["device_index"] == 1)
        src[:] = rng.integers(0, 255, n, dtype=np.uint8)
        await bounded(peer.write([l.addr], [r.addr], [n]), 120)
        assert np.array_equal(dst, src)
        assert sum(s["bytes"] for s in peer.connections() if s["device_index"] == 1) > before
        assert peer.alive
    finally:
        await a.close()
        await b.close()


async def verified_write(peer, l, r, src, dst, rng, label: str) -> str:
    """Writes new random bytes from src (region l) over dst (region r):
    "verified" when they landed, else the kvflow error's class name. A
    write that completes with other bytes in dst fails the test."""
    src[:] = rng.integers(0, 255, src.size, dtype=np.uint8)
    try:
        await bounded(peer.write([l.addr], [r.addr], [src.size], timeout=60), 120)
    except kvflow.KVFlowError as e:
        return type(e).__name__
    assert np.array_equal(dst, src), f"{label} completed but did not verify"
    return "verified"


async def rdma_link(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec("rdma", "link", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("rdma") is None, reason="needs root and rdma(8) to delete a device")
async def test_a_device_deleted_mid_transfer_is_closed_and_traffic_moves():
    """`rdma link delete rxe1` while a stream of verified writes runs over
    rxe0 and rxe1. The kernel removes rxe1's uverbs node and then waits for
    every open context on it, sending no verbs event: both engines notice
    the removal, close everything they had on rxe1 (so the deletion
    completes), and move its slices to rxe0. Every write either verifies
    or fails with a kvflow error; the writes after it verify, on rxe0 only;
    closing the engines does not hang and leaves no MR or QP."""
    names = rdma.device_names()[:2]
    gone = names[1]
    netdev = netdev_of(gone)
    a, b = await rdma_pair(rdma_devices=names)
    loop = asyncio.get_running_loop()
    outcomes: dict[str, int] = {}
    rng = np.random.default_rng(9)
    try:
        n = 4 << 20
        dst, src, r, l, peer = await connected(a, b, n, 9)

        async def one(i: int) -> str:
            what = await verified_write(peer, l, r, src, dst, rng, f"write {i}")
            outcomes[what] = outcomes.get(what, 0) + 1
            return what

        for i in range(3):
            assert await one(i) == "verified"
        per_dev = {0: 0, 1: 0}
        for s in peer.connections():
            per_dev[s["device_index"]] += s["bytes"]
        assert min(per_dev.values()) > 0, per_dev          # both devices carried data

        t0 = loop.time()
        deletion = loop.create_task(rdma_link("delete", gone))
        i, during = 3, 0
        during_outcomes: dict[str, int] = {}
        while not deletion.done():                        # writes go on while the device goes
            what = await one(i)
            during_outcomes[what] = during_outcomes.get(what, 0) + 1
            i, during = i + 1, during + 1
            assert loop.time() - t0 < 60 * TIME_SCALE, "rdma link delete did not return"
        took = loop.time() - t0
        rc, out = deletion.result()
        assert rc == 0, out
        assert gone not in rdma.device_names()
        detect = {}
        for name, e in (("initiator", a), ("target", b)):
            assert dev(e, 1)["state"] == "gone", (name, e.devices())
            detect[name] = round(dev(e, 1)["down_since"] - t0, 3)
        states = [(s["device_index"], s["state"]) for s in peer.connections()]
        assert all(st == "gone" for d, st in states if d == 1), states     # destroyed, never repaired
        assert all(st == "up" for d, st in states if d == 0), states
        on_dev0 = sum(s["bytes"] for s in peer.connections() if s["device_index"] == 0)
        for j in range(3):
            assert await one(i + j) == "verified", outcomes
        assert sum(s["bytes"] for s in peer.connections() if s["device_index"] == 0) >= on_dev0 + 3 * n
        assert b.counters()["mrs"] == 4 + 1 and a.counters()["mrs"] == 4 + 1   # rxe0's only
        print(f"\nrdma link delete {gone}: returned in {took:.2f} s; noticed after {detect} s "
              f"({dev(a, 1)['why']}); "
              f"{during} write(s) of {n >> 20} MiB during, outcomes {outcomes}")
        assert outcomes.get("verified", 0) >= 6 and set(outcomes) <= {"verified", "PeerLostError"}, outcomes
        # a write that ran while the device went (not only those before and after) verified
        assert during_outcomes.get("verified", 0) >= 1, during_outcomes
    finally:
        try:
            await readd(gone, netdev)          # first: later tests need their second device back
        finally:
            t1 = loop.time()
            await bounded(a.close(), 30)
            await bounded(b.close(), 30)
            print(f"engines closed in {loop.time() - t1:.2f} s")
    for e in (a, b):
        c = e.counters()
        assert c["mrs"] == 0 and c["qps"] == 0, c


def _usable(dev: str) -> bool:
    """The device is back: port ACTIVE and its IPv4-mapped GID (index 1) set."""
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/1/state") as f:
            if "ACTIVE" not in f.read():
                return False
        with open(f"/sys/class/infiniband/{dev}/ports/1/gids/1") as f:
            return f.read().strip().replace(":", "").strip("0") != ""
    except OSError:
        return False


async def readd(dev: str, netdev: str) -> None:
    """Adds Soft-RoCE device `dev` on `netdev` again (if it is gone) and
    waits until it is usable."""
    if dev not in rdma.device_names():
        rc, out = await rdma_link("add", dev, "type", "rxe", "netdev", netdev)
        assert rc == 0, out
    await until(lambda: _usable(dev), f"{dev} back (port ACTIVE, GID 1 set)", 30)


def dev(engine, index: int) -> dict:
    """Row `index` of engine.devices(): the rdma device's state, why and
    since when it is out of service, its errors and probe key."""
    return engine.devices()[index]


def dev_bytes(ch, index: int, rdev: int | None = None) -> int:
    """Bytes a peer's channel posted on its QPs on device `index` (toward
    the peer's device `rdev` only, when given), from Peer.connections()."""
    return sum(s["bytes"] for s in ch.connections()
               if s["device_index"] == index and rdev in (None, s["remote_device"]))


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("rdma") is None, reason="needs root and rdma(8) to delete a device")
async def test_a_device_deleted_and_added_again_is_back_in_service():
    """`rdma link delete rxe1` while a stream of verified writes runs (A to
    B; B is connected to A as well), then `rdma link add rxe1` again: both
    engines reopen rxe1 in its old slot, register their memory on it again
    and push the new keys (regions and probe) to each other, and every QP
    that went with the device is rebuilt on it: within a bounded time all
    QPs of both channels are up again, slices flow over rxe1 again (the
    QPs' byte counts and the device's own packet counter grow), and the
    engines hold as many MRs and QPs as before the deletion. No write
    completes with wrong bytes, none hangs, and only writes that overlapped
    the deletion may fail (with a kvflow error); closing leaves no MR or QP."""
    names = sorted(rdma.device_names())[:2]     # rxe0, rxe1 (a device added again is listed first)
    gone = names[1]
    netdev = netdev_of(gone)
    a, b = await rdma_pair(rdma_devices=names)
    loop = asyncio.get_running_loop()
    phases = ["before", "deleting", "gone", "adding", "back"]
    phase = [0]
    outcomes: dict[str, dict[str, int]] = {}        # the phases a write ran in -> outcome -> count
    stop = asyncio.Event()
    stream = None
    closed = False
    try:
        n = 1 << 20
        dst, src, r, l, peer = await connected(a, b, n, 19)
        back_dst, back_src, back_r, back_l, back_peer = await connected(b, a, n, 20)
        rng = np.random.default_rng(19)

        async def writes() -> None:
            while not stop.is_set():
                began = phase[0]
                what = await verified_write(peer, l, r, src, dst, rng, f"a write ({phases[began]})")
                ran = "..".join(phases[began:phase[0] + 1])
                outcomes.setdefault(ran, {})
                outcomes[ran][what] = outcomes[ran].get(what, 0) + 1

        def verified(p: str) -> int:
            assert stream is not None
            if stream.done():
                stream.result()                 # its assertion, or the write that did not end
                raise AssertionError(f"the write stream ended: {outcomes}")
            return outcomes.get(p, {}).get("verified", 0)

        stream = loop.create_task(writes())
        await until(lambda: verified("before") >= 2, "writes before the deletion")
        assert min(dev_bytes(peer, 0), dev_bytes(peer, 1)) > 0
        held = [(e.counters()["mrs"], e.counters()["qps"]) for e in (a, b)]

        phase[0] = phases.index("deleting")
        t0 = loop.time()
        rc, out = await bounded(rdma_link("delete", gone), 60)
        assert rc == 0, out
        await until(lambda: dev(a, 1)["state"] == "gone" and dev(b, 1)["state"] == "gone",
                    "both engines retired it")
        deleted = loop.time() - t0
        for ch in (peer, back_peer):
            assert all(s["state"] == "gone" for s in ch.connections() if s["device_index"] == 1), ch.connections()
        phase[0] = phases.index("gone")
        await until(lambda: verified("gone") >= 2, "writes over rxe0 alone")

        phase[0] = phases.index("adding")
        t_add = loop.time()
        rc, out = await bounded(rdma_link("add", gone, "type", "rxe", "netdev", netdev), 60)
        assert rc == 0, out
        reopened = {}
        await until(lambda: dev(a, 1)["state"] != "gone" and dev(b, 1)["state"] != "gone",
                    "both engines reopened it", 60)
        reopened["seen"] = round(loop.time() - t_add, 3)
        await until(lambda: all(s["up"] for ch in (peer, back_peer)
                                for s in ch.connections()), "every QP up again", 60)
        up = loop.time() - t_add
        phase[0] = phases.index("back")
        # the keys the peers were pushed are the ones now registered
        for e, p in ((b, peer), (a, back_peer)):
            assert p.descriptor.rdma["probe"][1] == [d["probe_rkey"] for d in e.devices()]
            assert all(d["up"] for d in p.descriptor.rdma["devices"]), p.descriptor.rdma
            assert {x.name: x.rkeys for x in p.regions} == {x.name: x.rkeys for x in e.regions}
            assert all(x.rkeys[1] for x in p.regions)
        # slices flow over rxe1 again, in both directions
        on1, back_on1 = dev_bytes(peer, 1), dev_bytes(back_peer, 1)
        pkts = rxe_counter(gone, "sent_pkts")
        mark = verified("back")
        await until(lambda: verified("back") >= mark + 3, "writes after the return")
        back_src[:] = rng.integers(0, 255, n, dtype=np.uint8)
        await bounded(back_peer.write([back_l.addr], [back_r.addr], [n]), 120)
        assert np.array_equal(back_dst, back_src)
        carried = dev_bytes(peer, 1) - on1
        assert carried >= n, (carried, peer.connections())
        assert dev_bytes(back_peer, 1) - back_on1 >= n // 4, back_peer.connections()
        assert rxe_counter(gone, "sent_pkts") - pkts >= carried // 4096
        assert [(e.counters()["mrs"], e.counters()["qps"]) for e in (a, b)] == held
        stop.set()
        await bounded(stream, 150)
        print(f"\nrdma link delete {gone}: both engines retired it after {deleted:.2f} s; "
              f"rdma link add: both reopened it after {reopened['seen']:.2f} s, every QP up on it "
              f"{up:.2f} s after the add; it carried {carried >> 10} KiB of {3 * n >> 10} KiB "
              f"written since; outcomes {outcomes}")
        for ran, seen in outcomes.items():
            assert set(seen) <= {"verified", "PeerLostError"}, outcomes
            if "deleting" not in ran:
                assert set(seen) == {"verified"}, outcomes      # only the deletion may cost a write
        closed = True
        await close_released(a, b)
    finally:
        stop.set()
        if stream is not None:
            await asyncio.wait([stream], timeout=150 * TIME_SCALE)
        try:
            await readd(gone, netdev)          # later tests need their second device back
        finally:
            if not closed:
                await bounded(a.close(), 30)
                await bounded(b.close(), 30)


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
async def test_the_initiator_reaches_a_target_device_that_was_reopened():
    """Only the target closes rxe1 and opens it again (_retire, then
    _reopen, as its removal and return would): the initiator's rxe1 stays
    open, so its QPs toward the target's rxe1 are not gone but broken
    (their target QPs are destroyed), and their repairs back off against a
    closed device. The reopen pushes the target's new region and probe keys
    with the device up again, which wakes those repairs: every QP is up
    again and carries slices, no write is lost, the counters balance."""
    names = sorted(rdma.device_names())[:2]
    a, b = await rdma_pair(rdma_devices=names)
    loop = asyncio.get_running_loop()
    closed = False
    try:
        n = 1 << 20
        dst, src, r, l, peer = await connected(a, b, n, 23)
        rng = np.random.default_rng(23)
        held = [(e.counters()["mrs"], e.counters()["qps"]) for e in (a, b)]
        b._rdma._retire(1, "test: removed")
        # its QPs toward the closed device time out; their slices move to rxe0
        for i in range(2):
            assert await verified_write(peer, l, r, src, dst, rng, f"write {i}") == "verified"
        await until(lambda: all(s["state"] == "broken" for s in peer.connections() if s["device_index"] == 1),
                    "the initiator's QPs toward the closed device broken", 60)
        await asyncio.sleep(2)                  # their repairs back off meanwhile
        assert dev(b, 1)["state"] == "gone" and all(s["state"] == "broken" for s in peer.connections()
                                                if s["device_index"] == 1), peer.connections()
        t0 = loop.time()
        b._rdma._reopen(1, "test: back")
        await until(lambda: all(s["up"] for s in peer.connections()), "every QP up again", 60)
        up = loop.time() - t0
        assert peer.descriptor.rdma["probe"][1] == [d["probe_rkey"] for d in b.devices()]
        on1 = dev_bytes(peer, 1)
        for i in range(2, 4):
            assert await verified_write(peer, l, r, src, dst, rng, f"write {i}") == "verified"
        assert dev_bytes(peer, 1) - on1 >= n, peer.connections()
        assert [(e.counters()["mrs"], e.counters()["qps"]) for e in (a, b)] == held
        print(f"\nthe target's rxe1 reopened: the initiator's QPs toward it up again after {up:.2f} s")
        closed = True
        await close_released(a, b)
    finally:
        if not closed:
            await bounded(a.close(), 30)
            await bounded(b.close(), 30)


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.parametrize("side", ["target", "initiator"])
async def test_a_channel_connected_while_a_device_was_gone_gets_qps_on_it_when_it_returns(side):
    """One engine's rxe1 is closed (_retire, as its removal would) before A
    connects to B: the channel pairs only the devices in service, so it has
    no QP on that device (the target's: its descriptor says it is not up;
    the initiator's: it is gone). When the device comes back (_reopen) the
    channel gets QPs for the pair it lacks, probed before they carry
    anything (pushed keys tell the initiator when it is the target's
    device; the reopen itself when it is its own): they come up, slices flow
    over rxe1, every write verifies, the counters balance at close. (The
    cross pair the channel made meanwhile, rxe1 to rxe0 or rxe0 to rxe1,
    does not reach in this VM: each rxe device sits on its own dummy
    netdev, which drops what it sends, and loops back only to its own
    address; its QPs stay broken and under repair, carrying nothing.)"""
    names = sorted(rdma.device_names())[:2]
    a, b = await rdma_pair(rdma_devices=names)
    loop = asyncio.get_running_loop()
    gone = b if side == "target" else a
    closed = False
    try:
        n = 1 << 20
        gone._rdma._retire(1, "test: removed")
        dst, src, r, l, peer = await connected(a, b, n, 29)
        rng = np.random.default_rng(29)
        ch = peer
        pairs = {(s["device_index"], s["remote_device"]) for s in ch.connections()}
        assert (1, 1) not in pairs and all(s["up"] for s in ch.connections()
                                           if s["device_index"] == s["remote_device"] == 0), ch.connections()
        assert await verified_write(peer, l, r, src, dst, rng, "write 0") == "verified"
        before = len(ch.connections())
        t0 = loop.time()
        gone._rdma._reopen(1, "test: back")
        await until(lambda: any(s["device_index"] == 1 and s["remote_device"] == 1 and s["up"]
                                for s in ch.connections()),
                    "QPs for the returning device pair in service", 60)
        took = loop.time() - t0
        stats = ch.connections()
        assert len(stats) == before + a._rdma.qps_per_pair, stats
        assert all(s["up"] for s in stats if s["device_index"] == s["remote_device"]), stats
        on1 = dev_bytes(ch, 1, 1)
        for i in range(1, 4):
            assert await verified_write(peer, l, r, src, dst, rng, f"write {i}") == "verified"
        assert dev_bytes(ch, 1, 1) > on1, ch.connections()
        print(f"\nthe {side}'s rxe1 back: the channel connected without it has QPs on it after {took:.2f} s")
        closed = True
        await close_released(a, b)
    finally:
        if not closed:
            await bounded(a.close(), 30)
            await bounded(b.close(), 30)


async def test_a_qp_outliving_its_device_is_destroyed_with_it():
    """Device.close() destroys the QPs it made that no channel took over
    (children before parents, counted); such a Qp then refuses connect and
    hand-over, its destroy() is a no-op, and a channel refuses it."""
    from kvflow import _core, _verbs
    core = _core.Core(1)
    events = _verbs.Events()
    try:
        name = rdma.device_names()[0]
        d = _verbs.Device(core, events, name, 0, ack_timeout=rdma.choose_ack_timeout(name))
        assert d.removal_known and not d.removed()          # its uverbs node, as at open
        # Soft-RoCE has no parent device: the software ACK timeout (537 ms)
        assert d.software and d.ack_timeout == 17 and "ack timeout 17 (537 ms)" in repr(d), repr(d)
        qp = d.create_qp(8)
        target = d.create_qp(1, target=True)
        assert core.counters()["qps"] == 2
        ch = _verbs.RdmaChannel(core, _core.RemoteTable(), "nowhere:1", 1 << 18, 1)
        d.close()
        assert core.counters()["qps"] == 0 and core.counters()["mrs"] == 0, core.counters()
        with pytest.raises(OSError):
            qp.connect(1, 0, bytes(16), 0, 5)
        with pytest.raises(OSError):
            ch.add_qp(qp, 0)
        qp.destroy()
        target.destroy()
        d.close()
        assert core.counters()["qps"] == 0
        ch.close()
    finally:
        events.close()
        core.close()


def retire_both(a, b, index: int) -> None:
    """Both engines see device `index` removed (as a uevent would tell them)."""
    for e in (a, b):
        e._rdma._retire(index, "test: removed")


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
async def test_a_device_retired_during_connect_or_repair_leaves_no_qp():
    """A device retired while connect() or a repair awaits the peer's reply
    destroys the QPs made for it (no verbs call on a closed context
    afterwards): the connect fails with ProviderUnavailableError and leaves
    no QP, a later connect pairs the other device; an engine closed while a
    repair waits destroys the repair's QP before its device."""
    names = rdma.device_names()[:2]
    a, b = await rdma_pair(rdma_devices=names)
    closed = False
    try:
        real = a._rdma.connect

        class RetireAfterReply:
            """The peer's link, whose first request's reply comes after both ends retired rxe1."""

            def __init__(self, link):
                self._link, self.address, self._done = link, link.address, False

            def __getattr__(self, name):
                return getattr(self._link, name)

            async def request(self, msg, timeout=10.0):
                reply = await self._link.request(msg, timeout)
                if not self._done:
                    self._done = True
                    retire_both(a, b, 1)
                return reply

        async def racing_connect(link, remote, token):
            return await real(RetireAfterReply(link), remote, token)

        a._rdma.connect = racing_connect
        with pytest.raises(kvflow.ProviderUnavailableError, match="went away while connecting"):
            await bounded(a.connect(b.address))
        del a._rdma.connect
        assert a.counters()["qps"] == 0, a.counters()
        dst, src, r, l, peer = await connected(a, b, 1 << 20, 11)
        assert {s["device_index"] for s in peer.connections()} == {0}
        await bounded(peer.write([l.addr], [r.addr], [1 << 20]))
        assert np.array_equal(dst, src)
        # a repair whose reply never comes, then the engine closes
        nqps = a.counters()["qps"]
        stall = asyncio.Event()
        real_request = peer._session.request

        async def stalled(msg, *args, **kw):
            await stall.wait()
            return await real_request(msg, *args, **kw)

        peer._session.request = stalled
        assert peer._channel.break_qp(0)
        a._rdma._start_repair(peer.link, peer._channel, 0)
        await until(lambda: a.counters()["qps"] == nqps + 1, "the repair made its QP")
        closed = True
        await close_released(a, b)
    finally:
        if not closed:
            await a.close()
            await b.close()


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip(8) to take a link down")
async def test_a_peer_whose_only_device_goes_is_lost_and_a_new_connect_works(monkeypatch):
    """A channel whose QPs are all on one device (one rail): that device's
    link goes down (the writes wait for a QP to come back: nothing else
    can carry them), then the device goes. What waited and what is
    submitted after fail with PeerLostError promptly (nothing waits for a
    QP that cannot come back), and a new connect() pairs the device still
    in service."""
    names = rdma.device_names()[:2]
    a, b = await rdma_pair(rdma_devices=names)
    link = netdev_of(a.devices()[1]["name"])
    loop = asyncio.get_running_loop()
    try:
        monkeypatch.setattr(rdma, "_pairs", lambda *args: [(1, 1)])
        n = 1 << 20
        dst, src, r, l, peer = await connected(a, b, n, 13)
        monkeypatch.undo()
        assert {s["device_index"] for s in peer.connections()} == {1}
        await bounded(peer.write([l.addr], [r.addr], [n]), 120)
        assert np.array_equal(dst, src)
        down = await asyncio.create_subprocess_exec("ip", "link", "set", link, "down")
        try:
            await down.wait()
            await until(lambda: dev(a, 1)["why"] is not None, "the port error seen")
            writes = [loop.create_task(peer.write([l.addr], [r.addr], [n], timeout=120)) for _ in range(4)]
            await asyncio.sleep(1)
            assert not any(w.done() for w in writes), writes      # parked: no QP is up
            t0 = loop.time()
            retire_both(a, b, 1)
            outcomes = await bounded(asyncio.gather(*writes, return_exceptions=True), 30)
            took = loop.time() - t0
        finally:
            up = await asyncio.create_subprocess_exec("ip", "link", "set", link, "up")
            await up.wait()
        kinds = [type(o).__name__ for o in outcomes]
        assert set(kinds) == {"PeerLostError"}, outcomes
        assert took < 5 * TIME_SCALE, took
        assert not peer.alive
        with pytest.raises(kvflow.PeerLostError):
            await bounded(peer.write([l.addr], [r.addr], [4096]), 10)
        await until(lambda: not a._rdma._lost, "the lost peer closed")
        assert a.counters()["qps"] == 0, a.counters()
        peer2 = await bounded(a.connect(b.address))
        assert peer2 is not peer and {s["device_index"] for s in peer2.connections()} == {0}
        src[:] = np.roll(src, 5)
        await bounded(peer2.write([l.addr], [r.addr], [n]), 120)
        assert np.array_equal(dst, src)
        print(f"\none-rail peer lost after its device went: parked writes failed in {took:.3f} s")
    finally:
        await bounded(a.close(), 30)
        await bounded(b.close(), 30)
    for e in (a, b):
        c = e.counters()
        assert c["mrs"] == 0 and c["qps"] == 0, c


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip(8) to take a link down")
async def test_connect_leaves_out_a_port_down_device_and_a_failed_probe_is_repaired(monkeypatch):
    """A QP whose probe fails at connect is broken and repaired (the
    connect stands on the others); an async QP error breaks and repairs
    its QP; a device whose port is down is left out of the pairing (no
    probe to time out) while the other one is in service."""
    names = rdma.device_names()[:2]
    link = netdev_of(names[1])
    a, b = await rdma_pair(rdma_devices=names)
    try:
        real_probe = a._rdma._probe_qp
        failed = []

        async def probe(peer, ch, i):
            if i == 1 and not failed:
                failed.append(i)
                raise kvflow.ProviderUnavailableError("test: this QP does not answer")
            return await real_probe(peer, ch, i)

        monkeypatch.setattr(a._rdma, "_probe_qp", probe)
        dst, src, r, l, peer = await connected(a, b, 1 << 20, 17)
        assert failed == [1]
        await until(lambda: all(s["up"] for s in peer.connections()), "the QP repaired", 60)
        await bounded(peer.write([l.addr], [r.addr], [1 << 20]))
        assert np.array_equal(dst, src)
        # an async QP error (IBV_EVENT_QP_FATAL) on one QP: that QP is repaired
        st = peer.connections()[2]
        a._rdma._qp_failed(st["device_index"], st["qpn"], "test: local work queue catastrophic error")
        await until(lambda: all(s["up"] for s in peer.connections())
                    and peer.connections()[2]["qpn"] != st["qpn"], "the QP repaired after its event", 60)
        await peer.close()
        loop = asyncio.get_running_loop()
        down = await asyncio.create_subprocess_exec("ip", "link", "set", link, "down")
        try:
            await down.wait()
            await until(lambda: dev(a, 1)["why"] is not None and dev(b, 1)["why"] is not None, "port errors seen")
            t0 = loop.time()
            peer = await bounded(a.connect(b.address))
            took = loop.time() - t0
            assert {(s["device_index"], s["remote_device"]) for s in peer.connections()} == {(0, 0)}
            assert took < rdma.PROBE_TIMEOUT, took
            src[:] = np.roll(src, 7)
            await bounded(peer.write([l.addr], [r.addr], [1 << 20]))
            assert np.array_equal(dst, src)
        finally:
            up = await asyncio.create_subprocess_exec("ip", "link", "set", link, "up")
            await up.wait()
    finally:
        await bounded(a.close(), 30)
        await bounded(b.close(), 30)
