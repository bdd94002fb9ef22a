"""kvflow-bench incast: N senders toward one receiver, with and without a
receive window (receiver credits), in one run.

Engines on this machine, all in this process, over --protocol (tcp or
rdma; the data path runs on their native threads): one receiver and
--senders senders, each writing --size bytes (one batch of --entries
entries) to its own part of the receiver's buffer, all at once, --rounds times per setting. The settings (--windows:
0 is no window, else Engine(receive_window=bytes)) alternate round by round,
so that drift on a shared machine hits them alike.

The report gives per setting the aggregate throughput (all senders' bytes
over the time until the last finished), the fairness between senders
(Jain's index of their throughputs: 1.0 is an even share), the most the
receiver's pool held at once and the payload that landed without credit
(must be 0), and the ratio of each window's throughput to no window's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, TextIO

import numpy as np

import kvflow
from kvflow.cli.bench_layout import format_size, parse_size
from kvflow.cli.bench_qos import Progress


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else float("nan")


async def run_round(args: argparse.Namespace, window: int, dst: np.ndarray,
                    srcs: list[np.ndarray]) -> dict[str, Any]:
    recv = kvflow.Engine(protocols=[args.protocol], receive_window=window or None,
                         tcp_connections=args.tcp_connections)
    senders: list[kvflow.Engine] = []
    await recv.start()
    try:
        rd = recv.register(dst).addr
        peers = []
        for src in srcs:
            e = kvflow.Engine(protocols=[args.protocol], tcp_connections=args.tcp_connections)
            senders.append(e)
            await e.start()
            peers.append((await e.connect(recv.address), e.register(src).addr))
        step = args.size // args.entries
        done: list[float] = []
        t0 = time.perf_counter()

        async def one(i: int, peer: kvflow.Peer, la: int) -> None:
            await peer.write([la + k * step for k in range(args.entries)],
                             [rd + i * args.size + k * step for k in range(args.entries)],
                             [step] * args.entries, timeout=args.timeout)
            done.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i, p, la) for i, (p, la) in enumerate(peers)))
        elapsed = max(done)
        st = recv.receive_window_stats() or {}
        return {"window": window, "gbps": step * args.entries * args.senders / elapsed / 1e9,
                "seconds": elapsed, "fairness": jain([step * args.entries / d for d in done]),
                "max_held": st.get("max_held", 0), "violations": st.get("violations", 0),
                "recalls": st.get("recalls", 0), "grants": st.get("grants", 0)}
    finally:
        for e in senders:
            await e.close()
        await recv.close()


def summarise(rounds: list[dict[str, Any]], windows: list[int]) -> list[dict[str, Any]]:
    out = []
    for w in windows:
        rs = [r for r in rounds if r["window"] == w]
        total = sum(r["seconds"] for r in rs)
        out.append({"window": w, "rounds": len(rs),
                    "gbps": sum(r["gbps"] * r["seconds"] for r in rs) / total,
                    "gbps_min": min(r["gbps"] for r in rs), "gbps_max": max(r["gbps"] for r in rs),
                    "fairness": min(r["fairness"] for r in rs),
                    "max_held": max(r["max_held"] for r in rs),
                    "violations": sum(r["violations"] for r in rs),
                    "recalls": sum(r["recalls"] for r in rs)})
    base = next((s for s in out if s["window"] == 0), None)
    for s in out:
        s["vs_no_window"] = s["gbps"] / base["gbps"] if base else float("nan")
    return out


def report(summary: list[dict[str, Any]], out: TextIO) -> None:
    print(f"{'window':>8} {'rounds':>6} {'GB/s':>7} {'min':>7} {'max':>7} {'fairness':>8} "
          f"{'max held':>9} {'violations':>10} {'vs none':>8}", file=out)
    for s in summary:
        name = format_size(s["window"]) if s["window"] else "none"
        print(f"{name:>8} {s['rounds']:>6d} {s['gbps']:>7.2f} {s['gbps_min']:>7.2f} {s['gbps_max']:>7.2f} "
              f"{s['fairness']:>8.3f} {format_size(s['max_held']) if s['max_held'] else '-':>9} "
              f"{s['violations']:>10d} {s['vs_no_window']:>8.2f}", file=out)


async def run_incast(args: argparse.Namespace) -> int:
    progress = Progress(None if args.no_progress else sys.stderr, "incast")
    rounds = []
    # allocated and touched once: page faults would otherwise dominate the first rounds
    dst = np.ones(args.size * args.senders, dtype=np.uint8)
    srcs = [np.full(args.size, i + 2, dtype=np.uint8) for i in range(args.senders)]
    for r in range(args.rounds):
        for w in args.windows:
            res = await run_round(args, w, dst, srcs)
            rounds.append(res)
            progress(f"round {r + 1}/{args.rounds}, window {format_size(w) if w else 'none'}: "
                     f"{res['gbps']:.2f} GB/s, fairness {res['fairness']:.3f}")
    summary = summarise(rounds, args.windows)
    if args.json:
        for s in summary:
            print(json.dumps(s), flush=True)
    else:
        report(summary, sys.stdout)
    return 0


def windows(text: str) -> list[int]:
    out = [parse_size(p.strip()) if p.strip() not in ("0", "none") else 0 for p in text.split(",")]
    if not out or len(set(out)) != len(out):
        raise ValueError(text)
    for w in out:
        if w:
            kvflow.Engine(receive_window=w)     # InvalidArgumentError names the bound
    return out


def add_parser(roles: Any, size: Any, count: Any, seconds: Any) -> None:
    p = roles.add_parser("incast", help="N senders toward one receiver, with and without a receive window")
    p.add_argument("--senders", type=count, default=3, metavar="N", help="senders (3)")
    p.add_argument("--size", type=size, default=256 << 20, metavar="SIZE", help="bytes per sender and round (256M)")
    p.add_argument("--entries", type=count, default=256, metavar="N", help="entries per sender's batch (256)")
    p.add_argument("--windows", type=windows, default=[0, 4 << 20], metavar="W[,W...]",
                   help="receive windows to compare, 0 or none: no window (default 0,4M)")
    p.add_argument("--rounds", type=count, default=3, metavar="N", help="rounds per window, alternating (3)")
    p.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp",
                   help="the provider every engine uses (tcp)")
    p.add_argument("--tcp-connections", type=count, default=2, metavar="N")
    p.add_argument("--timeout", type=seconds, default=120.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="one JSON object per window")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


__all__ = ["run_incast", "add_parser"]
