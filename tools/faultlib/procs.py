"""The fault suite's processes in namespace hosts: a target engine that
hashes what landed, and an initiator; both are tools/faults.py run with
hidden flags, answering MARK-prefixed JSON lines."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Any, AsyncIterator

import numpy as np

import kvflow
import kvflow.control.wire
from faultlib.netns import Topology
from faultlib.channel import Hashes, MARK, REGION, TARGET_PORT, ask_json_line, read_json_line
from faultlib.workload import Report, workload

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TOOLS)
SCRIPT = os.path.join(TOOLS, "faults.py")     # what a child runs, with the hidden flags of its role


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
        cmd = ["ip", "netns", "exec", self.topo.hosts[self.host], sys.executable, SCRIPT,
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
