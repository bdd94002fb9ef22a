"""The soak (tools/soak.py), shortened: about 45 s of randomised mixed load
(writes, reads, strided batches, notifications, cancels and timeouts) from
four initiator lanes (two over tcp to a target in a network namespace, an
in-process pair over "local", one over tcp on loopback) while rails flap,
the target is killed and restarted, garbage clients connect and regions are
deregistered and registered again.

It asserts what the soak's verdict asserts, one invariant at a time so that
a failure names it: nothing corrupted, nothing hung, every failure explained
by a fault, no transfer through a deregistered region, no batch or slice in
flight once the load stopped, sockets and threads back to their value after
start() once the peers closed, descriptors back, RSS flat; and that the load
and every kind of fault really happened. KVFLOW_SOAK_SECONDS changes the
length; the table is printed (pytest -s).
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import faults  # noqa: E402
import soak  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]

WHY = faults.netns_unavailable()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=WHY))

SECONDS = float(os.environ.get("KVFLOW_SOAK_SECONDS", "45"))
SEED = 7


async def test_soak_mixed_load_with_faults():
    res = await soak.soak(SECONDS, SEED, log=print)
    print("\n" + soak.table(res))
    t = res.tally

    # correctness
    assert not t.hangs, t.hangs
    assert not t.unexplained, t.unexplained
    assert not t.fence_violations, t.fence_violations
    assert not res.tool_errors, res.tool_errors
    assert not res.monitors.loop_errors, res.monitors.loop_errors

    # resources: nothing in flight once the load stopped, everything
    # released once the peers closed, nothing left once the engines closed
    for name, c in res.counters["load stopped"].items():
        assert c["slices_inflight"] == 0 and c["batches"] == 0, (name, c)
    for name, c in res.counters["peers closed"].items():
        start = res.counters["after start"][name]
        assert c["sockets"] <= start["sockets"] and c["threads"] <= start["threads"], (name, start, c)
    for name, c in res.counters["closed"].items():
        assert not any(c.values()), (name, c)
    assert not res.leaks, res.leaks
    assert res.fds_end <= res.fds_start + soak.FD_MARGIN, (res.fds_start, res.fds_end)
    assert res.rss_slope <= soak.RSS_SLOPE_LIMIT, res.rss_slope

    # the load and the faults happened
    for op, _ in soak.OPERATIONS:
        assert t.outcomes[f"{op} ok"] > 0, (op, dict(t.outcomes))
    assert t.outcomes["write_cancel TransferCancelledError"] + t.outcomes["task_cancel TransferCancelledError"] > 0
    assert t.bytes_verified > 0 and t.bytes_swept > 0 and t.notifications_checked > 0
    kinds = {f.kind.split()[0] for f in t.faults}
    assert {"rail", "target", "garbage", "deregister"} <= kinds, kinds
    assert res.target_restarts >= 1

    assert [p for p in res.problems() if not p.endswith(" corrupted")] == []
    # (late landings of writes abandoned after DRAIN_GRACE were a bug: the
    # connections still holding them are reset now)
    assert not t.corrupted, t.corruption
