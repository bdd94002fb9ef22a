"""Latency of small same-host writes over the local provider: one awaited
peer.write() at a time, same process (memcpy) and another process
(process_vm_writev), p50/p99 per size.

    python tools/local_latency.py [--n 20000] [--sizes 4096,65536] [--json]

Run it with PYTHONPATH pointing at the build to measure (the cross-process
target is started with the same kvflow); alternate builds between runs, on
a quiet machine, and compare only runs of one machine."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

import kvflow

TARGET = """
import sys
sys.path.insert(0, sys.argv[1])     # this kvflow, before the current directory's
import asyncio
import numpy as np
import kvflow

async def main():
    async with kvflow.Engine(protocols=("local",)) as eng:
        dst = np.zeros(1 << 20, np.uint8)
        region = eng.register(dst)
        print(eng.address, region.addr, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


async def measure(peer, src: np.ndarray, dst_addr: int, size: int, n: int) -> dict:
    la, ra, ln = [src.ctypes.data], [dst_addr], [size]
    for _ in range(min(1000, n)):
        await peer.write(la, ra, ln)
    t = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        await peer.write(la, ra, ln)
        t[i] = clock() - t0
    return {"p50_us": float(np.percentile(t, 50)) / 1e3, "p99_us": float(np.percentile(t, 99)) / 1e3}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="writes per size (default %(default)s)")
    ap.add_argument("--sizes", default="4096,65536", help="bytes per write, comma-separated")
    ap.add_argument("--json", action="store_true", help="one JSON line per result")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    src = np.full(max(sizes), 7, np.uint8)
    results = []
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        a.register(src)
        dst = np.zeros(1 << 20, np.uint8)
        region = b.register(dst)
        peer = await a.connect(b.address)
        for size in sizes:
            results.append({"peer": "process", "size": size, **await measure(peer, src, region.addr, size, args.n)})
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", TARGET, root,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            address, addr = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
            peer = await a.connect(address)
            assert peer.transport == "local", peer.transport
            for size in sizes:
                results.append({"peer": "host", "size": size, **await measure(peer, src, int(addr), size, args.n)})
        finally:
            proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 30)
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['peer']:8s} {r['size']:>7d} B  p50 {r['p50_us']:6.2f} us  p99 {r['p99_us']:6.2f} us")


if __name__ == "__main__":
    asyncio.run(main())
