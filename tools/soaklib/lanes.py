"""The soak's lanes: each an initiator task over one peer, with a shadow
of what the peer's window holds (a namespace target, or an in-process pair)."""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from typing import Any

import faults
import numpy as np

import kvflow
from soaklib.base import (
    ABORT_MAX_PIECES, Batch, HANG_S, Hang, KEEPALIVE, MAX_LEN, MAX_PIECES, OPERATIONS, POOL, SWEEP_CHUNK,
    TARGET_START_S, WINDOW, bounded, plan_batch, sha, sleep_or_stop)
from soaklib.tally import Tally


# ---------------------------------------------------------------------- lanes
class Lane:
    """One initiator task: a peer, a window of this engine's registered
    memory, a window of the peer's, and a shadow of what the latter holds
    (valid: bytes whose content is known)."""

    def __init__(self, name: str, scopes: tuple[str, ...], engine: kvflow.Engine, tally: Tally,
                 seed: int) -> None:
        self.name = name
        self.scopes = scopes
        self.engine = engine
        self.tally = tally
        self.rng = random.Random(seed)
        self.local = np.zeros(WINDOW, dtype=np.uint8)
        self.local[:] = 1                      # touch every page now: RSS starts flat
        self.local_region = engine.register(self.local, name="src")
        self.lbase = int(self.local.ctypes.data)
        self.shadow = np.zeros(WINDOW, dtype=np.uint8)
        self.valid = np.ones(WINDOW, dtype=bool)
        self.roff = 0                          # window's offset in the remote region
        self.rbase = 0                         # window's address at the peer
        self.peer: kvflow.Peer | None = None
        self.fences: list[list[float | None]] = []    # [deregistered, registered again]
        self.pool: np.ndarray = np.zeros(0, dtype=np.uint8)
        self.abort_pieces = ABORT_MAX_PIECES
        self.abandoned: collections.deque[tuple[float, float, str, str, Batch]] = collections.deque(maxlen=256)

    # -- what a kind of lane provides
    async def ensure_peer(self) -> kvflow.Peer:
        raise NotImplementedError

    async def remote_shas(self, ranges: list[tuple[int, int]], gen: int) -> list[str] | None:
        """Hashes of the remote region's ranges (region-relative), or None
        when the target restarted since generation `gen`."""
        raise NotImplementedError

    def generation(self) -> int:
        return 0

    async def deliver_check(self, payload: dict[str, Any]) -> bool | None:
        """After notify: whether the receiver found the ranges as announced
        (None: this lane's receiver does not check)."""
        return None

    # -- bookkeeping
    def record(self, op: str, t0: float, exc: BaseException | None, expected: tuple[type, ...] = ()) -> bool:
        """Counts an operation's outcome; True when it succeeded."""
        self.tally.ops[op] += 1
        if exc is None:
            self.tally.outcomes[f"{op} ok"] += 1
            self.check_fence(op, t0)
            return True
        name = type(exc).__name__
        if isinstance(exc, Hang):
            self.tally.outcomes[f"{op} HANG"] += 1
            self.tally.hangs.append({"lane": self.name, "op": op, "what": str(exc),
                                     "t": round(t0 - self.tally.t0, 2)})
            return False
        if isinstance(exc, expected):
            self.tally.outcomes[f"{op} {name}"] += 1
            return False
        self.tally.outcomes[f"{op} failed"] += 1
        self.tally.failed_by_error[name] += 1
        t1 = time.monotonic()
        fault = self.tally.explain(self.scopes, t0, t1)
        self.tally.failed_by_fault[fault or "none"] += 1
        if fault is None and len(self.tally.unexplained) < 50:
            self.tally.unexplained.append({
                "lane": self.name, "op": op, "error": name, "message": str(exc)[:200],
                "t": round(t0 - self.tally.t0, 2), "took": round(t1 - t0, 3),
                "last_fault": self.last_fault(t0)})
        return False

    def last_fault(self, t: float) -> str:
        past = [f for f in self.tally.faults if f.scope in self.scopes and f.start <= t]
        if not past:
            return "none before"
        f = past[-1]
        ended = "still on" if f.end is None else f"ended {t - f.end:.1f} s before"
        return f"{f.kind} ({ended})"

    def check_fence(self, op: str, t0: float) -> None:
        # An operation that started after deregister() returned and ended
        # before the region came back must not have succeeded.
        t1 = time.monotonic()
        for start, end in self.fences:
            if start is not None and t0 > start and (end is None or t1 < end):
                self.tally.fence_violations.append({"lane": self.name, "op": op,
                                                    "t": round(t0 - self.tally.t0, 2)})
                return

    def abandon(self, batch: Batch, op: str, t0: float, exc: BaseException) -> None:
        """A write that did not succeed may land (in part) or not: its bytes
        leave verification until rewritten, and it is remembered for the
        diagnosis of a later mismatch."""
        for _, ro, n in batch.pieces:
            self.valid[ro:ro + n] = False
        self.abandoned.append((t0, time.monotonic() - t0, op, type(exc).__name__, batch))

    def fill(self, batch: Batch) -> list[str]:
        """New random content for the batch's local pieces; their hashes."""
        rng = self.rng
        out = []
        batch.sources = []
        for lo, _, n in batch.pieces:
            s = rng.randrange(0, POOL - n + 1)
            self.local[lo:lo + n] = self.pool[s:s + n]
            batch.sources.append(s)
            out.append(sha(self.local[lo:lo + n]))
        return out

    def columns(self, batch: Batch) -> tuple[list[int], list[int], list[int], dict[str, Any]]:
        la = [self.lbase + o for o in batch.la]
        ra = [self.rbase + o for o in batch.ra]
        kw: dict[str, Any] = {}
        if batch.counts is not None:
            kw = {"counts": batch.counts, "local_strides": batch.ls, "remote_strides": batch.rs}
        return la, ra, list(batch.ln), kw

    async def fetch(self, ro: int, n: int) -> np.ndarray | None:
        """The remote window's bytes [ro, ro+n) as they are now (to
        diagnose a mismatch), or None."""
        return None

    async def diagnose(self, lo: int, ro: int, n: int, want: str) -> dict[str, Any]:
        """What a mismatched write left: how many bytes differ, where, and
        how many of those still hold the previous content (a lost or late
        write) rather than something else."""
        out: dict[str, Any] = {"source_changed_since_write": sha(self.local[lo:lo + n]) != want}
        now = await self.fetch(ro, n)
        if now is None:
            return out
        diff = now != self.local[lo:lo + n]
        where = np.flatnonzero(diff)
        if not where.size:
            out["differ_now"] = 0          # it landed after the hashes were taken
            return out
        stale = diff & (now == self.shadow[ro:ro + n]) & self.valid[ro:ro + n]
        out.update(bytes_differ=int(where.size), first_differ=int(where[0]), last_differ=int(where[-1]),
                   differ_but_equal_to_previous_content=int(stale.sum()))
        out["abandoned_writes_over_this_range"] = self.suspects(ro, n, now)
        return out

    def suspects(self, ro: int, n: int, now: np.ndarray) -> list[dict[str, Any]]:
        """The last writes that did not succeed over [ro, ro+n), and how
        many bytes of `now` (what the range holds) come from each: a write
        that was cancelled or failed and landed after all, late."""
        out = []
        for t0, took, op, outcome, b in self.abandoned:
            for (_, pro, pn), src in zip(b.pieces, b.sources):
                a, z = max(ro, pro), min(ro + n, pro + pn)
                if a < z:
                    theirs = self.pool[src + a - pro:src + z - pro]
                    out.append({"t": round(t0 - self.tally.t0, 2), "took": round(took, 3), "op": op,
                                "outcome": outcome, "overlap": z - a,
                                "bytes_now_equal_to_it": int((now[a - ro:z - ro] == theirs).sum())})
        return out[-5:]

    async def verify_write(self, op: str, batch: Batch, want: list[str], gen: int) -> None:
        """After a successful write: the target's hashes of what landed."""
        self.tally.bytes_written += batch.nbytes
        got = await bounded(self.remote_shas([(self.roff + ro, n) for _, ro, n in batch.pieces], gen),
                            "hashing on the target", 2 * HANG_S)
        for (lo, ro, n), w, g in zip(batch.pieces, want, got or [None] * len(want)):
            if g == w:
                self.tally.bytes_verified += n
            elif g is not None:
                detail = await self.diagnose(lo, ro, n, w)
                self.tally.corrupt(self.name, f"{op}: landed bytes differ", offset=ro, length=n, **detail)
            self.shadow[ro:ro + n] = self.local[lo:lo + n]
            self.valid[ro:ro + n] = g == w
        if got is None:
            self.tally.unverified += 1

    def verify_read(self, op: str, batch: Batch) -> None:
        self.tally.bytes_read += batch.nbytes
        for lo, ro, n in batch.pieces:
            got, want, ok = self.local[lo:lo + n], self.shadow[ro:ro + n], self.valid[ro:ro + n]
            if ok.all():
                same, checked = np.array_equal(got, want), n
            else:
                same, checked = np.array_equal(got[ok], want[ok]), int(ok.sum())
            if same:
                self.tally.bytes_verified += checked
            else:
                where = np.flatnonzero((got != want) & ok)
                self.tally.corrupt(self.name, f"{op}: read bytes differ from what was written",
                                   offset=ro, length=n, bytes_differ=int(where.size), first_differ=int(where[0]),
                                   still_the_fill=int((got[where] == 0xA5).sum()),
                                   abandoned_writes_over_this_range=self.suspects(ro, n, got))

    # -- operations
    async def op_write(self, peer: kvflow.Peer, op: str) -> None:
        batch = plan_batch(self.rng, strided=op.endswith("strided"))
        want = self.fill(batch)
        gen = self.generation()
        la, ra, ln, kw = self.columns(batch)
        t0 = time.monotonic()
        try:
            await bounded(peer.write(la, ra, ln, **kw), op)
        except (kvflow.KVFlowError, Hang) as e:
            self.record(op, t0, e)
            self.abandon(batch, op, t0, e)
            return
        self.record(op, t0, None)
        await self.verify_write(op, batch, want, gen)

    async def op_read(self, peer: kvflow.Peer, op: str) -> None:
        timeout = self.rng.uniform(0.0005, 0.02) if op == "read_timeout" else None
        batch = plan_batch(self.rng, strided=op.endswith("strided"),
                           max_pieces=self.abort_pieces if timeout else MAX_PIECES)
        for lo, _, n in batch.pieces:
            self.local[lo:lo + n] = 0xA5           # what was there must not pass for what was read
        la, ra, ln, kw = self.columns(batch)
        t0 = time.monotonic()
        try:
            await bounded(peer.read(la, ra, ln, timeout=timeout, **kw), op)
        except (kvflow.KVFlowError, Hang) as e:
            self.record(op, t0, e, (kvflow.TransferTimeoutError,) if timeout else ())
            return
        self.record(op, t0, None)
        self.verify_read(op, batch)

    async def op_write_abort(self, peer: kvflow.Peer, op: str) -> None:
        """write_nowait + cancel(), a short timeout=, or the awaiting task
        cancelled: whichever wins, a batch that did not succeed leaves
        verification until rewritten."""
        batch = plan_batch(self.rng, strided=self.rng.random() < 0.3, max_pieces=self.abort_pieces)
        want = self.fill(batch)
        gen = self.generation()
        la, ra, ln, kw = self.columns(batch)
        delay = self.rng.choice((0.0, 0.0, 0.0005, 0.002, 0.01, 0.03))
        t0 = time.monotonic()
        try:
            if op == "write_cancel":
                t = peer.write_nowait(la, ra, ln, **kw)
                await asyncio.sleep(delay)
                t.cancel()
                await bounded(t, op)
            elif op == "write_timeout":
                await bounded(peer.write(la, ra, ln, timeout=self.rng.uniform(0.0005, 0.02), **kw), op)
            else:
                task = asyncio.get_running_loop().create_task(peer.write(la, ra, ln, **kw))
                await asyncio.sleep(delay)
                task.cancel()
                done, _ = await asyncio.wait([task], timeout=HANG_S)
                if not done:
                    raise Hang(f"{op}: the cancelled task did not end within {HANG_S:g} s")
                if task.cancelled():
                    raise kvflow.TransferCancelledError("the awaiting task was cancelled")
                if task.exception() is not None:
                    raise task.exception()      # type: ignore[misc]
        except (kvflow.KVFlowError, Hang) as e:
            self.record(op, t0, e, (kvflow.TransferCancelledError, kvflow.TransferTimeoutError))
            self.abandon(batch, op, t0, e)
            return
        self.record(op, t0, None)
        await self.verify_write(op, batch, want, gen)

    async def op_notify(self, peer: kvflow.Peer, op: str) -> None:
        """A small write, then notify(): the receiver must find it landed."""
        batch = plan_batch(self.rng, strided=False, max_entries=8)
        want = self.fill(batch)
        gen = self.generation()
        la, ra, ln, kw = self.columns(batch)
        t0 = time.monotonic()
        self.tally.notifications_sent += 1
        payload = {"lane": self.name, "seq": self.tally.notifications_sent,
                   "ranges": [[self.roff + ro, n] for _, ro, n in batch.pieces], "shas": want}
        try:
            await bounded(peer.write(la, ra, ln, **kw), "notify's write")
            await bounded(peer.notify(json.dumps(payload).encode()), op)
            landed = await self.deliver_check(payload)
        except (kvflow.KVFlowError, Hang) as e:
            self.record(op, t0, e)
            self.abandon(batch, op, t0, e)
            return
        self.record(op, t0, None)
        if landed is None:
            await self.verify_write(op, batch, want, gen)
            return
        self.tally.bytes_written += batch.nbytes
        self.tally.notifications_checked += 1
        if landed:
            self.tally.bytes_verified += batch.nbytes
        else:
            detail = [await self.diagnose(lo, ro, n, w) for (lo, ro, n), w in zip(batch.pieces, want)]
            self.tally.corrupt(self.name, "notification arrived before the write it follows had landed",
                               pieces=detail)
        for lo, ro, n in batch.pieces:
            self.shadow[ro:ro + n] = self.local[lo:lo + n]
            self.valid[ro:ro + n] = bool(landed)

    async def run(self, stop: asyncio.Event) -> None:
        names = [o for o, _ in OPERATIONS]
        weights = [w for _, w in OPERATIONS]
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                peer = await self.ensure_peer()
            except (kvflow.KVFlowError, Hang) as e:
                self.record("connect", t0, e)
                await sleep_or_stop(stop, 0.3)
                continue
            op = self.rng.choices(names, weights)[0]
            if op in ("write", "write_strided"):
                await self.op_write(peer, op)
            elif op in ("read", "read_strided", "read_timeout"):
                await self.op_read(peer, op)
            elif op == "notify":
                await self.op_notify(peer, op)
            else:
                await self.op_write_abort(peer, op)
            await asyncio.sleep(self.rng.uniform(0, 0.005))

    async def sweep(self) -> None:
        """After the load: the whole window once more, where known."""
        raise NotImplementedError

    async def sweep_mismatch(self, o: int, n: int) -> None:
        detail: dict[str, Any] = {"offset": o, "length": n}
        now = await self.fetch(o, n)
        if now is not None:
            ok = self.valid[o:o + n]
            detail["bytes_differ"] = int(((now != self.shadow[o:o + n]) & ok).sum())
            detail["abandoned_writes_over_this_range"] = self.suspects(o, n, now)
        self.tally.corrupt(self.name, "final sweep: window differs from what was written", **detail)


