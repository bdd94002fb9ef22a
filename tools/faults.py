"""Fault injection across network namespaces: checksummed tcp transfers
between this host (the initiator) and target engines in network namespaces
("hosts"), all joined by a control network and two data rails (a bridge
each, veth links), while faults happen:

  rail     one rail goes down mid-transfer and comes back
  kill     the target is killed (SIGKILL) and restarted on the same address
  garbage  raw clients hammer the target's control and data ports with junk
  late     a write times out while its rail is down (shorter than the
           keepalive: the connections survive); the range is rewritten;
           nothing of the timed-out write may land when the rail is back
  netem    both rails lose 1% of their packets and add 5 ms of delay (needs
           sch_netem: the Soft-RoCE VM's kernel has it, this host's not)
  three    three hosts: this one writes to targets A and B at once; B is
           killed (SIGKILL) and restarted while A's writes go on (A's
           throughput before and during the fault is reported)
  three-silent  the same, with B's links cut before the kill (a crashed
           host: only the keepalive can tell)
  auto     rails from the topology: an initiator in a namespace host and the
           target pick their rails themselves (rails="auto"), pair them and
           bind each connection to its rail; the initiator's rail 1 goes down
           and comes back
  incast   not a fault: three senders write to one receiver behind a shaped
           link, with and without a receive window (throughput, and what
           queues and drops at the bottleneck)
  fair     not a fault: fair share between two peers of one engine behind
           one bottleneck (tbf on this host's rails); B's 1 MiB writes keep
           about half the link while A streams 16 MiB ones (a huge request)

Every case reports bytes sent, bytes verified (the target hashes what
landed; the initiator compares), transfers failed and with which error, the
slowest transfer (nothing may hang) and the time to detect the fault.

    python3 tools/faults.py                 # all cases, prints the table
    python3 tools/faults.py --cases rail --seconds 12 --json out.json

Needs root and `ip` (iproute2); tests/test_netns.py runs the same cases.
Addresses: 198.19.20.0/24 (control), 198.19.21.0/24 and 198.19.22.0/24
(rails); this host is .1, namespace host k is .(k+2) (A = host 0, B = 1).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from dataclasses import asdict

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
for _path in (ROOT, TOOLS):     # kvflow, and faultlib beside this script
    if _path not in sys.path:
        sys.path.insert(0, _path)

from faultlib.netns import Topology, netem_unavailable, netns_unavailable  # noqa: E402
from faultlib.channel import REGION  # noqa: E402
from faultlib.workload import Report  # noqa: E402
from faultlib.procs import serve_initiator, serve_target  # noqa: E402
from faultlib.cases import (  # noqa: E402
    case_auto, case_garbage, case_kill, case_late, case_netem, case_rail, case_three)
from faultlib.shaping import case_fair, case_incast  # noqa: E402
# what tests (test_netns.py, test_soak.py, test_incast.py, test_congestion.py) and
# tools/soak.py read from this module
from faultlib.netns import _ip  # noqa: E402,F401
from faultlib.channel import TARGET_PORT, TargetGone  # noqa: E402,F401
from faultlib.procs import Child, Target  # noqa: E402,F401
from faultlib.cases import _junk  # noqa: E402,F401


CASES = {"rail": case_rail, "kill": case_kill, "garbage": case_garbage, "late": case_late,
         "netem": case_netem, "three": case_three, "auto": case_auto, "fair": case_fair,
         "incast": case_incast,
         "three-silent": functools.partial(case_three, silent=True)}


async def run(cases: list[str], seconds: float, keepalive: float) -> list[Report]:
    topo = Topology(hosts=2).up()
    try:
        return [await CASES[c](topo, seconds, keepalive) for c in cases]
    finally:
        topo.down()


def table(reports: list[Report]) -> str:
    rows = ["| case | transfers | MiB sent | MiB verified | corrupted | failed (error) | slowest s | detect s | recover s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        failed = ", ".join(f"{v} {k}" for k, v in r.failed.items()) or "0"
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {r.case} | {r.transfers} | {r.bytes_sent / 2**20:.0f} | {r.bytes_verified / 2**20:.0f} | "
                    f"{r.corrupted} | {failed} | {r.slowest_s:.2f} | {fmt(r.detect_s)} | {fmt(r.recover_s)} |")
    for r in reports:
        for n in r.notes:
            rows.append(f"- {r.case}: {n}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="rail,kill,garbage,late,three,three-silent,auto" + ("" if netem_unavailable() else ",netem"),
                    help="comma-separated: " + ", ".join(CASES) + " (default: all that this kernel can do)")
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each case")
    ap.add_argument("--keepalive", type=float, default=2.0, help="engines' keepalive (dead-rail detection)")
    ap.add_argument("--json", help="also write the reports here")
    ap.add_argument("--serve-target", metavar="LISTEN", help=argparse.SUPPRESS)
    ap.add_argument("--rails", help=argparse.SUPPRESS)
    ap.add_argument("--hash-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--receive-window", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-initiator", metavar="TARGET", help=argparse.SUPPRESS)
    ap.add_argument("--listen", help=argparse.SUPPRESS)
    ap.add_argument("--hashes", help=argparse.SUPPRESS)
    ap.add_argument("--region", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_target:
        rails = a.rails.split(",") if a.rails else None
        asyncio.run(serve_target(a.serve_target, rails, REGION, a.keepalive, a.hash_port, a.receive_window))
        return 0
    if a.serve_initiator:
        asyncio.run(serve_initiator(a.listen, a.rails.split(","), a.serve_initiator, a.hashes, a.region,
                                    a.keepalive))
        return 0
    why = netns_unavailable()
    if why:
        print(f"faults: {why}", file=sys.stderr)
        return 2
    reports = asyncio.run(run(a.cases.split(","), a.seconds, a.keepalive))
    print(table(reports))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=1)
    return 0 if all(not r.corrupted and "HANG" not in r.failed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
