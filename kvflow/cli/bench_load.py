"""kvflow-bench's load and report: the coroutines that keep batches in
flight, the measured phase, verification, and the table or JSON lines."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, TextIO

import numpy as np

import kvflow
from kvflow.cli.bench_layout import (
    BenchError,
    format_size,
    HostBuffer,
    Layout,
    _MESSAGE_PREFIX,
    _PROGRESS_INTERVAL_S,
    ranges_digest,
)
from kvflow.tasks import cancel_and_wait


# --------------------------------------------------------------------------
# Request/reply over kvflow notifications


def encode_message(body: dict[str, Any]) -> bytes:
    return _MESSAGE_PREFIX + json.dumps(body, separators=(",", ":")).encode()


def decode_message(data: bytes) -> Optional[dict[str, Any]]:
    if not bytes(data[: len(_MESSAGE_PREFIX)]) == _MESSAGE_PREFIX:
        return None
    try:
        body = json.loads(bytes(data[len(_MESSAGE_PREFIX) :]))
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


class ReplyRouter:
    """Sends requests as notifications and matches replies to them by id.

    One task owns ``engine.notifications()`` for the initiator's lifetime, so
    no reply is lost between two requests.
    """

    def __init__(self, engine: kvflow.Engine) -> None:
        self._engine = engine
        self._waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 1
        self._task: Optional[asyncio.Task[None]] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        failure: BaseException = BenchError("notification stream ended")
        try:
            async for _sender, data in self._engine.notifications():
                body = decode_message(data)
                if body is None:
                    continue
                request_id = body.get("id")
                if type(request_id) is not int:
                    continue
                waiter = self._waiters.pop(request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(body)
        except asyncio.CancelledError:
            failure = BenchError("reply router closed")
            raise
        except Exception as exc:  # surfaced to whoever waits for a reply
            failure = exc
        finally:
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(failure)
            self._waiters.clear()

    async def request(self, peer: Any, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Send ``body`` to ``peer`` and wait for the reply with the same id.

        Raises:
            BenchError: no reply within ``timeout`` or the target reported an error.
            kvflow.KVFlowError: the notification could not be sent.
        """
        if self._task is None or self._task.done():
            raise BenchError("reply router is not running")
        request_id = self._next_id
        self._next_id += 1
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        try:
            await peer.notify(encode_message({**body, "id": request_id}))
            try:
                reply = await asyncio.wait_for(waiter, timeout)
            except asyncio.TimeoutError:
                raise BenchError(
                    f"no reply to {body.get('op')!r} from {peer.address} within {timeout:g} s"
                ) from None
        finally:
            self._waiters.pop(request_id, None)
        if "error" in reply:
            raise BenchError(f"target {peer.address} refused {body.get('op')!r}: {reply['error']}")
        return reply

    async def close(self) -> None:
        # what the task raised was delivered to the waiters already
        await cancel_and_wait([self._task])
        self._task = None


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            print(f"kvflow-bench: background task failed: {exc!r}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Load


@dataclass
class RunResult:
    protocol: str
    op: str
    layout: Layout
    nbytes: int
    seconds: float
    latency_p50_us: float
    latency_p99_us: float
    batches: int
    verified: Optional[bool] = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def entries_per_s(self) -> float:
        return self.batches * self.layout.batch / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "op": self.op,
            "block_size": self.layout.block_size,
            "batch": self.layout.batch,
            "concurrency": self.layout.concurrency,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 4),
            "latency_p50_us": round(self.latency_p50_us, 2),
            "latency_p99_us": round(self.latency_p99_us, 2),
            "entries_per_s": round(self.entries_per_s, 1),
            "verified": self.verified,
        }


class _RunState:
    """Shared by the slot coroutines of one run; all on the loop thread."""

    __slots__ = ("measuring", "phase_start_ns", "deadline_ns", "budget", "stop", "bytes_done",
                 "bytes_measured", "first_start_ns", "last_end_ns")

    def __init__(self, budget: Optional[int]) -> None:
        # Two phases: warmup, then the measured one. Every slot finishes its
        # warmup batches before any measured batch starts (as the baselines
        # in tools/ do): a warmup batch still in flight would take bandwidth
        # from the measured window. No batch of a phase starts at or after
        # its deadline_ns.
        self.measuring = False
        self.phase_start_ns = time.perf_counter_ns()
        self.deadline_ns = 1 << 62
        # Batches left to issue with --total-bytes; None with --duration.
        self.budget = budget
        self.stop = False
        self.bytes_done = 0
        self.bytes_measured = 0
        # The measured window: from the first measured batch's start to the
        # last one's end.
        self.first_start_ns = 1 << 62
        self.last_end_ns = 0

    def start_phase(self, measuring: bool, seconds: Optional[float]) -> None:
        self.measuring = measuring
        self.phase_start_ns = time.perf_counter_ns()
        self.deadline_ns = 1 << 62 if seconds is None else self.phase_start_ns + int(seconds * 1e9)


