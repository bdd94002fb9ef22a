#!/usr/bin/env python3
"""An emulated rail-optimised cluster in network namespaces, and KV
transfer patterns run across it with real kvflow engines (issue 21: the
ground the PXN relay is to be judged on).

    python3 tools/incast.py --strategy naive --json
    python3 tools/incast.py --strategy staggered --pattern pp-tp --nodes 2 --rails 4 --json
    python3 tools/incast.py --pattern aligned --strategy naive        # every flow on its own rail

The cluster: `--nodes` nodes of `--rails` ranks each; rank r of every
node has one NIC, on rail r: a veth pair into rail r's leaf switch (a
bridge in a namespace of its own), rate-limited with `tbf` at `--nic-mbit`
in both directions (the NIC's egress, and the leaf port's egress toward
it: where an incast's queue builds, read with `tc -s qdisc`). The leaves
are joined by a spine router (a namespace) over links limited to
`--spine-mbit` (default: a leaf's NICs together divided by
`--oversubscription`, 2:1), and routed, so that a flow between two rails
really crosses the spine and a rail-aligned one never does. Each rank is
a process running one kvflow engine (tcp) on its NIC's address.

Patterns: `pp-tp` (the seed's): the first node's ranks are pipeline
stages of a prefill, each holding `--layers`/R layers; the second node's
are a decode's tensor-parallel ranks, each needing its head shard of every
layer; every prefill rank writes its layers' shard d to decode rank d, so
each decode rank receives from every prefill rank, R-1 of them across
rails. `aligned`: prefill rank r writes only to decode rank r (no spine).
`incast`: the seed's 3 -> 1, prefill ranks 0, 2, 3 (of 4) all writing
their shard of every layer to decode rank 0 at once.

Strategies: `naive` (every flow starts at once), `staggered` (round k:
prefill rank p writes to decode rank (p + k) mod R; a rank starts its next
round when its flow of this one completed: the seed's first idea),
`send_relay` (the flows of naive, with the ranks in relay groups, one per
node: kvflow.paths.relay sends each cross-rail flow through the prefill
node's rank on the destination's rail), `recv_relay` (the same groups with
side="receive": each cross-rail flow goes over its sender's own rail to
the decode node's rank on that rail, which copies it to the destination
inside the node).

Each node's ranks run in a pid namespace of their own, behind one launcher
process: kvflow then sees the ranks of one node as one host (cross-memory
attach between them, the stand-in for the node's NVLink) and other nodes
as other hosts (tcp over the emulated links).

With --json the last line is one JSON object: strategy, pattern,
bytes_sent, bytes_verified, spine_bytes (bytes the spine's links carried,
from their counters), completion_p50_s / completion_p99_s (of the flows,
from the common start), makespan_s, decode_queue_peak_bytes (the largest
backlog sampled on the leaf ports toward decode ranks), drops (tbf drops
on every limited link), relayed_bytes, the transports the prefill ranks
used toward the decode ranks, and the cluster's shape.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MARK = "@@INCAST "
PORT = 7500
STRATEGIES = ("naive", "staggered", "send_relay", "recv_relay")
RELAYED = {"send_relay": "send", "recv_relay": "receive"}     # strategy -> RelayGroup side
PATTERNS = ("pp-tp", "aligned", "incast")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r


def _ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", ns, *args, check=check)


# ------------------------------------------------------------------ the cluster
class Cluster:
    """The namespaces, links, limits and routes (see the module's text).
    Addresses: rail r is 198.18.(10+r).0/24 with its leaf at .1 and node
    n's rank at .(10+n); leaf r reaches the spine over 198.18.(40+r).0/24
    (spine .1, leaf .2)."""

    def __init__(self, nodes: int = 2, rails: int = 2, nic_mbit: int = 200, spine_mbit: int | None = None,
                 oversubscription: float = 2.0, tag: str | None = None) -> None:
        if nodes < 2 or not 1 <= rails <= 8:
            raise ValueError("an incast cluster needs 2 or more nodes and 1 to 8 rails")
        self.nodes, self.rails, self.nic_mbit = nodes, rails, nic_mbit
        self.spine_mbit = spine_mbit or max(1, int(nodes * nic_mbit / oversubscription))
        tag = tag or f"{os.getpid() % 10000}"
        self.spine = f"kvfi{tag}s"
        self.leaves = [f"kvfi{tag}l{r}" for r in range(rails)]
        self.ranks = {(n, r): f"kvfi{tag}n{n}r{r}" for n in range(nodes) for r in range(rails)}

    def ip(self, node: int, rail: int) -> str:
        return f"198.18.{10 + rail}.{10 + node}"

    def up(self) -> "Cluster":
        self.down()
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    def _tbf(self, ns: str, dev: str, mbit: int) -> None:
        # burst: a few packets at this rate; latency bounds the queue (what
        # a NIC's buffer would): a backlog past it drops
        _ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
            "burst", "32kb", "latency", "200ms")

    def _create(self) -> None:
        for ns in (self.spine, *self.leaves, *self.ranks.values()):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _ns(self.spine, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for r, leaf in enumerate(self.leaves):
            _ns(leaf, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "-n", leaf, "link", "add", "name", "sw", "type", "bridge")
            _run("ip", "-n", leaf, "addr", "add", f"198.18.{10 + r}.1/24", "dev", "sw")
            _run("ip", "-n", leaf, "link", "set", "sw", "up")
            # the uplink: leaf <-> spine, limited both ways
            _run("ip", "-n", leaf, "link", "add", "name", "uplink", "type", "veth", "peer", "name", f"leaf{r}",
                 "netns", self.spine)
            _run("ip", "-n", leaf, "addr", "add", f"198.18.{40 + r}.2/24", "dev", "uplink")
            _run("ip", "-n", self.spine, "addr", "add", f"198.18.{40 + r}.1/24", "dev", f"leaf{r}")
            _run("ip", "-n", leaf, "link", "set", "uplink", "up")
            _run("ip", "-n", self.spine, "link", "set", f"leaf{r}", "up")
            _run("ip", "-n", leaf, "route", "add", "default", "via", f"198.18.{40 + r}.1")
            _run("ip", "-n", self.spine, "route", "add", f"198.18.{10 + r}.0/24", "via", f"198.18.{40 + r}.2")
            self._tbf(leaf, "uplink", self.spine_mbit)
            self._tbf(self.spine, f"leaf{r}", self.spine_mbit)
            for n in range(self.nodes):
                ns = self.ranks[(n, r)]
                _run("ip", "-n", leaf, "link", "add", "name", f"port{n}", "type", "veth", "peer", "name", "nic", "netns", ns)
                _run("ip", "-n", leaf, "link", "set", f"port{n}", "master", "sw", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip(n, r)}/24", "dev", "nic")
                _run("ip", "-n", ns, "link", "set", "nic", "up")
                _run("ip", "-n", ns, "route", "add", "default", "via", f"198.18.{10 + r}.1")
                self._tbf(ns, "nic", self.nic_mbit)
                self._tbf(leaf, f"port{n}", self.nic_mbit)

    def down(self) -> None:
        for ns in (*self.ranks.values(), *self.leaves, self.spine):
            _run("ip", "netns", "del", ns, check=False)

    def spine_bytes(self) -> int:
        """Bytes the spine has sent to the leaves so far (its links' counters)."""
        links = json.loads(_run("ip", "-n", self.spine, "-s", "-j", "link", "show").stdout)
        return sum(int(l["stats64"]["tx"]["bytes"]) for l in links if l["ifname"].startswith("leaf"))

    def qdiscs(self, ns: str) -> list[dict[str, Any]]:
        return json.loads(_ns(ns, "tc", "-s", "-j", "qdisc", "show").stdout or "[]")

    def drops(self) -> int:
        return sum(int(q.get("drops", 0)) for ns in (self.spine, *self.leaves, *self.ranks.values())
                   for q in self.qdiscs(ns) if q.get("kind") == "tbf")

    def decode_backlog(self, decode_node: int) -> int:
        """Bytes queued now on the leaf ports toward `decode_node`'s ranks."""
        total = 0
        for leaf in self.leaves:
            out = _ns(leaf, "tc", "-s", "-j", "qdisc", "show", "dev", f"port{decode_node}", check=False).stdout
            total += sum(int(q.get("backlog", 0)) for q in json.loads(out or "[]") if q.get("kind") == "tbf")
        return total


# ------------------------------------------------------------------ a rank
def pattern_bytes(rank: int, size: int) -> bytes:
    """The deterministic contents of prefill rank `rank`'s region."""
    import numpy as np
    return np.random.default_rng(1000 + rank).integers(0, 256, size, dtype=np.uint8).tobytes()


async def serve_rank(listen: str, size: int, fill_rank: int | None, relay: str | None = None) -> None:
    """One rank (inside its namespace): an engine on its NIC's address with
    one region ("kv", filled with pattern_bytes when it is a prefill rank);
    JSON commands on stdin, answers on stdout (MARK lines):
    {"flows": [...]} writes them (strategy order given by the driver) and
    answers each flow's completion time from the command's arrival;
    {"sha": [[off, n], ...]} answers the hashes of those ranges."""
    import numpy as np
    import kvflow
    # protocols chosen per peer: the ranks of one emulated node share a pid
    # namespace (one host: cross-memory attach between them), other nodes'
    # ranks are other hosts (tcp over the emulated links)
    group = None
    if relay is not None:
        name, rank, rail, side, folder = relay.split(":", 4)
        group = kvflow.RelayGroup(name, int(rank), int(rail), directory=folder, side=side)
    async with kvflow.Engine(listen, relay=group, protocols=("local", "tcp")) as eng:
        buf = np.zeros(size, np.uint8)
        if fill_rank is not None:
            buf[:] = np.frombuffer(pattern_bytes(fill_rank, size), np.uint8)
        region = eng.register(buf, name="kv")
        print(MARK + json.dumps({"address": eng.address, "addr": region.addr}), flush=True)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        peers: dict[str, Any] = {}
        while line := await reader.readline():
            cmd = json.loads(line)
            if "sha" in cmd:
                print(MARK + json.dumps({"sha": [hashlib.sha256(buf[o:o + n]).hexdigest() for o, n in cmd["sha"]]}),
                      flush=True)
                continue
            for f in cmd["flows"]:
                if f["to"] not in peers:
                    peers[f["to"]] = await eng.connect(f["to"])
            t0 = time.monotonic()
            done: dict[int, float] = {}

            async def flow(f: dict[str, Any]) -> None:
                la = [region.addr + o for o in f["local"]]
                await peers[f["to"]].write(la, f["remote"], f["lengths"])
                done[f["id"]] = time.monotonic() - t0

            async def chain(flows: list[dict[str, Any]]) -> None:
                for f in flows:                     # one after another: a staggered rank's rounds
                    await flow(f)

            groups: dict[int, list[dict[str, Any]]] = {}
            for f in cmd["flows"]:
                groups.setdefault(f["chain"], []).append(f)
            await asyncio.gather(*(chain(g) for g in groups.values()))
            print(MARK + json.dumps({"done": done, "relay": eng.relay_stats(),
                                     "transports": {a: p.transport for a, p in peers.items()}}), flush=True)


async def serve_node(ranks: list[list[str]]) -> None:
    """One emulated node (pid 1 of a pid namespace of its own): starts its
    ranks (each `ip netns exec NS incast.py rank ...`) and joins their
    stdio to its own: lines in are {"rank": i, ...} for rank i, lines out
    are MARK lines with "rank" added."""
    procs = []
    for args in ranks:
        procs.append(await asyncio.create_subprocess_exec(*args, stdin=subprocess.PIPE, stdout=subprocess.PIPE))

    async def pump(i: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            if line.startswith(MARK.encode()):
                msg = json.loads(line[len(MARK):])
                print(MARK + json.dumps({**msg, "rank": i}), flush=True)

    pumps = [asyncio.get_running_loop().create_task(pump(i, p)) for i, p in enumerate(procs)]
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        msg = json.loads(line)
        proc = procs[msg.pop("rank")]
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(msg) + "\n").encode())
        await proc.stdin.drain()
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    await asyncio.gather(*(p.wait() for p in procs))
    for t in pumps:
        t.cancel()


class Node:
    """One emulated node's ranks, in a pid namespace of their own (so that
    kvflow sees the ranks of one node as one host, and other nodes as other
    hosts), behind one launcher process."""

    def __init__(self, cluster: Cluster, node: int, ranks: list[list[str]]) -> None:
        self.cluster, self.node, self.ranks = cluster, node, ranks
        self.proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[int, asyncio.Queue[dict[str, Any]]] = {i: asyncio.Queue() for i in range(len(ranks))}
        self._pump: asyncio.Task[None] | None = None

    async def start(self) -> list[dict[str, Any]]:
        self.proc = await asyncio.create_subprocess_exec(
            "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, os.path.abspath(__file__),
            "node", json.dumps(self.ranks), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": ROOT})
        self._pump = asyncio.get_running_loop().create_task(self._read())
        return [await self.answer(i, 120) for i in range(len(self.ranks))]

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            if line.startswith(MARK.encode()):
                msg = json.loads(line[len(MARK):])
                self._waiting[msg.pop("rank")].put_nowait(msg)
        for q in self._waiting.values():
            q.put_nowait({"gone": True})

    async def answer(self, rank: int, timeout: float) -> dict[str, Any]:
        msg = await asyncio.wait_for(self._waiting[rank].get(), timeout)
        if msg.get("gone"):
            raise RuntimeError(f"node {self.node}'s rank {rank} exited")
        return msg

    async def ask(self, rank: int, cmd: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**cmd, "rank": rank}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.answer(rank, timeout)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._pump is not None:
            self._pump.cancel()


# ------------------------------------------------------------------ patterns and strategies
@dataclass
class Flow:
    id: int
    src: int            # prefill rank (node 0)
    dst: int            # decode rank (node 1)
    local: list[int]    # offsets in the prefill rank's region
    remote: list[int]   # offsets in the decode rank's region
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def make_flows(pattern: str, rails: int, layers: int, shard: int) -> list[Flow]:
    """pp-tp: prefill rank p holds layers [p*L/R, (p+1)*L/R), laid out
    layer by layer, each layer's R head shards side by side; decode rank d
    holds shard d of every layer, layer by layer. aligned: p -> p only.
    incast: the seed's picture, prefill ranks 0, 2, 3, ... (all but rank 1
    where there are three or more) filling decode rank 0 at once."""
    per = layers // rails
    flows = []
    for p in range(rails):
        for d in range(rails):
            if pattern == "aligned" and d != p:
                continue
            if pattern == "incast" and (d != 0 or (rails >= 3 and p == 1)):
                continue
            mine = range(p * per, (p + 1) * per)
            flows.append(Flow(len(flows), p, d,
                              [((l - p * per) * rails + d) * shard for l in mine],
                              [l * shard for l in mine], [shard] * per))
    return flows


def schedule(flows: list[Flow], strategy: str, rails: int) -> dict[int, list[tuple[int, Flow]]]:
    """Per prefill rank, its flows with a chain number: flows of one chain
    run one after another, chains at once. naive: a chain per flow;
    staggered: one chain per rank, round k toward decode rank (p+k) mod R."""
    out: dict[int, list[tuple[int, Flow]]] = {}
    for f in flows:
        out.setdefault(f.src, [])
    if strategy in ("naive", "send_relay", "recv_relay"):     # the relay reroutes inside the engines
        for f in flows:
            out[f.src].append((f.id, f))
    elif strategy == "staggered":
        for p in out:
            mine = {f.dst: f for f in flows if f.src == p}
            for k in range(rails):
                f = mine.get((p + k) % rails)
                if f is not None:
                    out[p].append((0, f))
    else:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))] if xs else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster(args.nodes, args.rails, args.nic_mbit, args.spine_mbit, args.oversubscription).up()
    shard = args.shard_kib << 10
    flows = make_flows(args.pattern, args.rails, args.layers, shard)
    prefill_size = (args.layers // args.rails) * args.rails * shard
    decode_size = args.layers * shard
    folder = tempfile.mkdtemp(prefix="kvflow-incast-")
    side = RELAYED.get(args.strategy)

    def rank_args(node: int, rail: int, size: int, fill: int | None) -> list[str]:
        a = ["ip", "netns", "exec", cluster.ranks[(node, rail)], sys.executable, os.path.abspath(__file__), "rank",
             "--listen", f"{cluster.ip(node, rail)}:{PORT}", "--size", str(size)]
        if fill is not None:
            a += ["--fill-rank", str(fill)]
        if side is not None:
            a += ["--relay", f"node{node}:{rail}:{rail}:{side}:{folder}"]
        return a

    nodes = [Node(cluster, 0, [rank_args(0, r, prefill_size, r) for r in range(args.rails)]),
             Node(cluster, 1, [rank_args(1, r, decode_size, None) for r in range(args.rails)])]
    try:
        infos = await asyncio.gather(*(n.start() for n in nodes))
        plan = schedule(flows, args.strategy, args.rails)
        decode = infos[1]
        cmds = {p: {"flows": [{"id": f.id, "chain": chain, "to": decode[f.dst]["address"],
                               "local": f.local, "remote": [decode[f.dst]["addr"] + o for o in f.remote],
                               "lengths": f.lengths} for chain, f in items]}
                for p, items in plan.items()}
        spine0, drops0 = cluster.spine_bytes(), cluster.drops()
        peak = 0
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, await asyncio.to_thread(cluster.decode_backlog, 1))
                await asyncio.sleep(0.01)

        sampler = asyncio.get_running_loop().create_task(sample())
        started = time.monotonic()
        answers = await asyncio.gather(*(nodes[0].ask(p, cmd) for p, cmd in cmds.items()))
        makespan = time.monotonic() - started
        sampling = False
        await sampler
        times = [float(t) for a in answers for t in a["done"].values()]
        relayed = sum(int((a.get("relay") or {}).get("relayed_bytes", 0)) for a in answers)
        transports = sorted({t for a in answers for t in a.get("transports", {}).values()})
        spine = cluster.spine_bytes() - spine0
        drops = cluster.drops() - drops0
        # verify every byte: each decode rank's ranges against the prefill pattern
        verified = 0
        for d in range(args.rails):
            mine = [f for f in flows if f.dst == d]
            ranges = [[o, n] for f in mine for o, n in zip(f.remote, f.lengths)]
            got = (await nodes[1].ask(d, {"sha": ranges}))["sha"]
            k = 0
            for f in mine:
                src = pattern_bytes(f.src, prefill_size)
                for lo, n in zip(f.local, f.lengths):
                    if hashlib.sha256(src[lo:lo + n]).hexdigest() == got[k]:
                        verified += n
                    k += 1
    finally:
        await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)
        cluster.down()
        shutil.rmtree(folder, ignore_errors=True)
    return {"strategy": args.strategy, "pattern": args.pattern, "nodes": args.nodes, "rails": args.rails,
            "nic_mbit": args.nic_mbit, "spine_mbit": cluster.spine_mbit, "flows": len(flows),
            "bytes_sent": sum(f.nbytes for f in flows), "bytes_verified": verified, "spine_bytes": spine,
            "completion_p50_s": round(_quantile(times, 0.5), 4), "completion_p99_s": round(_quantile(times, 0.99), 4),
            "makespan_s": round(makespan, 4), "decode_queue_peak_bytes": peak, "drops": drops,
            "relayed_bytes": relayed, "transports": transports}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        ap = argparse.ArgumentParser(prog="incast.py rank")
        ap.add_argument("--listen", required=True)
        ap.add_argument("--size", type=int, required=True)
        ap.add_argument("--fill-rank", type=int, default=None)
        ap.add_argument("--relay", default=None, help="group:rank:rail:side:folder")
        a = ap.parse_args(argv[1:])
        asyncio.run(serve_rank(a.listen, a.size, a.fill_rank, a.relay))
        return 0
    if argv[:1] == ["node"]:
        asyncio.run(serve_node(json.loads(argv[1])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="naive", choices=STRATEGIES)
    ap.add_argument("--pattern", default="pp-tp", choices=PATTERNS)
    ap.add_argument("--nodes", type=int, default=2, help="nodes (the first prefill, the second decode)")
    ap.add_argument("--rails", type=int, default=2, help="ranks and rails per node")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-kib", type=int, default=256, help="one layer's head shard for one decode rank")
    ap.add_argument("--nic-mbit", type=int, default=200)
    ap.add_argument("--spine-mbit", type=int, default=None)
    ap.add_argument("--oversubscription", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.layers % args.rails:
        ap.error("--layers must be a multiple of --rails")
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
    return 0 if res["bytes_verified"] == res["bytes_sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
