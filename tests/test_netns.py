"""Fault injection across network namespaces (tools/faults.py): target
engines in namespace hosts joined with this one by a control network and
two tcp rails (a bridge each, in a switch namespace, with a veth link to
every host), checksummed transfers while a rail goes down and comes back,
the target is killed and restarted, and garbage clients hammer its ports;
three hosts (two targets, one killed while the other is written); rails
picked from the topology on both ends (an initiator in a namespace too).

Timing bounds are the keepalive plus a slack, both stretched by
TIME_SCALE (the VM's emulation is slower at everything).

Each case asserts that nothing landed corrupted, nothing hung, and that the
failures are the expected typed ones (none at all for a rail going down).
The reports are printed (pytest -s, or -rA) for the closing notes.
"""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import faults  # noqa: E402

pytestmark = [pytest.mark.netns]

WHY = faults.netns_unavailable()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=WHY))

from _batches import TIME_SCALE  # noqa: E402

KEEPALIVE = 2.0 * TIME_SCALE     # dead-rail detection; stretched under the VM's emulation
SLACK = TIME_SCALE               # a second of timing margin, stretched likewise
SECONDS = 8.0


@pytest.fixture(scope="module")
def topo():
    t = faults.Topology(hosts=2).up()
    yield t
    t.down()


def test_up_removes_what_it_created_when_a_step_fails():
    t = faults.Topology(hosts=2, tag="x9")
    t.LINKS = ("ctl", "rail0", "an-interface-name-too-long")      # fails at the third network
    with pytest.raises(RuntimeError, match=r"too-long.* failed: \S"):       # with what ip said
        t.up()
    left = faults._ip("netns", "list").stdout
    assert not any(ns in left for ns in (t.switch, *t.hosts)), left
    assert all(faults._ip("link", "show", a, check=False).returncode for a in t.links)


async def test_child_that_never_says_hello_is_killed(topo):
    child = faults.Child(topo, 1.0, 0)
    # 198.51.100.1 is no address of the namespace: the engine cannot listen, the child exits
    with pytest.raises(faults.TargetGone, match=f"the child in {topo.hosts[0]} exited"):
        await child._spawn(["--serve-target", "198.51.100.1:7999"])
    assert child.proc is not None
    await asyncio.wait_for(child.proc.wait(), 10)          # exited or killed: not left running
    await child.stop()
    assert child.proc is None


def show(report: faults.Report) -> None:
    print("\n" + faults.table([report]))


def assert_sound(r: faults.Report) -> None:
    assert r.corrupted == 0, r
    assert "HANG" not in r.failed, r
    assert r.bytes_verified == r.bytes_sent, r


