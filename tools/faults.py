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
import contextlib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import kvflow  # noqa: E402
import kvflow.control.wire  # noqa: E402

SUBNETS = ("198.19.20", "198.19.21", "198.19.22")     # control, rail 0, rail 1
TARGET_PORT = 7400
REGION = 32 << 20
MARK = "@@FAULTS "


# ------------------------------------------------------------------ namespace
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `ip ARGS`; with `check`, a failure raises RuntimeError naming
    the command and saying what ip said (its stderr)."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None: tries, in a namespace
    of its own (deleted with all in it), each kind of thing Topology.up()
    creates: a namespace, a bridge, a veth pair."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"kvfprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        for what, args in (("bridge", ("link", "add", "kvfbr", "type", "bridge")),
                           ("veth pair", ("link", "add", "kvfa", "type", "veth", "peer", "name", "kvfb"))):
            r = _ip("-n", name, *args, check=False)
            if r.returncode:
                return f"cannot create a {what}: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


class Topology:
    """Hosts as network namespaces, joined with this host by three networks
    (control, rail 0, rail 1), each a bridge in a switch namespace of its
    own (so this host's firewall never sees their traffic). This host is .1
    on every network, namespace host k is .(k+2); inside a namespace the
    links are called ctl, rail0, rail1 (as on identical machines)."""

    LINKS = ("ctl", "rail0", "rail1")

    def __init__(self, hosts: int = 2, tag: str | None = None) -> None:
        # names carry a tag (default: this process's) so that two
        # topologies, or two runs, never remove each other's
        tag = tag or f"{os.getpid() % 100000}"
        self.switch = f"kvfs{tag}"
        self.hosts = [f"kvff{tag}" if k == 0 else f"kvff{tag}n{k}" for k in range(hosts)]
        self.ns = self.hosts[0]
        self.links = [f"kv{tag}{c}" for c in "cab"]                 # this host's links

    def host(self, i: int) -> str:
        return f"{SUBNETS[i]}.1"

    def target(self, i: int, host: int = 0) -> str:
        return f"{SUBNETS[i]}.{host + 2}"

    def up(self) -> "Topology":
        """Creates it (after removing what a previous run left); on a
        failure removes what it created and raises RuntimeError (what ip
        said)."""
        self.down()
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    def _create(self) -> None:
        for ns in (self.switch, *self.hosts):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i in range(3):
            _ip("-n", self.switch, "link", "add", f"br{i}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br{i}", "up")
            _ip("link", "add", self.links[i], "type", "veth", "peer", "name", f"h{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"h{i}", "master", f"br{i}", "up")
            _ip("addr", "add", f"{self.host(i)}/24", "dev", self.links[i])
            _ip("link", "set", self.links[i], "up")
            for k, ns in enumerate(self.hosts):
                _ip("-n", self.switch, "link", "add", f"p{k}x{i}", "type", "veth", "peer", "name", self.LINKS[i],
                    "netns", ns)
                _ip("-n", self.switch, "link", "set", f"p{k}x{i}", "master", f"br{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.target(i, k)}/24", "dev", self.LINKS[i])
                _ip("-n", ns, "link", "set", self.LINKS[i], "up")

    async def set_rail(self, rail: int, up: bool, host: int = 0) -> float:
        """Takes rail `rail` of namespace host `host` down or up (its switch
        port: the host sees its link lose carrier), without blocking the
        event loop (the engine under test shares it). Returns how long `ip`
        took."""
        return await self.set_link(1 + rail, up, host)

    async def set_link(self, link: int, up: bool, host: int = 0) -> float:
        """set_rail() for any of a host's links (0 is its control link)."""
        t0 = time.monotonic()
        port = f"p{host}x{link}"
        p = await asyncio.create_subprocess_exec("ip", "-n", self.switch, "link", "set", port,
                                                 "up" if up else "down", stderr=asyncio.subprocess.PIPE)
        _, err = await p.communicate()
        if p.returncode:
            raise RuntimeError(f"ip -n {self.switch} link set {port} failed: {err.decode().strip()}")
        return time.monotonic() - t0

    async def netem(self, rail: int, spec: str | None) -> None:
        """Puts netem (`spec`, e.g. "loss 1% delay 5ms") on both ends of a
        rail between this host and host 0, or removes it (None)."""
        for where, dev in (([], self.links[1 + rail]), (["-n", self.ns], self.LINKS[1 + rail])):
            args = ["tc", *where, "qdisc", "replace" if spec else "del", "dev", dev, "root"]
            if spec:
                args += ["netem", *spec.split()]
            p = await asyncio.create_subprocess_exec(*args, stderr=asyncio.subprocess.PIPE)
            _, err = await p.communicate()
            if p.returncode and spec:
                raise RuntimeError(f"{' '.join(args)}: {err.decode().strip()}")

    def down(self) -> None:
        for a in self.links:
            _ip("link", "del", a, check=False)
        for ns in (*self.hosts, self.switch):
            _ip("netns", "del", ns, check=False)


# --------------------------------------------------------------------- target
async def _stdin_lines() -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def serve_target(listen: str, rails: list[str] | None, size: int, keepalive: float,
                       hash_port: int | None = None, receive_window: int | None = None) -> None:
    """The target (runs inside the namespace): registers `size` bytes as
    "kv", says where on stdout, then answers hash requests from stdin (and,
    with `hash_port`, from tcp clients on the listen host: an initiator in
    another namespace verifies its writes there)."""
    async with kvflow.Engine(listen, rails=rails, protocols=("tcp",), keepalive=keepalive,
                             receive_window=receive_window) as eng:
        buf = np.zeros(size, dtype=np.uint8)
        region = eng.register(buf, name="kv")

        def answer(line: bytes) -> str:
            ranges = json.loads(line)["ranges"]
            return json.dumps({"shas": [hashlib.sha256(buf[o:o + n]).hexdigest() for o, n in ranges]})

        async def serve_hashes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # a client that goes away or sends junk ends its session; a
            # cancel (the target exits: stdin closed) goes on up
            try:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    while line := await reader.readline():
                        writer.write((answer(line) + "\n").encode())
                        await writer.drain()
            finally:
                writer.close()

        if hash_port is not None:
            await asyncio.start_server(serve_hashes, listen.rpartition(":")[0], hash_port)
        print(MARK + json.dumps({"address": eng.address, "addr": region.addr, "pid": os.getpid(),
                                 "data": eng.descriptor().data}), flush=True)
        reader = await _stdin_lines()
        while line := await reader.readline():
            print(MARK + answer(line), flush=True)


class TargetGone(RuntimeError):
    """The target process exited (killed by a fault case, or crashed)."""


async def ask_json_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: dict[str, Any],
                        timeout: float, *, gone: str, mark: bytes = b"") -> dict[str, Any]:
    """The protocol of this script's processes and the target's hash port:
    `request` as one JSON line, the answer one JSON line back (the first
    that starts with `mark`: a child's stdout carries other output too).
    Raises TargetGone(`gone`) when the other end closes first."""
    writer.write((json.dumps(request) + "\n").encode())
    await writer.drain()
    return await read_json_line(reader, timeout, gone=gone, mark=mark)


