"""kvflow-bench qos: short requests against a long stream, FIFO and QoS in
one run.

Two engines on this machine (initiator and target in this process; the
data path runs on their native threads). For each scheduling mode
(--modes, default "fifo,qos"): a LOW stream of --low-batches batches of
--low-size each (queued at once, --rounds times) saturates the link while a
HIGH batch of --high-entries entries of --high-entry bytes (not contiguous:
one slice each) arrives every --interval seconds (uniform in the range) and
is timed from its arrival to its completion. In FIFO mode priorities are
ignored (Engine(scheduling="fifo")): the baseline. Then, per mode, a cancel
check: a --cancel-size write queued behind another is cancelled and the
time until it raises is measured.

With --repeat N the modes run N times each, in turn (fifo, qos, fifo, qos,
...), so that a machine whose speed drifts during the run slows both alike;
each mode's figures then pool its runs (the stream's bytes over its seconds,
every short batch's latency, the slowest cancel).

The report gives per mode the stream's throughput and the short batches'
latency percentiles, and the ratios: FIFO p99 / QoS p99 and QoS stream
throughput / FIFO's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any, TextIO

import numpy as np

import kvflow
from kvflow.cli.bench_layout import BenchError, format_size

MODES = ("fifo", "qos")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Progress:
    """One line per event on stderr (a terminal or a log file alike)."""

    def __init__(self, out: TextIO | None, mode: str = "qos") -> None:
        self.out = out
        self.mode = mode

    def __call__(self, text: str) -> None:
        if self.out is not None:
            print(f"kvflow-bench {self.mode}: {text}", file=self.out, flush=True)


async def _pair(args: argparse.Namespace, scheduling: str, nbytes: int):
    protocols = None if args.protocol == "auto" else (args.protocol,)
    kw = {"protocols": protocols, "scheduling": scheduling, "tcp_connections": args.tcp_connections,
          "tcp_express": None if args.tcp_express is None else args.tcp_express == "on"}
    if args.tcp_buffers is not None:
        kw["tcp_send_buffer"], kw["tcp_receive_buffer"] = args.tcp_buffers
    a, b = kvflow.Engine(**kw), kvflow.Engine(**kw, receive_window=args.receive_window or None)
    await a.start()
    await b.start()
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    ls, rd = a.register(src), b.register(dst)
    peer = await asyncio.wait_for(a.connect(b.address), args.connect_timeout)
    return a, b, peer, ls.addr, rd.addr, (src, dst)


async def run_mode(args: argparse.Namespace, scheduling: str, progress: Progress) -> dict[str, Any]:
    low, nlow = args.low_size, args.low_batches
    ring = 4                                     # the stream rewrites 4 buffers of low_size
    high_span = args.high_entries * 2 * args.high_entry
    a, b, peer, la, ra, keep = await _pair(args, scheduling, ring * low + high_span)
    qos = scheduling != "fifo"
    try:
        low_prio = kvflow.Priority.LOW if qos else kvflow.Priority.NORMAL
        high_prio = kvflow.Priority.HIGH if qos else kvflow.Priority.NORMAL
        hl = [la + ring * low + i * 2 * args.high_entry for i in range(args.high_entries)]
        hr = [ra + ring * low + i * 2 * args.high_entry for i in range(args.high_entries)]
        hn = [args.high_entry] * args.high_entries
        latencies: list[float] = []
        high_transfers = []
        streaming = True

        async def arrivals() -> None:
            rng = random.Random(args.seed)
            await asyncio.sleep(args.interval[0])
            while streaming:
                t0 = time.perf_counter()
                t = peer.write_nowait(hl, hr, hn, priority=high_prio, timeout=args.timeout)
                t.add_done_callback(lambda _t, t0=t0: latencies.append(time.perf_counter() - t0))
                high_transfers.append(t)
                await asyncio.sleep(rng.uniform(*args.interval))

        shorts = asyncio.get_running_loop().create_task(arrivals())
        moved = 0
        t0 = time.perf_counter()
        for r in range(args.rounds):
            batch = [peer.write_nowait([la + (i % ring) * low], [ra + (i % ring) * low], [low],
                                       priority=low_prio, timeout=args.timeout) for i in range(nlow)]
            for t in batch:
                await t
                moved += low
            progress(f"{scheduling}: round {r + 1}/{args.rounds}: {format_size(moved)} streamed, "
                     f"{len(latencies)} short batches done")
        elapsed = time.perf_counter() - t0
        streaming = False
        await shorts
        await asyncio.gather(*high_transfers)
        cancel_ms = await cancel_check(args, peer, la, ra, low_prio)
        return {"mode": scheduling, "protocol": peer.transport, "stream_bytes": moved, "seconds": elapsed,
                "latencies_ms": [x * 1e3 for x in latencies], "cancel_ms": cancel_ms}
    finally:
        await a.close()
        await b.close()
        del keep


async def cancel_check(args: argparse.Namespace, peer: kvflow.Peer, la: int, ra: int,
                       prio: kvflow.Priority) -> float:
    """ms from cancel() to the raise of a --cancel-size write queued behind another."""
    n = max(1, args.cancel_size // args.low_size)
    cols = ([la] * n, [ra] * n, [args.low_size] * n)
    first = peer.write_nowait(*cols, priority=prio)
    second = peer.write_nowait(*cols, priority=prio)
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    second.cancel()
    try:
        await second
    except kvflow.TransferCancelledError:
        pass
    took = (time.perf_counter() - t0) * 1e3
    await first
    return took


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its runs: the stream's bytes over its
    seconds, the percentiles of every short batch's latency, the slowest
    cancel."""
    moved = sum(r["stream_bytes"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    lat_ms = [x for r in runs for x in r["latencies_ms"]]
    return {"mode": runs[0]["mode"], "protocol": runs[0]["protocol"], "runs": len(runs),
            "stream_gbps": moved / seconds / 1e9, "stream_bytes": moved, "seconds": seconds,
            "stream_gbps_runs": [r["stream_bytes"] / r["seconds"] / 1e9 for r in runs],
            "short_batches": len(lat_ms), "short_p50_ms": percentile(lat_ms, 50),
            "short_p99_ms": percentile(lat_ms, 99), "short_max_ms": max(lat_ms) if lat_ms else float("nan"),
            "cancel_ms": max(r["cancel_ms"] for r in runs)}


def report(results: list[dict[str, Any]], out: TextIO) -> None:
    print(f"{'mode':<6} {'stream GB/s':>11} {'short n':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'cancel ms':>10}", file=out)
    for r in results:
        print(f"{r['mode']:<6} {r['stream_gbps']:>11.2f} {r['short_batches']:>8d} {r['short_p50_ms']:>8.2f} "
              f"{r['short_p99_ms']:>8.2f} {r['short_max_ms']:>8.2f} {r['cancel_ms']:>10.1f}", file=out)
    by = {r["mode"]: r for r in results}
    if "fifo" in by and "qos" in by:
        f, q = by["fifo"], by["qos"]
        print(f"short p99: FIFO/QoS = {f['short_p99_ms'] / q['short_p99_ms']:.1f}x; "
              f"stream throughput: QoS/FIFO = {q['stream_gbps'] / f['stream_gbps']:.2f}", file=out)


def ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["mode"]: r for r in results}
    if "fifo" not in by or "qos" not in by:
        return {}
    return {"short_p99_fifo_over_qos": by["fifo"]["short_p99_ms"] / by["qos"]["short_p99_ms"],
            "stream_qos_over_fifo": by["qos"]["stream_gbps"] / by["fifo"]["stream_gbps"]}


async def run_qos(args: argparse.Namespace) -> int:
    progress = Progress(None if args.no_progress else sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for k in range(args.repeat):
        for mode in args.modes:
            progress(f"{mode}{f' (run {k + 1}/{args.repeat})' if args.repeat > 1 else ''}: "
                     f"{args.rounds} x {args.low_batches} x {format_size(args.low_size)} LOW stream, "
                     f"{args.high_entries} x {format_size(args.high_entry)} HIGH every "
                     f"{args.interval[0] * 1e3:g}-{args.interval[1] * 1e3:g} ms")
            runs[mode].append(await run_mode(args, mode, progress))
    results = [pooled(runs[mode]) for mode in args.modes]
    if args.json:
        for r in results:
            print(json.dumps(r), flush=True)
        if ratios(results):
            print(json.dumps({"ratios": ratios(results)}), flush=True)
    else:
        report(results, sys.stdout)
    return 0


def interval(text: str) -> tuple[float, float]:
    parts = [float(p) for p in text.split("-")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
        raise ValueError(text)
    return parts[0] / 1e3, parts[1] / 1e3


def buffers(text: str) -> tuple[int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 2:
        raise ValueError(text)
    return parts[0], parts[1]


def modes(text: str) -> tuple[str, ...]:
    out = tuple(m.strip() for m in text.split(","))
    if not out or any(m not in MODES for m in out):
        raise ValueError(text)
    return out


def add_parser(roles: Any, size: Any, count: Any, seconds: Any) -> None:
    p = roles.add_parser("qos", help="short HIGH batches against a LOW stream, FIFO and QoS in one run")
    p.add_argument("--protocol", choices=("auto", "tcp", "local", "rdma"), default="tcp")
    p.add_argument("--tcp-connections", type=count, default=2, metavar="N")
    p.add_argument("--tcp-express", choices=("on", "off"), default=None,
                   help="the tcp express lane for HIGH batches (Engine(tcp_express=); default: the engine's, on)")
    p.add_argument("--tcp-buffers", type=buffers, default=None, metavar="SEND,RECEIVE",
                   help="SO_SNDBUF,SO_RCVBUF of the tcp data connections in bytes (0: the kernel's; "
                        "default: the engine's, 512K,0)")
    p.add_argument("--receive-window", type=size, default=None, metavar="SIZE",
                   help="the target's Engine(receive_window=) in both modes (default none)")
    p.add_argument("--modes", type=modes, default=MODES, help="comma-separated: fifo,qos (default both)")
    p.add_argument("--low-batches", type=count, default=64, metavar="N", help="LOW batches per round (64)")
    p.add_argument("--low-size", type=size, default=16 << 20, metavar="SIZE", help="bytes per LOW batch (16M)")
    p.add_argument("--rounds", type=count, default=3, metavar="N", help="rounds of the LOW stream (3)")
    p.add_argument("--repeat", type=count, default=1, metavar="N",
                   help="run the modes N times each, in turn, and pool each mode's runs (1)")
    p.add_argument("--high-entries", type=count, default=16, metavar="N", help="entries per HIGH batch (16)")
    p.add_argument("--high-entry", type=size, default=64 << 10, metavar="SIZE", help="bytes per HIGH entry (64K)")
    p.add_argument("--interval", type=interval, default=(0.010, 0.020), metavar="MS[-MS]",
                   help="HIGH arrivals every MS (uniform in the range; default 10-20)")
    p.add_argument("--cancel-size", type=size, default=1 << 30, metavar="SIZE",
                   help="the cancel check's write, queued behind another of that size (1G)")
    p.add_argument("--timeout", type=seconds, default=120.0, metavar="SECONDS")
    p.add_argument("--connect-timeout", type=seconds, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object per mode, then the ratios")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


__all__ = ["run_qos", "add_parser", "BenchError"]