async def test_rail_down_and_back_loses_nothing(topo):
    r = await faults.case_rail(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    assert r.failed == {}, "a rail going down must cost throughput, not transfers"
    assert r.transfers > 10 and r.bytes_sent > 0
    # noticed within the keepalive window (plus a probe), rebuilt once it is back
    assert r.detect_s is not None and r.detect_s < 2 * KEEPALIVE + 2 * SLACK, r
    assert r.recover_s is not None and r.recover_s < 10 * SLACK, r
    assert r.slowest_s < 3 * KEEPALIVE + 5 * SLACK, r


async def test_killed_target_fails_fast_and_restart_is_reached(topo):
    r = await faults.case_kill(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    # the batch in flight fails, or (a kill right after it completed) the
    # target dies before hashing it
    assert set(r.failed) <= {"PeerLostError"} and sum(r.failed.values()) + r.unverifiable == 1, r
    assert r.detect_s is not None and r.detect_s < KEEPALIVE + 3 * SLACK, r
    assert "old peer refused after restart" in r.notes, r.notes


async def test_timed_out_write_never_lands_late(topo):
    r = await faults.case_late(topo, SECONDS, KEEPALIVE)
    show(r)
    assert r.failed == {"TransferTimeoutError": 1}, r
    assert r.corrupted == 0, "a byte of the timed-out write landed over the later one"
    assert r.bytes_verified == r.bytes_sent == 16 << 20, r


@pytest.mark.vm
@pytest.mark.skipif(WHY is None and faults.netem_unavailable() is not None,
                    reason=f"{faults.netem_unavailable()}: runs in the Soft-RoCE VM (tests/test_rdma_vm.py)")
async def test_lossy_delayed_rails_complete_everything(topo):
    r = await faults.case_netem(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    assert r.failed == {}, r
    assert r.transfers > 3


async def test_garbage_clients_do_not_disturb_transfers(topo):
    r = await faults.case_garbage(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    assert r.failed == {}, r
    assert r.transfers > 10


@pytest.mark.parametrize("silent", [False, True], ids=["killed", "cut-off-and-killed"])
async def test_three_hosts_dead_target_does_not_slow_the_other(topo, silent):
    r = await faults.case_three(topo, 3 * SECONDS / 2, KEEPALIVE, silent=silent)
    show(r)
    assert_sound(r)
    # B's batch in flight fails, or (a kill right after it completed) B died
    # before hashing it; nothing else fails: A never, B's new peer never
    assert set(r.failed) <= {"PeerLostError"} and sum(r.failed.values()) + r.unverifiable == 1, r
    # a killed process's sockets close at once; a silent host is declared
    # lost by the keepalive (pings every keepalive/3, lost after keepalive)
    assert r.detect_s is not None and r.detect_s < KEEPALIVE + (1.5 if silent else 0.5) * SLACK, r
    assert any(n.startswith("old peer refused after restart") for n in r.notes), r.notes
    assert any(n.startswith("a write to dead B: PeerLostError") for n in r.notes), r.notes
    # A is not slowed by B's death: generous, this machine's 2 cores are shared
    before, dead = r.throughput["before"], r.throughput["B dead"]
    assert before > 0 and dead > 0.3 * before, r.throughput
    assert r.throughput["B restarting"] > 0, r.throughput


async def test_rails_from_topology_pair_and_fail_over(topo):
    r = await faults.case_auto(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    assert r.failed == {}, "a rail going down must cost throughput, not transfers"
    # each engine found its two rails itself (its control link left out)...
    assert r.rails["target"] == [topo.target(1, 0), topo.target(2, 0)], r.rails
    assert r.rails["initiator"] == [topo.target(1, 1), topo.target(2, 1)], r.rails
    # ...and every data connection is bound to, and leaves from, the
    # initiator's rail on the target rail's subnet: two per rail, and the
    # express lane (HIGH batches) on the first
    assert sorted(r.rails["bound"]) == [topo.target(1, 1)] * 3 + [topo.target(2, 1)] * 2, r.rails
    assert r.rails["pairs"] == [[topo.target(1, 1), topo.target(1, 0)], [topo.target(2, 1), topo.target(2, 0)]], r.rails
    assert r.rails["down"] == [], r.rails
    assert r.detect_s is not None and r.detect_s < 2 * KEEPALIVE + 2 * SLACK, r
    assert r.recover_s is not None and r.recover_s < 10 * SLACK, r
    assert r.transfers > 10


async def test_peers_of_one_engine_share_a_bottleneck(topo):
    """Fair share between the peers of one engine (issue 18): behind one
    rate-limited link, a peer with small writes keeps about half of it while
    another streams 16 MiB writes, and none of its writes waits for that
    backlog (each of the peers' tcp connections is a flow of its own; the
    kernel shares the link between flows)."""
    r = await faults.case_fair(topo, SECONDS, KEEPALIVE)
    show(r)
    assert_sound(r)
    t = r.throughput
    assert t["B alone"] > 0 and t["A with B"] > 0, r
    # loose bounds (measured: Jain 0.997-0.999, B keeps 0.50; docs/qos.md):
    # B is not starved by A's backlog
    assert t["jain"] >= 0.8, r
    assert t["B with A"] >= 0.25 * t["B alone"], r
    assert t["B slowest with A s"] < 2.0 * SLACK, r


async def test_incast_window_behind_a_bottleneck(topo):
    """Receiver credits where incast happens (issue 18): three senders, one
    receiver whose rails are shaped (its NIC). With a 4 MiB receive window
    the senders hold at most the window unacknowledged toward it (without
    one, what their socket buffers take), at no cost in throughput: the
    link, not the grant path, sets the pace."""
    window = 4 << 20
    r = await faults.case_incast(topo, 1.5 * SECONDS, KEEPALIVE, windows=(0, window))
    show(r)
    assert_sound(r)
    t, q = r.throughput, r.rails
    assert t["no window"] > 0, r
    # Not the speed target (>= 0.9x: measured side by side in
    # tools/faults.py runs, docs/qos.md): only that a window does not throttle
    # the link; a loaded CI machine moves single runs by +-10%.
    assert t["window 4 MiB"] >= 0.5 * t["no window"], r
    assert q["window 4 MiB"]["send_queued"] <= window + (256 << 10), r
    assert q["no window"]["send_queued"] > window, "the contrast: without a window the senders queue more"
