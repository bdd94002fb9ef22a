"""The processes of the store soak (tools/soak.py --mode store): a standalone
master (`python -m kvflow.store master`), optionally etcd under it, and pool
members, each tools/soak.py run with the hidden flag --store-member: a holder
(mounts a segment, serves until its stdin closes) or a writer (puts what its
stdin asks, from the shared content pool, and answers one JSON line each).

Every object's bytes follow from its key (content_of): the writer and the
soak's own client hold the same pool (content_pool), so any process can put
a key and the soak can check any get byte for byte without remembering the
bytes themselves."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TOOLS)
SCRIPT = os.path.join(TOOLS, "soak.py")     # what a member runs, with --store-member
MARK = "@@STORE "                            # a member's answers; anything else on stdout is not one
POOL_BYTES = 8 << 20                         # the content pool: objects are slices of it
START_S = 60.0                               # a member imports numpy and kvflow: slow under load


def content_pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, POOL_BYTES, dtype=np.uint8)


def key_for(prefix: str, serial: int, offset: int, size: int) -> str:
    return f"{prefix}/{serial}/{offset}/{size}"


def content_of(key: str) -> tuple[int, int]:
    """(offset in the pool, size) of `key`'s bytes."""
    _, _, offset, size = key.rsplit("/", 3)
    return int(offset), int(size)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- in a member
async def serve_member(master: str, role: str, segment_size: int, seed: int, timeout: float) -> None:
    """The body of a member process (runs there)."""
    from kvflow.errors import KVFlowError
    from kvflow.store import StoreClient

    async with StoreClient(master, segment_size=segment_size, local_buffer_size=0, protocols=("tcp",),
                           timeout=timeout) as c:
        pool = content_pool(seed) if role == "writer" else None
        base = c.register_buffer(pool).addr if pool is not None else 0
        print(MARK + json.dumps({"client": c.client_id, "segment": c.segment_id}), flush=True)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            req = json.loads(line)
            keys = req["keys"]
            where = [content_of(k) for k in keys]
            try:
                got = await c.batch_put_from(keys, [base + o for o, _ in where], [n for _, n in where],
                                             replica_num=req["rn"])
                out = [r if isinstance(r, int) else type(r).__name__ for r in got]
            except KVFlowError as e:            # the whole call: every key shares it
                out = [type(e).__name__] * len(keys)
            print(MARK + json.dumps({"results": out}), flush=True)


# ------------------------------------------------------------ in the soak
class Member:
    """A member process seen from the soak: start (until its hello), ask
    (a writer's put), SIGKILL, SIGSTOP/SIGCONT, stop (stdin closed)."""

    def __init__(self, name: str, role: str, master: str, segment_size: int, seed: int, timeout: float) -> None:
        self.name, self.role, self.master = name, role, master
        self.segment_size, self.seed, self.timeout = segment_size, seed, timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.client = ""
        self.segment: int | None = None
        self.starts = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, SCRIPT, "--store-member", self.role, "--store-master", self.master,
            "--segment-size", str(self.segment_size), "--seed", str(self.seed),
            "--store-timeout", str(self.timeout),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env())
        try:
            hello = await self._read(START_S)
        except BaseException:
            self.kill()
            raise
        self.client, self.segment = hello["client"], hello["segment"]
        self.starts += 1

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise ConnectionError(f"store member {self.name} exited")
            if line.startswith(MARK.encode()):
                return json.loads(line[len(MARK):])

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())

    async def answer(self, timeout: float) -> dict[str, Any]:
        return await self._read(timeout)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def signal(self, sig: int) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def reap(self) -> None:
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except asyncio.TimeoutError:
                self.kill()
                await self.proc.wait()
        self.proc = None


class MasterProc:
    """`python -m kvflow.store master` on a free loopback port (with etcd:
    durable, cluster "soak"); `address` once it printed `ready`."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0", *self.args,
            stdout=subprocess.PIPE, cwd=ROOT, env=_env())
        assert self.proc.stdout is not None
        line = ""
        while "ready" not in line:              # a durable one prints `standby` first
            line = (await asyncio.wait_for(self.proc.stdout.readline(), START_S)).decode()
            if not line:
                raise ConnectionError("the store master exited before it was ready")
        self.address = line.split()[-1]

    async def stop(self) -> int | None:
        """Stops it (SIGTERM); its exit status (0 or -SIGTERM: clean)."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            return await asyncio.wait_for(self.proc.wait(), 15)
        except asyncio.TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


class Etcd:
    """A throw-away single-node etcd on loopback (as tests/_metadata_servers.py
    starts it), its data in a temporary directory."""

    def __init__(self) -> None:
        self.port, self.peer_port = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="kvflow-soak-etcd-")
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def unavailable() -> str | None:
        return None if shutil.which("etcd") else "etcd is not installed (Debian: etcd-server)"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        peer, client = f"http://127.0.0.1:{self.peer_port}", f"http://{self.address}"
        with open(os.path.join(self.dir, "etcd.log"), "wb") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "soak", "--data-dir", os.path.join(self.dir, "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"soak={peer}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ConnectionError(f"etcd did not come up on {self.address}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
