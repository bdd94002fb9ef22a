#!/usr/bin/env python3
"""How long kvflow holds the event loop while batches stream.

Two engines in this process; batches of --batch entries of --block-size
bytes (scattered: a one-block gap after each, so nothing coalesces) go out
with write_nowait(), --concurrency at a time, for --rounds rounds. Meanwhile
a ticker task sleeps 1 ms at a time and records how much later than asked
it woke up: the loop's lag, i.e. how long something else (kvflow's submit
and completion handling, or a transfer done inside a system call) kept the
loop from running it. Every written block is checked afterwards.

    python3 tools/loop_lag.py --protocol tcp
    python3 tools/rdma_vm.py -- python3 tools/loop_lag.py --protocol rdma
    KVFLOW_RDMA_WORKER_POSTS=0 python3 tools/rdma_vm.py -- python3 tools/loop_lag.py --protocol rdma

Prints one line (and a JSON object with --json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvflow  # noqa: E402

TICK = 0.001


def pct(values: list[float], q: float) -> float:
    """The q-quantile of values, in ms."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] * 1e3


async def measure(args) -> dict:
    a = kvflow.Engine(protocols=(args.protocol,))
    b = kvflow.Engine(protocols=(args.protocol,))
    await a.start()
    await b.start()
    try:
        step = 2 * args.block_size if args.scatter else args.block_size
        n = step * args.batch
        src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        r = b.register(dst, name="kv")
        l = a.register(src)
        peer = await a.connect(b.address)
        offs = [i * step for i in range(args.batch)]
        la = [l.addr + o for o in offs]
        ra = [r.addr + o for o in offs]
        ln = [args.block_size] * args.batch
        await peer.write(la, ra, ln)                 # warm: connected, registered, paths up
        lags: list[float] = []
        calls: list[float] = []
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(TICK)
                lags.append(time.perf_counter() - t - TICK)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(10 * TICK)
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            pending = []
            for _ in range(args.concurrency):
                t = time.perf_counter()
                pending.append(peer.write_nowait(la, ra, ln))
                calls.append(time.perf_counter() - t)
            await asyncio.gather(*pending)
        elapsed = time.perf_counter() - t0
        done.set()
        await tick
        verified = all(np.array_equal(dst[o:o + args.block_size], src[o:o + args.block_size]) for o in offs)
        rdma = getattr(a, "_rdma", None)
        return {
            "protocol": peer.transport, "block_size": args.block_size, "batch": args.batch,
            "scatter": args.scatter, "concurrency": args.concurrency, "rounds": args.rounds,
            "worker_posts": [d.worker_posts for d in rdma.devices] if rdma is not None else None,
            "mbps": args.rounds * args.concurrency * args.batch * args.block_size / elapsed / 1e6,
            "submit_ms_p50": pct(calls, 0.5), "submit_ms_max": pct(calls, 1.0),
            "lag_ms_p50": pct(lags, 0.5), "lag_ms_p99": pct(lags, 0.99), "lag_ms_max": pct(lags, 1.0),
            "verified": verified,
        }
    finally:
        await a.close()
        await b.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", default="rdma", choices=("rdma", "tcp", "local"))
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contiguous", dest="scatter", action="store_false",
                   help="adjacent entries (default: scattered)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = asyncio.run(measure(args))
    print(f"{res['protocol']} worker_posts={res['worker_posts']} {res['mbps']:.1f} MB/s  "
          f"write_nowait() ms p50 {res['submit_ms_p50']:.2f} max {res['submit_ms_max']:.2f}  "
          f"loop lag ms p50 {res['lag_ms_p50']:.2f} p99 {res['lag_ms_p99']:.2f} max {res['lag_ms_max']:.2f}  "
          f"verified={res['verified']}")
    if args.json:
        print(json.dumps(res))
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
