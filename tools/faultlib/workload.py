"""The fault suite's checksummed workload and its Report, and the small
helpers the cases share."""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable

import numpy as np

import kvflow
import kvflow.control.wire
from faultlib.channel import REGION, TargetGone

if TYPE_CHECKING:      # procs imports this module (serve_initiator runs the workload)
    from faultlib.procs import Target


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


def _after(seconds: float) -> asyncio.Event:
    ev = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, ev.set)
    return ev
