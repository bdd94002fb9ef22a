"""The PXN relay, send side (kvflow.paths.relay), in host memory: two
"nodes" of two rails each, every engine a real kvflow engine; a write to
a destination on another rail goes through the sender's group member on
that rail, which posts it; every byte lands where it was written to, the
destination's bounds still hold, and the members' counters say which way
the bytes went. (On one host every engine reaches every other; the
emulated cluster where the rails are real links is tools/incast.py.)"""
from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

import kvflow
from kvflow import RelayGroup

from _batches import bounded


def sha(a) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a))).hexdigest()


@pytest.fixture(params=["tcp", "local"])
def protocol(request):
    return request.param


async def _cluster(make_engine, protocol, tmp_path, side="send", lanes=True):
    """node0: prefill ranks on rails 0, 1; node1: decode ranks on rails 0, 1."""
    d = str(tmp_path)
    eng = {}
    for node in (0, 1):
        for rail in (0, 1):
            eng[(node, rail)] = await make_engine(protocols=[protocol], relay=RelayGroup(
                f"node{node}", rail, rail, directory=d, side=side, lanes=lanes))
    return eng


async def test_cross_rail_writes_go_through_the_member_on_that_rail(make_engine, protocol, tmp_path):
    eng = await _cluster(make_engine, protocol, tmp_path)
    src = np.random.default_rng(3).integers(0, 256, 12 << 20, dtype=np.uint8)
    s = eng[(0, 0)].register(src)
    pools = {rail: np.zeros(12 << 20, np.uint8) for rail in (0, 1)}
    for rail, pool in pools.items():
        eng[(1, rail)].register(pool, name="kv")
    # rail 0 -> decode rail 1: through prefill rank 1; 64 pages and one large run
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    dst = peer.region("kv").addr
    offs = np.arange(64, dtype=np.uint64) * np.uint64(65536)
    await bounded(peer.write(s.addr + offs, dst + 2 * offs, np.full(64, 65536, np.uint64)))
    await bounded(peer.write([s.addr + (4 << 20)], [dst + (8 << 20)], [4 << 20]))
    for i in range(64):
        assert sha(pools[1][2 * i * 65536: 2 * i * 65536 + 65536]) == sha(src[i * 65536: (i + 1) * 65536])
    assert sha(pools[1][8 << 20: 12 << 20]) == sha(src[4 << 20: 8 << 20])
    moved = 64 * 65536 + (4 << 20)
    assert eng[(0, 0)].relay_stats()["relayed_bytes"] == moved
    assert eng[(0, 1)].relay_stats()["forwarded_bytes"] == moved
    # through the shared-memory lane (kvflow.paths.relay.lanes), not by messages
    assert eng[(0, 0)].relay_stats()["lanes_used"] == 1
    assert eng[(0, 1)].relay_stats()["lane_forwarded_bytes"] == moved
    # from another thread (the Mooncake API's path) too: write_blocking is relayed, not sent directly
    before = eng[(0, 0)].relay_stats()["relayed_bytes"]
    await bounded(asyncio.get_running_loop().run_in_executor(
        None, lambda: peer.write_blocking([s.addr], [dst + (11 << 20)], [65536])))
    assert sha(pools[1][11 << 20: (11 << 20) + 65536]) == sha(src[:65536])
    assert eng[(0, 0)].relay_stats()["relayed_bytes"] == before + 65536
    moved += 65536
    # rail-aligned: directly, nothing relayed
    aligned = await bounded(eng[(0, 0)].connect(eng[(1, 0)].address))
    await bounded(aligned.write([s.addr], [aligned.region("kv").addr], [1 << 20]))
    assert sha(pools[0][:1 << 20]) == sha(src[:1 << 20])
    assert eng[(0, 0)].relay_stats()["relayed_bytes"] == moved
    # a notification after a relayed write finds the data there
    await bounded(peer.write([s.addr], [dst], [65536]))
    await bounded(peer.notify(b"layer done"))
    _, msg = await bounded(eng[(1, 1)].notifications().__anext__())
    assert msg == b"layer done" and sha(pools[1][:65536]) == sha(src[:65536])
    await asyncio.sleep(0.05)
    assert eng[(0, 1)].relay_stats()["leases"] == 0          # every lease given back


