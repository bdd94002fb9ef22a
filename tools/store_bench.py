"""kvflow.store beside kvflow's raw tcp writes (and Mooncake Store), in one run.

    python tools/store_bench.py                          # kvflow store + raw, 64 x 64K/1M/4M, 5 rounds
    python tools/store_bench.py --mooncake --repeat 2    # Mooncake Store too, systems alternating
    python tools/store_bench.py --json out.json
    python tools/store_bench.py --compat --repeat 3      # Mooncake Store's API: kvflow's class vs the wheel
    python tools/store_bench.py --etcd --repeat 3        # the master in memory vs made durable by etcd

Layout, per system: a master process (kvflow: `python -m kvflow.store master`;
Mooncake: `mooncake_master`), a holder process that mounts one segment
(and serves), and a bench client process that mounts nothing, puts 64
objects per batch call from its registered memory into the holder's
segment (batch_put_from), reads them back into other registered memory
(batch_get_into, every byte compared after the timed call), and removes
them. Over tcp on loopback. kvflow's raw row is the same bench client's
engine writing (Peer.write) / reading (Peer.read) the same 64 entries
into the holder's segment directly: the pool's overhead is the
difference. batch_exists: 128 keys that exist, one call at a time, p50.
Each point is the median of --rounds timed calls after one warm-up call.
put_from: one 4 KiB object per call, --put-calls calls one after another, p50.

--etcd: the kvflow store twice, alternating: its master in memory, and its
master made durable by an etcd the bench starts (`python -m kvflow.store
master --etcd`, a fresh data dir under the system's temp dir: etcd fsyncs
each commit there; the client follows the leader through etcd). The table
is then the durable master's cost per op, with the etcd txns per call the
master reports.

--compat runs kvflow's own asyncio bench client (StoreClient), then the
same Mooncake-API bench client and holder (the code of the Mooncake rows)
twice: on kvflow's MooncakeDistributedStore
(kvflow.compat.mooncake.store, through the shim, against `python -m
kvflow.store master`) and on the real wheel (mooncake_master): the same
calls, so the ratio is kvflow's drop-in against Mooncake Store. It adds
single-call put()/get() of 4 KiB bytes (p50 over --exists-calls calls).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _protocols(args) -> tuple[str, ...] | None:
    return None if args.protocol == "auto" else (args.protocol,)


def _env(system: str = "kvflow") -> dict:
    env = dict(os.environ)
    paths = [ROOT]
    if system == "kvflow-mc":       # `mooncake.store` is kvflow's (the shim first)
        from kvflow.compat.mooncake import shim_path
        paths.insert(0, shim_path())
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


# -- roles ----------------------------------------------------------------------

async def _kvflow_holder(args) -> None:
    from kvflow.store import StoreClient
    async with StoreClient(args.master, segment_size=args.segment, local_buffer_size=0,
                           protocols=_protocols(args)) as c:
        region = [r for r in c.engine.regions if r.name and r.name.startswith("kvflow-store/")][0]
        print(json.dumps({"engine": c.engine.address, "region": region.name}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def _mooncake_holder(args) -> None:
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", args.segment, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"mooncake setup: {rc}")
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    s.close()


def _timed(samples: list, nbytes: int) -> dict:
    med = statistics.median(samples)
    return {"seconds_p50": med, "gbps": nbytes / med / 1e9, "rounds": len(samples)}


async def _kvflow_client(args, holder: dict) -> dict:
    from kvflow.store import StoreClient
    sizes, batch = [_parse_size(s) for s in args.sizes.split(",")], args.batch
    out: dict = {"system": "kvflow", "points": []}
    async with StoreClient(args.master, segment_size=0, local_buffer_size=0, protocols=_protocols(args)) as c:
        top = max(sizes) * batch
        src = np.random.default_rng(1).integers(0, 256, top, dtype=np.uint8)
        dst = np.zeros(top, np.uint8)
        rs, rd = c.register_buffer(src), c.register_buffer(dst)
        peer = await c.engine.connect(holder["engine"])
        seg = peer.region(holder["region"])
        out["transport"] = peer.transport
        for size in sizes:
            idx = np.arange(batch, dtype=np.uint64) * np.uint64(size)
            lens = np.full(batch, size, np.uint64)
            laddr = [rs.addr + i * size for i in range(batch)]
            daddr = [rd.addr + i * size for i in range(batch)]
            t = {"put": [], "get": [], "raw_write": [], "raw_read": [], "memcpy": []}
            for r in range(args.rounds + 1):
                t0 = time.perf_counter()
                await peer.write(rs.addr + idx, seg.addr + idx, lens)
                t1 = time.perf_counter()
                await peer.read(rd.addr + idx, seg.addr + idx, lens)
                t2 = time.perf_counter()
                keys = [f"bench/{size}/{r}/{i}" for i in range(batch)]
                res = await c.batch_put_from(keys, laddr, [size] * batch)
                t3 = time.perf_counter()
                assert res == [1] * batch, res
                dst[:] = 0
                t4 = time.perf_counter()
                res = await c.batch_get_into(keys, daddr, [size] * batch)
                t5 = time.perf_counter()
                assert res == [size] * batch, res
                assert np.array_equal(dst[:batch * size], src[:batch * size]), "wrong bytes"
                await c.batch_remove(keys, force=True)
                t6 = time.perf_counter()
                for i in range(batch):                  # the ceiling: the same bytes, one process
                    dst[i * size:(i + 1) * size] = src[i * size:(i + 1) * size]
                t7 = time.perf_counter()
                if r:                                   # round 0 warms up
                    t["memcpy"].append(t7 - t6)
                    t["raw_write"].append(t1 - t0)
                    t["raw_read"].append(t2 - t1)
                    t["put"].append(t3 - t2)
                    t["get"].append(t5 - t4)
            nbytes = batch * size
            for op, samples in t.items():
                out["points"].append({"op": op, "size": size, "batch": batch, **_timed(samples, nbytes)})
        out["points"].append(await _kvflow_exists(c, args, rs.addr))
        out["points"].append(await _kvflow_put_one(c, args, rs.addr))
        out["master"] = await c.stats()
    return out


async def _kvflow_put_one(c, args, addr: int) -> dict:
    """A single small put per call: the latency a commit adds (etcd's, with --etcd)."""
    lat = []
    for i in range(args.put_calls + 10):
        t0 = time.perf_counter()
        assert await c.put_from(f"one/{i}", addr, 4096) == 1
        dt = time.perf_counter() - t0
        if i >= 10:
            lat.append(dt)
    await c.batch_remove([f"one/{i}" for i in range(args.put_calls + 10)], force=True)
    lat.sort()
    return {"op": "put_from", "keys": 1, "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[int(len(lat) * 0.99)] * 1e6}


async def _kvflow_exists(c, args, addr: int) -> dict:
    keys = [f"exists/{i}" for i in range(args.exists_keys)]
    assert await c.batch_put_from(keys, [addr] * len(keys), [64] * len(keys)) == [1] * len(keys)
    lat = []
    for i in range(args.exists_calls + 10):
        t0 = time.perf_counter()
        got = await c.batch_exists(keys)
        dt = time.perf_counter() - t0
        assert got == [True] * len(keys)
        if i >= 10:
            lat.append(dt)
    await c.batch_remove(keys, force=True)
    lat.sort()
    return {"op": "batch_exists", "keys": len(keys), "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[int(len(lat) * 0.99)] * 1e6}


def _mooncake_client(args) -> dict:
    from mooncake.store import MooncakeDistributedStore
    sizes, batch = [_parse_size(s) for s in args.sizes.split(",")], args.batch
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"mooncake setup: {rc}")
    out: dict = {"system": args.system, "points": []}
    top = max(sizes) * batch
    src = np.random.default_rng(1).integers(0, 256, top, dtype=np.uint8)
    dst = np.zeros(top, np.uint8)
    assert s.register_buffer(src.ctypes.data, top) == 0
    assert s.register_buffer(dst.ctypes.data, top) == 0
    for size in sizes:
        laddr = [src.ctypes.data + i * size for i in range(batch)]
        daddr = [dst.ctypes.data + i * size for i in range(batch)]
        t = {"put": [], "get": []}
        for r in range(args.rounds + 1):
            keys = [f"bench/{size}/{r}/{i}" for i in range(batch)]
            t0 = time.perf_counter()
            res = s.batch_put_from(keys, laddr, [size] * batch)
            t1 = time.perf_counter()
            assert list(res) == [0] * batch, res
            dst[:] = 0
            t2 = time.perf_counter()
            res = s.batch_get_into(keys, daddr, [size] * batch)
            t3 = time.perf_counter()
            assert list(res) == [size] * batch, res
            assert np.array_equal(dst[:batch * size], src[:batch * size]), "wrong bytes"
            assert list(s.batch_remove(keys, True)) == [0] * batch     # force: past the get's lease
            if r:
                t["put"].append(t1 - t0)
                t["get"].append(t3 - t2)
        for op, samples in t.items():
            out["points"].append({"op": op, "size": size, "batch": batch, **_timed(samples, batch * size)})
    keys = [f"exists/{i}" for i in range(args.exists_keys)]
    small = np.ones(64, np.uint8)
    assert s.register_buffer(small.ctypes.data, 64) == 0
    s.batch_put_from(keys, [small.ctypes.data] * len(keys), [64] * len(keys))
    lat = []
    for i in range(args.exists_calls + 10):
        t0 = time.perf_counter()
        got = s.batch_is_exist(keys)
        dt = time.perf_counter() - t0
        assert list(got) == [1] * len(keys), got
        if i >= 10:
            lat.append(dt)
    lat.sort()
    out["points"].append({"op": "batch_exists", "keys": len(keys), "p50_us": lat[len(lat) // 2] * 1e6,
                          "p99_us": lat[int(len(lat) * 0.99)] * 1e6})
    if args.compat:
        out["points"] += _mooncake_single_calls(s, args.exists_calls)
    s.close()
    return out


def _mooncake_single_calls(s, calls: int) -> list[dict]:
    """put()/get() of 4 KiB bytes, one call at a time (through the local
    buffer): each call's latency, p50/p99."""
    value = os.urandom(4096)
    lat: dict[str, list[float]] = {"put": [], "get": []}
    for i in range(calls + 10):
        key = f"single/{i}"
        t0 = time.perf_counter()
        assert s.put(key, value) == 0
        t1 = time.perf_counter()
        assert s.get(key) == value
        t2 = time.perf_counter()
        if i >= 10:
            lat["put"].append(t1 - t0)
            lat["get"].append(t2 - t1)
    out = []
    for op, v in lat.items():
        v.sort()
        out.append({"op": f"{op} 4 KiB", "keys": 1, "p50_us": v[len(v) // 2] * 1e6,
                    "p99_us": v[int(len(v) * 0.99)] * 1e6})
    return out


# -- orchestration --------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def run_system(system: str, args) -> dict:
    """One system's master, holder and bench client (processes); the
    client's points ({"op", "size", "batch", "gbps", ...} and the
    batch_exists / put_from latencies), or {"error"}. tools/compare.py's
    store rows come from here too."""
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--compat"] * bool(args.compat) + [
        "--protocol", args.protocol, "--sizes", args.sizes, "--batch", str(args.batch), "--rounds", str(args.rounds),
        "--exists-keys", str(args.exists_keys), "--exists-calls", str(args.exists_calls),
        "--put-calls", str(args.put_calls)]
    procs = []
    tmp = None
    try:
        if system.startswith("kvflow"):
            extra = []
            if system.startswith("kvflow-etcd"):
                tmp, where = _start_etcd(procs)
                extra = ["--etcd", where, "--cluster", "bench",
                         "--commit", "async" if system.endswith("async") else "sync"]
            m = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0",
                                  *extra], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
            procs.append(m)
            line = m.stdout.readline()
            while line and "standby" in line:         # a durable master campaigns first
                line = m.stdout.readline()
            assert "ready" in line, line
            master = line.split()[-1] if not extra else f"etcd://{where}/bench"
        else:
            port = _free_port()
            m = subprocess.Popen(["mooncake_master", f"--rpc_port={port}",
                                  f"--metrics_port={_free_port()}", "--enable_metric_reporting=false"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            procs.append(m)
            master = f"127.0.0.1:{port}"
            time.sleep(1.0)
        # the holder's and client's code: kvflow's own, or the Mooncake-API one
        # (kvflow-mc: the same code as mooncake's, on kvflow's mooncake.store)
        kind = "kvflow" if system.startswith("kvflow") and system != "kvflow-mc" else system
        h = subprocess.Popen(me + ["holder", "--system", kind, "--master", master, "--protocol", args.protocol,
                                   "--segment", str(args.segment)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env(system))
        procs.append(h)
        holder = h.stdout.readline()
        assert holder.strip(), f"{system} holder did not start"
        r = subprocess.run(me + ["client", "--system", kind, "--master", master, "--holder", holder.strip()]
                           + common, capture_output=True, text=True, cwd=ROOT, env=_env(system), timeout=600)
        if r.returncode != 0:
            return {"system": system, "error": r.stderr[-2000:]}
        return {**json.loads(r.stdout.strip().splitlines()[-1]), "system": system}
    finally:
        for p in reversed(procs):
            if p.stdin:
                p.stdin.close()
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if tmp is not None:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)


def _start_etcd(procs: list) -> tuple[str, str]:
    """etcd on free loopback ports with a fresh data dir: (dir, host:port)."""
    import tempfile
    import urllib.request
    tmp = tempfile.mkdtemp(prefix="kvflow-bench-etcd-")
    port, peer = _free_port(), _free_port()
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    e = subprocess.Popen(["etcd", "--name", "bench", "--data-dir", os.path.join(tmp, "data"),
                          "--listen-client-urls", client, "--advertise-client-urls", client,
                          "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                          "--initial-cluster", f"bench={peer_url}", "--log-level", "warn"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(e)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                if json.load(r).get("health") == "true":
                    return tmp, f"127.0.0.1:{port}"
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("etcd did not start")
        time.sleep(0.1)


def _durability_table(runs: list[dict]) -> str:
    """The master in memory vs made durable by etcd, per op."""
    by: dict[tuple, dict[str, list[float]]] = {}
    txns: dict[str, list[float]] = {}
    for run in runs:
        for p in run.get("points", []):
            if p["op"] in ("batch_exists", "put_from"):
                key = (p["op"], f"{p['keys']} key{'s' if p['keys'] > 1 else ''}", "p50 us")
                v = p["p50_us"]
            elif p["op"] in ("put", "get"):
                key = ({"put": "batch_put_from", "get": "batch_get_into"}[p["op"]],
                       f"{p['batch']} x {_label(p['size'])}", "ms")
                v = p["seconds_p50"] * 1e3
            else:
                continue
            by.setdefault(key, {}).setdefault(run["system"], []).append(v)
        if "etcd_txns" in run.get("master", {}):
            txns.setdefault(run["system"], []).append((run["master"]["etcd_txns"], run["master"]["etcd_keys"]))
    med = lambda v: statistics.median(v) if v else float("nan")
    lines = ["| op | layout | unit | master in memory | + etcd, sync commit | added | + etcd, async commit "
             "| added |", "|---|---|---|---|---|---|---|---|"]
    for (op, layout, unit), sys_ in by.items():
        a, b, c = (med(sys_.get(k, [])) for k in ("kvflow", "kvflow-etcd", "kvflow-etcd-async"))
        lines.append(f"| {op} | {layout} | {unit} | {a:.3g} | {b:.3g} | {b - a:+.3g} | {c:.3g} | {c - a:+.3g} |")
    for system, tk in txns.items():
        lines.append(f"\n{system}: etcd txns / keys written per run: " + ", ".join(f"{t}/{k}" for t, k in tk))
    return "\n".join(lines)


def _table(runs: list[dict]) -> str:
    rows: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        for p in run.get("points", []):
            if p["op"] in ("batch_exists", "put_from"):
                key = (p["op"], f"{p['keys']} keys", "p50 us")
                rows.setdefault(key, {}).setdefault(run["system"], []).append(p["p50_us"])
            else:
                name = {"put": "batch_put_from", "get": "batch_get_into"}.get(p["op"], p["op"])
                key = (name, f"{p['batch']} x {_label(p['size'])}", "GB/s")
                rows.setdefault(key, {}).setdefault(run["system"], []).append(p["gbps"])
    transports = sorted({r.get("transport", "?") for r in runs if r.get("system") == "kvflow"})
    lines = [f"kvflow transport: {', '.join(transports)}",
             "| op | layout | unit | kvflow store | kvflow raw | store / raw | memcpy | store / memcpy "
             "| Mooncake Store (tcp) | kvflow / Mooncake |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: f"{statistics.median(v):.3g}" if v else "-"
    for (op, layout, unit), by in rows.items():
        if op.startswith("raw") or op == "memcpy":
            continue
        kv = by.get("kvflow", [])
        raw_op = {"batch_put_from": "raw_write", "batch_get_into": "raw_read"}.get(op)
        raw = rows.get((raw_op, layout, unit), {}).get("kvflow", []) if raw_op else []
        mc = by.get("mooncake", [])
        cp = rows.get(("memcpy", layout, unit), {}).get("kvflow", []) if raw_op else []
        ratio = lambda a, b: f"{statistics.median(a) / statistics.median(b):.2f}" if a and b else "-"
        lines.append(f"| {op} | {layout} | {unit} | {fmt(kv)} | {fmt(raw)} | {ratio(kv, raw)} | {fmt(cp)} "
                     f"| {ratio(kv, cp)} | {fmt(mc)} | {ratio(kv, mc)} |")
    return "\n".join(lines)


def _compat_table(runs: list[dict]) -> str:
    """kvflow's MooncakeDistributedStore against the wheel's, same calls."""
    rows: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        for p in run.get("points", []):
            if p["op"] not in ("put", "get") and "p50_us" not in p:
                continue            # the native client's raw and memcpy rows
            if "p50_us" in p:
                key = (p["op"], f"{p['keys']} keys" if p["keys"] > 1 else "1 call", "p50 us")
                val = p["p50_us"]
            else:
                key = ({"put": "batch_put_from", "get": "batch_get_into"}[p["op"]],
                       f"{p['batch']} x {_label(p['size'])}", "GB/s")
                val = p["gbps"]
            rows.setdefault(key, {}).setdefault(run["system"], []).append(val)
    lines = ["| op | layout | unit | kvflow StoreClient (asyncio) | kvflow (Mooncake API) | Mooncake Store "
             "| Mooncake API / StoreClient | kvflow / Mooncake (Mooncake API) |",
             "|---|---|---|---|---|---|---|---|"]
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    fmt = lambda v: f"{v:.3g}" if v else "-"  # noqa: E731
    for (op, layout, unit), by in rows.items():
        na, kv, mc = med(by.get("kvflow", [])), med(by.get("kvflow-mc", [])), med(by.get("mooncake", []))
        lines.append(f"| {op} | {layout} | {unit} | {fmt(na)} | {fmt(kv)} | {fmt(mc)} "
                     f"| {f'{kv / na:.2f}' if kv and na else '-'} | {f'{kv / mc:.2f}' if kv and mc else '-'} |")
    return "\n".join(lines) + "\n(latency rows: below 1 means kvflow is faster)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", default="run", choices=("run", "holder", "client"))
    p.add_argument("--system", default="kvflow", choices=("kvflow", "mooncake", "kvflow-mc"))
    p.add_argument("--master")
    p.add_argument("--holder")
    p.add_argument("--segment", type=int, default=512 << 20)
    p.add_argument("--sizes", default="64K,1M,4M")
    p.add_argument("--protocol", default="tcp", choices=("tcp", "local", "auto"),
                   help="kvflow's provider between the two client processes (Mooncake: always tcp)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--exists-keys", type=int, default=128)
    p.add_argument("--exists-calls", type=int, default=200)
    p.add_argument("--mooncake", action="store_true", help="Mooncake Store beside kvflow")
    p.add_argument("--compat", action="store_true",
                   help="Mooncake Store's API on both: kvflow's MooncakeDistributedStore vs the wheel's")
    p.add_argument("--repeat", type=int, default=1, help="runs per system, alternating")
    p.add_argument("--json", help="write every run's points here")
    p.add_argument("--put-calls", type=int, default=200, help="single 4 KiB puts timed, one at a time")
    p.add_argument("--etcd", action="store_true",
                   help="the master in memory vs made durable by an etcd the bench starts")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.role == "holder":
        if args.system == "kvflow":
            asyncio.run(_kvflow_holder(args))
        else:
            _mooncake_holder(args)
        return 0
    if args.role == "client":
        if args.system == "kvflow":
            out = asyncio.run(_kvflow_client(args, json.loads(args.holder)))
        else:
            out = _mooncake_client(args)
        print(json.dumps(out), flush=True)
        return 0
    if args.compat:
        systems = ["kvflow", "kvflow-mc", "mooncake"]
    else:
        systems = ["kvflow"] + (["kvflow-etcd", "kvflow-etcd-async"] if args.etcd else []) + \
            (["mooncake"] if args.mooncake else [])
    runs = []
    for i in range(args.repeat):
        for system in systems:
            run = run_system(system, args)
            if "error" in run:
                print(f"{system}: error\n{run['error']}", file=sys.stderr)
            runs.append(run)
    if args.compat:
        print(_compat_table(runs))
    else:
        print(_table([r for r in runs if not r.get("system", "").startswith("kvflow-etcd")]))
    if args.etcd:
        print(_durability_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
