"""deregister() and the local provider: nothing is copied into or out of a
region after deregister() returned (the region fence, kvflow/_native/
fence.h), for peers in this process (memcpy) and in others
(process_vm_writev/readv); a copier stuck inside is waited for a bounded
time (RegionBusyError). And same-process peers' copy of the target's table
is updated at once, so a write submitted right after deregister() is
refused whole."""
from __future__ import annotations

import numpy as np
import pytest

import kvflow

from _batches import bounded


async def test_write_after_deregister_in_same_process_is_refused():
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        src = np.full(1 << 20, 7, np.uint8)
        a.register(src)
        dst = np.zeros(1 << 20, np.uint8)
        region = b.register(dst)
        peer = await bounded(a.connect(b.address))
        assert peer.transport == "local"
        b.deregister(region)                      # no await: no pushed frame was read yet
        with pytest.raises(kvflow.RemoteAccessError):
            peer.write_nowait([src.ctypes.data], [region.addr], [1 << 20])
        with pytest.raises(kvflow.RemoteAccessError):
            await bounded(peer.write([src.ctypes.data], [region.addr], [4096]))
        assert not dst.any()
        region = b.register(dst)                  # and registering again makes it usable at once
        await bounded(peer.write([src.ctypes.data], [region.addr], [4096]))
        assert (dst[:4096] == 7).all() and not dst[4096:].any()


# ---------------------------------------------------------------------------
# The region fence (kvflow/_native/fence.h): nothing is copied into or out of
# a region after its deregister() returned, whatever the peer had queued or
# however stale its table was. Each round: a peer streams into (or out of) a
# fresh region, deregister() runs at a random moment of the stream, and the
# region is filled with MARKER right after it returned; no byte of the
# stream may land after (the region holds MARKER only), and no read may
# bring MARKER back.

import asyncio
import os
import signal
import sys
import threading
import time

import kvflow.engine.engine as engine_mod
from _batches import TIME_SCALE
from _fence_peer import BIG, IN_FLIGHT, MARKER, PAYLOAD, stream
from _providers import skip_unavailable

ROUNDS = int(os.environ.get("KVFLOW_FENCE_ROUNDS", "20"))
XPROC_ROUNDS = int(os.environ.get("KVFLOW_FENCE_XPROC_ROUNDS", "10"))
REGION = 8 << 20
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fence_peer.py")


def deregister_quiet(eng: kvflow.Engine, region, bound: float = 60.0) -> int:
    """deregister(), called again after RegionBusyError (what the contract
    says to do) until it returns: a copier preempted for longer than
    LOCAL_FENCE_WAIT on a loaded machine is inside for that long. Returns
    how many RegionBusyError it took; fails after `bound` seconds."""
    t0 = time.monotonic()
    busy = 0
    while True:
        try:
            eng.deregister(region)
            return busy
        except kvflow.RegionBusyError:
            busy += 1
            assert time.monotonic() - t0 < bound * TIME_SCALE, "a copier stayed inside the region"


def _blocking_stream(peer, op: str, buf: np.ndarray, addr: int, length: int, stop: threading.Event,
                     out: dict) -> None:
    """Small transfers from (into) the registered 4 KiB `buf` on a thread
    of its own (write_blocking/read_blocking: copied inline on this thread,
    beside the loop's and the workers'), until the first error. out: ok,
    error, marker bytes read back."""
    buf[:] = PAYLOAD if op == "write" else 0
    out.update(ok=0, error=None, marker=0)
    fn = peer.write_blocking if op == "write" else peer.read_blocking
    i = 0
    while not stop.is_set():
        off = (i * 4096 * 7) % (length - 4096)
        i += 1
        try:
            fn([buf.ctypes.data], [addr + off], [4096], timeout=30)
            out["ok"] += 1
        except kvflow.KVFlowError as e:
            out["error"] = type(e).__name__
            break
        finally:
            if op == "read":
                out["marker"] += int(np.count_nonzero(buf == MARKER))
                buf[:] = 0