async def test_receive_side_relay_passes_through_the_destination_nodes_member_on_our_rail(
        make_engine, protocol, tmp_path):
    """side="receive": prefill rail 0 -> decode rail 1 goes over rail 0 to
    decode node's rank on rail 0, which copies it to its neighbour on rail
    1; rail-aligned writes and writes inside one node go directly."""
    eng = await _cluster(make_engine, protocol, tmp_path, side="receive")
    src = np.random.default_rng(4).integers(0, 256, 8 << 20, dtype=np.uint8)
    s = eng[(0, 0)].register(src)
    pools = {rail: np.zeros(8 << 20, np.uint8) for rail in (0, 1)}
    for rail, pool in pools.items():
        eng[(1, rail)].register(pool, name="kv")
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    assert sorted(peer.descriptor.relay["members"]) == sorted(
        [(0, eng[(1, 0)].address), (1, eng[(1, 1)].address)])
    dst = peer.region("kv").addr
    offs = np.arange(32, dtype=np.uint64) * np.uint64(131072)
    await bounded(peer.write(s.addr + offs, dst + offs, np.full(32, 65536, np.uint64)))
    await bounded(peer.write([s.addr + (4 << 20)], [dst + (4 << 20)], [4 << 20]))
    for i in range(32):
        o = i * 131072
        assert sha(pools[1][o:o + 65536]) == sha(src[o:o + 65536])
    assert sha(pools[1][4 << 20:]) == sha(src[4 << 20:])
    moved = 32 * 65536 + (4 << 20)
    assert eng[(0, 0)].relay_stats()["relayed_bytes"] == moved
    assert eng[(1, 0)].relay_stats()["forwarded_bytes"] == moved        # the decode node's rank on rail 0
    assert eng[(0, 1)].relay_stats()["forwarded_bytes"] == 0            # not the sender's neighbour
    # rail-aligned, and within one node: directly
    aligned = await bounded(eng[(0, 0)].connect(eng[(1, 0)].address))
    await bounded(aligned.write([s.addr], [aligned.region("kv").addr], [65536]))
    inside = await bounded(eng[(1, 0)].connect(eng[(1, 1)].address))
    r0 = eng[(1, 0)].regions[0]
    await bounded(inside.write([r0.addr], [dst], [4096]))
    assert eng[(0, 0)].relay_stats()["relayed_bytes"] == moved
    assert eng[(1, 0)].relay_stats()["relayed_bytes"] == 0
    assert eng[(1, 0)].relay_stats()["leases"] == 0
    # the member's inbox lent its slots (the receive side's hop) and has every one back
    staging = eng[(1, 0)].metrics()["staging"]
    inbox = staging["relay_inbox"]
    assert inbox["allocations"] == 1 and inbox["max_in_use"] >= 1, inbox
    assert inbox["in_use"] == inbox["leases"] == 0 and inbox["free"] == inbox["slots"], inbox
    assert staging["outgoing"] is None and staging["inbox"] is None      # no GPU memory: no GPU staging pools


async def test_a_relayed_write_from_unregistered_memory_is_refused_before_the_lane(make_engine, tmp_path):
    """The lane path copies from this engine's memory with memcpy: a range
    that is not registered is refused (UnregisteredMemoryError naming the
    entry) before any slot is taken; the lane still works afterwards."""
    eng = await _cluster(make_engine, "tcp", tmp_path)
    src = np.arange(1 << 20, dtype=np.uint8)
    s = eng[(0, 0)].register(src)
    pool = np.zeros(1 << 20, np.uint8)
    eng[(1, 1)].register(pool, name="kv")
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    dst = peer.region("kv").addr
    with pytest.raises(kvflow.UnregisteredMemoryError, match="entry 1"):
        await bounded(peer.write([s.addr, s.addr + (1 << 20) - 10], [dst, dst + 4096], [4096, 4096]))
    assert not pool.any()
    await bounded(peer.write([s.addr], [dst], [1 << 20]))
    assert sha(pool) == sha(src) and eng[(0, 0)].relay_stats()["lanes_used"] == 1


async def test_a_member_that_stops_draining_is_written_around(make_engine, tmp_path):
    """A member in the same process (its pid lives on) that stops draining
    its lanes: the header says so, and the sender's parts waiting on its
    lane go directly to the destination instead (rerouted_bytes), instead
    of waiting for ever or failing; every byte lands."""
    eng = await _cluster(make_engine, "tcp", tmp_path)
    src = np.random.default_rng(9).integers(0, 256, 8 << 20, dtype=np.uint8)
    s = eng[(0, 0)].register(src)
    pool = np.zeros(8 << 20, np.uint8)
    eng[(1, 1)].register(pool, name="kv")
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    await bounded(peer.write([s.addr], [peer.region("kv").addr], [4096]))     # the lane is claimed
    pool[:] = 0
    relay = eng[(0, 1)]._relay
    await relay.forwarder.lanes.close()                                       # it stops draining
    await bounded(peer.write([s.addr], [peer.region("kv").addr], [8 << 20]))
    assert sha(pool) == sha(src)
    assert eng[(0, 0)].relay_stats()["rerouted_bytes"] == 8 << 20


