"""Soak: a bounded, randomised mixed load with faults, every byte checked.

Four initiator lanes run at once in this process, each a task doing one
operation after another on a window of memory it alone uses:

  ns-a, ns-b    tcp to a target engine in a network namespace (tools/faults.py:
                a control link and two rails), one initiator engine each
  pair-local    an in-process pair of engines over the "local" provider
  pair-tcp      an in-process pair of engines over tcp on 127.0.0.1
  pair-rdma     (only with --lanes rdma) an in-process pair over rdma, e.g. in
                the Soft-RoCE VM: python3 tools/rdma_vm.py --netdev dummy
                --devices 2 -- python3 tools/soak.py --lanes rdma --faults dereg

Operations (random batch shapes: 1-64 entries of 64 B - 4 MiB, some strided):
write, read, write_nowait then cancel, writes and reads with a short
timeout=, a task cancelled mid-write, and write-then-notify (the receiver
hashes the written ranges when the notification arrives: completed writes
must have landed). Each lane keeps a shadow of what its remote window must
hold; a write that failed, timed out or was cancelled may or may not have
landed, so its bytes leave verification until rewritten. Every successful
write is hashed on the target (the namespace target hashes its own memory,
faults.Target.shas; in-process targets hash the numpy buffer), every
successful read is compared with the shadow, and at the end each window is
swept once more (a late landing shows there).

Meanwhile two schedulers inject faults at random times: on the namespace
target a rail going down for 1-4 s, SIGKILL and restart (lanes reconnect
with engine.connect), bursts of garbage clients on every port; on the
in-process pairs deregister + register of either side's region. Every
failure is charged to the fault whose window covers it; one no fault
explains is reported with its timing (and fails the run).

RSS and open descriptors of this process (and of the target) are sampled
every SAMPLE_S seconds. At the end every engine must have no batch and no
slice in flight before anything closes, its sockets and threads must return
to their value after start() once its peers have closed, descriptors must
return to within FD_MARGIN of the start, and RSS may grow over the second
half of the run by at most RSS_SLOPE_LIMIT MiB/min.

A mismatch is diagnosed: the range is read back, and compared with the
content of the last writes over it that did not succeed (each piece's
content is a slice of one random pool, so it can be recomputed). Bytes of a
write whose await gave up after DRAIN_GRACE, found over a later successful
write, are counted apart as late landings (a known engine bug, see
late_landing()); they still count as corrupted.

    python3 tools/soak.py --seconds 300 [--seed N] [--json out.json]
        [--faults rail,kill,garbage,dereg] [--big-cancels] [--lanes ns,local,tcp,rdma]

Exit status: 0 when every invariant held, 1 otherwise, 2 when network
namespaces cannot be made (needs root and iproute2). tests/test_soak.py runs
a shorter soak with a fixed seed.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import faults  # noqa: E402  (also puts the checkout on sys.path)
import numpy as np  # noqa: E402

import kvflow  # noqa: E402
from kvflow.engine.transfer import DRAIN_GRACE

KEEPALIVE = 3.0
# engine.counters() entries that are resources (back to their value once peers close);
# the others (fenced, cut_off, wakeups) are tallies of events
RESOURCES = ("sockets", "threads", "slices_inflight", "batches", "mrs", "qps")
# Nothing may take longer: a rail failure is noticed within the keepalive,
# its slices move, and a cancelled batch drains within DRAIN_GRACE (2 s).
HANG_S = 3 * KEEPALIVE + 15
TARGET_START_S = 60.0          # a restarted namespace target imports numpy and kvflow
WINDOW = 16 << 20              # each lane's remote (and local) window
MIN_LEN, MAX_LEN = 64, 4 << 20
MAX_ENTRIES = 64
MAX_PIECES = 256               # strided entries: pieces per batch, at most
# With small_cancels (--small-cancels), batches that are cancelled or time
# out stay at 16 pieces (at most 64 slices of 1 MiB): the shape that did not
# reach the tcp sender's former claim_locked() overflow (fixed; more than
# 64 cancelled slices in one connection's queue smashed its stack).
ABORT_MAX_PIECES = 16
POOL = 8 << 20                 # random bytes that writes copy from
SAMPLE_S = 2.0
RSS_SLOPE_LIMIT = 20.0         # MiB/min over the second half
FD_MARGIN = 4
QUIESCE_S = 8.0                # for the last cancelled batches to drain
RELEASE_S = 15.0               # for target-side sessions to end after their peer closed
SWEEP_CHUNK = 1 << 20

FAULTS = ("rail", "kill", "garbage", "dereg")
LANES = ("ns", "local", "tcp", "rdma")      # "ns": the two namespace lanes; the rest: in-process pairs
DEFAULT_LANES = ("ns", "local", "tcp")

# (operation, weight)
OPERATIONS = (("write", 28), ("write_strided", 12), ("read", 16), ("read_strided", 8),
              ("write_cancel", 10), ("write_timeout", 6), ("task_cancel", 6), ("read_timeout", 5),
              ("notify", 9))

T = TypeVar("T")


class Hang(Exception):
    """An await outlived HANG_S."""


async def bounded(aw: Awaitable[T], what: str, limit: float = HANG_S) -> T:
    """Awaits `aw` for at most `limit` seconds; raises Hang past it. (A
    TransferTimeoutError is a TimeoutError too: it passes through.)"""
    try:
        return await asyncio.wait_for(aw, limit)
    except kvflow.KVFlowError:
        raise
    except asyncio.TimeoutError:
        raise Hang(f"{what} took over {limit:g} s") from None


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def sha(buf: np.ndarray) -> str:
    return hashlib.sha256(buf).hexdigest()       # numpy slices hash without a copy


# ------------------------------------------------------------- process probes
def rss_mib(pid: int | str = "self") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def fd_count(pid: int | str = "self") -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def fix_malloc_threshold() -> None:
    """glibc raises its mmap threshold (up to 32 MiB) each time a large
    block is freed, after which multi-MiB temporaries come from the heap
    and RSS wanders by tens of MiB with no leak at all. A fixed threshold
    returns them to the kernel at once, so that the RSS slope means
    something."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 << 10)          # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def slope_mib_per_min(samples: list[dict[str, Any]], key: str = "rss") -> float:
    """Least-squares slope of samples[key] over the second half of the run."""
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if len(pts) < 4:
        return 0.0
    half = pts[-1][0] / 2
    pts = [p for p in pts if p[0] >= half] or pts
    if len(pts) < 3:
        return 0.0
    ts = np.array([p[0] for p in pts])
    vs = np.array([p[1] for p in pts])
    return float(np.polyfit(ts, vs, 1)[0] * 60)


