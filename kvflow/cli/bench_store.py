"""kvflow-bench store: put, get and exists through the KVCache pool
(kvflow.store), the calls SGLang's and vLLM's store code makes.

Layout: this process runs the master (embedded, listening on
--master-listen; or --master HOST:PORT, a standalone one) and a holder
client that mounts one segment of --segment-size bytes; --clients client
processes (mounting nothing) each register a buffer and, per object size
and batch size, run --rounds rounds (after --warmup unmeasured ones) of:

    put     batch_put_from of --batch objects from registered memory
    get     batch_get_into of the same keys into other registered memory
            (every byte compared with what was put, after the timed call)
    exists  batch_exists of the same keys (all must be there)

and then remove them (not timed). Every client starts each call at once
(a barrier per call: this process sends the command, the clients answer
with their start and end times), so a round's throughput is all the
clients' bytes over the time from the first start to the last end. The
objects go over --protocol (auto: kvflow's choice; same host: local)
into the holder's segment. Each object is stamped with its round and
index before it is put, so a get that read stale bytes fails the check.

Per (op, object size, batch) one row: objects, bytes, GB/s (bytes over
the sum of the rounds' times), per-call latency p50/p99 (every client's
calls), master round trips per call (the clients' own counters,
kvflow.store.metrics: put 2, get 1, exists 1, whatever the batch), and
for get whether every byte verified. --json prints one object per row.

    kvflow-bench store --size 64K,1M,4M --batch 64 --json
    kvflow-bench store --clients 4 --op put,get --size 1M --plot store.png
    kvflow-bench store --master 10.0.0.1:50051 --protocol tcp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvflow.cli.bench_layout import BenchError, format_size
from kvflow.cli.bench_plot import check_plotting, plot_sweep
from kvflow.cli.bench_qos import Progress, percentile
from kvflow.store import StoreClient

__all__ = ["add_parser", "run_store", "segment_size_for"]

OPS = ("put", "get", "exists")
KEY_PREFIX = "kvflow-bench"
# what each timed call costs at the master, by design (a check on the
# counters, and on the design: one round trip per batch, any size)
ROUND_TRIP_METHODS = {"put": ("batch_put_start", "batch_put_end"), "get": ("batch_get_replicas",),
                      "exists": ("batch_exists",), "remove": ("batch_remove",)}


def segment_size_for(clients: int, batch: int, size: int) -> int:
    """The holder's segment: one round of every client's objects at 1.3x
    (under the 0.95 eviction watermark with room for the allocator's
    alignment), rounded up to a MiB, at least 16 MiB."""
    need = int(clients * batch * (size + 64) * 1.3)
    return max(16 << 20, (need + (1 << 20) - 1) >> 20 << 20)


def _protocols(name: str) -> tuple[str, ...] | None:
    return None if name == "auto" else (name,)


# -- the client processes ----------------------------------------------------------------------------------
class _Worker:
    """One client process: a StoreClient mounting nothing, a source and a
    destination buffer, commands on stdin, one JSON answer per line."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = StoreClient(args.master, segment_size=0, local_buffer_size=0,
                                  protocols=_protocols(args.protocol), timeout=args.timeout)
        self.src = np.random.default_rng(args.seed).integers(0, 256, args.span, dtype=np.uint8)
        self.dst = np.zeros(args.span, np.uint8)

    async def run(self) -> None:
        async with self.client as c:
            rs, rd = c.register_buffer(self.src), c.register_buffer(self.dst)
            transport = None
            if self.args.holder:
                transport = (await c.engine.connect(self.args.holder)).transport
            self._say({"ready": True, "transport": transport})
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                cmd = json.loads(line)
                if cmd["op"] == "metrics":
                    self._say(c.metrics())
                    continue
                self._say(await self._call(cmd, rs.addr, rd.addr))

    async def _call(self, cmd: dict, src: int, dst: int) -> dict:
        c, op, size, batch = self.client, cmd["op"], cmd["size"], cmd["batch"]
        keys = [f"{KEY_PREFIX}/{self.args.index}/{size}/{batch}/{cmd['round']}/{i}" for i in range(batch)]
        if op == "put":                 # a stamp per round and object: stale bytes cannot verify
            stamp = (np.uint64(cmd["round"]) << np.uint64(32)) | np.arange(batch, dtype=np.uint64)
            stamp_bytes = stamp.astype("<u8").view(np.uint8).reshape(batch, 8)
            n = min(8, size)
            self.src[:batch * size].reshape(batch, size)[:, :n] = stamp_bytes[:, :n]
        elif op == "get":
            self.dst[:batch * size] = 0
        before = c.counters.master_round_trips()
        t0 = time.monotonic()
        if op == "put":
            out = await c.batch_put_from(keys, [src + i * size for i in range(batch)], [size] * batch)
        elif op == "get":
            out = await c.batch_get_into(keys, [dst + i * size for i in range(batch)], [size] * batch)
        elif op == "exists":
            out = await c.batch_exists(keys)
        else:
            out = await c.batch_remove(keys, force=True)
        t1 = time.monotonic()
        reply: dict[str, Any] = {"t0": t0, "t1": t1, "round_trips": c.counters.master_round_trips() - before}
        want = {"put": 1, "get": size, "exists": True, "remove": None}[op]
        reply["ok"] = sum(1 for r in out if r == want and not isinstance(r, BaseException))
        bad = [r for r in out if isinstance(r, BaseException)]
        if bad:
            reply["error"] = f"{type(bad[0]).__name__}: {bad[0]}"
        if op == "get":
            reply["verified"] = bool(np.array_equal(self.dst[:batch * size], self.src[:batch * size]))
        return reply

    @staticmethod
    def _say(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.cli.bench_store")
    p.add_argument("role", choices=("worker",))
    p.add_argument("--master", required=True)
    p.add_argument("--holder", default=None, help="the holder's engine (to report the transport)")
    p.add_argument("--protocol", default="auto")
    p.add_argument("--span", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    asyncio.run(_Worker(args).run())
    return 0


# -- this process: master, holder, orchestration -----------------------------------------------------------
class _Clients:
    """The client processes, driven in lockstep."""

    def __init__(self, procs: list[asyncio.subprocess.Process], timeout: float) -> None:
        self.procs = procs
        self.timeout = timeout

    @classmethod
    async def start(cls, args: argparse.Namespace, master: str, holder: str, span: int) -> tuple[_Clients, str]:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        procs: list[asyncio.subprocess.Process] = []
        clients = cls(procs, args.timeout + 30)
        try:
            for i in range(args.clients):
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvflow.cli.bench_store", "worker", "--master", master,
                    "--holder", holder, "--protocol", args.protocol, "--span", str(span), "--index", str(i),
                    "--seed", str(args.seed + i), "--timeout", str(args.timeout),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env))
            ready = await asyncio.gather(*(clients._read(p) for p in procs))
        except BaseException:
            await clients.close()
            raise
        return clients, ready[0].get("transport") or "?"

    async def _read(self, p: asyncio.subprocess.Process) -> dict:
        try:
            line = await asyncio.wait_for(p.stdout.readline(), self.timeout)
        except asyncio.TimeoutError:
            raise BenchError(f"a client process did not answer within {self.timeout:g} s") from None
        if not line:
            raise BenchError(f"a client process exited (status {await p.wait()}); its error is above")
        return json.loads(line)

    async def each(self, cmd: dict) -> list[dict]:
        """Sends `cmd` to every client at once; their answers, in order."""
        data = (json.dumps(cmd) + "\n").encode()
        for p in self.procs:
            p.stdin.write(data)
        await asyncio.gather(*(p.stdin.drain() for p in self.procs))
        return list(await asyncio.gather(*(self._read(p) for p in self.procs)))

    async def close(self) -> None:
        for p in self.procs:
            if p.returncode is None and p.stdin is not None:
                p.stdin.close()                 # EOF: the client leaves the pool and exits
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()


