"""The relay's hop inside a node, timed: a sender process writes a batch to a
destination process through a relay member process (three processes on
this host), with the hop through shared-memory lanes or by the inbox's
control messages, and directly (no relay) for reference; paired runs,
alternated.

    python3 tools/relay_hop.py --mib 64 --rounds 5 [--json]

Every provider here is kvflow's same-host one, so this measures the
relay's own cost (copies, messages, polling), not a network. With --json
the last line is one JSON object with each mode's GB/s (median of the
rounds) and the lanes / inbox and lanes / direct ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "@@"


async def serve(group: str, rank: int, rail: int, folder: str, lanes: bool, size: int) -> None:
    """A member or the destination: an engine in a relay group, one region."""
    import numpy as np
    import kvflow
    async with kvflow.Engine(relay=kvflow.RelayGroup(group, rank, rail, directory=folder, lanes=lanes)) as eng:
        buf = np.zeros(size, np.uint8)
        region = eng.register(buf, name="kv")
        print(MARK + json.dumps({"address": eng.address, "addr": region.addr}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print(MARK + json.dumps({"forwarded": eng.relay_stats()["forwarded_bytes"]}), flush=True)


async def send(folder: str, lanes: bool, dest: str, size: int, rounds: int, direct: bool) -> None:
    import numpy as np
    import kvflow
    group = None if direct else kvflow.RelayGroup("node0", 0, 0, directory=folder, lanes=lanes)
    async with kvflow.Engine(relay=group) as eng:
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        s = eng.register(src)
        peer = await eng.connect(dest)
        dst = peer.region("kv").addr
        pages = np.arange(size // 65536, dtype=np.uint64) * np.uint64(65536)      # 64 KiB pages
        await peer.write(s.addr + pages[:16], dst + pages[:16], np.full(16, 65536, np.uint64))   # warm up
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await peer.write(s.addr + pages, dst + pages, np.full(len(pages), 65536, np.uint64))
            times.append(time.perf_counter() - t0)
        stats = eng.relay_stats() if group is not None else {}
        print(MARK + json.dumps({"seconds": times, "relayed": stats.get("relayed_bytes", 0),
                                 "lanes_used": stats.get("lanes_used", 0)}), flush=True)


def _spawn(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _read(p: subprocess.Popen) -> dict:
    for line in p.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"process {p.args} ended without an answer (rc {p.wait()})")


def one(mode: str, mib: int, rounds: int) -> dict:
    size = mib << 20
    folder = tempfile.mkdtemp(prefix="kvflow-relayhop-")
    lanes = mode == "lanes"
    member = _spawn(["serve", "node0", "1", "1", folder, str(int(lanes)), str(size)])
    dest = _spawn(["serve", "node1", "1", "1", folder, str(int(lanes)), str(size)])
    try:
        _read(member)
        d = _read(dest)
        s = _spawn(["send", folder, str(int(lanes)), d["address"], str(size), str(rounds), str(int(mode == "direct"))])
        res = _read(s)
        s.wait(60)
        for p in (member, dest):
            p.stdin.close()
        fwd = _read(member)["forwarded"]
        gbps = [size / t / 1e9 for t in res["seconds"]]
        return {"mode": mode, "gbps": statistics.median(gbps), "runs": [round(g, 2) for g in gbps],
                "relayed_bytes": res["relayed"], "forwarded_bytes": fwd, "lanes_used": res["lanes_used"]}
    finally:
        for p in (member, dest):
            if p.poll() is None:
                p.kill()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        g, rank, rail, folder, lanes, size = sys.argv[2:8]
        asyncio.run(serve(g, int(rank), int(rail), folder, bool(int(lanes)), int(size)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        folder, lanes, dest, size, rounds, direct = sys.argv[2:8]
        asyncio.run(send(folder, bool(int(lanes)), dest, int(size), int(rounds), bool(int(direct))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=2, help="alternations of the three modes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out: dict[str, list[dict]] = {}
    for _ in range(a.pairs):
        for mode in ("lanes", "inbox", "direct"):
            r = one(mode, a.mib, a.rounds)
            out.setdefault(mode, []).append(r)
            print(f"{mode:6} {r['gbps']:.2f} GB/s  runs {r['runs']}  relayed {r['relayed_bytes']} "
                  f"forwarded {r['forwarded_bytes']} lanes_used {r['lanes_used']}", file=sys.stderr, flush=True)
    med = {m: statistics.median(r["gbps"] for r in rs) for m, rs in out.items()}
    summary = {"mib": a.mib, "gbps": {m: round(v, 3) for m, v in med.items()},
               "lanes_vs_inbox": round(med["lanes"] / med["inbox"], 3),
               "lanes_vs_direct": round(med["lanes"] / med["direct"], 3)}
    print(json.dumps(summary) if a.json else summary)


if __name__ == "__main__":
    main()