async def read_json_line(reader: asyncio.StreamReader, timeout: float, *, gone: str,
                         mark: bytes = b"") -> dict[str, Any]:
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if not line:
            raise TargetGone(gone)
        if line.startswith(mark):
            return json.loads(line[len(mark):])


class Hashes:
    """shas(): the target's SHA-256 of its region's ranges, asked by
    _ask (over a child's stdin/stdout, or the target's hash port)."""

    async def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        raise NotImplementedError

    async def shas(self, ranges: list[tuple[int, int]]) -> list[str]:
        return (await self._ask({"ranges": ranges}, 120))["shas"]


class Child:
    """A process of this script run in a namespace host: it answers with
    MARK-prefixed JSON lines on stdout, and exits when its stdin closes.
    `role` names it in errors."""

    role = "child"

    def __init__(self, topo: Topology, keepalive: float, host: int) -> None:
        self.topo = topo
        self.keepalive = keepalive
        self.host = host
        self.proc: asyncio.subprocess.Process | None = None

    async def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        cmd = ["ip", "netns", "exec", self.topo.hosts[self.host], sys.executable, os.path.abspath(__file__),
               *args, "--keepalive", str(self.keepalive)]
        self.proc = await asyncio.create_subprocess_exec(*cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
        assert self.proc.stdout is not None
        try:
            # python + numpy + kvflow imports: minutes under emulation
            return await read_json_line(self.proc.stdout, 300, gone=self._gone(), mark=MARK.encode())
        except BaseException:
            self.kill()         # no hello (timed out, cancelled, crashed): stop() reaps it
            raise

    def _gone(self) -> str:
        return f"the {self.role} in {self.topo.hosts[self.host]} exited"

    async def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        return await ask_json_line(self.proc.stdout, self.proc.stdin, request, timeout, gone=self._gone(),
                                   mark=MARK.encode())

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            # `ip netns exec` execs python: the pid is the child's
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.proc = None


class Target(Child, Hashes):
    """The target process, started in namespace host `host` (or restarted
    there). With `auto_rails` its engine picks its rails from its topology
    (KVFLOW_TCP_RAILS=auto) instead of being given the host's two rails;
    with `hash_port` it also answers hash requests on TARGET_PORT + 1."""

    role = "target"

    def __init__(self, topo: Topology, keepalive: float, host: int = 0, *, auto_rails: bool = False,
                 hash_port: bool = False, receive_window: int | None = None) -> None:
        super().__init__(topo, keepalive, host)
        self.auto_rails = auto_rails
        self.hash_port = hash_port
        self.receive_window = receive_window
        self.address = ""
        self.addr = 0
        self.data: list[tuple[str, int]] = []

    async def start(self) -> None:
        t, k = self.topo, self.host
        args = ["--serve-target", f"{t.target(0, k)}:{TARGET_PORT}"]
        if not self.auto_rails:
            args += ["--rails", f"{t.target(1, k)},{t.target(2, k)}"]
        if self.hash_port:
            args += ["--hash-port", str(TARGET_PORT + 1)]
        if self.receive_window:
            args += ["--receive-window", str(self.receive_window)]
        hello = await self._spawn(args, {"KVFLOW_TCP_RAILS": "auto"} if self.auto_rails else None)
        self.address, self.addr = hello["address"], hello["addr"]
        self.data = [(h, p) for h, p in hello["data"]]


# ------------------------------------------------------------------- workload
@dataclass
class Report:
    case: str
    transfers: int = 0
    bytes_sent: int = 0
    bytes_verified: int = 0
    corrupted: int = 0
    unverifiable: int = 0          # written, then the target died before it could hash them
    failed: dict[str, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    detect_s: float | None = None
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)
    throughput: dict[str, float] = field(default_factory=dict)   # B/s of a workload, per phase
    rails: dict[str, Any] = field(default_factory=dict)          # who listened and connected where


async def workload(peer: kvflow.Peer, target: Target, src: np.ndarray, local_addr: int, report: Report,
                   stop: asyncio.Event, *, seed: int, limit: float,
                   written: list[tuple[float, int]] | None = None) -> None:
    """Writes random batches (1-8 entries of 4 KiB-1 MiB) at random places of
    the target's region until `stop`; each successful batch is verified by
    the target's hashes. A batch may fail (typed error) but must not hang.
    `written` gets (loop time, bytes) of every completed write."""
    rng = np.random.default_rng(seed)
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        n = int(rng.integers(1, 9))
        lengths = [int(x) for x in rng.integers(4096, 1 << 20, n)]
        span = REGION // n
        offs = [i * span + int(rng.integers(0, span - lengths[i])) for i in range(n)]
        for o, ln in zip(offs, lengths):
            src[o:o + ln] = rng.integers(0, 256, ln, dtype=np.uint8)
        t0 = loop.time()
        report.transfers += 1
        try:
            await asyncio.wait_for(
                peer.write([local_addr + o for o in offs], [target.addr + o for o in offs], lengths), limit)
        except asyncio.TimeoutError:
            report.failed["HANG"] = report.failed.get("HANG", 0) + 1
            raise
        except kvflow.KVFlowError as e:
            report.failed[type(e).__name__] = report.failed.get(type(e).__name__, 0) + 1
            return
        finally:
            report.slowest_s = max(report.slowest_s, loop.time() - t0)
        if written is not None:
            written.append((loop.time(), sum(lengths)))
        want = [hashlib.sha256(src[o:o + ln]).hexdigest() for o, ln in zip(offs, lengths)]
        try:
            got = await target.shas(list(zip(offs, lengths)))
        except TargetGone:
            report.unverifiable += 1       # its memory went with it
            return
        report.bytes_sent += sum(lengths)
        for w, g, ln in zip(want, got, lengths):
            if w == g:
                report.bytes_verified += ln
            else:
                report.corrupted += 1


async def _initiator(topo: Topology, keepalive: float) -> tuple[kvflow.Engine, np.ndarray, int]:
    eng = kvflow.Engine(f"{topo.host(0)}:0", protocols=("tcp",), keepalive=keepalive)
    await eng.start()
    src = np.zeros(REGION, dtype=np.uint8)
    region = eng.register(src)
    return eng, src, region.addr


@contextlib.asynccontextmanager
async def _session(topo: Topology, keepalive: float) -> AsyncIterator[tuple[Target, kvflow.Engine, np.ndarray, int]]:
    """A started target and initiator (engine, its registered source buffer
    and that buffer's address), both closed on the way out."""
    target = Target(topo, keepalive)
    await target.start()
    try:
        eng, src, laddr = await _initiator(topo, keepalive)
        try:
            yield target, eng, src, laddr
        finally:
            await eng.close()
    finally:
        await target.stop()


class HashClient(Hashes):
    """Target.shas() for an initiator that is not the target's parent: asks
    the target's hash port (serve_target's hash_port) over the control
    network. `addr` is the target region's address."""

    def __init__(self, addr: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.addr = addr
        self._reader, self._writer = reader, writer

    async def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await ask_json_line(self._reader, self._writer, request, timeout,
                                   gone="the target's hash port closed")


async def serve_initiator(listen: str, rails: list[str] | None, target: str, hashes: str, region: int,
                          keepalive: float) -> None:
    """An initiator in a namespace host (runs there): connects to `target`
    and writes the workload to its region (at `region`), verified through
    the target's hash port `hashes`, until stdin says "stop"; says its rails
    and connections on stdout at start and on "conns", its Report at the
    end."""
    async with kvflow.Engine(listen, rails=rails, protocols=("tcp",), keepalive=keepalive) as eng:
        src = np.zeros(REGION, dtype=np.uint8)
        laddr = eng.register(src).addr
        host, _, port = hashes.rpartition(":")
        verifier = HashClient(region, *await asyncio.open_connection(host, int(port)))
        peer = await eng.connect(target)
        report = Report("initiator")
        stop = asyncio.Event()
        work = asyncio.get_running_loop().create_task(
            workload(peer, verifier, src, laddr, report, stop, seed=9, limit=3 * keepalive + 10))  # type: ignore[arg-type]
        print(MARK + json.dumps({"rails": eng.descriptor().data, "connections": peer.connections()}), flush=True)
        reader = await _stdin_lines()
        while line := await reader.readline():
            if json.loads(line).get("op") == "conns":
                print(MARK + json.dumps({"connections": peer.connections()}), flush=True)
                continue
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError):      # counted as HANG by workload
                await work
            print(MARK + json.dumps(asdict(report)), flush=True)
            return


class Initiator(Child):
    """An initiator process (serve_initiator) in namespace host `host`,
    writing to `target`; `rails` is its engine's rails argument."""

    role = "initiator"

    def __init__(self, topo: Topology, keepalive: float, host: int, target: Target, rails: str = "auto") -> None:
        super().__init__(topo, keepalive, host)
        self.target = target
        self.rails = rails
        self.data: list[tuple[str, int]] = []

    async def start(self) -> list[dict[str, Any]]:
        """Starts it; returns its first connections()."""
        t, k = self.topo, self.host
        hello = await self._spawn(["--serve-initiator", self.target.address, "--listen", f"{t.target(0, k)}:0",
                                   "--rails", self.rails, "--hashes", f"{t.target(0, self.target.host)}:{TARGET_PORT + 1}",
                                   "--region", str(self.target.addr)])
        self.data = [(h, p) for h, p in hello["rails"]]
        return hello["connections"]

    async def connections(self) -> list[dict[str, Any]]:
        return (await self._ask({"op": "conns"}, 30))["connections"]

    async def finish(self, timeout: float) -> Report:
        """Stops the workload; its Report."""
        return Report(**await self._ask({"op": "stop"}, timeout))


async def case_auto(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Rails from the topology on both ends: a target (KVFLOW_TCP_RAILS=auto)
    and an initiator (rails="auto") in two namespace hosts, each with a
    control link and two rails, pick their rails themselves (the rails, not
    the control link, whose address they listen on); the initiator pairs
    its rails with the target's and binds each data connection to its own
    rail on the same subnet. Then the initiator's rail 1 goes down and comes
    back: every write completes (rail 0 carries it), verified by the
    target's hashes."""
    report = Report("rails from the topology, initiator's rail 1 down and back")
    loop = asyncio.get_running_loop()
    target = Target(topo, keepalive, host=0, auto_rails=True, hash_port=True)
    init = Initiator(topo, keepalive, 1, target)
    try:
        await target.start()
        conns = await init.start()
        # the address each connection left from (its socket's), with the
        # rail it was bound to; one whose rail was down at connect has none
        opened = [c for c in conns if c["local"] is not None]
        pairs = [list(p) for p in sorted({(c["local"], c["endpoint"].rpartition(":")[0]) for c in opened})]
        if any(c["local"] != c["source"] for c in opened):
            report.notes.append(f"CONNECTIONS NOT FROM THEIR BOUND RAIL: {conns}")
        down = [c["endpoint"] for c in conns if c["local"] is None]
        if down:
            report.notes.append(f"CONNECTIONS DOWN AT CONNECT: {down}")
        report.rails = {"target": sorted(h for h, _ in target.data), "initiator": sorted(h for h, _ in init.data),
                        "pairs": pairs, "bound": [c["source"] for c in conns], "down": down}
        report.notes.append(f"target rails {report.rails['target']}, initiator rails {report.rails['initiator']}, "
                            f"connections (local, endpoint) {pairs}")
        rail1 = [c["index"] for c in conns if c["source"] == topo.target(2, 1)]
        await asyncio.sleep(seconds / 3)
        t_down = loop.time()
        await topo.set_rail(1, False, host=1)
        while report.detect_s is None and loop.time() - t_down < 3 * keepalive + 10:
            await asyncio.sleep(0.1)
            now = await init.connections()
            if rail1 and all(not now[i]["up"] for i in rail1):
                report.detect_s = loop.time() - t_down
        await asyncio.sleep(max(0.0, t_down + seconds / 3 - loop.time()))
        t_up = loop.time()
        await topo.set_rail(1, True, host=1)
        while report.recover_s is None and loop.time() - t_up < 20:
            await asyncio.sleep(0.1)
            if all(c["up"] for c in await init.connections()):
                report.recover_s = loop.time() - t_up
        await asyncio.sleep(max(0.0, t_up + seconds / 3 - loop.time()))
        now = await init.connections()
        report.notes.append(f"slices moved off rail 1: {sum(c['moved'] for c in now)}; rail 1 carried "
                            f"{sum(now[i]['bytes'] for i in rail1) >> 20} MiB; "
                            f"rebuilt connections: {sum(c['rebuilt'] for c in now)}")
        _merge(report, await init.finish(3 * keepalive + 30))
    finally:
        await topo.set_rail(1, True, host=1)
        await asyncio.gather(init.stop(), target.stop())
    return report


async def case_rail(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Rail 1 goes down for a third of the run, then comes back: every batch
    must complete (its slices move to rail 0), nothing may be corrupted."""
    report = Report("rail down and back")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        try:
            peer = await eng.connect(target.address)
            rail1 = [c["index"] for c in peer.connections() if c["endpoint"].startswith(topo.target(2))]
            if not rail1:
                raise RuntimeError(f"no connection on rail 1: {peer.connections()}")
            stop = asyncio.Event()
            work = loop.create_task(workload(peer, target, src, laddr, report, stop, seed=1,
                                             limit=3 * keepalive + 10))
            await asyncio.sleep(seconds / 3)
            t_down = loop.time()
            took = await topo.set_rail(1, False)
            report.notes.append(f"`ip link set down` took {took:.2f} s")
            while report.detect_s is None and loop.time() - t_down < 3 * keepalive + 10:
                await asyncio.sleep(0.05)
                if any(not peer.connections()[i]["up"] for i in rail1):
                    report.detect_s = loop.time() - t_down
            await asyncio.sleep(max(0.0, t_down + seconds / 3 - loop.time()))
            t_up = loop.time()
            await topo.set_rail(1, True)
            while report.recover_s is None and loop.time() - t_up < 20:
                await asyncio.sleep(0.05)
                if all(c["up"] for c in peer.connections()):
                    report.recover_s = loop.time() - t_up
            await asyncio.sleep(max(0.0, t_up + seconds / 3 - loop.time()))
            stop.set()
            await work
            conns = peer.connections()
            moved = sum(c["moved"] for c in conns)
            rail1_bytes = sum(conns[i]["bytes"] for i in rail1)
            report.notes.append(f"slices moved off rail 1: {moved}; rail 1 carried {rail1_bytes >> 20} MiB; "
                                f"rebuilt connections: {sum(c['rebuilt'] for c in conns)}")
        finally:
            await topo.set_rail(1, True)
    return report


async def case_kill(topo: Topology, seconds: float, keepalive: float) -> Report:
    """The target dies (SIGKILL) mid-transfer: the batch in flight fails with
    a typed error promptly; a restarted target is reached again, and the old
    peer (stale descriptor) can never write into the new process."""
    report = Report("target killed and restarted")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        old = await eng.connect(target.address)
        stop = asyncio.Event()
        work = loop.create_task(workload(old, target, src, laddr, report, stop, seed=2,
                                         limit=3 * keepalive + 10))
        await asyncio.sleep(seconds / 2)
        old_addr = target.addr
        target.kill()
        t_kill = loop.time()
        await asyncio.wait_for(work, 3 * keepalive + 15)    # ends at the first failure
        report.detect_s = loop.time() - t_kill
        await target.proc.wait()
        await target.start()                               # same control address, new incarnation
        stale = 0
        try:
            await old.write([laddr], [old_addr], [4096], timeout=5)
        except kvflow.PeerLostError:
            stale = 1
        report.notes.append("old peer refused after restart" if stale else "OLD PEER WROTE AFTER RESTART")
        if not stale:
            report.corrupted += 1
        peer = await eng.connect(target.address)
        if peer is old:
            report.notes.append("connect() returned the dead peer")
            report.corrupted += 1
        stop = asyncio.Event()
        again = loop.create_task(workload(peer, target, src, laddr, report, stop, seed=3, limit=30))
        await asyncio.sleep(seconds / 2)
        stop.set()
        await again
    return report


def _rate(written: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Bytes per second of the writes that completed in [t0, t1)."""
    return sum(n for t, n in written if t0 <= t < t1) / max(t1 - t0, 1e-9)


def _merge(into: Report, part: Report) -> None:
    into.transfers += part.transfers
    into.bytes_sent += part.bytes_sent
    into.bytes_verified += part.bytes_verified
    into.corrupted += part.corrupted
    into.unverifiable += part.unverifiable
    into.slowest_s = max(into.slowest_s, part.slowest_s)
    for k, v in part.failed.items():
        into.failed[k] = into.failed.get(k, 0) + v


async def case_three(topo: Topology, seconds: float, keepalive: float, *, silent: bool = False) -> Report:
    """Three hosts: this one writes to targets A and B at once, each over its
    two rails, until B dies (SIGKILL; with `silent`, B's links are cut
    first, as when a host crashes, so that only the keepalive can tell).
    B's write in flight fails with PeerLostError within the keepalive bound;
    A's writes go on, their throughput must not collapse (no retry storm);
    B restarts on the same address (new incarnation): the old peer refuses
    to write, B's new memory stays untouched by it, and a new peer writes B
    again. Every completed write is verified. throughput: A's B/s before
    the kill, while B is dead, while B restarts and is written again."""
    report = Report("three hosts: B " + ("cut off and killed" if silent else "killed") + " and restarted, A written on")
    loop = asyncio.get_running_loop()
    a, b = Target(topo, keepalive, host=0), Target(topo, keepalive, host=1)
    eng: kvflow.Engine | None = None
    work: list[asyncio.Task[None]] = []
    stop_a = asyncio.Event()
    try:
        await _all_or_none(a.start(), b.start())
        eng, src_a, laddr_a = await _initiator(topo, keepalive)
        src_b = np.zeros(REGION, dtype=np.uint8)
        laddr_b = eng.register(src_b).addr
        peer_a, old = await asyncio.gather(eng.connect(a.address), eng.connect(b.address))
        lost_at: list[float] = []
        old.on_lost(lambda *_: lost_at.append(loop.time()))
        ra, rb = Report("A"), Report("B")
        written: list[tuple[float, int]] = []
        limit = 3 * keepalive + 10
        work_a = loop.create_task(workload(peer_a, a, src_a, laddr_a, ra, stop_a, seed=6, limit=limit,
                                           written=written))
        work_b = loop.create_task(workload(old, b, src_b, laddr_b, rb, asyncio.Event(), seed=7, limit=limit))
        work += [work_a, work_b]
        t_start = loop.time()
        await asyncio.sleep(seconds / 3)
        if silent:
            for link in range(3):
                await topo.set_link(link, False, host=1)
        old_addr = b.addr
        t_kill = loop.time()
        b.kill()
        await asyncio.wait_for(work_b, limit + 5)       # ends at its first failure
        t_failed = loop.time()
        while not lost_at and loop.time() - t_kill < limit:
            await asyncio.sleep(0.02)
        report.detect_s = (lost_at[0] if lost_at else t_failed) - t_kill
        report.notes.append(f"B's write in flight ended after {t_failed - t_kill:.2f} s "
                            f"({', '.join(rb.failed) or 'completed before the kill'}); "
                            f"peer lost after {report.detect_s:.2f} s")
        t0 = loop.time()
        try:
            await old.write([laddr_b], [old_addr], [4096], timeout=5)
            dead_write = "WROTE"
        except kvflow.KVFlowError as e:
            dead_write = type(e).__name__
        report.notes.append(f"a write to dead B: {dead_write} after {(loop.time() - t0) * 1e3:.1f} ms")
        await asyncio.sleep(max(0.0, t_kill + seconds / 3 - loop.time()))
        t_restart = loop.time()
        if silent:
            for link in range(3):
                await topo.set_link(link, True, host=1)
        await b.proc.wait()
        await b.start()                                   # same control address, new incarnation
        t0 = loop.time()
        try:
            await old.write([laddr_b], [old_addr], [4096], timeout=5)
            report.notes.append("OLD PEER WROTE AFTER RESTART")
            report.corrupted += 1
        except kvflow.PeerLostError:
            report.notes.append(f"old peer refused after restart ({(loop.time() - t0) * 1e3:.1f} ms)")
        untouched = (await b.shas([(0, REGION)]))[0] == hashlib.sha256(bytes(REGION)).hexdigest()
        if not untouched:
            report.notes.append("B'S NEW MEMORY CHANGED BEFORE ITS NEW PEER WROTE")
            report.corrupted += 1
        peer_b = await eng.connect(b.address)
        if peer_b is old or peer_b.descriptor.incarnation == old.descriptor.incarnation:
            report.notes.append("connect() returned the dead peer")
            report.corrupted += 1
        rb2 = Report("B again")
        await workload(peer_b, b, src_b, laddr_b, rb2, _after(seconds / 3), seed=8, limit=limit)
        t_end = loop.time()
        stop_a.set()
        await asyncio.wait_for(work_a, limit + 5)
        report.throughput = {"before": _rate(written, t_start, t_kill), "B dead": _rate(written, t_kill, t_restart),
                             "B restarting": _rate(written, t_restart, t_end)}
        report.notes.append("A's write rate MB/s: " + ", ".join(f"{k} {v / 1e6:.0f}"
                                                                for k, v in report.throughput.items()))
        report.notes.append(f"A: {ra.transfers} transfers, {ra.bytes_verified >> 20} MiB verified; "
                            f"B: {rb.transfers} before the kill, {rb2.transfers} after the restart "
                            f"({rb2.bytes_verified >> 20} MiB verified)")
        for part in (ra, rb, rb2):
            _merge(report, part)
    finally:
        # on an error above the workloads may still run: they end before
        # the engine they write with closes
        stop_a.set()
        for task in work:
            task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
        if silent:
            for link in range(3):
                await topo.set_link(link, True, host=1)
        if eng is not None:
            await eng.close()
        await asyncio.gather(a.stop(), b.stop())
    return report


async def _stream(peer: kvflow.Peer, laddr: int, raddr: int, size: int, depth: int, stop: asyncio.Event,
                  done: list[tuple[float, int, float]]) -> None:
    """Keeps `depth` writes of `size` bytes in flight until `stop`; `done`
    gets (loop time, bytes, seconds) of each completed write."""
    loop = asyncio.get_running_loop()

    async def one() -> None:
        while not stop.is_set():
            t0 = loop.time()
            await peer.write([laddr], [raddr], [size], timeout=60)
            done.append((loop.time(), size, loop.time() - t0))

    await asyncio.gather(*(one() for _ in range(depth)))


def _window(done: list[tuple[float, int, float]], t0: float, t1: float) -> tuple[float, float]:
    """(B/s, the slowest write's seconds) of the writes that ended in [t0, t1)."""
    inside = [(n, s) for t, n, s in done if t0 <= t < t1]
    return sum(n for n, _ in inside) / (t1 - t0), max((s for _, s in inside), default=0.0)


async def case_fair(topo: Topology, seconds: float, keepalive: float, rate: str = "400mbit") -> Report:
    """Two peers of one engine behind one bottleneck (tbf at `rate` on this
    host's side of each rail): B streams 1 MiB writes (16 in flight) alone,
    then while A streams 16 MiB writes (4 in flight, 64 MiB queued at any
    time: a huge request). Fair share: B keeps about half the link, and no
    write of B's waits for A's backlog. The targets' copies are checked at
    the end. throughput: B alone, A and B together; notes: Jain's index of
    the two together, and B's slowest write alone and with A."""
    report = Report(f"fair share: two peers behind one {rate} bottleneck")
    loop = asyncio.get_running_loop()
    a, b = Target(topo, keepalive, host=0), Target(topo, keepalive, host=1)
    eng: kvflow.Engine | None = None
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    shaped = [topo.links[1], topo.links[2]]
    try:
        for dev in shaped:
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb", "latency", "20ms")
        await _all_or_none(a.start(), b.start())
        eng, src, laddr = await _initiator(topo, keepalive)
        src[:] = np.random.default_rng(9).integers(0, 256, REGION, dtype=np.uint8)
        peer_a, peer_b = await asyncio.gather(eng.connect(a.address), eng.connect(b.address))
        done_a: list[tuple[float, int, float]] = []
        done_b: list[tuple[float, int, float]] = []
        tasks.append(loop.create_task(_stream(peer_b, laddr, b.addr, 1 << 20, 16, stop_b, done_b)))
        third = seconds / 3
        await asyncio.sleep(third / 3)                   # B's ramp-up
        t1 = loop.time()
        await asyncio.sleep(third)
        t2 = loop.time()
        tasks.append(loop.create_task(_stream(peer_a, laddr, a.addr, 16 << 20, 4, stop_a, done_a)))
        await asyncio.sleep(third / 3)                   # A's ramp-up
        t3 = loop.time()
        await asyncio.sleep(third)
        t4 = loop.time()
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        b_alone, b_slow_alone = _window(done_b, t1, t2)
        b_both, b_slow_both = _window(done_b, t3, t4)
        a_both, a_slow = _window(done_a, t3, t4)
        report.throughput = {"B alone": b_alone, "B with A": b_both, "A with B": a_both}
        jain = (a_both + b_both) ** 2 / (2 * (a_both ** 2 + b_both ** 2)) if a_both + b_both else 0.0
        report.notes.append(f"MB/s: B alone {b_alone / 1e6:.1f}; together A {a_both / 1e6:.1f}, "
                            f"B {b_both / 1e6:.1f} (B keeps {b_both / b_alone:.2f} of its rate alone); "
                            f"Jain's index {jain:.3f}" if b_alone else "B moved nothing alone")
        report.notes.append(f"slowest write: B alone {b_slow_alone * 1e3:.0f} ms, B with A "
                            f"{b_slow_both * 1e3:.0f} ms, A (16 MiB) {a_slow * 1e3:.0f} ms")
        report.throughput["jain"] = jain
        report.throughput["B slowest with A s"] = b_slow_both
        report.transfers = len(done_a) + len(done_b)
        report.slowest_s = max(b_slow_both, a_slow, b_slow_alone)
        for target, size in ((a, 16 << 20), (b, 1 << 20)):
            report.bytes_sent += size
            got = (await target.shas([(0, size)]))[0]
            if got == hashlib.sha256(src[:size]).hexdigest():
                report.bytes_verified += size
            else:
                report.corrupted += 1
    finally:
        stop_a.set()
        stop_b.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for dev in shaped:
            _tc("qdisc", "del", "dev", dev, "root", check=False)
        if eng is not None:
            await eng.close()
        await asyncio.gather(a.stop(), b.stop())
    return report


def _qdisc_backlog(ns: str, dev: str) -> tuple[int, int]:
    """(bytes queued now, packets dropped so far) of `dev`'s root qdisc in `ns`."""
    out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev], capture_output=True,
                         text=True).stdout
    backlog = re.search(r"backlog (\d+)([KM]?)b", out)
    dropped = re.search(r"dropped (\d+)", out)
    scale = {"": 1, "K": 1000, "M": 1000000}
    return (int(backlog.group(1)) * scale[backlog.group(2)] if backlog else 0,
            int(dropped.group(1)) if dropped else 0)


def _send_queued(dsts: list[str]) -> int:
    """Bytes this host's tcp sockets to `dsts` hold unacknowledged (Send-Q:
    queued in the kernel or on the wire toward the receiver)."""
    total = 0
    for dst in dsts:
        out = subprocess.run(["ss", "-tnH", "state", "established", "dst", dst], capture_output=True,
                             text=True).stdout
        total += sum(int(line.split()[1]) for line in out.splitlines() if line.strip())
    return total


async def case_incast(topo: Topology, seconds: float, keepalive: float, rate: str = "400mbit",
                      windows: tuple[int, ...] = (0, 4 << 20, 16 << 20), senders: int = 3) -> Report:
    """Incast behind a real bottleneck: `senders` engines on this host write
    to one target whose rails are shaped at `rate` toward it (tbf on the
    switch ports: the target's NIC), once per receive window (0: none).
    Each sender keeps 4 writes of 4 MiB in flight. throughput: aggregate
    B/s per window; notes: the ratio to no window, the most bytes the
    senders' sockets held unacknowledged toward the receiver (what a window
    bounds), the most queued at the bottleneck and the packets it dropped.
    The target's copy is checked after each round."""
    report = Report(f"incast: {senders} senders, one receiver behind {rate}")
    loop = asyncio.get_running_loop()
    ports = ["p0x1", "p0x2"]                   # the switch's ports toward host 0's rails
    size, depth = 4 << 20, 4
    try:
        for dev in ports:
            _tc("-n", topo.switch, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
                "latency", "50ms")
        for window in windows:
            target = Target(topo, keepalive, receive_window=window or None)
            engines: list[kvflow.Engine] = []
            stop = asyncio.Event()
            tasks: list[asyncio.Task[None]] = []
            try:
                await target.start()
                src = np.random.default_rng(window % 997).integers(0, 256, REGION, dtype=np.uint8)
                for _ in range(senders):
                    eng = kvflow.Engine(f"{topo.host(0)}:0", protocols=("tcp",), keepalive=keepalive)
                    await eng.start()
                    engines.append(eng)
                laddrs = [eng.register(src).addr for eng in engines]
                peers = await asyncio.gather(*(eng.connect(target.address) for eng in engines))
                drops0 = sum(_qdisc_backlog(topo.switch, d)[1] for d in ports)
                done: list[tuple[float, int, float]] = []
                tasks = [loop.create_task(_stream(p, la, target.addr, size, depth, stop, done))
                         for p, la in zip(peers, laddrs)]
                await asyncio.sleep(seconds / 6)            # ramp-up
                t0, peak, queued = loop.time(), 0, 0
                rails = [topo.target(1), topo.target(2)]
                while loop.time() - t0 < seconds / 3:
                    peak = max(peak, sum(_qdisc_backlog(topo.switch, d)[0] for d in ports))
                    queued = max(queued, await asyncio.to_thread(_send_queued, rails))
                    await asyncio.sleep(0.05)
                t1 = loop.time()
                stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                drops = sum(_qdisc_backlog(topo.switch, d)[1] for d in ports) - drops0
                rate_bps, slowest = _window(done, t0, t1)
                name = f"window {window >> 20} MiB" if window else "no window"
                report.throughput[name] = rate_bps
                report.notes.append(f"{name}: {rate_bps / 1e6:.1f} MB/s, senders' unacknowledged bytes peak "
                                    f"{queued / 2**20:.1f} MiB, bottleneck queue peak {peak / 1e3:.0f} kB, "
                                    f"{drops} packets dropped, slowest 4 MiB write {slowest:.2f} s")
                report.transfers += len(done)
                report.slowest_s = max(report.slowest_s, slowest)
                report.bytes_sent += size
                if (await target.shas([(0, size)]))[0] == hashlib.sha256(src[:size]).hexdigest():
                    report.bytes_verified += size
                else:
                    report.corrupted += 1
                report.rails[name] = {"peak_backlog": peak, "dropped": drops, "send_queued": queued}
            finally:
                stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for eng in engines:
                    await eng.close()
                await target.stop()
        base = report.throughput.get("no window")
        if base:
            report.notes.append("vs no window: " + ", ".join(f"{k} {v / base:.2f}"
                                                             for k, v in report.throughput.items()))
    finally:
        for dev in ports:
            _tc("-n", topo.switch, "qdisc", "del", "dev", dev, "root", check=False)
    return report


def _tc(*args: str, check: bool = True) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"tc {' '.join(args)} failed: {r.stderr.strip()}")


