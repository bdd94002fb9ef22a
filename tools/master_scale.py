"""How far one kvflow.store master goes: its memory per object, what a
metadata call costs it in CPU, and the calls per second it serves as
clients are added, with the index at several sizes.

    python tools/master_scale.py                                   # 0, 100k, 1M objects; 1, 2, 4 clients
    python tools/master_scale.py --objects 0,200000 --clients 1,4 --seconds 5 --json out.json
    python tools/master_scale.py --etcd                            # the master made durable by etcd
    python tools/master_scale.py --recovery --objects 10000,100000 # a durable master SIGKILLed: recovery times

Layout: a master process (`python -m kvflow.store master`), a loader
process that mounts a segment and puts the index's objects into it (256 B
each, batches of 1,000, `batch_put`) and stays (its objects live while it
does), then, per client count, that many driver processes, each with
--inflight calls in flight for --seconds:
- `exists`: batch_exists of 128 keys drawn from the index (a read lookup:
  what every server asks before its puts and gets);
- `put`: batch_put of 16 objects of 256 B into the driver's own segment,
  then batch_remove of them (put_start, put_end, remove: three master
  calls; the bytes are a memmove in the driver's own process).
With --recovery (a durable master, always with etcd) there are no
drivers: per index size, the leader is SIGKILLed and a new one takes over
(`--takeover restart`: a new master process started at once; `standby`:
one started, as a standby, before the kill), while a reader that was
connected before the kill gets a pre-existing object until it succeeds,
then checks every key with batch_exists and a sample's bytes with
batch_get (the loaders stay alive: their segments keep the bytes).
Times are from the kill; `ready` is the new master's ready line, and
`recover` the time its recovery took (its log line), from etcd's answer
to the index rebuilt.

The master is one asyncio thread: its CPU per call (utime + stime from
/proc over the master's own call count) is what bounds it, whatever the
clients; `ceiling` is one core divided by that cost. On this 2-core
machine the drivers share the cores with the master, so the calls/s
measured at several clients are below the ceiling.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OBJ = 256
LOAD_BATCH = 1000
TICK = os.sysconf("SC_CLK_TCK")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK      # utime + stime


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def _key(i: int) -> str:
    return f"idx/{i:09d}"


def _value(i: int) -> bytes:
    """Object i's bytes: its number, so a reader can tell them apart."""
    return i.to_bytes(8, "little") * (OBJ // 8)


# -- roles --------------------------------------------------------------------------

async def _load(master: str, n: int, start: int) -> None:
    """Puts objects start..n-1 (mounting room for them) and stays until stdin closes."""
    from kvflow.store import StoreClient
    async with StoreClient(master, segment_size=max(n - start, 1) * OBJ * 2 + (1 << 20),
                           protocols=("tcp",)) as c:
        t0 = time.perf_counter()
        for lo in range(start, n, LOAD_BATCH):
            ids = range(lo, min(n, lo + LOAD_BATCH))
            res = await c.batch_put([_key(i) for i in ids], [_value(i) for i in ids])
            bad = [r for r in res if isinstance(r, BaseException)]
            if bad:
                raise SystemExit(f"load: {bad[0]!r}")
        took = time.perf_counter() - t0
        print(json.dumps({"loaded": n - start, "seconds": took}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _drive(master: str, op: str, n: int, seconds: float, inflight: int, seed: int) -> None:
    from kvflow.store import StoreClient
    rng = random.Random(seed)
    calls = keys_done = 0
    async with StoreClient(master, segment_size=(4 << 20) if op == "put" else 0,
                           local_buffer_size=(1 << 20) if op == "put" else 0, protocols=("tcp",),
                           prefer_local=True) as c:       # its own segment: none left mid-put by a driver that ended
        end = time.perf_counter() + seconds

        async def exists_loop() -> None:
            nonlocal calls, keys_done
            while time.perf_counter() < end:
                keys = [f"idx/{rng.randrange(n):09d}" for _ in range(128)] if n else \
                    [f"none/{rng.randrange(1 << 30)}" for _ in range(128)]
                got = await c.batch_exists(keys)
                assert all(got) if n else not any(got), "wrong answer"
                calls += 1
                keys_done += 128

        async def put_loop(w: int) -> None:
            nonlocal calls, keys_done
            value = b"\xa5" * OBJ
            r = 0
            while time.perf_counter() < end:
                keys = [f"drv/{seed}/{w}/{r}/{i}" for i in range(16)]
                r += 1
                res = await c.batch_put(keys, [value] * 16)
                assert not any(isinstance(x, BaseException) for x in res), res
                await c.batch_remove(keys, force=True)
                calls += 3
                keys_done += 16

        t0 = time.perf_counter()
        loops = [exists_loop() if op == "exists" else put_loop(w) for w in range(inflight)]
        await asyncio.gather(*loops)
        took = time.perf_counter() - t0
    print(json.dumps({"calls": calls, "keys": keys_done, "seconds": took}), flush=True)


async def _read_back(master: str, n: int, sample: int, seed: int) -> None:
    """Connects (and gets an object) before the kill; told the kill on
    stdin, gets one pre-existing object until that works, then checks that
    all n exist and that `sample` of them have their bytes. Prints the
    monotonic times (CLOCK_MONOTONIC is the machine's: the parent's too)."""
    from kvflow.errors import KVFlowError
    from kvflow.store import StoreClient
    rng = random.Random(seed)
    async with StoreClient(master, segment_size=0, local_buffer_size=8 << 20, protocols=("tcp",)) as c:
        assert await c.get(_key(0)) == _value(0)
        print(json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)       # the leader is dead now
        probe, tries = rng.randrange(n), 0
        give_up = time.monotonic() + 120
        while True:
            tries += 1
            if time.monotonic() > give_up:
                raise SystemExit(f"read: no get of {_key(probe)} within 120 s of the kill")
            try:
                if await c.get(_key(probe)) == _value(probe):
                    break
            except KVFlowError:
                pass
            await asyncio.sleep(0.005)
        t_first = time.monotonic()
        missing = 0
        for lo in range(0, n, 4096):
            keys = [_key(i) for i in range(lo, min(n, lo + 4096))]
            missing += sum(not x for x in await c.batch_exists(keys))
        t_exist = time.monotonic()
        ids = rng.sample(range(n), min(sample, n))
        wrong = 0
        for lo in range(0, len(ids), 512):
            part = ids[lo:lo + 512]
            got = await c.batch_get([_key(i) for i in part])
            wrong += sum(g != _value(i) for g, i in zip(got, part))
        print(json.dumps({"first_get": t_first, "all_exist": t_exist, "sample_read": time.monotonic(),
                          "tries": tries, "missing": missing, "wrong": wrong, "sample": len(ids)}), flush=True)


# -- the run --------------------------------------------------------------------------

def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT)


def _start_master(args, extra: list) -> tuple[subprocess.Popen, str]:
    """The master (and with --etcd a real etcd, store_bench's, appended to
    `extra`): (its process, its address)."""
    cmd = [sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"]
    if args.etcd:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from store_bench import _start_etcd
        _, where = _start_etcd(extra)
        cmd += ["--etcd", where, "--cluster", "scale"]
    m = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    while True:
        line = m.stdout.readline()
        if not line:
            raise SystemExit("the master exited before it was ready")
        if "ready" in line:
            return m, line.split()[-1]


def _master_stats(addr: str) -> dict:
    from kvflow.store.rpc import BlockingQuery
    q = BlockingQuery(addr, 5.0)
    try:
        return q.call("stats")
    finally:
        q.close()


def _master_calls(addr: str) -> int:
    return int(_master_stats(addr)["calls"])


def run(args) -> dict:
    sizes = [int(float(x)) for x in args.objects.split(",")]
    counts = [int(x) for x in args.clients.split(",")]
    out: dict = {"etcd": args.etcd, "object_bytes": OBJ, "points": [], "index": []}
    extra: list = []
    master, addr = _start_master(args, extra)
    loaders: list = []
    try:
        base_rss = _rss(master.pid)
        have = 0
        for n in sorted(sizes):
            if n > have:
                ld = _spawn("load", addr, str(n), str(have))
                info = json.loads(ld.stdout.readline())
                loaders.append(ld)
                row = {"objects": n, "load_puts_per_s": info["loaded"] / info["seconds"],
                       "master_rss_mib": _rss(master.pid) / 2**20,
                       "bytes_per_object": (_rss(master.pid) - base_rss) / n}
                have = n
            else:
                row = {"objects": n, "master_rss_mib": _rss(master.pid) / 2**20}
            out["index"].append(row)
            print(f"index {n} objects: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                     if k != "objects"), file=sys.stderr, flush=True)
            for op in args.ops.split(","):
                for k in counts:
                    calls0, cpu0 = _master_calls(addr), _cpu_s(master.pid)
                    t0 = time.perf_counter()
                    drivers = [_spawn("drive", addr, op, str(n), str(args.seconds), str(args.inflight),
                                      str(1000 * k + i)) for i in range(k)]
                    res = [json.loads(d.communicate()[0].strip().splitlines()[-1]) for d in drivers]
                    wall = time.perf_counter() - t0
                    calls1, cpu1 = _master_calls(addr), _cpu_s(master.pid)
                    mcalls = calls1 - calls0 - 1            # less our own stats call
                    n_calls = sum(r["calls"] for r in res)
                    secs = max(r["seconds"] for r in res)
                    cpu_us = (cpu1 - cpu0) / max(mcalls, 1) * 1e6
                    p = {"objects": n, "op": op, "clients": k, "inflight": args.inflight,
                         "calls_per_s": n_calls / secs, "keys_per_s": sum(r["keys"] for r in res) / secs,
                         "master_cpu_pct": 100 * (cpu1 - cpu0) / wall, "master_calls": mcalls,
                         "master_cpu_us_per_call": cpu_us, "ceiling_calls_per_s": 1e6 / cpu_us}
                    out["points"].append(p)
                    print(f"  {op} x{k}: {p['calls_per_s']:.0f} calls/s, master {p['master_cpu_pct']:.0f}% CPU, "
                          f"{cpu_us:.1f} us/call (ceiling {p['ceiling_calls_per_s']:.0f}/s)",
                          file=sys.stderr, flush=True)
    finally:
        _stop(loaders, [master], extra)
    return out


def _stop(loaders: list, masters: list, extra: list) -> None:
    """Loaders leave (stdin closed), then the masters and etcd stop."""
    for ld in loaders:
        ld.stdin.close()
        ld.wait(60)
    for m in masters:
        if m.poll() is None:
            m.terminate()
            m.wait(30)
    for e in extra:
        e.terminate()
        e.wait(30)


# -- recovery --------------------------------------------------------------------------

RECOVERED = re.compile(r"recovered \d+ segments, (\d+) objects .* in ([0-9.]+) s")


def _durable_master(where: str, args, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0",
                             "--etcd", where, "--cluster", "scale", "--leader-ttl", str(args.leader_ttl)],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=_env(), cwd=ROOT)


def _line(proc: subprocess.Popen, word: str) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the master exited before it printed {word!r}")
        if word in line:
            return line


def _recovered(log: str) -> tuple[int, float]:
    """(objects, seconds) from the master's `leading cluster ...` log line."""
    with open(log) as f:
        m = RECOVERED.search(f.read())
    if m is None:
        raise SystemExit(f"no recovery line in {log}")
    return int(m.group(1)), float(m.group(2))


def run_recovery(args) -> dict:
    import tempfile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from store_bench import _start_etcd
    sizes = [int(float(x)) for x in args.objects.split(",")]
    hows = args.takeover.split(",")
    out: dict = {"object_bytes": OBJ, "leader_ttl": args.leader_ttl, "load": [], "recovery": []}
    extra: list = []
    logs = tempfile.mkdtemp(prefix="kvflow-recovery-")
    _, where = _start_etcd(extra)
    spec = f"etcd://{where}/scale"
    masters: list = []
    loaders: list = []
    readers: list = []
    try:
        log = os.path.join(logs, "m0.log")
        leader = _durable_master(where, args, log)
        masters.append(leader)
        addr = _line(leader, "ready").split()[-1]
        have = 0
        for n in sorted(sizes):
            s0 = _master_stats(addr)
            ld = _spawn("load", spec, str(n), str(have))
            info = json.loads(ld.stdout.readline())
            loaders.append(ld)
            s1 = _master_stats(addr)
            txns = s1["etcd_txns"] - s0["etcd_txns"]
            row = {"objects": n, "load_puts_per_s": info["loaded"] / info["seconds"],
                   "etcd_txns_per_s": txns / info["seconds"],
                   "keys_per_txn": (s1["etcd_keys"] - s0["etcd_keys"]) / max(txns, 1),
                   "master_rss_mib": _rss(leader.pid) / 2**20, "etcd_rss_mib": _rss(extra[0].pid) / 2**20}
            have = n
            out["load"].append(row)
            print(f"loaded {n}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "objects"),
                  file=sys.stderr, flush=True)
            for how in hows:
                log = os.path.join(logs, f"m{len(masters)}.log")
                if how == "standby":
                    new = _durable_master(where, args, log)
                    masters.append(new)
                    _line(new, "standby")
                rd = _spawn("read", spec, str(n), str(args.sample), str(n))
                readers.append(rd)
                assert json.loads(rd.stdout.readline())["ready"]
                t_kill = time.monotonic()
                leader.kill()
                leader.wait()
                if how == "restart":
                    new = _durable_master(where, args, log)
                    masters.append(new)
                rd.stdin.write("killed\n")
                rd.stdin.flush()
                addr = _line(new, "ready").split()[-1]
                t_ready = time.monotonic()
                got = json.loads(rd.communicate()[0].strip().splitlines()[-1])
                recovered, recover_s = _recovered(log)
                leader = new
                r = {"objects": n, "takeover": how, "recovered": recovered, "ready_s": t_ready - t_kill,
                     "recover_s": recover_s, "first_get_s": got["first_get"] - t_kill,
                     "all_exist_s": got["all_exist"] - t_kill, "sample_read_s": got["sample_read"] - t_kill,
                     "missing": got["missing"], "wrong": got["wrong"], "sample": got["sample"],
                     "master_rss_mib": _rss(leader.pid) / 2**20, "etcd_rss_mib": _rss(extra[0].pid) / 2**20}
                out["recovery"].append(r)
                print(f"  {how} at {n}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()
                                                      if k not in ("objects", "takeover")),
                      file=sys.stderr, flush=True)
    finally:
        for rd in readers:
            if rd.poll() is None:
                rd.kill()
                rd.wait(30)
        _stop(loaders, masters, extra)
    return out


def recovery_table(out: dict) -> str:
    rows = ["| objects | load (batch_put of 1,000) | etcd txns/s | keys per txn | master RSS | etcd RSS |",
            "|---|---|---|---|---|---|"]
    for r in out["load"]:
        rows.append(f"| {r['objects']:,} | {r['load_puts_per_s']:,.0f} objects/s | {r['etcd_txns_per_s']:,.0f} | "
                    f"{r['keys_per_txn']:.1f} | {r['master_rss_mib']:.0f} MiB | {r['etcd_rss_mib']:.0f} MiB |")
    rows += ["", f"Times from the SIGKILL (leader lease {out['leader_ttl']:g} s):", "",
             "| objects | takeover | ready | of which recovery | first get | all exist | sample's bytes read | "
             "missing | master RSS after |", "|---|---|---|---|---|---|---|---|---|"]
    for r in out["recovery"]:
        rows.append(f"| {r['objects']:,} | {r['takeover']} | {r['ready_s']:.2f} s | {r['recover_s']:.3f} s | "
                    f"{r['first_get_s']:.2f} s | {r['all_exist_s']:.2f} s | {r['sample_read_s']:.2f} s "
                    f"({r['sample']:,}, {r['wrong']} wrong) | {r['missing']} | {r['master_rss_mib']:.0f} MiB |")
    return "\n".join(rows)


def table(out: dict) -> str:
    rows = ["| objects | op | clients | calls/s | keys/s | master CPU | master CPU per call | one core's ceiling |",
            "|---|---|---|---|---|---|---|---|"]
    for p in out["points"]:
        rows.append(f"| {p['objects']:,} | {p['op']} | {p['clients']} | {p['calls_per_s']:,.0f} | "
                    f"{p['keys_per_s']:,.0f} | {p['master_cpu_pct']:.0f}% | {p['master_cpu_us_per_call']:.1f} us | "
                    f"{p['ceiling_calls_per_s']:,.0f}/s |")
    rows += ["", "| objects | master RSS | bytes per object | load (batch_put of 1,000) |", "|---|---|---|---|"]
    for r in out["index"]:
        bpo = f"{r['bytes_per_object']:.0f}" if "bytes_per_object" in r else "-"
        load = f"{r['load_puts_per_s']:,.0f} objects/s" if "load_puts_per_s" in r else "-"
        rows.append(f"| {r['objects']:,} | {r['master_rss_mib']:.0f} MiB | {bpo} | {load} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "load":
        asyncio.run(_load(argv[1], int(argv[2]), int(argv[3])))
        return 0
    if argv and argv[0] == "drive":
        asyncio.run(_drive(argv[1], argv[2], int(argv[3]), float(argv[4]), int(argv[5]), int(argv[6])))
        return 0
    if argv and argv[0] == "read":
        asyncio.run(_read_back(argv[1], int(argv[2]), int(argv[3]), int(argv[4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", default="0,100000,1000000", help="index sizes, ascending (objects of 256 B)")
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--ops", default="exists,put")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--inflight", type=int, default=4, help="calls in flight per client")
    p.add_argument("--etcd", action="store_true", help="the master made durable by a real etcd")
    p.add_argument("--recovery", action="store_true",
                   help="a durable master SIGKILLed at each index size: how long until it serves again")
    p.add_argument("--takeover", default="restart,standby", help="with --recovery: restart, standby or both")
    p.add_argument("--leader-ttl", type=float, default=2.0, help="with --recovery: the masters' --leader-ttl")
    p.add_argument("--sample", type=int, default=5000, help="with --recovery: objects whose bytes are read back")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.recovery:
        out = run_recovery(args)
        print(recovery_table(out))
    else:
        out = run(args)
        print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