@pytest.mark.parametrize("op", ["write", "read"])
async def test_same_process_stream_stops_at_deregister(op):
    """A peer engine of this process streams 4 MiB batches (its workers copy
    them, 1 MiB slices queued behind each other) and 4 KiB ones (copied
    inline on the loop), plus 4 KiB blocking transfers on a thread of its
    own; deregister() at a random moment, then MARKER fills the region:
    none of it is overwritten (write), none of it is read (read). Failed on
    the old code: the queued slices were not fenced."""
    rng = np.random.default_rng(42)
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        bufs = [np.full(BIG, PAYLOAD if op == "write" else 0, np.uint8) for _ in range(IN_FLIGHT)]
        for buf in bufs:
            a.register(buf)
        small = np.zeros(4096, np.uint8)
        a.register(small)
        dst = np.zeros(REGION, np.uint8)
        peer = await bounded(a.connect(b.address))
        assert peer.transport == "local"
        outcomes, late = [], []
        for _ in range(ROUNDS):
            dst[:] = PAYLOAD if op == "read" else 0
            region = b.register(dst)
            running = asyncio.Event()
            task = asyncio.ensure_future(stream(peer, op, region.addr, REGION, bufs, running.set))
            stop, side = threading.Event(), {}
            th = threading.Thread(target=_blocking_stream, args=(peer, op, small, region.addr, REGION, stop, side))
            th.start()
            try:
                await bounded(running.wait())
                await asyncio.sleep(float(rng.uniform(0, 0.01)))
                deregister_quiet(b, region)
                dst[:] = MARKER                     # anything landing or read from now on shows
                result = (await bounded(task)).split()
            finally:
                stop.set()
                await bounded(asyncio.get_running_loop().run_in_executor(None, th.join))
            outcomes.append((result[2], side["error"]))
            # bytes that landed after deregister() returned, or were read then
            late.append(int(np.count_nonzero(dst != MARKER)) if op == "write"
                        else int(result[3]) + side["marker"])
        assert late == [0] * ROUNDS, f"bytes {op} after deregister() returned, per round: {late}"
        assert b._core.fence_busy() == 0
        # each stream ended on the deregister: its transfers were refused from then on
        assert all(e == "RemoteAccessError" for e, _ in outcomes), outcomes
        assert all(e in ("RemoteAccessError", None) for _, e in outcomes), outcomes