class NamespaceTarget:
    """faults.Target plus what the lanes share about it: a lock around its
    hash pipe (one request at a time; a restart waits for the one in
    flight) and a generation that counts restarts."""

    def __init__(self, topo: faults.Topology) -> None:
        self.topo = topo
        self.target = faults.Target(topo, KEEPALIVE)
        self.lock = asyncio.Lock()
        self.generation = 0
        self.ready = asyncio.Event()

    @property
    def pid(self) -> int | None:
        p = self.target.proc
        return p.pid if p is not None and p.returncode is None else None

    async def start(self) -> None:
        await bounded(self.target.start(), "starting the namespace target", TARGET_START_S)
        self.ready.set()

    async def restart(self) -> None:
        """SIGKILL whenever the fault scheduler says (a hash request may be
        in flight: it fails and counts as unverifiable), then a new target
        once no request uses the old one's pipes."""
        self.generation += 1
        self.ready.clear()
        self.target.kill()
        async with self.lock:
            if self.target.proc is not None:
                await bounded(self.target.proc.wait(), "the killed target to exit", 10)
            await self.target.stop()
            await self.start()

    async def shas(self, ranges: list[tuple[int, int]], gen: int) -> list[str] | None:
        async with self.lock:
            if gen != self.generation or not self.ready.is_set():
                return None
            try:
                return await self.target.shas(ranges)
            except (RuntimeError, ConnectionError) as e:
                if gen != self.generation:
                    return None            # killed while hashing
                raise RuntimeError(f"the namespace target stopped answering: {e}") from e

    async def stop(self) -> None:
        await bounded(self.target.stop(), "stopping the namespace target", 20)