async def _all_or_none(*aws: Awaitable[Any]) -> list[Any]:
    """Runs `aws` at once; when one fails the others are cancelled (and
    awaited) and its error raised as it is (asyncio.TaskGroup would do the
    same from Python 3.11, wrapped in an ExceptionGroup; this runs on 3.10)."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _junk(host: str, port: int, stop: asyncio.Event, rng: random.Random, sent: list[int]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        s = socket.socket()
        s.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), 2)
            kind = rng.randrange(3)
            if kind == 0:
                data = rng.randbytes(rng.randrange(1, 4096))
            elif kind == 1:       # a data hello with a wrong token, then frames
                data = kvflow.control.wire.DATA_HEADER.pack(
                    kvflow.control.wire.DATA_MAGIC, kvflow.control.wire.DATA_HELLO, 0, 0,
                    rng.getrandbits(64), kvflow.control.wire.DATA_WIRE_VERSION, rng.getrandbits(64)) + rng.randbytes(256)
            else:                 # a huge length prefix
                data = (0xFFFFFFF0).to_bytes(4, "big") + rng.randbytes(64)
            await asyncio.wait_for(loop.sock_sendall(s, data), 2)
            sent[0] += len(data)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            s.close()
        await asyncio.sleep(0.005)


async def case_garbage(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Unauthenticated and garbage clients hammer every port of the target
    while a legitimate initiator transfers: nothing of it may fail."""
    report = Report("garbage clients")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        loop = asyncio.get_running_loop()
        peer = await eng.connect(target.address)
        ports = [(h, p) for h, p in peer.descriptor.data] + [(topo.target(0), TARGET_PORT)]
        stop = asyncio.Event()
        sent = [0]
        rng = random.Random(4)
        junk = [loop.create_task(_junk(h, p, stop, rng, sent)) for h, p in ports for _ in range(2)]
        await workload(peer, target, src, laddr, report, _after(seconds), seed=4, limit=30)
        stop.set()
        await asyncio.gather(*junk)
        report.notes.append(f"junk sent: {sent[0] >> 10} KiB on {len(ports)} ports")
    return report


