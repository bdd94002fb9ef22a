"""A standalone kvflow.store master for the tests (`python -m kvflow.store
master` in a process of its own), and the environment its processes need."""
from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def store_env() -> dict:
    """This environment, with the checkout on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@contextlib.asynccontextmanager
async def standalone_master(*args: str):
    """Starts a master listening on a free port (extra `args` to its
    command line) and yields (its address, its process) once it printed its
    `ready` line (a durable one prints `standby` lines first); at the end
    stops it, unless the test did, and checks it exited cleanly."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0", *args,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        while line and "standby" in line:       # a durable master campaigns first
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "ready" in line, line
        yield line.split()[-1], proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) in (0, -signal.SIGTERM)


async def stop_member(proc) -> None:
    """Ends a member process the tests started (its stdin closed: it leaves;
    continued first, in case a test stopped it); killed after 10 s."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
