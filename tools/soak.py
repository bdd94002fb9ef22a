"""Soak: a bounded, randomised mixed load with faults, every byte checked.

Four initiator lanes run at once in this process, each a task doing one
operation after another on a window of memory it alone uses:

  ns-a, ns-b    tcp to a target engine in a network namespace (tools/faults.py:
                a control link and two rails), one initiator engine each
  pair-local    an in-process pair of engines over the "local" provider
  pair-tcp      an in-process pair of engines over tcp on 127.0.0.1
  pair-rdma     (only with --lanes rdma) an in-process pair over rdma, e.g. in
                the Soft-RoCE VM: python3 tools/rdma_vm.py --netdev dummy
                --devices 2 -- python3 tools/soak.py --lanes rdma --faults dereg

Operations (random batch shapes: 1-64 entries of 64 B - 4 MiB, some strided):
write, read, write_nowait then cancel, writes and reads with a short
timeout=, a task cancelled mid-write, and write-then-notify (the receiver
hashes the written ranges when the notification arrives: completed writes
must have landed). Each lane keeps a shadow of what its remote window must
hold; a write that failed, timed out or was cancelled may or may not have
landed, so its bytes leave verification until rewritten. Every successful
write is hashed on the target (the namespace target hashes its own memory,
faults.Target.shas; in-process targets hash the numpy buffer), every
successful read is compared with the shadow, and at the end each window is
swept once more (a late landing shows there).

Meanwhile two schedulers inject faults at random times: on the namespace
target a rail going down for 1-4 s, SIGKILL and restart (lanes reconnect
with engine.connect), bursts of garbage clients on every port; on the
in-process pairs deregister + register of either side's region. Every
failure is charged to the fault whose window covers it; one no fault
explains is reported with its timing (and fails the run).

RSS and open descriptors of this process (and of the target) are sampled
every SAMPLE_S seconds. At the end every engine must have no batch and no
slice in flight before anything closes, its sockets and threads must return
to their value after start() once its peers have closed, descriptors must
return to within FD_MARGIN of the start, and RSS may grow over the second
half of the run by at most RSS_SLOPE_LIMIT MiB/min.

A mismatch is diagnosed: the range is read back, and compared with the
content of the last writes over it that did not succeed (each piece's
content is a slice of one random pool, so it can be recomputed). Bytes of a
write whose await gave up after DRAIN_GRACE, found over a later successful
write, are counted apart as late landings (a known engine bug, see
late_landing()); they still count as corrupted.

    python3 tools/soak.py --seconds 300 [--seed N] [--json out.json]
        [--faults rail,kill,garbage,dereg] [--big-cancels] [--lanes ns,local,tcp,rdma]

--mode store soaks the KVCache pool (kvflow.store) instead: a standalone
master (over etcd with --store-etcd), --holders member processes with
segments, a writer process and this process's client; puts, gets checked
byte for byte, exists and removes while holders are killed and stopped, the
writer is killed mid-put and the small pool evicts; at the end the segment
space must balance and come back to zero (soaklib/store.py says what is
checked). It needs neither root nor namespaces:

    python3 tools/soak.py --mode store --seconds 120 [--holders 3] [--store-etcd]

Exit status: 0 when every invariant held, 1 otherwise, 2 when network
namespaces cannot be made (needs root and iproute2). tests/test_soak.py runs
a shorter soak with a fixed seed.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import sys
import time
from typing import Any, Callable

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import faults  # noqa: E402  (also puts the checkout on sys.path)
import numpy as np  # noqa: E402

import kvflow  # noqa: E402
from soaklib.base import (  # noqa: E402
    ABORT_MAX_PIECES, DEFAULT_LANES, FAULTS, HANG_S, Hang, KEEPALIVE, LANES, MAX_PIECES, POOL, QUIESCE_S, RELEASE_S,
    RESOURCES, TARGET_START_S, bounded, fd_count, fix_malloc_threshold, slope_mib_per_min)
from soaklib.lanes import Lane, NamespaceLane, NamespaceTarget, PairLane  # noqa: E402
from soaklib.inject import namespace_faults, region_faults  # noqa: E402
from soaklib.monitor import WarningLog, sample, watch_lag  # noqa: E402
from soaklib.report import SoakResult, plain, table, to_json  # noqa: E402
from soaklib.store import store_soak, table as store_table  # noqa: E402
from soaklib.store_procs import Etcd, serve_member  # noqa: E402
# the names tests/test_soak.py and tests/test_soak_rdma.py read from this module
from soaklib.base import FD_MARGIN, OPERATIONS, RSS_SLOPE_LIMIT  # noqa: E402,F401


async def quiesce(engines: dict[str, kvflow.Engine], keys: tuple[str, ...], want: Callable[[str, dict], dict],
                  limit: float) -> dict[str, dict[str, int]]:
    """Polls every engine's counters until `keys` reach want(name, ...)'s
    values (or `limit`); returns the last readings."""
    deadline = time.monotonic() + limit
    while True:
        now = {n: e.counters() for n, e in engines.items()}
        if all(now[n].get(k, 0) <= want(n, now[n]).get(k, 0) for n in engines for k in keys) \
                or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


async def soak(seconds: float, seed: int = 1, *, faults_on: tuple[str, ...] = FAULTS, big_cancels: bool = True,
               lanes_on: tuple[str, ...] = DEFAULT_LANES,
               log: Callable[[str], None] | None = None) -> SoakResult:
    """Runs the soak (see the module doc) and returns what it saw; the
    caller judges by result.problems(). faults_on: which kinds of FAULTS
    to inject; big_cancels: batches that are cancelled or time out get
    every shape (see ABORT_MAX_PIECES); lanes_on: which of LANES run
    (without "ns" no namespace is made and rail/kill/garbage faults have
    nothing to hit). Fixes glibc's mmap threshold for the rest of the
    process (fix_malloc_threshold)."""
    if not lanes_on or set(lanes_on) - set(LANES):
        raise ValueError(f"lanes_on: choose from {LANES}, not {lanes_on}")
    say = log or (lambda _m: None)
    fix_malloc_threshold()
    loop = asyncio.get_running_loop()
    res = SoakResult(seconds, seed, debug_build=bool(kvflow.features.get("debug")), big_cancels=big_cancels)
    tally, mon = res.tally, res.monitors
    gc.collect()
    res.fds_start = fd_count() or 0
    t_start = time.monotonic()
    tally.t0 = t_start

    previous = loop.get_exception_handler()

    def on_loop_error(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        mon.loop_errors.append(f"{ctx.get('message')}: {ctx.get('exception')!r}")
        (previous or (lambda _l, c: lp.default_exception_handler(c)))(lp, ctx)

    loop.set_exception_handler(on_loop_error)
    handler = WarningLog(mon, t_start)
    klog = logging.getLogger("kvflow")
    klog.addHandler(handler)
    rng = random.Random(seed)
    pool_rng = np.random.default_rng(seed)
    pool = pool_rng.integers(0, 256, POOL, dtype=np.uint8)

    topo = faults.Topology()
    ns = NamespaceTarget(topo)
    engines: dict[str, kvflow.Engine] = {}
    baseline: dict[str, dict[str, int]] = {}
    lanes: list[Lane] = []
    helpers: list[asyncio.Task[Any]] = []
    try:
        if "ns" in lanes_on:
            topo.up()
            await ns.start()
            say(f"soak: namespace target up (pid {ns.pid})")
        say(f"soak: lanes {', '.join(lanes_on)}; {seconds:g} s of load, seed {seed}")

        async def engine(name: str, listen: str, protocols: tuple[str, ...], **kw: Any) -> kvflow.Engine:
            e = kvflow.Engine(listen, protocols=protocols, keepalive=KEEPALIVE, **kw)
            await e.start()
            engines[name] = e
            baseline[name] = e.counters()
            return e

        ns_lanes = [
            NamespaceLane("ns-a", ns, await engine("ns-a", f"{topo.host(0)}:0", ("tcp",)), 0, tally, seed * 10 + 1),
            NamespaceLane("ns-b", ns, await engine("ns-b", f"{topo.host(0)}:0", ("tcp",), tcp_connections=1),
                          1, tally, seed * 10 + 2),
        ] if "ns" in lanes_on else []
        pair_lanes = []
        for proto in [p for p in LANES[1:] if p in lanes_on]:
            init = await engine(f"pair-{proto} initiator", "127.0.0.1:0", (proto,))
            tgt = await engine(f"pair-{proto} target", "127.0.0.1:0", (proto,))
            pair_lanes.append(PairLane(f"pair-{proto}", init, tgt, tally, seed * 10 + 2 + LANES.index(proto)))
        lanes = [*ns_lanes, *pair_lanes]
        for n, e in engines.items():
            # the lanes' windows stay registered until their engines close
            # (re-registration keeps the count): MRs are balanced from here
            baseline[n]["mrs"] = e.counters().get("mrs", 0)
        for lane in lanes:
            lane.pool = pool
            lane.abort_pieces = MAX_PIECES if big_cancels else ABORT_MAX_PIECES
        res.lanes = [f"{ln.name} ({ln.engine.protocols[0]})" for ln in lanes]

        helpers += [loop.create_task(sample(mon, t_start, ns, tally, say)), loop.create_task(watch_lag(mon, t_start))]
        stop = asyncio.Event()
        garbage_sent = [0]
        work = [loop.create_task(lane.run(stop)) for lane in lanes]
        chaos = []
        if set(faults_on) & {"rail", "kill", "garbage"} and ns_lanes:
            chaos.append(loop.create_task(namespace_faults(ns, ns_lanes, stop, random.Random(rng.random()), tally,
                                                           garbage_sent, faults_on)))
        if "dereg" in faults_on:
            chaos.append(loop.create_task(region_faults(pair_lanes, stop, random.Random(rng.random()), tally)))
        # The load ends early if any task dies (a bug in this tool or an
        # exception the engine should not raise): that is reported.
        ended = loop.create_task(asyncio.sleep(seconds))
        running = {ended, *work, *chaos}
        while ended in running:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                break
        ended.cancel()
        stop.set()
        say(f"soak: load stopped after {time.monotonic() - t_start:.0f} s; draining")
        done, pending = await asyncio.wait([*work, *chaos], timeout=2 * HANG_S + TARGET_START_S)
        for t in pending:
            res.tool_errors.append(f"a task did not stop within {2 * HANG_S + TARGET_START_S:g} s: {t!r}")
            t.cancel()
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                e = t.exception()
                res.tool_errors.append(f"task died: {type(e).__name__}: {e}")
        res.garbage_kib = garbage_sent[0] >> 10
        res.target_restarts = ns.generation

        # Everything awaited: no batch, no slice may be left in flight.
        quiet = await quiesce(engines, ("slices_inflight", "batches"), lambda n, c: {}, QUIESCE_S)
        res.counters["load stopped"] = quiet
        for n, c in quiet.items():
            if c.get("slices_inflight") or c.get("batches"):
                res.leaks.append(f"{n}: in flight after the load stopped: {c}")

        for lane in lanes:
            try:
                await lane.sweep()
            except (kvflow.KVFlowError, Hang, RuntimeError) as e:
                res.tool_errors.append(f"{lane.name}: sweep failed: {e}")

        # Peers closed: each engine's sockets and threads back to their
        # value after start() (the target side's sessions end when their
        # connections close).
        for lane in lanes:
            if lane.peer is not None:
                try:
                    await bounded(lane.peer.close(), "peer.close()")
                except Hang as e:
                    res.tool_errors.append(f"{lane.name}: {e}")
            if isinstance(lane, PairLane) and lane.consumer is not None:
                lane.consumer.cancel()
        released = await quiesce(engines, RESOURCES, lambda n, c: baseline[n], RELEASE_S)
        res.counters["after start"] = baseline
        res.counters["peers closed"] = released
        for n, c in released.items():
            # resources only: fenced, cut_off and wakeups are tallies of events, they only grow
            over = {k: (baseline[n].get(k, 0), v) for k, v in c.items()
                    if k in RESOURCES and v > baseline[n].get(k, 0)}
            if over:
                res.leaks.append(f"{n}: counters above their value after start() once its peers "
                                 f"closed (start, now): {over}")
    finally:
        for t in helpers:
            t.cancel()
        for lane in lanes:
            if isinstance(lane, PairLane) and lane.consumer is not None:
                lane.consumer.cancel()
        await asyncio.gather(*helpers, *[ln.consumer for ln in lanes
                                         if isinstance(ln, PairLane) and ln.consumer is not None],
                             return_exceptions=True)
        closed = {}
        for n, e in engines.items():
            await bounded(e.close(), f"closing {n}")
            closed[n] = e.counters()
        res.counters["closed"] = closed
        try:
            if "ns" in lanes_on:
                await ns.stop()
        finally:
            if "ns" in lanes_on:
                topo.down()
            klog.removeHandler(handler)
            loop.set_exception_handler(previous)
    lanes.clear()
    engines.clear()
    gc.collect()
    await asyncio.sleep(0.2)          # subprocess pipe transports close on the next iterations
    gc.collect()
    res.fds_end = fd_count() or 0
    res.rss_slope = slope_mib_per_min(mon.samples)
    res.wall_s = round(time.monotonic() - t_start, 1)
    return res


def store_main(a: argparse.Namespace) -> int:
    """--mode store: the KVCache pool's soak (soaklib/store.py)."""
    if a.store_etcd and Etcd.unavailable():
        print(f"soak: {Etcd.unavailable()}", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    res = asyncio.run(store_soak(a.seconds, seed, holders=a.holders, etcd=a.store_etcd,
                                 log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(store_table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**plain(res), "problems": res.problems()}, f, indent=1, default=str)
    return 0 if not res.problems() else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("transfer", "store"), default="transfer",
                    help="transfer: engines and lanes (default); store: the KVCache pool (kvflow.store)")
    ap.add_argument("--seconds", type=float, default=300.0, help="length of the load")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    ap.add_argument("--small-cancels", action="store_true",
                    help="cancel and time out only batches of at most 16 pieces")
    ap.add_argument("--lanes", default=",".join(DEFAULT_LANES), help="comma-separated: " + ", ".join(LANES))
    ap.add_argument("--holders", type=int, default=3, help="--mode store: holder processes (segments)")
    ap.add_argument("--store-etcd", action="store_true", help="--mode store: a durable master over etcd")
    # a store member process (soaklib/store_procs.py starts them)
    ap.add_argument("--store-member", choices=("holder", "writer"), help=argparse.SUPPRESS)
    ap.add_argument("--store-master", help=argparse.SUPPRESS)
    ap.add_argument("--segment-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store-timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.store_member:
        asyncio.run(serve_member(a.store_master, a.store_member, a.segment_size, a.seed or 0, a.store_timeout))
        return 0
    if a.mode == "store":
        if a.holders < 2:
            ap.error("--holders: at least 2 (objects with two replicas)")
        return store_main(a)
    lanes = tuple(x for x in a.lanes.split(",") if x)
    if not lanes or set(lanes) - set(LANES):
        ap.error(f"--lanes: choose from {', '.join(LANES)}")
    why = faults.netns_unavailable() if "ns" in lanes else None
    if why:
        print(f"soak: {why}", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    chosen = tuple(f for f in a.faults.split(",") if f)
    if set(chosen) - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(set(chosen) - set(FAULTS))}")
    res = asyncio.run(soak(a.seconds, seed, faults_on=chosen, big_cancels=not a.small_cancels, lanes_on=lanes,
                           log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(to_json(res), f, indent=1, default=str)
    return 0 if not res.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