async def case_late(topo: Topology, seconds: float, keepalive: float) -> Report:
    """A timed-out write must never land after its error was raised: the
    connections that still hold it are reset after the drain grace."""
    report = Report("timed-out write during a rail outage, then rewritten")
    target = Target(topo, keepalive)
    await target.start()
    size, chunk = 16 << 20, 64 << 10
    eng = kvflow.Engine(f"{topo.host(0)}:0", protocols=("tcp",), keepalive=keepalive)
    await eng.start()
    old, new = np.full(size, 0xAA, np.uint8), np.full(size, 0xBB, np.uint8)
    lo, ln = eng.register(old), eng.register(new)
    loop = asyncio.get_running_loop()
    try:
        peer = await eng.connect(target.address)
        outage = min(0.75 * keepalive, 1.5)       # the rail's connections survive it
        await topo.set_rail(1, False)
        back = loop.call_later(outage, lambda: loop.create_task(topo.set_rail(1, True)))
        report.transfers += 1
        t0 = loop.time()
        try:
            await peer.write([lo.addr], [target.addr], [size], timeout=0.05)
        except kvflow.KVFlowError as e:
            report.failed[type(e).__name__] = 1
        report.slowest_s = loop.time() - t0
        for off in range(0, size, chunk):
            report.transfers += 1
            await asyncio.wait_for(peer.write([ln.addr + off], [target.addr + off], [chunk]), 30)
            report.bytes_sent += chunk
        await asyncio.sleep(outage + seconds / 2)     # the rail is back; anything late has landed by now
        back.cancel()
        want = hashlib.sha256(new[:1 << 20]).hexdigest()
        shas = await target.shas([(o, 1 << 20) for o in range(0, size, 1 << 20)])
        report.bytes_verified = sum(1 << 20 for s in shas if s == want)
        report.corrupted = sum(1 for s in shas if s != want)
    finally:
        await topo.set_rail(1, True)
        await eng.close()
        await target.stop()
    return report


