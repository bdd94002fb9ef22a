#!/usr/bin/env python3
"""A flow-level simulator of KV transfers across a rail-optimised cluster,
with the strategies of tools/incast.py (issue 21: the relay judged at a
scale no machine here has).

    python3 tools/flowsim.py --case small --json            # the emulation's small case, beside its measurements
    python3 tools/flowsim.py --case cluster --strategy naive --load 0.6 --json
    python3 tools/flowsim.py --case cluster --sweep --plot docs/img   # every strategy over a range of loads, PNGs

The model, and why it is this one:

- Links with a capacity in bytes/s, one per direction: every GPU's NIC out
  (`tx`) and the leaf port toward it (`rx`, where an incast's queue builds,
  as the emulation samples it), each rail's leaf up to the spine and the
  spine down to it, and every GPU's share of its node's interconnect out
  and in (NVLink, or in the emulation cross-memory attach). Rank g of every
  node sits on rail g; a flow between two rails crosses the spine.
- A flow is a path of links and a byte count. Each link is a FIFO that
  serves `capacity * dt` a step, split among the flows waiting at it in
  proportion to what each has queued there; what it serves moves to the
  flow's next link. A sender keeps at most `window` bytes of the flow in
  the network (what an RDMA queue pair's outstanding writes or a tcp
  socket's buffer bound): so a link whose arrivals exceed its capacity
  builds a queue, and the windows of the flows behind it bound that queue.
  No congestion control beyond the windows (the PFC-paused RoCE fabric the
  seed worries about, and what tbf does to tcp in the emulation).
  Max-min fair sharing, the usual flow-level model, has no queues at all
  and would show no incast.
- Relayed flows have two segments, each with its own window: the sender's
  hop into the relay member's slots (window: the slots a write may hold),
  and the member's hop onward (window: its connection's). The member's
  slots are host (or GPU) memory, not a fabric queue.
- Strategies as in tools/incast.py: naive (every flow at once), staggered
  (per prefill rank, one flow after another, round k toward decode rank
  (p + k) mod R), send_relay (a cross-rail flow goes over the interconnect
  to the prefill node's rank on the destination's rail, which sends it on
  its NIC), recv_relay (over the sender's own rail to the decode node's
  rank on that rail, which copies it over the interconnect).

Cases:
- `small`: the emulation of tools/incast.py (2 nodes x 4 rails, 200 Mbit/s
  NICs, the spine 2:1 or --oversubscription, 64 MiB in 16 flows for pp-tp,
  24 MiB for the 3 -> 1 incast), printed beside the medians measured in
  the emulation (docs/relay_emulation.json) where there are some.
- `cluster`: N nodes x 8 GPUs x 8 rails (400 Gbps NICs, 900 GB/s NVLink),
  half prefill (each node one PP-8 instance), half decode (each node one
  TP-8 instance); requests arrive as in the Mooncake conversation trace
  (its input lengths and arrival order, the gaps scaled to the offered
  --load: KV bytes over the decode nodes' NIC capacity), each one the
  seed's pattern: every prefill stage sends its layers' head shard t to
  decode rank t. Request completion: its last flow, from its arrival.

With --json the last line is one JSON object; for one run it has the
fields of tools/incast.py (strategy, pattern, bytes_sent, bytes_delivered,
spine_bytes, completion_p50_s, completion_p99_s, makespan_s,
decode_queue_peak_bytes) and, for the cluster, request_p50_s and
request_p99_s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import incast  # noqa: E402  (the emulation's patterns and schedules, shared with it)

STRATEGIES = incast.STRATEGIES
TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "mooncake", "conversation_trace.jsonl")
EMULATION = os.path.join(ROOT, "docs", "relay_emulation.json")


# ------------------------------------------------------------------ the cluster
@dataclass
class Cluster:
    """Links of a rail-optimised cluster: `nodes` nodes of `rails` GPUs,
    GPU g of each node on rail g. Capacities in bytes/s."""
    nodes: int
    rails: int
    nic: float                 # one NIC, each direction
    interconnect: float        # one GPU's share of its node's interconnect, each direction
    spine: float               # one leaf's link to the spine, each direction
    goodput: float = 1.0       # payload share of a link's rate (headers)

    def __post_init__(self) -> None:
        n, r = self.nodes, self.rails
        self.kinds: list[str] = []
        caps: list[float] = []

        def add(kind: str, cap: float) -> int:
            self.kinds.append(kind)
            caps.append(cap * self.goodput)
            return len(caps) - 1

        self.tx = [[add("tx", self.nic) for _ in range(r)] for _ in range(n)]
        self.rx = [[add("rx", self.nic) for _ in range(r)] for _ in range(n)]
        self.up = [add("up", self.spine) for _ in range(r)]
        self.down = [add("down", self.spine) for _ in range(r)]
        self.out = [[add("out", self.interconnect / self.goodput) for _ in range(r)] for _ in range(n)]
        self.into = [[add("in", self.interconnect / self.goodput) for _ in range(r)] for _ in range(n)]
        self.capacity = np.array(caps)

    def direct(self, src: tuple[int, int], dst: tuple[int, int]) -> list[int]:
        (sn, sg), (dn, dg) = src, dst
        if sn == dn:
            return [self.out[sn][sg], self.into[dn][dg]]
        mid = [] if sg == dg else [self.up[sg], self.down[dg]]
        return [self.tx[sn][sg], *mid, self.rx[dn][dg]]

    def route(self, src: tuple[int, int], dst: tuple[int, int], strategy: str) -> tuple[list[int], int]:
        """The flow's links and where its second segment starts (len(path):
        none): a relay applies only to a cross-rail flow between nodes."""
        (sn, sg), (dn, dg) = src, dst
        if sn == dn or sg == dg or strategy not in ("send_relay", "recv_relay"):
            p = self.direct(src, dst)
            return p, len(p)
        if strategy == "send_relay":          # over the interconnect to (sn, dg), then its rail
            a, b = [self.out[sn][sg], self.into[sn][dg]], [self.tx[sn][dg], self.rx[dn][dg]]
        else:                                  # over its own rail to (dn, sg), then the interconnect
            a, b = [self.tx[sn][sg], self.rx[dn][sg]], [self.out[dn][sg], self.into[dn][dg]]
        return a + b, len(a)


@dataclass
class Flow:
    src: tuple[int, int]
    dst: tuple[int, int]
    nbytes: int
    start: float = 0.0                 # earliest start (a request's arrival)
    after: int | None = None           # index of the flow it waits for (a staggered chain)
    request: int = 0
    path: list[int] = field(default_factory=list)
    relay_at: int = 0


# ------------------------------------------------------------------ the simulation
def simulate(cluster: Cluster, flows: Sequence[Flow], strategy: str, window: float, relay_window: float,
             dt: float | None = None, decode_nodes: Sequence[int] | None = None,
             max_steps: int = 5_000_000) -> dict[str, Any]:
    """Runs the flows to completion; returns per-flow completion times (from
    each flow's start), the spine's bytes, the decode rx ports' queue peak."""
    F = len(flows)
    for f in flows:
        f.path, f.relay_at = cluster.route(f.src, f.dst, strategy)
    H = max(len(f.path) for f in flows)
    link = np.full((F, H), -1, np.int64)
    for i, f in enumerate(flows):
        link[i, :len(f.path)] = f.path
    hops = np.array([len(f.path) for f in flows])
    relay_at = np.array([f.relay_at for f in flows])
    valid = link >= 0
    col = np.arange(H)[None, :]
    seg1 = valid & (col < relay_at[:, None])          # hops of the first segment
    seg2 = valid & ~seg1
    last = col == (hops[:, None] - 1)
    into_relay = col == (relay_at[:, None] - 1)        # served here, a flow enters its relay slots
    relayed = relay_at < hops
    cap = cluster.capacity
    nlinks = len(cap)
    if dt is None:                                      # a window's quarter through the slowest NIC
        dt = min(window / 4, 256 << 10) / (cluster.nic * cluster.goodput)
    lk = np.where(valid, link, nlinks)                  # padding -> a sink column
    flat = lk.ravel()
    cap_dt = np.append(cap * dt, np.inf)
    spine_down = np.zeros(nlinks + 1, bool)
    spine_down[cluster.down] = True
    decode_rx = np.zeros(nlinks + 1, bool)
    for n in (decode_nodes if decode_nodes is not None else range(cluster.nodes)):
        decode_rx[cluster.rx[n]] = True

    size = np.array([f.nbytes for f in flows], float)
    start = np.array([f.start for f in flows])
    after = np.array([-1 if f.after is None else f.after for f in flows])
    pending = size.copy()               # not yet sent by the source
    held = np.zeros(F)                  # in the relay member's slots
    q = np.zeros((F, H))                # queued at each hop's link
    delivered = np.zeros(F)
    began = np.full(F, np.nan)
    done = np.full(F, np.nan)
    win1 = np.where(relayed, relay_window, window)
    spine = 0.0
    peak = 0.0
    t = 0.0
    eps = 0.5
    steps = 0
    # the step works on the active flows only, gathered into compact arrays
    # whenever one starts or ends
    act = np.zeros(0, np.int64)
    while True:
        left_to_do = np.isnan(done)
        if not left_to_do.any():
            break
        ready = left_to_do & (start <= t + 1e-12)
        waiting = after >= 0
        ready[waiting] &= ~np.isnan(done[after[waiting]])
        began[ready & np.isnan(began)] = t
        act = np.nonzero(ready)[0]
        if not len(act):                # idle: jump to the next start
            nxt = start[left_to_do & (start > t)]
            if not len(nxt):
                raise RuntimeError("flows wait on flows that never finish")
            t = float(nxt.min())
            continue
        a_q, a_pending, a_held, a_del = q[act], pending[act], held[act], delivered[act]
        a_seg1, a_seg2, a_last, a_into = seg1[act], seg2[act], last[act], into_relay[act] & relayed[act, None]
        a_relayed, a_relay_at, a_win1, a_size = relayed[act], relay_at[act], win1[act], size[act]
        a_lk = lk[act]
        a_flat = a_lk.ravel()
        a_down = spine_down[a_flat]
        pass_on = ~(a_last | a_into)
        while True:
            # the sources, then the relay members, fill their segments' windows
            in1 = (a_q * a_seg1).sum(1) + a_held
            send = np.clip(np.minimum(a_pending, a_win1 - in1), 0, None)
            a_pending -= send
            a_q[:, 0] += send
            if a_relayed.any():
                in2 = (a_q * a_seg2).sum(1)
                fwd = np.where(a_relayed, np.clip(np.minimum(a_held, window - in2), 0, None), 0)
                a_held -= fwd
                rows = np.nonzero(fwd)[0]
                a_q[rows, a_relay_at[rows]] += fwd[rows]
            # every link serves its capacity, shared in proportion to what waits
            backlog = np.bincount(a_flat, weights=a_q.ravel(), minlength=nlinks + 1)
            share = np.divide(np.minimum(backlog, cap_dt), backlog, out=np.zeros_like(backlog), where=backlog > 0)
            served = a_q * share[a_lk]
            a_q -= served
            spine += float(served.ravel()[a_down].sum())
            a_del += (served * a_last).sum(1)
            a_held += (served * a_into).sum(1)
            # a queue is what a link could not serve this step (bytes passing
            # through at its rate are not queued)
            left = np.bincount(a_flat, weights=a_q.ravel(), minlength=nlinks + 1)
            peak = max(peak, float(left[decode_rx].max(initial=0)))
            a_q[:, 1:] += (served * pass_on)[:, :-1]
            t += dt
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"no end after {max_steps} steps of {dt:g} s")
            finished = a_del >= a_size - eps
            arriving = left_to_do & ~ready & (start <= t + 1e-12) & (after < 0)
            if finished.any() or arriving.any():
                break
        q[act], pending[act], held[act], delivered[act] = a_q, a_pending, a_held, a_del
        done[act[finished]] = t
    return {"done": done, "began": began, "spine_bytes": spine, "decode_queue_peak_bytes": peak,
            "bytes_delivered": float(delivered.sum()), "steps": steps, "dt": dt}