class NamespaceLane(Lane):
    """tcp to the namespace target; window `index` of its region "kv"."""

    def __init__(self, name: str, ns: NamespaceTarget, engine: kvflow.Engine, index: int, tally: Tally,
                 seed: int) -> None:
        super().__init__(name, ("ns", name), engine, tally, seed)
        self.ns = ns
        self.index = index
        self.roff = index * WINDOW
        self.gen = -1                # the target's generation when this lane connected
        self.incarnation = -1
        self.scratch = np.zeros(MAX_LEN, dtype=np.uint8)
        self.scratch[:] = 0
        engine.register(self.scratch, name="scratch")

    def generation(self) -> int:
        return self.gen

    async def ensure_peer(self) -> kvflow.Peer:
        # A killed target's peer is used until it fails (the operations in
        # flight must fail with a typed error, promptly); reconnecting while
        # the target is down fails too, until it is back.
        if self.peer is not None and self.peer.alive:
            return self.peer
        gen = self.ns.generation
        peer = await bounded(self.engine.connect(self.ns.target.address, timeout=10), "connect")
        if peer.descriptor.incarnation != self.incarnation:
            # a new incarnation starts zeroed (np.zeros)
            self.incarnation = peer.descriptor.incarnation
            self.shadow[:] = 0
            self.valid[:] = True
        self.gen = gen
        self.peer = peer
        self.rbase = peer.region("kv").addr + self.roff
        return peer

    async def remote_shas(self, ranges: list[tuple[int, int]], gen: int) -> list[str] | None:
        return await self.ns.shas(ranges, gen)

    async def fetch(self, ro: int, n: int) -> np.ndarray | None:
        if self.peer is None:
            return None
        try:
            await bounded(self.peer.read([int(self.scratch.ctypes.data)], [self.rbase + ro], [n]), "diagnosis read")
        except (kvflow.KVFlowError, Hang):
            return None
        return self.scratch[:n].copy()

    async def sweep(self) -> None:
        if self.gen != self.ns.generation or not self.ns.ready.is_set():
            return
        chunks = [(o, min(SWEEP_CHUNK, WINDOW - o)) for o in range(0, WINDOW, SWEEP_CHUNK)]
        chunks = [(o, n) for o, n in chunks if self.valid[o:o + n].all()]
        got = await bounded(self.ns.shas([(self.roff + o, n) for o, n in chunks], self.gen),
                            "sweep hashes", 2 * HANG_S)
        if got is None:
            return
        for (o, n), g in zip(chunks, got):
            if g == sha(self.shadow[o:o + n]):
                self.tally.bytes_swept += n
            else:
                await self.sweep_mismatch(o, n)


