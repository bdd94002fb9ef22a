"""The soak's limits and shapes (sizes, timeouts, the mix of
operations), its process probes and the random batches the lanes send."""
from __future__ import annotations

import asyncio
import ctypes
import hashlib
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, TypeVar

import numpy as np

import kvflow

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