def _quantile(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, float), q)) if len(xs) else 0.0


# ------------------------------------------------------------------ the small case (the emulation's)
def small_flows(pattern: str, strategy: str, rails: int, layers: int, shard: int) -> list[Flow]:
    """tools/incast.py's flows and schedule: prefill node 0, decode node 1."""
    eflows = incast.make_flows(pattern, rails, layers, shard)
    out: list[Flow] = []
    index: dict[int, int] = {}
    for p, items in incast.schedule(eflows, "naive" if strategy != "staggered" else strategy, rails).items():
        prev: dict[int, int] = {}
        for chain, f in items:
            index[f.id] = len(out)
            out.append(Flow((0, f.src), (1, f.dst), f.nbytes,
                            after=prev.get(chain) if strategy == "staggered" else None))
            prev[chain] = index[f.id]
    return out


def run_small(strategy: str, pattern: str = "pp-tp", rails: int = 4, layers: int = 8, shard_kib: int = 2048,
              nic_mbit: float = 200, oversubscription: float = 2.0, interconnect: float = 3.8e9,
              window: float = 512 << 10, relay_window: float = 16 << 20, goodput: float = 1448 / 1514,
              dt: float | None = None) -> dict[str, Any]:
    """The emulation's small case. Defaults: its NICs and spine, tcp over
    Ethernet's payload share, the lanes hop's measured rate (relay_hop.py:
    3.8 GB/s) as the interconnect, a relay write's 4 slots of 4 MiB, and a
    tcp window fitted to the 3 -> 1 incast's measured queue peak."""
    nic = nic_mbit * 1e6 / 8
    cluster = Cluster(2, rails, nic, interconnect, 2 * nic / oversubscription, goodput)
    flows = small_flows(pattern, strategy, rails, layers, shard_kib << 10)
    res = simulate(cluster, flows, strategy, window, relay_window, dt=dt, decode_nodes=[1])
    times = list(res["done"])
    return {"strategy": strategy, "pattern": pattern, "oversubscription": oversubscription, "flows": len(flows),
            "bytes_sent": sum(f.nbytes for f in flows), "bytes_delivered": round(res["bytes_delivered"]),
            "spine_bytes": round(res["spine_bytes"]), "completion_p50_s": round(_quantile(times, 0.5), 4),
            "completion_p99_s": round(_quantile(times, 0.99), 4), "makespan_s": round(max(times), 4),
            "decode_queue_peak_bytes": round(res["decode_queue_peak_bytes"])}