class PairLane(Lane):
    """An in-process pair: this lane's engine writes to `target`'s region."""

    def __init__(self, name: str, engine: kvflow.Engine, target: kvflow.Engine, tally: Tally, seed: int) -> None:
        super().__init__(name, (name,), engine, tally, seed)
        self.target = target
        self.dst = np.zeros(WINDOW, dtype=np.uint8)
        self.dst[:] = 0
        self.dst_region = target.register(self.dst, name="dst")
        self.waiters: dict[int, asyncio.Future[bool]] = {}
        self.consumer: asyncio.Task[None] | None = None

    async def ensure_peer(self) -> kvflow.Peer:
        if self.peer is None or not self.peer.alive:
            self.peer = await bounded(self.engine.connect(self.target.address, timeout=10), "connect")
            self.rbase = int(self.dst.ctypes.data)
            if self.consumer is None:
                self.consumer = asyncio.get_running_loop().create_task(self.consume())
        return self.peer

    async def remote_shas(self, ranges: list[tuple[int, int]], gen: int) -> list[str] | None:
        return [sha(self.dst[o:o + n]) for o, n in ranges]

    async def fetch(self, ro: int, n: int) -> np.ndarray | None:
        return self.dst[ro:ro + n].copy()

    async def deliver_check(self, payload: dict[str, Any]) -> bool | None:
        fut = self.waiters.get(payload["seq"])
        if fut is None:
            fut = self.waiters[payload["seq"]] = asyncio.get_running_loop().create_future()
        try:
            return await bounded(fut, "the notification to arrive")
        finally:
            self.waiters.pop(payload["seq"], None)

    async def consume(self) -> None:
        """The receiving engine's notifications: hash the announced ranges
        the moment the notification is seen."""
        async for _, data in self.target.notifications():
            msg = json.loads(data)
            landed = all(sha(self.dst[o:o + n]) == s for (o, n), s in zip(msg["ranges"], msg["shas"]))
            fut = self.waiters.get(msg["seq"])
            if fut is None:
                # not awaited yet: the sender is still between notify() and deliver_check()
                fut = self.waiters[msg["seq"]] = asyncio.get_running_loop().create_future()
            if fut.done():
                self.tally.notifications_unmatched += 1
            else:
                fut.set_result(landed)

    async def sweep(self) -> None:
        ok = self.valid
        if np.array_equal(self.dst[ok], self.shadow[ok]):
            self.tally.bytes_swept += int(ok.sum())
            return
        bad = np.flatnonzero((self.dst != self.shadow) & ok)
        chunks = {int(b) // SWEEP_CHUNK * SWEEP_CHUNK for b in [*bad[::4096], bad[-1]]}
        for o in sorted(chunks):
            await self.sweep_mismatch(o, min(SWEEP_CHUNK, WINDOW - o))

    def region_of(self, side: str) -> tuple[kvflow.Engine, np.ndarray, kvflow.Region, str]:
        if side == "dst":
            return self.target, self.dst, self.dst_region, "dst"
        return self.engine, self.local, self.local_region, "src"

    def set_region(self, side: str, region: kvflow.Region) -> None:
        if side == "dst":
            self.dst_region = region
        else:
            self.local_region = region