class FencePeer:
    """_fence_peer.py in a child process, connected to `address`."""

    def __init__(self, proc: asyncio.subprocess.Process, pid: int) -> None:
        self.proc = proc
        self.pid = pid

    @classmethod
    async def start(cls, address: str) -> "FencePeer":
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        proc = await asyncio.create_subprocess_exec(sys.executable, PEER_SCRIPT, address, env=env,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self = cls(proc, proc.pid)
        try:
            words = await self.expect("ready")
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        assert int(words[1]) == proc.pid
        return self

    async def send(self, line: str) -> None:
        self.proc.stdin.write((line + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, word: str, timeout: float = 60) -> list[str]:
        line = await bounded(self.proc.stdout.readline(), timeout)
        words = line.decode().split()
        assert words and words[0] == word, f"the peer said {line!r}, not {word!r}"
        return words

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.send("exit")
            except (ConnectionError, OSError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@pytest.fixture
def xproc_local():
    skip_unavailable("local-xproc")


@pytest.mark.parametrize("op", ["write", "read"])
async def test_cross_process_stream_stops_at_deregister(op, xproc_local):
    """A peer in another process streams 4 MiB and 4 KiB transfers with
    process_vm_writev/readv; deregister() at a random moment, then MARKER
    fills the region: none of it is overwritten (write), none of it read
    (read), though the peer's table learns of the deregister only later.
    Failed on the old code: the peer went on copying until the pushed table
    arrived."""
    rng = np.random.default_rng(7)
    async with kvflow.Engine(protocols=("local",)) as b:
        p = await FencePeer.start(b.address)
        try:
            dst = np.zeros(REGION, np.uint8)
            errors, late = [], []
            for _ in range(XPROC_ROUNDS):
                dst[:] = PAYLOAD if op == "read" else 0
                region = b.register(dst)
                await p.send(f"{op} {region.addr} {REGION}")
                await p.expect("running")
                await asyncio.sleep(float(rng.uniform(0, 0.01)))
                deregister_quiet(b, region)
                dst[:] = MARKER
                words = await p.expect("stopped")
                errors.append(words[2])
                late.append(int(np.count_nonzero(dst != MARKER)) if op == "write" else int(words[3]))
            assert late == [0] * XPROC_ROUNDS, f"bytes {op} after deregister() returned, per round: {late}"
            assert b._core.fence_busy() == 0
            assert all(e == "RemoteAccessError" for e in errors), errors
        finally:
            await p.close()


async def test_deregister_gives_up_on_a_stopped_copier_then_waits_again(monkeypatch, xproc_local):
    """A peer process stopped inside the fence (between its check and its
    copy: deterministic here with the test hook) holds deregister() for
    LOCAL_FENCE_WAIT, then RegionBusyError names it: the region is gone
    from the table and from what peers see, its buffer kept referenced.
    deregister() again waits again; once the process is killed it returns
    (a process that is gone copies nothing more)."""
    monkeypatch.setattr(engine_mod, "LOCAL_FENCE_WAIT", 0.3)
    async with kvflow.Engine(protocols=("local",)) as b:
        p = await FencePeer.start(b.address)
        try:
            dst = np.zeros(REGION, np.uint8)
            region = b.register(dst)
            await p.send(f"hold {region.addr + 4096} 4096")
            assert (await p.expect("held"))[1] == "0"
            os.kill(p.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(kvflow.RegionBusyError) as e:
                b.deregister(region)
            took = time.monotonic() - t0
            assert e.value.pids == (p.pid,)
            assert 0.3 <= took < 10 * TIME_SCALE, took
            assert region not in b.regions and b._draining == {region.id: region}
            with pytest.raises(kvflow.RegionBusyError):
                b.deregister(region)                   # still inside: waits, and says so again
            p.proc.kill()
            await bounded(p.proc.wait())
            b.deregister(region)                       # gone: nothing to wait for
            assert b._draining == {} and b._core.fence_busy() == 0
            with pytest.raises(kvflow.InvalidArgumentError):
                b.deregister(region)                   # and now it is not registered at all
        finally:
            await p.close()


async def test_deregister_waits_for_a_same_process_copier_that_leaves(monkeypatch):
    """The same with a copier of this process (the hook holds the fence as a
    copy would): RegionBusyError after the wait, and deregister() again
    returns once it left; a write of the peer meanwhile is refused."""
    monkeypatch.setattr(engine_mod, "LOCAL_FENCE_WAIT", 0.2)
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        src = np.full(4096, PAYLOAD, np.uint8)
        a.register(src)
        dst = np.zeros(REGION, np.uint8)
        region = b.register(dst)
        peer = await bounded(a.connect(b.address))
        assert peer._channel._hold(region.addr, REGION) == 0
        with pytest.raises(kvflow.RegionBusyError) as e:
            b.deregister(region)
        assert e.value.pids == (os.getpid(),)
        with pytest.raises(kvflow.RemoteAccessError):
            await bounded(peer.write([src.ctypes.data], [region.addr], [4096]))
        peer._channel._release()
        b.deregister(region)
        assert b._draining == {} and b._core.fence_busy() == 0
        assert not dst.any()


async def test_a_copier_stopped_at_random_never_hangs_deregister(monkeypatch, xproc_local):
    """A streaming peer process is stopped (SIGSTOP) at a random moment and
    the region deregistered: deregister() returns (the peer was not inside)
    or raises RegionBusyError within the bound (it was); after the peer runs
    again, deregister() returns, and from its return on MARKER stays."""
    monkeypatch.setattr(engine_mod, "LOCAL_FENCE_WAIT", 0.2)
    rng = np.random.default_rng(3)
    async with kvflow.Engine(protocols=("local",)) as b:
        p = await FencePeer.start(b.address)
        try:
            dst = np.zeros(REGION, np.uint8)
            busy = 0
            for _ in range(max(2, XPROC_ROUNDS // 2)):
                dst[:] = 0
                region = b.register(dst)
                await p.send(f"write {region.addr} {REGION}")
                await p.expect("running")
                await asyncio.sleep(float(rng.uniform(0, 0.005)))
                os.kill(p.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    try:
                        b.deregister(region)
                        inside = False
                    except kvflow.RegionBusyError as e:
                        assert e.pids == (p.pid,)
                        inside = True
                    # returned, or gave up after LOCAL_FENCE_WAIT: never hangs on the stopped peer
                    assert time.monotonic() - t0 < 10 * TIME_SCALE
                    if inside:
                        busy += 1
                        os.kill(p.pid, signal.SIGCONT)
                        deregister_quiet(b, region)    # it leaves once it runs
                    dst[:] = MARKER
                finally:
                    os.kill(p.pid, signal.SIGCONT)
                words = await p.expect("stopped")
                assert words[2] == "RemoteAccessError", words
                assert (dst == MARKER).all(), (
                    f"{int(np.count_nonzero(dst != MARKER))} bytes landed after deregister() returned")
            print(f"stopped inside the region in {busy} rounds")
        finally:
            await p.close()


async def test_local_channel_to_a_process_without_a_fence_is_refused():
    """A cross-process local channel needs the target's fence record: a
    process that has none (a plain child) is refused with a typed error."""
    skip_unavailable("local-xproc")
    from kvflow import _core

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import sys; sys.stdin.read()",
                                                stdin=asyncio.subprocess.PIPE)
    try:
        assert _core.fence_probe(proc.pid, 12345) != 0
        core = _core.Core(1)
        try:
            with pytest.raises(OSError):
                _core.LocalChannel(core, _core.RemoteTable(), "x", proc.pid, 4096, None, 12345)
        finally:
            core.close()
    finally:
        proc.stdin.close()
        await bounded(proc.wait())


def _fence_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("kvflow-fence" in line for line in f)


async def test_cancelled_slices_give_the_fence_back():
    """Queued slices hold the target's fence record; those a cancel drops
    from the queue give it back: once both engines are closed and their
    channels gone, no record stays mapped in this process."""
    import gc

    gc.collect()
    base = _fence_mappings()
    async with kvflow.Engine(protocols=("local",), local_workers=1) as a, \
            kvflow.Engine(protocols=("local",)) as b:
        assert _fence_mappings() == base + 2          # one record per engine
        src = np.full(BIG, PAYLOAD, np.uint8)
        a.register(src)
        dst = np.zeros(BIG, np.uint8)
        region = b.register(dst)
        peer = await bounded(a.connect(b.address))
        ts = [peer.write_nowait([src.ctypes.data], [region.addr], [BIG]) for _ in range(16)]
        for t in ts:
            t.cancel()
        cancelled = 0
        for t in ts:
            try:
                await bounded(t)
            except kvflow.TransferCancelledError:
                cancelled += 1
        assert cancelled
        del peer, ts
    gc.collect()
    assert _fence_mappings() == base