async def test_relayed_write_outside_the_destination_is_refused(make_engine, tmp_path):
    eng = await _cluster(make_engine, "tcp", tmp_path)
    src = np.ones(1 << 20, np.uint8)
    s = eng[(0, 0)].register(src)
    pool = np.zeros(1 << 20, np.uint8)
    eng[(1, 1)].register(pool, name="kv", access=kvflow.Access.READ)
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    with pytest.raises(kvflow.RemoteAccessError, match="relay via"):
        await bounded(peer.write([s.addr], [peer.region("kv").addr], [4096]))
    assert not pool.any()
    with pytest.raises(kvflow.UnregisteredMemoryError):        # the sender's own range is checked first
        await bounded(peer.write([s.addr + (1 << 20)], [peer.region("kv").addr], [4096]))
    # the member is still usable, and its leases came back
    await asyncio.sleep(0.05)
    assert eng[(0, 1)].relay_stats()["leases"] == 0


async def test_no_member_on_the_rail_writes_directly(make_engine, tmp_path):
    d = str(tmp_path)
    a = await make_engine(protocols=["tcp"], relay=RelayGroup("n0", 0, 0, directory=d))
    b = await make_engine(protocols=["tcp"], relay=RelayGroup("n1", 0, 3, directory=d))   # rail 3: nobody in n0
    pool = np.zeros(4096, np.uint8)
    b.register(pool, name="kv")
    src = np.full(4096, 7, np.uint8)
    s = a.register(src)
    peer = await bounded(a.connect(b.address))
    await bounded(peer.write([s.addr], [peer.region("kv").addr], [4096]))
    assert (pool == 7).all() and a.relay_stats()["relayed_bytes"] == 0


def test_relay_group_and_descriptor_part_are_checked():
    from kvflow.control.descriptor import relay_from_wire
    with pytest.raises(kvflow.InvalidArgumentError):
        RelayGroup("a/b", 0, 0)
    with pytest.raises(kvflow.InvalidArgumentError):
        RelayGroup("n", -1, 0)
    with pytest.raises(kvflow.InvalidArgumentError, match="side"):
        RelayGroup("n", 0, 0, side="both")
    assert relay_from_wire({"group": "n0", "rank": 1, "rail": 2}) == {"group": "n0", "rank": 1, "rail": 2,
                                                                        "members": []}
    assert relay_from_wire({"group": "n0", "rank": 1, "rail": 2, "members": [[0, "h:1"], [2, "h:2"]]})["members"] \
        == [(0, "h:1"), (2, "h:2")]
    for bad in ({"group": "", "rank": 0, "rail": 0}, {"group": "n", "rank": True, "rail": 0},
                {"group": "n", "rank": 0}, ["n", 0, 0], {"group": "n", "rank": 0, "rail": 0, "members": [[0]]},
                {"group": "n", "rank": 0, "rail": 0, "members": [[-1, "h:1"]]},
                {"group": "n", "rank": 0, "rail": 0, "members": {"0": "h:1"}},
                {"group": "n", "rank": 0, "rail": 0, "members": [[0, 5]]}):
        with pytest.raises(kvflow.ProtocolError):
            relay_from_wire(bad)


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "inbox"])
async def test_a_member_that_goes_away_is_written_around_and_later_writes_go_directly(make_engine, tmp_path, lanes):
    """A member closed while a relayed write is in flight: that write still
    completes (the parts it had not forwarded go directly), every byte
    lands; the member's file is gone with it, so the next write to that
    rail goes directly."""
    eng = await _cluster(make_engine, "tcp", tmp_path, lanes=lanes)
    src = np.random.default_rng(5).integers(0, 256, 32 << 20, dtype=np.uint8)
    s = eng[(0, 0)].register(src)
    pool = np.zeros(32 << 20, np.uint8)
    eng[(1, 1)].register(pool, name="kv")
    peer = await bounded(eng[(0, 0)].connect(eng[(1, 1)].address))
    t = peer.write_nowait([s.addr], [peer.region("kv").addr], [32 << 20])
    while eng[(0, 1)].relay_stats()["forwarded_bytes"] == 0 and not t.done():
        await asyncio.sleep(0.001)
    await bounded(eng[(0, 1)].close())                       # the member on rail 1 goes away
    await bounded(t)
    assert sha(pool) == sha(src)
    stats = eng[(0, 0)].relay_stats()
    assert stats["relayed_bytes"] + stats["rerouted_bytes"] >= 32 << 20
    pool[:] = 0
    await bounded(peer.write([s.addr], [peer.region("kv").addr], [1 << 20]))      # directly now
    assert sha(pool[:1 << 20]) == sha(src[:1 << 20])


