"""python -m kvflow.store master --listen HOST:PORT: a standalone master.
Prints a line containing `ready` once it listens; stops on SIGINT/SIGTERM.

With `--etcd HOST:PORT [--cluster NAME]` the master is durable and one of
possibly several: it campaigns for the cluster's leadership (printing
`standby` while another master leads), and once it leads it recovers the
index from etcd, then serves (`ready`). It exits with status 3 when it
can no longer make its changes durable (etcd lost, or fenced by a newer
leader), and with status 1 when etcd cannot be reached at start.

`--metrics-port PORT` serves the master's Prometheus metrics (segments,
objects, evictions, lease waits, lookups: kvflow/store/metrics.py) over
http on the --listen host (needs prometheus-client)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from .durable import Journal, Layout
from .election import Election
from .errors import DurabilityError
from .etcd import EtcdClient
from .gc_freeze import GcFreezer
from .master import Master

log = logging.getLogger("kvflow.store.master")


async def _lead(master: Master, args: argparse.Namespace, stop: asyncio.Event) -> Election | None:
    """Campaigns, recovers, attaches the journal. None when stopped first."""
    layout = Layout(args.cluster)
    etcd = EtcdClient(args.etcd, timeout=args.etcd_timeout)
    await etcd.post("/v3/maintenance/status", {})        # reachable now, or a DurabilityError
    election = Election(etcd, layout.leader, master.address, ttl=args.leader_ttl)
    if not await election.attempt():
        print(f"kvflow.store master standby on {master.address} (cluster {args.cluster})", flush=True)
        campaign = asyncio.ensure_future(election.campaign())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([campaign, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not campaign.done():
            campaign.cancel()
            await asyncio.gather(campaign, return_exceptions=True)
            await election.resign()
            await etcd.close()
            return None
        campaign.result()
    t0 = time.monotonic()
    journal = Journal(etcd, layout, master.model, fence_revision=election.revision, clock=master.clock)
    counts = await journal.recover(master.clock())
    master.attach_journal(journal, sync_commit=args.commit == "sync")
    master.leadership = election        # space is handed out only while its lease runs
    journal.stage()
    journal.flush_recovered()       # records recovery found stale go now
    log.warning("leading cluster %s: recovered %d segments, %d objects (%d dropped), %d quotas, %d tasks in "
                "%.3f s (etcd read %.3f s); %d free bytes fenced for %.1f s", args.cluster, counts["segments"],
                counts["objects"], counts["dropped"], counts["quotas"], counts["tasks"], time.monotonic() - t0,
                counts["read_s"], counts["fenced"], counts["fence_s"])
    election.lost.add_done_callback(
        lambda f: master.durability_lost(f.exception()) if f.exception() else None)
    return election


async def _serve(args: argparse.Namespace) -> None:
    master = Master(lease_ttl=args.lease_ttl, client_grace=args.client_grace,
                    heartbeat_interval=args.heartbeat_interval,
                    high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                    soft_pin_ttl=args.soft_pin_ttl)
    if args.root_fs_dir:        # told to every client at register (the Mooncake API's take it)
        master.root_fs_dir = os.path.join(os.path.abspath(args.root_fs_dir), args.cluster)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    election = None
    freezer = GcFreezer()       # this process is the master's own: its index kept off the collector
    freezer.install()
    await master.start(args.listen, serving=args.etcd is None)
    if args.metrics_port is not None:
        _serve_metrics(master, args.listen.rpartition(":")[0], args.metrics_port)
    try:
        if args.etcd is not None:
            election = await _lead(master, args, stop)
            if election is None:
                return
            freezer.freeze_now()        # the recovered index, as it is (rebuilt with the collector off)
            await master.serve()
        print(f"kvflow.store master ready on {master.address}", flush=True)
        args.ready = True
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, master.failed], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if master.failed.done() and master.failed.exception() is not None:
            raise master.failed.exception()
    finally:
        freezer.uninstall()
        await master.close()
        if election is not None:
            await election.resign()         # the standby takes over at once
            await election.etcd.close()


def _serve_metrics(master: Master, host: str, port: int) -> None:
    """prometheus_client's http server (a thread of its own) with this
    master's collector alone in its registry."""
    from prometheus_client import CollectorRegistry, start_http_server

    from .metrics import register_prometheus
    registry = CollectorRegistry()
    register_prometheus(master, registry)
    start_http_server(port, addr=host, registry=registry)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.store")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("master", help="run a standalone master")
    m.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 picks one)")
    m.add_argument("--lease-ttl", type=float, default=5.0, help="seconds a get's lease lasts")
    m.add_argument("--client-grace", type=float, default=60.0,
                   help="seconds of silence before a connected client is declared lost (after a "
                        "restart: before a client that has not registered again is)")
    m.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between a client's heartbeats (what clients are told)")
    m.add_argument("--high-watermark", type=float, default=0.95)
    m.add_argument("--soft-pin-ttl", type=float, default=1800.0,
                   help="seconds a soft pin lasts when the put names none (Mooncake's default: 30 min)")
    m.add_argument("--low-watermark", type=float, default=0.85)
    m.add_argument("--etcd", help="HOST:PORT of etcd: a durable master, leader of --cluster")
    m.add_argument("--cluster", default="default", help="the cluster's name in etcd")
    m.add_argument("--leader-ttl", type=float, default=2.0,
                   help="seconds of the leader's etcd lease (how long a dead leader is waited for)")
    m.add_argument("--commit", choices=("sync", "async"), default="sync",
                   help="sync: a put is acknowledged once its record is in etcd; async: at once, "
                        "the record follows within one flush (a crash may forget the last puts)")
    m.add_argument("--etcd-timeout", type=float, default=2.0, help="seconds per etcd request")
    m.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (needs prometheus-client)")
    m.add_argument("--root-fs-dir", "--root_fs_dir", default="",
                   help="a directory under which clients that ask for it (the Mooncake API's clients, "
                        "as Mooncake's) keep their SSD tiers: <dir>/<cluster>/<host>-<n>")
    m.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(_serve(args))
    except DurabilityError as e:
        print(f"kvflow.store master: DurabilityError: {e}", file=sys.stderr)
        return 3 if getattr(args, "ready", False) else 1
    except Exception as e:        # a listen address in use, or not this host's
        print(f"kvflow.store master: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