# A slot yields to the loop at least this often even if the engine completes
# every batch inline (an already-resolved awaitable never suspends), so the
# other slots and the progress line still get to run.
_YIELD_EVERY = 64


async def _drive_slot(
    transfer: Callable[..., Awaitable[None]],
    local: np.ndarray,
    remote: np.ndarray,
    lengths: np.ndarray,
    timeout: Optional[float],
    batch_bytes: int,
    state: _RunState,
    latencies: Optional[list[int]],
) -> None:
    """Runs one slot's batches back to back until the phase's deadline (or
    budget); `latencies` None: the warmup phase, nothing recorded."""
    # The hot loop: arrays are built once, names are bound to locals, and the
    # only per-batch allocation is the latency int, so what is measured is the
    # engine, not this loop. The loop checks the clock itself rather than
    # waiting for a timer task, which an inline-completing engine would starve.
    perf_ns = time.perf_counter_ns
    deadline_ns = state.deadline_ns
    measured = latencies is not None
    record = latencies.append if latencies is not None else None
    countdown = _YIELD_EVERY
    while not state.stop:
        started = perf_ns()
        # Past the deadline, stop, but only once this slot has measured a
        # batch: a batch longer than the whole window still gets measured.
        if started >= deadline_ns and (latencies or not measured):
            return
        if measured and state.budget is not None:
            if state.budget <= 0:
                return
            state.budget -= 1
        await transfer(local, remote, lengths, timeout=timeout)
        ended = perf_ns()
        state.bytes_done += batch_bytes
        if record is not None:
            record(ended - started)
            state.bytes_measured += batch_bytes
            if started < state.first_start_ns:
                state.first_start_ns = started
            if ended > state.last_end_ns:
                state.last_end_ns = ended
        countdown -= 1
        if not countdown:
            countdown = _YIELD_EVERY
            await asyncio.sleep(0)


async def _show_progress(state: _RunState, args: argparse.Namespace, label: str, stream: TextIO) -> None:
    perf_ns = time.perf_counter_ns
    last_ns, last_bytes = perf_ns(), 0
    begun_ns = last_ns
    width = 0
    # a terminal gets one line rewritten in place; a log one line per second
    tty = hasattr(stream, "isatty") and stream.isatty()
    try:
        while True:
            await asyncio.sleep(_PROGRESS_INTERVAL_S if tty else 1.0)
            now_ns, done = perf_ns(), state.bytes_done
            rate = (done - last_bytes) / max(now_ns - last_ns, 1)  # bytes/ns == GB/s
            last_ns, last_bytes = now_ns, done
            if not state.measuring:
                shown = done
                phase = f"warmup {(now_ns - begun_ns) / 1e9:4.1f}/{args.warmup:g} s"
            elif args.total_bytes is not None:
                shown = state.bytes_measured
                phase = f"of {format_size(args.total_bytes)}"
            else:
                shown = state.bytes_measured
                phase = f"{(now_ns - state.phase_start_ns) / 1e9:5.1f}/{args.duration:g} s"
            line = f"{label}  {format_size(shown):>11}  {rate:8.3f} GB/s  {phase}"
            if not tty:
                stream.write(f"kvflow-bench: {line}\n")
                stream.flush()
                continue
            line = "\r" + line
            width = max(width, len(line))
            stream.write(line.ljust(width))
            stream.flush()
    finally:
        if width:
            stream.write("\r" + " " * width + "\r")
            stream.flush()