def _row(op: str, size: int, batch: int, rounds: list[list[dict]], extra: dict) -> dict:
    """One (op, size, batch) point from its rounds (each: every client's answer)."""
    clients = len(rounds[0])
    walls = [max(a["t1"] for a in r) - min(a["t0"] for a in r) for r in rounds]
    calls = [a["t1"] - a["t0"] for r in rounds for a in r]
    objects = clients * batch * len(rounds)
    seconds = sum(walls)
    row = {"mode": "store", "op": op, "object_size": size, "batch": batch, "clients": clients,
           "rounds": len(rounds), "calls": len(calls), "objects": objects,
           "ok": sum(a["ok"] for r in rounds for a in r), "seconds": seconds,
           "latency_p50_us": percentile(calls, 50) * 1e6, "latency_p99_us": percentile(calls, 99) * 1e6,
           "keys_per_s": objects / seconds if seconds else None,
           "master_round_trips_per_call": sum(a["round_trips"] for r in rounds for a in r) / len(calls), **extra}
    if op == "exists":
        row["bytes"], row["gbps"] = 0, None
    else:
        row["bytes"] = objects * size
        row["gbps"] = row["bytes"] / seconds / 1e9 if seconds else None
        row["gbps_median_round"] = statistics.median(batch * size * clients / w / 1e9 for w in walls)
    if op == "get":
        row["verified"] = all(a["verified"] for r in rounds for a in r)
        row["bytes_verified"] = row["bytes"] if row["verified"] else 0
    errors = [a["error"] for r in rounds for a in r if "error" in a]
    if errors:
        row["error"] = errors[0]
    return row


