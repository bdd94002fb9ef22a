"""How long a kvflow.store master's loop stalls while its index grows: a
master process, a loader putting N objects of 256 B in batches of 1,000
(tools/master_scale.py's load role, another process), and this process
asking the master `batch_exists` of one key in a loop, one call at a
time, timing every round trip until the load ends.

    python tools/master_stalls.py --objects 1000000
    python tools/master_stalls.py --objects 1000000 --before /path/to/other/checkout   # both, alternating

A round trip far above the p50 is the master's loop stopped (Python's
full garbage collections walked the whole index before gc_freeze.py), or
the host's scheduler: compare runs side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(root: str, n: int, slow_ms: float) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    m = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    loader = None
    try:
        while True:
            line = m.stdout.readline()
            if not line:
                raise SystemExit(f"{root}: the master exited before it was ready")
            if "ready" in line:
                addr = line.split()[-1]
                break
        sys.path.insert(0, root)
        from kvflow.store.rpc import BlockingQuery
        q = BlockingQuery(addr, 30.0)
        loader = subprocess.Popen([sys.executable, os.path.join(root, "tools", "master_scale.py"), "load", addr,
                                   str(n), "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env, cwd=root)
        lat: list[float] = []
        while True:
            t0 = time.perf_counter()
            q.call("batch_exists", ["idx/000000001"])
            lat.append(time.perf_counter() - t0)
            if select.select([loader.stdout], [], [], 0)[0]:
                done = json.loads(loader.stdout.readline())
                break
        q.close()
    finally:
        if loader is not None:
            loader.stdin.close()
            loader.wait()
        m.terminate()
        m.wait()
    lat.sort()
    slow = [x for x in lat if x * 1e3 > slow_ms]
    return {"checkout": root, "objects": n, "load_s": round(done["seconds"], 2), "probes": len(lat),
            "p50_us": round(lat[len(lat) // 2] * 1e6, 1), "p999_ms": round(lat[int(len(lat) * 0.999)] * 1e3, 2),
            "max_ms": round(lat[-1] * 1e3, 1), "slow": len(slow), "slow_s": round(sum(slow), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--before", help="another checkout, run alternating with this one")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=50.0, help="round trips counted as stalls above this")
    p.add_argument("--json")
    args = p.parse_args(argv)
    roots = [ROOT] + ([os.path.abspath(args.before)] if args.before else [])
    rows = [run(r, args.objects, args.slow_ms) for _ in range(args.repeat) for r in roots]
    print(f"| checkout | objects | load | probes | p50 | p99.9 | max | over {args.slow_ms:g} ms | their sum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['checkout']} | {r['objects']:,} | {r['load_s']} s | {r['probes']:,} | {r['p50_us']} us | "
              f"{r['p999_ms']} ms | {r['max_ms']} ms | {r['slow']} | {r['slow_s']} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
