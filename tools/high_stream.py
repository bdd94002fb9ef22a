"""What the tcp express lane costs a stream made of one class alone: two
engines over loopback tcp, `--batches` writes of `--size` bytes (1 MiB
entries), `--inflight` at a time, with and without the lane, per class;
the settings alternate, `--rounds` times. Prints GB/s per setting, and
with --json one JSON object per measurement.

    python3 tools/high_stream.py [--sizes 1M,16M] [--classes NORMAL,HIGH] [--rounds 2] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

import kvflow
from kvflow import Priority
from kvflow.cli.bench_layout import parse_size

MiB = 1 << 20


async def stream(express: bool, priority: Priority, size: int, inflight: int, batches: int) -> float:
    """GB/s of `batches` writes of `size` bytes, `inflight` at a time (after 8 to warm up)."""
    a = kvflow.Engine(protocols=["tcp"], tcp_express=express)
    b = kvflow.Engine(protocols=["tcp"], tcp_express=express)
    await a.start()
    await b.start()
    try:
        src = np.ones(size * inflight, np.uint8)
        dst = np.zeros(size * inflight, np.uint8)
        a.register(src)
        b.register(dst)
        peer = await a.connect(b.address)
        entries = max(1, size // MiB)
        step = size // entries

        async def one(k: int) -> None:
            off = (k % inflight) * size
            await peer.write([src.ctypes.data + off + j * step for j in range(entries)],
                             [dst.ctypes.data + off + j * step for j in range(entries)], [step] * entries,
                             priority=priority)

        for k in range(8):
            await one(k)
        gate = asyncio.Semaphore(inflight)

        async def gated(k: int) -> None:
            async with gate:
                await one(k)
        t0 = time.perf_counter()
        await asyncio.gather(*(gated(k) for k in range(batches)))
        seconds = time.perf_counter() - t0
        if not np.array_equal(src, dst):
            raise SystemExit("the bytes differ")
        return batches * size / seconds / 1e9
    finally:
        await a.close()
        await b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--classes", default="NORMAL,HIGH")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--batches", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    classes = [Priority[c.strip().upper()] for c in args.classes.split(",")]
    for _ in range(args.rounds):
        for express in (False, True):
            for prio in classes:
                for size in sizes:
                    gbps = asyncio.run(stream(express, prio, size, args.inflight, args.batches))
                    if args.json:
                        print(json.dumps({"express": express, "priority": prio.name, "size": size, "gbps": gbps}))
                    else:
                        print(f"express {'on ' if express else 'off'} {prio.name:<6} {size / MiB:>5.0f} MiB:"
                              f" {gbps:6.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