def small_table(oversubscriptions: Sequence[float] = (2.0, 4.0), **kw: Any) -> list[dict[str, Any]]:
    """Every strategy and pattern of the small case, beside the emulation's
    medians (docs/relay_emulation.json) where they were measured."""
    measured = {}
    if os.path.exists(EMULATION):
        with open(EMULATION) as fh:
            for row in json.load(fh)["runs"]:
                measured[(row["pattern"], float(row["oversubscription"]), row["strategy"])] = row
    rows = []
    for over in oversubscriptions:
        for pattern in ("pp-tp", "incast"):
            for s in STRATEGIES:
                sim = run_small(s, pattern, oversubscription=over, **kw)
                m = measured.get((pattern, over, s))
                rows.append({**sim, "emulated": m})
    return rows


# ------------------------------------------------------------------ the cluster case
def trace_requests(n: int, path: str = TRACE) -> list[tuple[float, int]]:
    """The first n requests of the Mooncake trace: (arrival s, input tokens)."""
    out = []
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            out.append((r["timestamp"] / 1000.0, int(r["input_length"])))
            if len(out) == n:
                break
    return out


CLUSTER_PATTERNS = ("pp-tp", "pp-tp-rounds")


def cluster_flows(cluster: Cluster, strategy: str, load: float, requests: int, kv_bytes_per_token: int,
                  trace: str = TRACE, pattern: str = "pp-tp") -> tuple[list[Flow], list[int]]:
    """Requests from the trace, the gaps scaled to `load`: prefill nodes are
    the first half, decode nodes the second; request i goes from prefill
    instance i mod P to decode instance (i * 7 + 3) mod D (spread, so no
    pair is always together); every prefill stage g sends its head shard t
    to decode rank t. pp-tp: a stage's flows all at once (staggered: one
    after another from rank g on, as incast.schedule does); pp-tp-rounds:
    a stage's flows one after another in rank order, as a connector that
    loops over the decode ranks sends them, so that in round k every stage
    sends to decode rank k (the seed's incast; staggered: round k toward
    rank (g + k) mod R, the seed's first idea)."""
    if pattern not in CLUSTER_PATTERNS:
        raise ValueError(f"pattern {pattern!r}: one of {', '.join(CLUSTER_PATTERNS)}")
    reqs = trace_requests(requests, trace)
    R = cluster.rails
    P = cluster.nodes // 2
    D = cluster.nodes - P
    decode = list(range(P, cluster.nodes))
    kv = [tokens * kv_bytes_per_token for _, tokens in reqs]
    span = max(reqs[-1][0] - reqs[0][0], 1e-9)
    # offered load: the requests' KV bytes over what the decode NICs take in the trace's span
    scale = (sum(kv) / (D * R * cluster.nic * cluster.goodput * load)) / span
    flows: list[Flow] = []
    for i, ((ts, _), nbytes) in enumerate(zip(reqs, kv)):
        pn, dn = i % P, decode[(i * 7 + 3) % D]
        shard = max(1, nbytes // (R * R))
        arrive = (ts - reqs[0][0]) * scale
        for g in range(R):
            prev = None
            order = [(g + k) % R for k in range(R)] if strategy == "staggered" else range(R)
            chained = strategy == "staggered" or pattern == "pp-tp-rounds"
            for t in order:
                flows.append(Flow((pn, g), (dn, t), shard, start=arrive, request=i,
                                  after=prev if chained else None))
                prev = len(flows) - 1
    return flows, decode


def run_cluster(strategy: str, load: float, nodes: int = 16, rails: int = 8, nic_gbps: float = 400,
                nvlink_gbs: float = 900, oversubscription: float = 2.0, requests: int = 200,
                kv_bytes_per_token: int = 327_680, window: float = 1 << 20, relay_window: float | None = None,
                dt: float | None = None, trace: str = TRACE, pattern: str = "pp-tp") -> dict[str, Any]:
    """One strategy at one load. kv_bytes_per_token: K and V of a 70B-class
    model with grouped-query attention (80 layers x 8 KV heads x 128 x 2
    bytes x 2); nvlink_gbs: one GPU's NVLink, both directions together
    (H100/H200: 900); window: an RDMA connection's outstanding writes;
    relay_window: a relayed flow's bytes in its first segment, its slots
    (default: the same as window; 16-32 MiB, what one kvflow relay write
    may hold, raises the p99 at high load by a fifth in this model: FIFO
    queues share by what waits, so deep windows let the oldest flows hog)."""
    relay_window = window if relay_window is None else relay_window
    nic = nic_gbps * 1e9 / 8
    cluster = Cluster(nodes, rails, nic, nvlink_gbs * 1e9 / 2, nodes * nic / oversubscription)
    flows, decode = cluster_flows(cluster, strategy, load, requests, kv_bytes_per_token, trace, pattern)
    res = simulate(cluster, flows, strategy, window, relay_window, dt=dt, decode_nodes=decode)
    n = max(f.request for f in flows) + 1
    arrive = np.full(n, np.inf)
    end = np.zeros(n)
    for f, d, b in zip(flows, res["done"], res["began"]):
        arrive[f.request] = min(arrive[f.request], f.start)
        end[f.request] = max(end[f.request], d)
    latency = end - arrive
    flow_times = [d - f.start for f, d in zip(flows, res["done"])]
    return {"strategy": strategy, "pattern": pattern, "load": load, "nodes": nodes, "rails": rails,
            "oversubscription": oversubscription, "requests": n, "flows": len(flows),
            "bytes_sent": sum(f.nbytes for f in flows), "bytes_delivered": round(res["bytes_delivered"]),
            "spine_bytes": round(res["spine_bytes"]),
            "completion_p50_s": round(_quantile(flow_times, 0.5), 6),
            "completion_p99_s": round(_quantile(flow_times, 0.99), 6),
            "request_p50_s": round(_quantile(latency, 0.5), 6), "request_p99_s": round(_quantile(latency, 0.99), 6),
            "makespan_s": round(float(np.max(res["done"])), 6),
            "decode_queue_peak_bytes": round(res["decode_queue_peak_bytes"]),
            "request_latencies_s": [round(float(x), 6) for x in latency]}


def sweep(loads: Sequence[float], **kw: Any) -> list[dict[str, Any]]:
    return [run_cluster(s, load, **kw) for load in loads for s in STRATEGIES]


def plot(rows: list[dict[str, Any]], folder: str) -> list[str]:
    """Two PNGs: request-completion CDFs per strategy at the highest load,
    and the decode NIC's queue peak (and request p99) against load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    top = max(r["load"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in STRATEGIES:
        lat = sorted(next(r for r in rows if r["strategy"] == s and r["load"] == top)["request_latencies_s"])
        ax.plot([x * 1e3 for x in lat], np.arange(1, len(lat) + 1) / len(lat), label=s)
    first = rows[0]
    ax.set_xlabel("request KV transfer completion (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{first['pattern']}, {first['nodes']} nodes x {first['rails']} rails, "
                 f"spine {first['oversubscription']:g}:1, load {top:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    cdf = os.path.join(folder, "flowsim_cdf.png")
    fig.tight_layout()
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in STRATEGIES:
        mine = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["load"])
        a1.plot([r["load"] for r in mine], [r["decode_queue_peak_bytes"] / 2**20 for r in mine], "o-", label=s)
        a2.plot([r["load"] for r in mine], [r["request_p99_s"] * 1e3 for r in mine], "o-", label=s)
    a1.set_xlabel("offered load (of the decode NICs)")
    a1.set_ylabel("decode NIC port queue peak (MiB)")
    a2.set_xlabel("offered load (of the decode NICs)")
    a2.set_ylabel("request completion p99 (ms)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    queue = os.path.join(folder, "flowsim_queue.png")
    fig.tight_layout()
    fig.savefig(queue, dpi=120)
    plt.close(fig)
    return [cdf, queue]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("small", "cluster"), default="small")
    ap.add_argument("--strategy", choices=STRATEGIES, default=None, help="one strategy (default: all)")
    ap.add_argument("--pattern", choices=("pp-tp", "incast", "aligned", "pp-tp-rounds"), default="pp-tp",
                    help="small: pp-tp, incast, aligned; cluster: pp-tp, pp-tp-rounds")
    ap.add_argument("--oversubscription", type=float, default=None)
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--sweep", action="store_true", help="cluster: every strategy at --loads")
    ap.add_argument("--loads", default="0.2,0.4,0.6,0.8,0.9")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--window-kib", type=float, default=None, help="a connection's bytes in the network")
    ap.add_argument("--relay-window-kib", type=float, default=None, help="a relayed flow's first segment's")
    ap.add_argument("--plot", default=None, help="cluster sweep: write PNGs into this folder")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    extra = {} if args.window_kib is None else {"window": args.window_kib * 1024}
    if args.relay_window_kib is not None:
        extra["relay_window"] = args.relay_window_kib * 1024
    if args.case == "small":
        overs = (args.oversubscription,) if args.oversubscription else (2.0, 4.0)
        if args.strategy:
            res: Any = run_small(args.strategy, args.pattern, oversubscription=overs[0], **extra)
        else:
            res = small_table(overs, **extra)
            for r in res:
                m = r["emulated"] or {}
                print(f"{r['pattern']:>7} {r['oversubscription']:g}:1 {r['strategy']:>11}: p99 "
                      f"{r['completion_p99_s']:.3f} s (emulated {m.get('completion_p99_s', '-')}), p50 "
                      f"{r['completion_p50_s']:.3f} ({m.get('completion_p50_s', '-')}), spine "
                      f"{r['spine_bytes'] / 1e6:.2f} MB ({m.get('spine_mb', '-')}), queue peak "
                      f"{r['decode_queue_peak_bytes'] / 1e3:.1f} KB ({m.get('decode_queue_peak_kb', '-')})")
    else:
        if args.pattern not in CLUSTER_PATTERNS:
            ap.error(f"--pattern {args.pattern}: the cluster case has {', '.join(CLUSTER_PATTERNS)}")
        kw = dict(nodes=args.nodes, requests=args.requests, pattern=args.pattern, **extra)
        if args.oversubscription:
            kw["oversubscription"] = args.oversubscription
        if args.sweep:
            res = sweep([float(x) for x in args.loads.split(",")], **kw)
            for r in res:
                print(f"load {r['load']:.2f} {r['strategy']:>11}: request p50 {r['request_p50_s'] * 1e3:8.2f} ms "
                      f"p99 {r['request_p99_s'] * 1e3:8.2f} ms, spine {r['spine_bytes'] / 1e9:8.2f} GB, "
                      f"decode queue peak {r['decode_queue_peak_bytes'] / 2**20:7.2f} MiB")
            if args.plot:
                for p in plot(res, args.plot):
                    print("wrote", p)
            for r in res:
                r.pop("request_latencies_s")
        else:
            res = run_cluster(args.strategy or "naive", args.load, **kw)
            res.pop("request_latencies_s")
    if args.json:
        print(json.dumps(res))
    elif not isinstance(res, list):
        for k, v in res.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