# -------------------------------------------------------------------- tally
@dataclass
class Fault:
    kind: str
    scope: str             # "ns" (every namespace lane) or a lane's name
    start: float
    end: float | None = None
    grace: float = 0.0     # how long after `end` failures are still its doing

    def covers(self, t0: float, t1: float) -> bool:
        end = math.inf if self.end is None else self.end + self.grace
        return t0 <= end and t1 >= self.start


@dataclass
class Tally:
    ops: Counter = field(default_factory=Counter)           # operation -> count
    outcomes: Counter = field(default_factory=Counter)      # "op outcome" -> count
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_verified: int = 0
    bytes_swept: int = 0
    unverified: int = 0          # a write's target restarted before it could be hashed
    failed_by_error: Counter = field(default_factory=Counter)
    failed_by_fault: Counter = field(default_factory=Counter)
    unexplained: list[dict[str, Any]] = field(default_factory=list)
    corrupted: int = 0
    late_landings: int = 0       # of which: bytes of a write abandoned after DRAIN_GRACE, landed late
    corruption: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    fence_violations: list[dict[str, Any]] = field(default_factory=list)
    notifications_sent: int = 0
    notifications_checked: int = 0
    notifications_unmatched: int = 0
    faults: list[Fault] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)      # times in reports are relative to this

    def begin(self, kind: str, scope: str, grace: float) -> Fault:
        f = Fault(kind, scope, time.monotonic(), grace=grace)
        self.faults.append(f)
        return f

    def explain(self, scopes: tuple[str, ...], t0: float, t1: float) -> str | None:
        hit = [f for f in self.faults if f.scope in scopes and f.covers(t0, t1)]
        return hit[-1].kind if hit else None

    def corrupt(self, lane: str, what: str, **detail: Any) -> None:
        self.corrupted += 1
        if late_landing(detail):
            self.late_landings += 1
            detail["late_landing"] = True
        if len(self.corruption) < 50:
            now = time.monotonic()
            recent = [f"{f.kind} at {f.start - self.t0:.1f} s"
                      + ("" if f.end is None else f" for {f.end - f.start:.1f} s")
                      for f in self.faults if f.start > now - 15]
            self.corruption.append({"lane": lane, "what": what, "t": round(now - self.t0, 2), **detail,
                                    "faults in the last 15 s": recent})