_MEMBER = """
import asyncio, sys, kvflow
async def main():
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                             relay=kvflow.RelayGroup("node0", 1, 1, directory=sys.argv[1])) as eng:
        print(eng.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


@pytest.fixture
def member_process(tmp_path):
    """The relay member of node0 on rail 1 in a process of its own (so it
    can be stopped and killed), its group folder tmp_path; yields the Popen
    once its engine is up."""
    import os
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    member = subprocess.Popen([sys.executable, "-c", _MEMBER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": root}, text=True)
    try:
        assert member.stdout.readline().strip()
        yield member
    finally:
        if member.poll() is None:
            member.send_signal(signal.SIGCONT)
            member.stdin.close()
            try:
                member.wait(20)
            except subprocess.TimeoutExpired:
                member.kill()
                member.wait(10)


async def _through_member(make_engine, tmp_path, seed):
    """node0's rank 0 (here) and node1's rank 1 (here): 48 MiB of random
    bytes to write, a zeroed pool, the peer; one write through the member
    process first, so that our lane in its segment is claimed."""
    d = str(tmp_path)
    sender = await make_engine(protocols=["tcp"], relay=RelayGroup("node0", 0, 0, directory=d))
    dest = await make_engine(protocols=["tcp"], relay=RelayGroup("node1", 1, 1, directory=d))
    src = np.random.default_rng(seed).integers(0, 256, 48 << 20, dtype=np.uint8)
    s = sender.register(src)
    pool = np.zeros(48 << 20, np.uint8)
    dest.register(pool, name="kv")
    peer = await bounded(sender.connect(dest.address))
    dst = peer.region("kv").addr
    await bounded(peer.write([s.addr], [dst], [4096]))
    assert sender.relay_stats()["lanes_used"] == 1
    pool[:] = 0
    return sender, src, s, pool, peer, dst


async def test_a_slow_member_back_pressures_its_sender_through_the_lane_credits(make_engine, tmp_path,
                                                                                 member_process):
    """The member on rail 1 is another process, stopped (SIGSTOP) for a
    while and then run in short bursts: a slow relay. The sender's 48 MiB
    write (12 slots through a lane of 4) waits for credits instead of
    failing or overrunning: while the member is stopped, no slot beyond the
    lane's 4 is rung and nothing lands; in every sample, rung - collected
    <= 4; once the member runs, every byte lands, in place."""
    import glob
    import json
    import os
    import signal
    import time
    from kvflow._lanes import Lanes
    from kvflow.paths.relay.lanes import LANE_SLOTS

    member = member_process
    sender, src, s, pool, peer, dst = await _through_member(make_engine, tmp_path, 11)
    recs = [json.load(open(f)) for f in glob.glob(os.path.join(str(tmp_path), "kvflow-relay-node0", "*"))]
    rec = next(r for r in recs if r.get("pid") == member.pid)           # the member's group file
    seg = Lanes(rec["lanes"])
    lane = next(i for i in range(seg.lanes) if seg.owner_of(i) == os.getpid())
    base = seg.state(lane)
    member.send_signal(signal.SIGSTOP)
    t = peer.write_nowait([s.addr], [dst], [48 << 20])
    samples = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:                               # stopped: credits run out
        samples.append(seg.state(lane))
        await asyncio.sleep(0.01)
    assert not t.done(), "the write finished through a stopped member"
    held = seg.state(lane)
    assert held["rung"] - base["rung"] == LANE_SLOTS                  # four slots filled, no more
    assert not pool.any()                                             # and nothing landed
    for _ in range(40):                                               # then slow: short bursts
        member.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.02)
        member.send_signal(signal.SIGSTOP)
        samples.append(seg.state(lane))
        await asyncio.sleep(0.05)
        if t.done():
            break
    member.send_signal(signal.SIGCONT)
    await bounded(t)
    assert all(x["rung"] - x["collected"] <= LANE_SLOTS for x in samples)
    assert sha(pool) == sha(src)
    assert sender.relay_stats()["relayed_bytes"] >= 48 << 20
    seg.close()


async def test_a_member_process_killed_mid_write_is_written_around(make_engine, tmp_path, member_process):
    """The member on rail 1, another process, is stopped with four slots of
    a 48 MiB write in its lane and then killed (SIGKILL: no close, its group
    file stays): the sender sees the process gone and writes every part
    directly; the write completes, every byte in place; the next write to
    that rail goes directly (a dead process's file is ignored)."""
    import signal
    member = member_process
    sender, src, s, pool, peer, dst = await _through_member(make_engine, tmp_path, 12)
    member.send_signal(signal.SIGSTOP)
    t = peer.write_nowait([s.addr], [dst], [48 << 20])
    await asyncio.sleep(0.3)
    assert not t.done()
    member.kill()
    member.wait(10)
    await bounded(t)
    assert sha(pool) == sha(src)
    assert sender.relay_stats()["rerouted_bytes"] == 48 << 20
    before = sender.relay_stats()["relayed_bytes"]
    await bounded(peer.write([s.addr], [dst], [1 << 20]))
    assert sender.relay_stats()["relayed_bytes"] == before


async def test_device_lanes_asked_for_where_cuda_is_not_usable(make_engine, tmp_path, caplog):
    """RelayGroup(device=0) on a machine without a usable GPU: the member
    says why it has no device lanes, publishes none, and relays host memory
    as before."""
    import kvflow.cuda
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here: tests/test_cuda.py runs the device lanes")
    import json
    import logging
    d = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        member = await make_engine(protocols=["tcp"], relay=RelayGroup("node0", 1, 1, directory=d, device=0))
    assert "no device lanes on cuda:0" in caplog.text
    assert member.relay_stats()["device_lanes"] == 0
    assert json.load(open(tmp_path / "kvflow-relay-node0" / "1.json"))["device_lanes"] is None
    sender = await make_engine(protocols=["tcp"], relay=RelayGroup("node0", 0, 0, directory=d))
    dest = await make_engine(protocols=["tcp"], relay=RelayGroup("node1", 1, 1, directory=d))
    src = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
    s = sender.register(src)
    pool = np.zeros(8 << 20, np.uint8)
    dest.register(pool, name="kv")
    peer = await bounded(sender.connect(dest.address))
    await bounded(peer.write([s.addr], [peer.region("kv").addr], [8 << 20]))
    assert sha(pool) == sha(src)
    stats = sender.relay_stats()
    assert stats["relayed_bytes"] == 8 << 20 and stats["device_lane_bytes"] == 0
    with pytest.raises(kvflow.InvalidArgumentError, match="device"):
        RelayGroup("node0", 2, 2, device=-1)


def test_the_relay_throughput_tool_runs_on_host_memory():
    """tools/gpu_relay.py --memory host (the GPU check runs it on cuda
    memory): the member in a process of its own, direct and relayed writes
    side by side, every byte verified, the relayed ones counted."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "gpu_relay.py"), "--memory", "host",
                          "--mib", "8", "--rounds", "2", "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["verified"] and res["member_device_lanes"] == 0
    assert res["relayed_bytes"] == 3 * (8 << 20) and res["rerouted_bytes"] == 0     # the warm-up and 2 rounds
    assert res["direct_gbps"] > 0 and res["relayed_gbps"] > 0


async def test_peers_may_not_touch_a_members_lanes(make_engine, tmp_path):
    """A member's lane slots hold other senders' bytes: registered as the
    source of its forwards only, so a peer's write into them (or read from
    them) is refused, and relayed writes still go through."""
    eng = await _cluster(make_engine, "tcp", tmp_path)
    member, outsider = eng[(0, 1)], eng[(1, 0)]
    src = np.ones(4096, np.uint8)
    s = outsider.register(src)
    peer = await bounded(outsider.connect(member.address))
    lanes = peer.region("kvflow.relay.lanes")
    with pytest.raises(kvflow.RemoteAccessError):
        await bounded(peer.write([s.addr], [lanes.addr], [4096]))
    with pytest.raises(kvflow.RemoteAccessError):
        await bounded(peer.read([s.addr], [lanes.addr], [4096]))
    sender, dest = eng[(0, 0)], eng[(1, 1)]
    data = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    d = sender.register(data)
    pool = np.zeros(1 << 20, np.uint8)
    dest.register(pool, name="kv")
    to = await bounded(sender.connect(dest.address))
    await bounded(to.write([d.addr], [to.region("kv").addr], [1 << 20]))
    assert sha(pool) == sha(data) and sender.relay_stats()["lanes_used"] == 1