async def _point(clients: _Clients, args: argparse.Namespace, size: int, batch: int, extra: dict,
                 progress: Progress) -> list[dict]:
    timed: dict[str, list[list[dict]]] = {op: [] for op in args.ops}
    total = args.warmup + args.rounds
    for r in range(total):
        for op in ("put", "get", "exists"):
            if op not in args.ops and op != "put":
                continue                        # a get or exists needs the objects put, timed or not
            answers = await clients.each({"op": op, "size": size, "batch": batch, "round": r})
            if op in args.ops and r >= args.warmup:
                timed[op].append(answers)
        await clients.each({"op": "remove", "size": size, "batch": batch, "round": r})
    rows = [_row(op, size, batch, timed[op], extra) for op in args.ops]
    for row in rows:
        rate = f"{row['gbps']:.2f} GB/s, " if row["gbps"] is not None else ""
        progress(f"{row['op']} {batch} x {format_size(size)}, {row['clients']} client(s): {rate}"
                 f"p50 {row['latency_p50_us']:.0f} us, {row['master_round_trips_per_call']:g} master round "
                 f"trip(s) per call" + (f", verified {row['verified']}" if "verified" in row else ""))
    return rows


def _report(rows: list[dict], out: Any) -> None:
    print(f"{'op':<7} {'size':>8} {'batch':>5} {'clients':>7} {'objects':>8} {'GB/s':>7} {'p50 us':>9} "
          f"{'p99 us':>9} {'rt/call':>7} {'verified':>8}", file=out)
    for r in rows:
        gbps = f"{r['gbps']:.3f}" if r["gbps"] is not None else "-"
        print(f"{r['op']:<7} {format_size(r['object_size']):>8} {r['batch']:>5} {r['clients']:>7} "
              f"{r['objects']:>8} {gbps:>7} {r['latency_p50_us']:>9.1f} {r['latency_p99_us']:>9.1f} "
              f"{r['master_round_trips_per_call']:>7.2g} {r.get('verified', '-')!s:>8}", file=out)


def _summary(metrics: list[dict], master: dict) -> str:
    """One line of the clients' round trips and the master's counts."""
    by: dict[str, list[float]] = {}
    for m in metrics:
        for method, h in m["round_trips"].items():
            t = by.setdefault(method, [0, 0.0])
            t[0] += h["count"]
            t[1] += h["sum_seconds"]
    parts = [f"{method} {n} (mean {s / n * 1e6:.0f} us)" for method, (n, s) in sorted(by.items())
             if n and method != "heartbeat"]
    return ("metrics: master round trips: " + (", ".join(parts) or "none")
            + f"; evictions {sum(master['evictions'].values())}, lease waits {sum(master['lease_waits'].values())}")


