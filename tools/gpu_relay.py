#!/usr/bin/env python3
"""The relay's copy hidden behind the network (issue 21): the same write,
direct and relayed, side by side in one run.

One node of two rails (a sender on rail 0 here; the relay member on rail 1
in a process of its own), and a destination node with a rank on each rail
(here). Each round writes `--mib` MiB (as 1 MiB entries) from the sender
to the destination on rail 0 (direct: the sender's own NIC) and to the one
on rail 1 (relayed: through the member, which posts it). Everything goes
over tcp on loopback: on one host the "network" is the kernel's copy.

    python3 tools/gpu_relay.py --json                 # a GPU: cuda memory, the member's device lanes
    python3 tools/gpu_relay.py --memory host --json   # anywhere: host memory, host lanes

--memory cuda: the source is GPU memory, the member has device lanes
(RelayGroup(device=0)): each slot is copied GPU to GPU through CUDA IPC,
its doorbell written by the sender's stream, and the member stages it to
tcp; the direct write is staged by the sender. --memory host: host memory
and host lanes.

Prints, with --json, one JSON line: memory, mib, rounds, direct_gbps and
relayed_gbps (median of the rounds), ratio (relayed / direct), the
sender's relay counters, and verified (every byte of both destinations
equal to the source after the last round).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_MEMBER = """
import asyncio, sys, kvflow
device = None if sys.argv[2] == "host" else 0
async def main():
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                             relay=kvflow.RelayGroup("node0", 1, 1, directory=sys.argv[1], device=device)) as eng:
        print(eng.address, eng.relay_stats()["device_lanes"], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def _sha(buf: Any) -> str:
    if hasattr(buf, "cpu"):
        buf = buf.cpu().numpy()
    return hashlib.sha256(memoryview(np.ascontiguousarray(buf))).hexdigest()


async def run(memory: str = "cuda", mib: int = 64, rounds: int = 5) -> dict[str, Any]:
    import kvflow
    from kvflow import RelayGroup
    n = mib << 20
    with tempfile.TemporaryDirectory(prefix="kvflow-gpu-relay-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                     else None) as d:
        member = subprocess.Popen([sys.executable, "-c", _MEMBER, d, memory], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT}, text=True)
        try:
            line = member.stdout.readline().split() if member.stdout is not None else []
            if len(line) != 2:
                raise RuntimeError("the member process did not start")
            device_lanes = int(line[1])
            async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                                     relay=RelayGroup("node0", 0, 0, directory=d)) as sender, \
                    kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                                  relay=RelayGroup("node1", 0, 0, directory=d)) as d0, \
                    kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                                  relay=RelayGroup("node1", 1, 1, directory=d)) as d1:
                host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
                if memory == "cuda":
                    import torch
                    src: Any = torch.from_numpy(host).cuda()
                    torch.cuda.synchronize()
                else:
                    src = host
                s = sender.register(src, name="src")
                pools = [np.zeros(n, np.uint8), np.zeros(n, np.uint8)]
                d0.register(pools[0], name="kv")
                d1.register(pools[1], name="kv")
                peers = [await sender.connect(d0.address), await sender.connect(d1.address)]
                offs = np.arange(mib, dtype=np.uint64) * np.uint64(1 << 20)
                sizes = np.full(mib, 1 << 20, np.uint64)

                async def once(i: int) -> float:
                    t0 = time.perf_counter()
                    await peers[i].write(s.addr + offs, peers[i].region("kv").addr + offs, sizes, timeout=120)
                    return time.perf_counter() - t0

                await once(0)                   # warm: connections, staging, lanes
                await once(1)
                times: list[list[float]] = [[], []]
                for r in range(rounds):
                    for i in ((0, 1) if r % 2 == 0 else (1, 0)):      # alternate the order
                        pools[i][:] = 0
                        times[i].append(await once(i))
                verified = all(_sha(p) == _sha(host) for p in pools)
                direct, relayed = (n / statistics.median(t) / 1e9 for t in times)
                stats = sender.relay_stats() or {}
        finally:
            if member.stdin is not None:
                member.stdin.close()
            try:
                member.wait(30)
            except subprocess.TimeoutExpired:
                member.kill()
    return {"memory": memory, "mib": mib, "rounds": rounds, "member_device_lanes": device_lanes,
            "direct_gbps": round(direct, 3), "relayed_gbps": round(relayed, 3), "ratio": round(relayed / direct, 3),
            "relayed_bytes": stats.get("relayed_bytes", 0), "device_lane_bytes": stats.get("device_lane_bytes", 0),
            "rerouted_bytes": stats.get("rerouted_bytes", 0), "verified": verified}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.rounds < 1:
        ap.error("--mib and --rounds are at least 1")
    res = asyncio.run(run(args.memory, args.mib, args.rounds))
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{args.memory}: {args.mib} MiB direct {res['direct_gbps']} GB/s, relayed {res['relayed_gbps']} GB/s "
              f"(x{res['ratio']}), verified {res['verified']}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