def late_landing(detail: dict[str, Any]) -> bool:
    """Whether a mismatch holds (far more than by chance: 1/256) the bytes of
    an earlier write whose await gave up waiting for its drain (DRAIN_GRACE)
    and raised while slices of it were still on the wire. Those land late,
    over whatever was written there since: a known engine bug (the tcp
    sender's slices on a stalled but live connection are neither recalled
    nor fenced), reported apart from other corruption."""
    for piece in [detail, *detail.get("pieces", [])]:
        for s in piece.get("abandoned_writes_over_this_range", []):
            if s["took"] >= DRAIN_GRACE - 0.05 and s["bytes_now_equal_to_it"] > max(16, s["overlap"] // 16):
                return True
    return False


# -------------------------------------------------------------------- batches
@dataclass
class Batch:
    """Entries (window-relative offsets) and the pieces they expand to."""
    la: list[int]
    ra: list[int]
    ln: list[int]
    counts: list[int] | None          # None: plain entries
    ls: list[int] | None
    rs: list[int] | None
    pieces: list[tuple[int, int, int]]      # (local offset, remote offset, length)
    sources: list[int] = field(default_factory=list)   # each piece's content: the pool from there

    @property
    def nbytes(self) -> int:
        return sum(p[2] for p in self.pieces)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if hi > lo else lo


def plan_batch(rng: random.Random, *, strided: bool, max_entries: int = MAX_ENTRIES,
               max_pieces: int = MAX_PIECES) -> Batch:
    """Random non-overlapping entries: entry i lives in slot i of the window
    on both sides (at independent offsets), so no two pieces overlap."""
    n = min(max_entries, max_pieces, int(2 ** rng.uniform(0, math.log2(max_entries + 1))))
    span = WINDOW // n
    la, ra, ln, counts, ls, rs, pieces = [], [], [], [], [], [], []
    for i in range(n):
        c = rng.randint(2, 16) if strided else 1
        c = max(1, min(c, max_pieces // n, span // MIN_LEN))
        length = log_uniform(rng, MIN_LEN, min(MAX_LEN, span // c))
        # stride >= length (pieces of one entry do not overlap); the
        # entry's footprint (c-1)*stride + length fits in its slot
        top = (span - length) // (c - 1) if c > 1 else length
        lstride, rstride = rng.randint(length, top), rng.randint(length, top)
        lo = i * span + rng.randint(0, span - ((c - 1) * lstride + length))
        ro = i * span + rng.randint(0, span - ((c - 1) * rstride + length))
        la.append(lo), ra.append(ro), ln.append(length)
        counts.append(c), ls.append(lstride), rs.append(rstride)
        pieces.extend((lo + k * lstride, ro + k * rstride, length) for k in range(c))
    if not strided:
        return Batch(la, ra, ln, None, None, None, pieces)
    return Batch(la, ra, ln, counts, ls, rs, pieces)


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


# --------------------------------------------------------------------- faults
async def namespace_faults(ns: NamespaceTarget, lanes: list[NamespaceLane], stop: asyncio.Event,
                           rng: random.Random, tally: Tally, garbage_sent: list[int],
                           kinds: tuple[str, ...]) -> None:
    """One fault at a time on the namespace target, at random times, each
    kind at least once per cycle (rails twice)."""
    cycle: list[str] = []
    await sleep_or_stop(stop, rng.uniform(2, 4))
    while not stop.is_set():
        if not cycle:
            cycle = [k for k in ("rail", "kill", "garbage", "rail") if k in kinds]
            rng.shuffle(cycle)
        kind = cycle.pop()
        if kind == "rail":
            rail = rng.randrange(2)
            f = tally.begin(f"rail {rail} down", "ns", grace=KEEPALIVE + 5)
            try:
                await ns.topo.set_rail(rail, False)
                await asyncio.sleep(rng.uniform(1, 4))
            finally:
                await ns.topo.set_rail(rail, True)
                f.end = time.monotonic()
        elif kind == "kill":
            f = tally.begin("target killed", "ns", grace=KEEPALIVE + 10)
            try:
                await ns.restart()
            finally:
                f.end = time.monotonic()
        else:
            ports = [(ns.topo.target(0), faults.TARGET_PORT)]
            for lane in lanes:
                if lane.peer is not None and lane.gen == ns.generation:
                    ports += [tuple(ep) for ep in lane.peer.descriptor.data]
                    break
            f = tally.begin("garbage clients", "ns", grace=2.0)
            halt = asyncio.Event()
            junk_rng = random.Random(rng.random())
            junk = [asyncio.get_running_loop().create_task(faults._junk(h, p, halt, junk_rng, garbage_sent))
                    for h, p in sorted(set(ports)) for _ in range(2)]
            try:
                await asyncio.sleep(rng.uniform(2, 5))
            finally:
                halt.set()
                await bounded(asyncio.gather(*junk), "garbage clients to stop", 10)
                f.end = time.monotonic()
        await sleep_or_stop(stop, rng.uniform(2, 6))


async def region_faults(lanes: list[PairLane], stop: asyncio.Event, rng: random.Random, tally: Tally) -> None:
    """deregister() then register() again, either side of an in-process pair."""
    await sleep_or_stop(stop, rng.uniform(1, 3))
    while not stop.is_set():
        lane = rng.choice(lanes)
        side = rng.choice(("dst", "src"))
        engine, buf, region, name = lane.region_of(side)
        f = tally.begin(f"deregister {side}", lane.name, grace=1.0)
        engine.deregister(region)
        fence: list[float | None] = [time.monotonic(), None]
        lane.fences.append(fence)
        try:
            await asyncio.sleep(rng.uniform(0.2, 1.5))
        finally:
            lane.set_region(side, engine.register(buf, name=name))
            fence[1] = f.end = time.monotonic()
        await sleep_or_stop(stop, rng.uniform(1.5, 5))


# ------------------------------------------------------------------- monitors
@dataclass
class Monitors:
    samples: list[dict[str, Any]] = field(default_factory=list)
    lag_max: float = 0.0
    stalls: list[tuple[float, float]] = field(default_factory=list)     # (t, seconds) over 1 s
    warnings: list[tuple[float, str]] = field(default_factory=list)
    loop_errors: list[str] = field(default_factory=list)


async def sample(mon: Monitors, t0: float, ns: NamespaceTarget, tally: Tally,
                 say: Callable[[str], None]) -> None:
    """Samples this process and the target; a progress line every 10 s."""
    n = 0
    while True:
        pid = ns.pid
        s = {"t": round(time.monotonic() - t0, 2), "rss": rss_mib(), "fds": fd_count(),
             "target_rss": rss_mib(pid) if pid else None, "target_fds": fd_count(pid) if pid else None,
             "target_gen": ns.generation}
        mon.samples.append(s)
        if n % max(1, round(10 / SAMPLE_S)) == 0:
            say(f"soak: t={s['t']:.0f} s ops={sum(tally.ops.values())} verified={tally.bytes_verified >> 20} MiB "
                f"faults={len(tally.faults)} failed={sum(tally.failed_by_error.values())} "
                f"corrupted={tally.corrupted} hangs={len(tally.hangs)} rss={s['rss']:.0f} MiB fds={s['fds']}")
        n += 1
        await asyncio.sleep(SAMPLE_S)


async def watch_lag(mon: Monitors, t0: float) -> None:
    """How late the loop runs a 0.1 s timer: starvation shows here before
    it shows as a keepalive firing."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(0.1)
        late = loop.time() - before - 0.1
        mon.lag_max = max(mon.lag_max, late)
        if late > 1.0:
            mon.stalls.append((round(before - t0, 2), round(late, 2)))


class WarningLog(logging.Handler):
    def __init__(self, mon: Monitors, t0: float) -> None:
        super().__init__(logging.WARNING)
        self.mon, self.t0 = mon, t0

    def emit(self, record: logging.LogRecord) -> None:
        self.mon.warnings.append((round(time.monotonic() - self.t0, 2), record.getMessage()))


def warning_kind(msg: str) -> str:
    for pattern, kind in ((r"silent for", "keepalive: peer declared lost"),
                          (r"data connection \d+ .* failed", "data connection failed"),
                          (r"data connection \d+ .* is back", "data connection rebuilt"),
                          (r"down at connect", "rail down at connect")):
        if re.search(pattern, msg):
            return kind
    return re.sub(r"[\d.:]+", "#", msg)[:70]


# ---------------------------------------------------------------------- soak
@dataclass
class SoakResult:
    seconds: float
    seed: int
    wall_s: float = 0.0
    lanes: list[str] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    monitors: Monitors = field(default_factory=Monitors)
    rss_slope: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    counters: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    garbage_kib: int = 0
    target_restarts: int = 0
    debug_build: bool = False
    big_cancels: bool = False

    def problems(self) -> list[str]:
        t = self.tally
        out = []
        if t.corrupted:
            out.append(f"{t.corrupted} corrupted")
        if t.hangs:
            out.append(f"{len(t.hangs)} hangs")
        if t.unexplained:
            out.append(f"{t.failed_by_fault['none']} failures no fault explains")
        if t.fence_violations:
            out.append(f"{len(t.fence_violations)} transfers succeeded on a deregistered region")
        if self.rss_slope > RSS_SLOPE_LIMIT:
            out.append(f"RSS grows {self.rss_slope:.1f} MiB/min over the second half (limit {RSS_SLOPE_LIMIT:g})")
        if self.fds_end > self.fds_start + FD_MARGIN:
            out.append(f"descriptors {self.fds_start} -> {self.fds_end}")
        if self.monitors.loop_errors:
            out.append(f"{len(self.monitors.loop_errors)} errors reached the loop's exception handler")
        out += self.leaks + self.tool_errors
        return out


async def quiesce(engines: dict[str, kvflow.Engine], keys: tuple[str, ...], want: Callable[[str, dict], dict],
                  limit: float) -> dict[str, dict[str, int]]:
    """Polls every engine's counters until `keys` reach want(name, ...)'s
    values (or `limit`); returns the last readings."""
    deadline = time.monotonic() + limit
    while True:
        now = {n: e.counters() for n, e in engines.items()}
        if all(now[n].get(k, 0) <= want(n, now[n]).get(k, 0) for n in engines for k in keys) \
                or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


async def soak(seconds: float, seed: int = 1, *, faults_on: tuple[str, ...] = FAULTS, big_cancels: bool = True,
               lanes_on: tuple[str, ...] = DEFAULT_LANES,
               log: Callable[[str], None] | None = None) -> SoakResult:
    """Runs the soak (see the module doc) and returns what it saw; the
    caller judges by result.problems(). faults_on: which kinds of FAULTS
    to inject; big_cancels: batches that are cancelled or time out get
    every shape (see ABORT_MAX_PIECES); lanes_on: which of LANES run
    (without "ns" no namespace is made and rail/kill/garbage faults have
    nothing to hit). Fixes glibc's mmap threshold for the rest of the
    process (fix_malloc_threshold)."""
    if not lanes_on or set(lanes_on) - set(LANES):
        raise ValueError(f"lanes_on: choose from {LANES}, not {lanes_on}")
    say = log or (lambda _m: None)
    fix_malloc_threshold()
    loop = asyncio.get_running_loop()
    res = SoakResult(seconds, seed, debug_build=bool(kvflow.features.get("debug")), big_cancels=big_cancels)
    tally, mon = res.tally, res.monitors
    gc.collect()
    res.fds_start = fd_count() or 0
    t_start = time.monotonic()
    tally.t0 = t_start

    previous = loop.get_exception_handler()

    def on_loop_error(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        mon.loop_errors.append(f"{ctx.get('message')}: {ctx.get('exception')!r}")
        (previous or (lambda _l, c: lp.default_exception_handler(c)))(lp, ctx)

    loop.set_exception_handler(on_loop_error)
    handler = WarningLog(mon, t_start)
    klog = logging.getLogger("kvflow")
    klog.addHandler(handler)
    rng = random.Random(seed)
    pool_rng = np.random.default_rng(seed)
    pool = pool_rng.integers(0, 256, POOL, dtype=np.uint8)

    topo = faults.Topology()
    ns = NamespaceTarget(topo)
    engines: dict[str, kvflow.Engine] = {}
    baseline: dict[str, dict[str, int]] = {}
    lanes: list[Lane] = []
    helpers: list[asyncio.Task[Any]] = []
    try:
        if "ns" in lanes_on:
            topo.up()
            await ns.start()
            say(f"soak: namespace target up (pid {ns.pid})")
        say(f"soak: lanes {', '.join(lanes_on)}; {seconds:g} s of load, seed {seed}")

        async def engine(name: str, listen: str, protocols: tuple[str, ...], **kw: Any) -> kvflow.Engine:
            e = kvflow.Engine(listen, protocols=protocols, keepalive=KEEPALIVE, **kw)
            await e.start()
            engines[name] = e
            baseline[name] = e.counters()
            return e

        ns_lanes = [
            NamespaceLane("ns-a", ns, await engine("ns-a", f"{topo.host(0)}:0", ("tcp",)), 0, tally, seed * 10 + 1),
            NamespaceLane("ns-b", ns, await engine("ns-b", f"{topo.host(0)}:0", ("tcp",), tcp_connections=1),
                          1, tally, seed * 10 + 2),
        ] if "ns" in lanes_on else []
        pair_lanes = []
        for proto in [p for p in LANES[1:] if p in lanes_on]:
            init = await engine(f"pair-{proto} initiator", "127.0.0.1:0", (proto,))
            tgt = await engine(f"pair-{proto} target", "127.0.0.1:0", (proto,))
            pair_lanes.append(PairLane(f"pair-{proto}", init, tgt, tally, seed * 10 + 2 + LANES.index(proto)))
        lanes = [*ns_lanes, *pair_lanes]
        for n, e in engines.items():
            # the lanes' windows stay registered until their engines close
            # (re-registration keeps the count): MRs are balanced from here
            baseline[n]["mrs"] = e.counters().get("mrs", 0)
        for lane in lanes:
            lane.pool = pool
            lane.abort_pieces = MAX_PIECES if big_cancels else ABORT_MAX_PIECES
        res.lanes = [f"{ln.name} ({ln.engine.protocols[0]})" for ln in lanes]

        helpers += [loop.create_task(sample(mon, t_start, ns, tally, say)), loop.create_task(watch_lag(mon, t_start))]
        stop = asyncio.Event()
        garbage_sent = [0]
        work = [loop.create_task(lane.run(stop)) for lane in lanes]
        chaos = []
        if set(faults_on) & {"rail", "kill", "garbage"} and ns_lanes:
            chaos.append(loop.create_task(namespace_faults(ns, ns_lanes, stop, random.Random(rng.random()), tally,
                                                           garbage_sent, faults_on)))
        if "dereg" in faults_on:
            chaos.append(loop.create_task(region_faults(pair_lanes, stop, random.Random(rng.random()), tally)))
        # The load ends early if any task dies (a bug in this tool or an
        # exception the engine should not raise): that is reported.
        ended = loop.create_task(asyncio.sleep(seconds))
        running = {ended, *work, *chaos}
        while ended in running:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                break
        ended.cancel()
        stop.set()
        say(f"soak: load stopped after {time.monotonic() - t_start:.0f} s; draining")
        done, pending = await asyncio.wait([*work, *chaos], timeout=2 * HANG_S + TARGET_START_S)
        for t in pending:
            res.tool_errors.append(f"a task did not stop within {2 * HANG_S + TARGET_START_S:g} s: {t!r}")
            t.cancel()
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                e = t.exception()
                res.tool_errors.append(f"task died: {type(e).__name__}: {e}")
        res.garbage_kib = garbage_sent[0] >> 10
        res.target_restarts = ns.generation

        # Everything awaited: no batch, no slice may be left in flight.
        quiet = await quiesce(engines, ("slices_inflight", "batches"), lambda n, c: {}, QUIESCE_S)
        res.counters["load stopped"] = quiet
        for n, c in quiet.items():
            if c.get("slices_inflight") or c.get("batches"):
                res.leaks.append(f"{n}: in flight after the load stopped: {c}")

        for lane in lanes:
            try:
                await lane.sweep()
            except (kvflow.KVFlowError, Hang, RuntimeError) as e:
                res.tool_errors.append(f"{lane.name}: sweep failed: {e}")

        # Peers closed: each engine's sockets and threads back to their
        # value after start() (the target side's sessions end when their
        # connections close).
        for lane in lanes:
            if lane.peer is not None:
                try:
                    await bounded(lane.peer.close(), "peer.close()")
                except Hang as e:
                    res.tool_errors.append(f"{lane.name}: {e}")
            if isinstance(lane, PairLane) and lane.consumer is not None:
                lane.consumer.cancel()
        released = await quiesce(engines, RESOURCES, lambda n, c: baseline[n], RELEASE_S)
        res.counters["after start"] = baseline
        res.counters["peers closed"] = released
        for n, c in released.items():
            # resources only: fenced, cut_off and wakeups are tallies of events, they only grow
            over = {k: (baseline[n].get(k, 0), v) for k, v in c.items()
                    if k in RESOURCES and v > baseline[n].get(k, 0)}
            if over:
                res.leaks.append(f"{n}: counters above their value after start() once its peers "
                                 f"closed (start, now): {over}")
    finally:
        for t in helpers:
            t.cancel()
        for lane in lanes:
            if isinstance(lane, PairLane) and lane.consumer is not None:
                lane.consumer.cancel()
        await asyncio.gather(*helpers, *[ln.consumer for ln in lanes
                                         if isinstance(ln, PairLane) and ln.consumer is not None],
                             return_exceptions=True)
        closed = {}
        for n, e in engines.items():
            await bounded(e.close(), f"closing {n}")
            closed[n] = e.counters()
        res.counters["closed"] = closed
        try:
            if "ns" in lanes_on:
                await ns.stop()
        finally:
            if "ns" in lanes_on:
                topo.down()
            klog.removeHandler(handler)
            loop.set_exception_handler(previous)
    lanes.clear()
    engines.clear()
    gc.collect()
    await asyncio.sleep(0.2)          # subprocess pipe transports close on the next iterations
    gc.collect()
    res.fds_end = fd_count() or 0
    res.rss_slope = slope_mib_per_min(mon.samples)
    res.wall_s = round(time.monotonic() - t_start, 1)
    return res


# --------------------------------------------------------------------- report
def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(res: SoakResult) -> str:
    t, mon = res.tally, res.monitors
    rows = [f"soak: {res.seconds:g} s of load (wall {res.wall_s:g} s), seed {res.seed}, keepalive {KEEPALIVE:g} s, "
            f"lanes: {', '.join(res.lanes)}; kvflow.features['debug']: {res.debug_build}",
            "cancelled and timed-out batches: " + ("any shape" if res.big_cancels else
                                                   f"at most {ABORT_MAX_PIECES} pieces (--small-cancels)"), "",
            "| operation | count | ok | cancelled | timed out | failed | hang |",
            "|---|---|---|---|---|---|---|"]
    for op in [o for o, _ in OPERATIONS] + ["connect"]:
        if not t.ops[op]:
            continue
        oc = t.outcomes
        rows.append(f"| {op} | {t.ops[op]} | {oc[f'{op} ok']} | {oc[f'{op} TransferCancelledError']} | "
                    f"{oc[f'{op} TransferTimeoutError']} | {oc[f'{op} failed']} | {oc[f'{op} HANG']} |")
    rows += ["", "| MiB written | MiB read | MiB verified | MiB swept at end "
             "| writes unverifiable (target restarted) |",
             "|---|---|---|---|---|",
             f"| {_mib(t.bytes_written)} | {_mib(t.bytes_read)} | {_mib(t.bytes_verified)} | {_mib(t.bytes_swept)} "
             f"| {t.unverified} |", ""]
    kinds = Counter(f.kind for f in t.faults)
    rows.append("faults injected: " + (", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none")
                + f" (target restarts: {res.target_restarts}; garbage sent: {res.garbage_kib} KiB)")
    rows.append("namespace faults (t s, lasted s): " + (", ".join(
        f"{f.start - t.t0:.0f} {f.kind} {0 if f.end is None else f.end - f.start:.1f}"
        for f in t.faults if f.scope == "ns") or "none"))
    rows.append("failures by error: " + (", ".join(f"{k} {v}" for k, v in t.failed_by_error.most_common())
                                         or "none"))
    rows.append("failures by fault: " + (", ".join(f"{k} {v}" for k, v in t.failed_by_fault.most_common())
                                         or "none"))
    rows.append(f"notifications: {t.notifications_sent} sent, {t.notifications_checked} checked on arrival, "
                f"{t.notifications_unmatched} unmatched")
    rows.append(f"corrupted: {t.corrupted} (late landings of writes abandoned after DRAIN_GRACE: "
                f"{t.late_landings})   hangs: {len(t.hangs)}   unexplained failures: "
                f"{t.failed_by_fault['none']}   fence violations: {len(t.fence_violations)}")
    rss = [s["rss"] for s in mon.samples if s.get("rss") is not None]
    if rss:
        rows.append(f"RSS MiB start/mid/end: {rss[0]:.0f} / {rss[len(rss) // 2]:.0f} / {rss[-1]:.0f}; "
                    f"slope over the second half: {res.rss_slope:+.2f} MiB/min (limit {RSS_SLOPE_LIMIT:g})")
    fds = [s["fds"] for s in mon.samples if s.get("fds") is not None]
    rows.append(f"fds start/peak/end: {res.fds_start} / {max(fds, default=0)} / {res.fds_end} "
                f"(margin {FD_MARGIN})")
    last = [s for s in mon.samples if s.get("target_rss") is not None]
    last = [s for s in last if s["target_gen"] == last[-1]["target_gen"]] if last else []
    if last:
        rows.append(f"namespace target, last of {res.target_restarts + 1} incarnations: RSS MiB peak/last "
                    f"{max(s['target_rss'] for s in last):.0f} / {last[-1]['target_rss']:.0f}, "
                    f"fds peak/last {max(s['target_fds'] for s in last)} / {last[-1]['target_fds']}")
    rows.append(f"loop lag max: {mon.lag_max:.2f} s; stalls over 1 s: {len(mon.stalls)} {mon.stalls[:5]}")
    wk = Counter(warning_kind(m) for _, m in mon.warnings)
    rows.append("kvflow warnings: " + (", ".join(f"{k} x{v}" for k, v in wk.most_common()) or "none"))
    rows += ["", "| engine | load stopped (slices, batches) | after start (sockets, threads) | "
             "peers closed (sockets, threads, slices, batches) | closed |", "|---|---|---|---|---|"]
    c = res.counters
    for n in c.get("after start", {}):
        q, b, p, z = (c.get(k, {}).get(n, {}) for k in ("load stopped", "after start", "peers closed", "closed"))
        rows.append(f"| {n} | {q.get('slices_inflight')}, {q.get('batches')} | {b.get('sockets')}, "
                    f"{b.get('threads')} | {p.get('sockets')}, {p.get('threads')}, {p.get('slices_inflight')}, "
                    f"{p.get('batches')} | {'all 0' if z and not any(z.values()) else z} |")
    if not any(ln.endswith("(rdma)") for ln in res.lanes):
        rows.append("(MR and QP counters: no rdma engine in this soak)")
    else:
        rows.append("| engine (MRs, QPs) | after start and the lanes' registrations | load stopped | peers closed "
                    "| closed |")
        rows.append("|---|---|---|---|---|")
        for n in c.get("after start", {}):
            b, q, p, z = (c.get(k, {}).get(n, {}) for k in ("after start", "load stopped", "peers closed", "closed"))
            rows.append(f"| {n} | {b.get('mrs')}, {b.get('qps')} | {q.get('mrs')}, {q.get('qps')} | "
                        f"{p.get('mrs')}, {p.get('qps')} | {z.get('mrs')}, {z.get('qps')} |")
    for title, items in (("unexplained failures", t.unexplained), ("corruption", t.corruption),
                         ("hangs", t.hangs), ("fence violations", t.fence_violations)):
        for it in items[:10]:
            rows.append(f"- {title}: {it}")
    for _, m in [w for w in mon.warnings if "silent for" in w[1]][:10]:
        rows.append(f"- keepalive: {m}")
    for ts, m in [w for w in mon.warnings if "silent for" in w[1]][:10]:
        rows.append(f"  at t={ts} s")
    problems = res.problems()
    rows.append("")
    rows.append("verdict: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return "\n".join(rows)


def plain(obj: Any) -> Any:
    """JSON-ready copy (dataclasses.asdict would count a Counter's items)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {k: plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def to_json(res: SoakResult) -> dict[str, Any]:
    out = plain(res)
    out["tally"]["faults"] = [{"kind": f.kind, "scope": f.scope, "t": round(f.start - res.tally.t0, 2),
                               "lasted": None if f.end is None else round(f.end - f.start, 2)}
                              for f in res.tally.faults]
    out["problems"] = res.problems()
    out["rss_slope_mib_per_min"] = res.rss_slope
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0, help="length of the load")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    ap.add_argument("--small-cancels", action="store_true",
                    help="cancel and time out only batches of at most 16 pieces")
    ap.add_argument("--lanes", default=",".join(DEFAULT_LANES), help="comma-separated: " + ", ".join(LANES))
    a = ap.parse_args(argv)
    lanes = tuple(x for x in a.lanes.split(",") if x)
    if not lanes or set(lanes) - set(LANES):
        ap.error(f"--lanes: choose from {', '.join(LANES)}")
    why = faults.netns_unavailable() if "ns" in lanes else None
    if why:
        print(f"soak: {why}", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    chosen = tuple(f for f in a.faults.split(",") if f)
    if set(chosen) - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(set(chosen) - set(FAULTS))}")
    res = asyncio.run(soak(a.seconds, seed, faults_on=chosen, big_cancels=not a.small_cancels, lanes_on=lanes,
                           log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(to_json(res), f, indent=1, default=str)
    return 0 if not res.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