async def run_store(args: argparse.Namespace) -> int:
    progress = Progress(None if args.no_progress else sys.stderr, "store")
    span = max(args.sizes) * max(args.batches)
    segment = args.segment_size if args.segment_size is not None else \
        segment_size_for(args.clients, max(args.batches), max(args.sizes))
    embedded = args.master is None
    holder = StoreClient(args.master, segment_size=segment, local_buffer_size=0, protocols=_protocols(args.protocol),
                         master_listen=args.master_listen if embedded else None, timeout=args.timeout)
    rows: list[dict] = []
    async with holder:
        master_address = holder.master_address
        progress(f"master {'embedded, ' if embedded else ''}{master_address}; holder segment "
                 f"{format_size(segment)}; {args.clients} client process(es)")
        clients, transport = await _Clients.start(args, master_address, holder.engine.address, span)
        progress(f"the clients reach the holder over {transport}")
        try:
            extra = {"protocol": transport, "master": "embedded" if embedded else master_address,
                     "segment_size": segment}
            for batch in args.batches:
                for size in args.sizes:
                    rows += await _point(clients, args, size, batch, extra, progress)
            metrics = await clients.each({"op": "metrics"})
        finally:
            await clients.close()
        summary = _summary(metrics, await holder.stats(detail=True))
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        _report(rows, sys.stdout)
        progress(summary)
    if args.plot:
        shown = [SimpleNamespace(layout=SimpleNamespace(block_size=r["object_size"], batch=r["batch"],
                                                        concurrency=r["clients"]),
                                 gbps=float("nan") if r["gbps"] is None else r["gbps"],
                                 latency_p50_us=r["latency_p50_us"], latency_p99_us=r["latency_p99_us"],
                                 op=r["op"]) for r in rows]
        path = plot_sweep(shown, args.plot, title=f"kvflow-bench store over {transport}",
                          series=lambda r: f"{r.op} batch {r.layout.batch}")
        progress(f"wrote {path}")
    failed = [r for r in rows if r.get("verified") is False or r["ok"] != r["objects"]]
    for r in failed:
        print(f"kvflow-bench store: {r['op']} {format_size(r['object_size'])}: {r['ok']} of {r['objects']} "
              f"objects ok{', bytes did NOT verify' if r.get('verified') is False else ''}"
              + (f" ({r['error']})" if "error" in r else ""), file=sys.stderr, flush=True)
    return 3 if failed else 0


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(text)
    return ops


def add_parser(roles: Any, sizes: Any, counts: Any, size: Any, count: Any, seconds: Any) -> None:
    p = roles.add_parser("store", help="put/get/exists through the KVCache pool (kvflow.store)")
    p.add_argument("--op", type=_ops, default=OPS, dest="ops", metavar="OP[,OP...]",
                   help="of put, get, exists (default all; get and exists put their objects untimed)")
    p.add_argument("--size", type=sizes, default=[64 << 10, 1 << 20, 4 << 20], dest="sizes", metavar="SIZE[,SIZE...]",
                   help="object sizes (default 64K,1M,4M)")
    p.add_argument("--batch", type=counts, default=(64,), dest="batches", metavar="N[,N...]",
                   help="objects per call (default 64)")
    p.add_argument("--clients", type=count, default=1, metavar="N", help="client processes (default 1)")
    p.add_argument("--rounds", type=count, default=5, metavar="N", help="timed rounds per point (default 5)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="unmeasured rounds first (default 1)")
    p.add_argument("--protocol", choices=("auto", "tcp", "local", "rdma"), default="auto",
                   help="what moves the objects between the clients and the holder (default auto)")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="a standalone master (python -m kvflow.store master); default: embedded in this process")
    p.add_argument("--master-listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the embedded master listens for the client processes (default %(default)s)")
    p.add_argument("--segment-size", type=lambda t: 0 if t.strip() == "0" else size(t), default=None, metavar="SIZE",
                   help="the holder's segment (default: one round of every client's objects, x1.3; "
                        "0 with --master: no holder segment, the pool has its own)")
    p.add_argument("--seed", type=int, default=1, metavar="N")
    p.add_argument("--timeout", type=seconds, default=30.0, metavar="SECONDS", help="per call (default 30)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="GB/s and latency against object size, a line per op and batch (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="one JSON object per (op, size, batch)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before anything starts."""
    if args.segment_size == 0 and args.master is None:
        parser.error("--segment-size 0 needs --master (a pool with segments of its own)")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.plot:
        check_plotting()


if __name__ == "__main__":
    sys.exit(worker_main())

