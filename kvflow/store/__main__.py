"""python -m kvflow.store master --listen HOST:PORT: a standalone master.
Prints a line containing `ready` once it listens; stops on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .master import Master


async def _serve(args: argparse.Namespace) -> None:
    master = Master(lease_ttl=args.lease_ttl, client_grace=args.client_grace,
                    heartbeat_interval=args.heartbeat_interval,
                    high_watermark=args.high_watermark, low_watermark=args.low_watermark)
    await master.start(args.listen)
    print(f"kvflow.store master ready on {master.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await master.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.store")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("master", help="run a standalone master")
    m.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 picks one)")
    m.add_argument("--lease-ttl", type=float, default=5.0, help="seconds a get's lease lasts")
    m.add_argument("--client-grace", type=float, default=60.0,
                   help="seconds of silence before a connected client is declared lost")
    m.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between a client's heartbeats (what clients are told)")
    m.add_argument("--high-watermark", type=float, default=0.95)
    m.add_argument("--low-watermark", type=float, default=0.85)
    m.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(_serve(args))
    except Exception as e:        # a listen address in use, or not this host's
        print(f"kvflow.store master: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