NETEM = "loss 1% delay 5ms"


def netem_unavailable() -> str | None:
    """Why netem cannot be used here, or None (tries it on a veth link)."""
    if shutil.which("tc") is None:
        return "needs tc (iproute2)"
    name = f"kvfq{os.getpid() % 100000}"
    if _ip("link", "add", name, "type", "veth", "peer", "name", name + "p", check=False).returncode:
        return "cannot create a veth pair"
    try:
        r = subprocess.run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
        return None if r.returncode == 0 else f"no netem qdisc in this kernel ({r.stderr.strip()})"
    finally:
        _ip("link", "del", name, check=False)


async def case_netem(topo: Topology, seconds: float, keepalive: float) -> Report:
    """Both rails lose and delay packets: slower, but every batch completes
    and verifies (tcp retransmits; nothing is declared dead)."""
    report = Report(f"netem {NETEM} on both rails")
    async with _session(topo, keepalive) as (target, eng, src, laddr):
        try:
            peer = await eng.connect(target.address)
            for rail in (0, 1):
                await topo.netem(rail, NETEM)
            await workload(peer, target, src, laddr, report, _after(seconds), seed=5, limit=3 * keepalive + 10)
            report.notes.append(f"failed connections: {sum(c['failures'] for c in peer.connections())}")
        finally:
            for rail in (0, 1):
                await topo.netem(rail, None)
    return report


def _after(seconds: float) -> asyncio.Event:
    ev = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, ev.set)
    return ev


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