async def measure(
    peer: Any,
    layout: Layout,
    local_base: int,
    remote_base: int,
    args: argparse.Namespace,
    progress: Optional[TextIO],
) -> RunResult:
    """Run one load (warmup, then --duration or --total-bytes) and measure it.

    Raises:
        kvflow.KVFlowError: a transfer failed; the other slots are let finish
            their batch in flight first.
    """
    loop = asyncio.get_running_loop()
    transfer = peer.write if args.op == "write" else peer.read
    budget = None
    if args.total_bytes is not None:
        budget = max(1, -(-args.total_bytes // layout.batch_bytes))
    per_slot: list[list[int]] = [[] for _ in range(layout.concurrency)]
    slot_arrays = [layout.slot_arrays(i, local_base, remote_base) for i in range(layout.concurrency)]

    state = _RunState(budget)
    helpers: list[asyncio.Task[None]] = []
    if progress is not None:
        label = f"{args.op} {format_size(layout.block_size)} x{layout.batch}"
        helpers.append(loop.create_task(_show_progress(state, args, label, progress)))

    async def phase(measuring: bool, seconds: Optional[float]) -> None:
        state.start_phase(measuring, seconds)
        slots = [
            loop.create_task(_drive_slot(transfer, *arrays, args.timeout, layout.batch_bytes, state,
                                         latencies if measuring else None))
            for arrays, latencies in zip(slot_arrays, per_slot)
        ]
        try:
            done, pending = await asyncio.wait(slots, return_when=asyncio.FIRST_EXCEPTION)
            failed = [task for task in done if not task.cancelled() and task.exception() is not None]
            if failed:
                # Let the others complete the batch they have in flight (bounded
                # by --timeout) rather than cancel transfers mid-way.
                state.stop = True
                await asyncio.gather(*pending, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
        finally:
            for task in slots:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)

    try:
        if args.warmup > 0:
            await phase(False, args.warmup)
        await phase(True, args.duration if args.total_bytes is None else None)
    finally:
        state.stop = True
        await cancel_all(helpers)

    batches = sum(len(latencies) for latencies in per_slot)
    if batches == 0:
        raise BenchError("no batch completed in the measurement window")
    latencies_ns = np.fromiter(
        (value for latencies in per_slot for value in latencies), dtype=np.int64, count=batches
    )
    p50, p99 = np.percentile(latencies_ns, [50, 99])
    return RunResult(
        protocol=peer.transport,
        op=args.op,
        layout=layout,
        nbytes=batches * layout.batch_bytes,
        seconds=(state.last_end_ns - state.first_start_ns) / 1e9,
        latency_p50_us=float(p50) / 1e3,
        latency_p99_us=float(p99) / 1e3,
        batches=batches,
    )


async def verify_run(
    router: ReplyRouter, peer: Any, buffer: HostBuffer, layout: Layout, remote_offset: int, args: argparse.Namespace
) -> bool:
    """Compare the checksum of the entries on both sides after a run."""
    request = {
        "op": "checksum",
        "offset": remote_offset,
        "stride": layout.stride,
        "length": layout.block_size,
        "count": layout.distinct_entries,
    }
    local_task = asyncio.to_thread(
        ranges_digest, memoryview(buffer.array), 0, layout.stride, layout.block_size,
        layout.distinct_entries,
    )
    reply, local_digest = await asyncio.gather(
        router.request(peer, request, timeout=args.verify_timeout), local_task
    )
    return reply.get("digest") == local_digest


# --------------------------------------------------------------------------
# Reporting


_COLUMNS = (
    # (title, width, json-or-derived value formatter)
    ("protocol", 8),
    ("op", 5),
    ("layout", 7),
    ("block", 10),
    ("batch", 6),
    ("conc", 5),
    ("bytes", 11),
    ("seconds", 8),
    ("GB/s", 9),
    ("p50 us", 10),
    ("p99 us", 10),
    ("entries/s", 12),
    ("verified", 8),
)


class Reporter:
    """JSON lines (--json) or a plain aligned table, one row per run."""

    def __init__(self, as_json: bool, stream: TextIO) -> None:
        self._json = as_json
        self._stream = stream
        self._header_done = False

    def row(self, result: RunResult) -> None:
        if self._json:
            print(json.dumps(result.as_json()), file=self._stream, flush=True)
            return
        if not self._header_done:
            print(self._format([title for title, _ in _COLUMNS]), file=self._stream)
            print(self._format(["-" * width for _, width in _COLUMNS]), file=self._stream)
            self._header_done = True
        verified = {None: "-", True: "yes", False: "NO"}[result.verified]
        cells = [
            result.protocol,
            result.op,
            "scatter" if result.layout.scatter else "contig",
            format_size(result.layout.block_size),
            str(result.layout.batch),
            str(result.layout.concurrency),
            format_size(result.nbytes),
            f"{result.seconds:.3f}",
            f"{result.gbps:.3f}",
            f"{result.latency_p50_us:.1f}",
            f"{result.latency_p99_us:.1f}",
            f"{result.entries_per_s:,.0f}",
            verified,
        ]
        print(self._format(cells), file=self._stream, flush=True)

    @staticmethod
    def _format(cells: Sequence[str]) -> str:
        parts = []
        for (title, width), cell in zip(_COLUMNS, cells):
            left = title in ("protocol", "op", "layout")
            parts.append(cell.ljust(width) if left else cell.rjust(width))
        return "  ".join(parts).rstrip()


