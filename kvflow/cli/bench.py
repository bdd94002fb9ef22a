"""kvflow-bench: throughput and latency of kvflow transfers.

A perf-test CLI in the spirit of Mooncake's ``transfer_engine_bench`` and
``nixlbench``. Three roles:

``target``
    Starts an :class:`kvflow.Engine`, registers one buffer named ``bench``,
    prints ``KVFLOW_TARGET <address>`` on stdout and serves until SIGINT or
    SIGTERM (or until stdin reaches EOF with ``--stdin-control``). It also
    answers checksum requests that ``--verify`` sends as kvflow notifications.
``initiator --target ADDR``
    Connects to a target and runs the load: ``--concurrency`` coroutines, each
    awaiting one batch of ``--batch`` entries of ``--block-size`` bytes at a
    time on its own slice of the local and the remote buffer.
``pair``
    Starts a target in a child process on this machine, runs the initiator
    against it, then stops the target.

Examples::

    kvflow-bench pair --protocol tcp --block-size 64K --batch 64 --duration 2
    kvflow-bench pair --sweep --block-size 4K,64K,1M,16M --json
    kvflow-bench target --listen 10.0.0.1:7777 --buffer-size 1G
    kvflow-bench initiator --target 10.0.0.1:7777 --listen 10.0.0.2:0 --op read

Sizes accept a plain byte count or a binary suffix: ``4K``, ``64KiB``, ``1M``,
``16MiB``, ``1G`` (K, KB and KiB all mean 1024 bytes, as in nixlbench).

Throughput (``gbps``) is in 10**9 bytes per second. Latency percentiles are per
batch, from the call to ``peer.write``/``peer.read`` to its completion.

Exit status: 0 success, 1 error, 2 usage error, 3 verification mismatch,
130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Awaitable, Callable, Optional, Sequence, TextIO

import numpy as np

import kvflow

__all__ = ["main", "parse_size", "format_size"]

REGION_NAME = "bench"
TARGET_BANNER = "KVFLOW_TARGET"
DEFAULT_BLOCK_SIZE = "64K"
DEFAULT_SWEEP = "4K,16K,64K,256K,1M"
MIN_TARGET_BUFFER = 64 << 20
# Same default as tools/baselines, so both sides of a comparison touch the
# same amount of memory.
DEFAULT_MAX_REGION = 256 << 20
SECRET_ENV = "KVFLOW_BENCH_SECRET"

# Requests and replies between initiator and target ride on kvflow
# notifications: this prefix plus one JSON object. Notifications that do not
# start with it belong to someone else and are ignored.
_MESSAGE_PREFIX = b"kvflow-bench "
# Bounds what one checksum request may ask of a target (per-range hashing is
# a Python loop on the target).
_MAX_CHECKSUM_RANGES = 1 << 24
_PAGE = 4096
_PROGRESS_INTERVAL_S = 0.25
# The two sides seed their fill patterns from different key spaces so that a
# transfer that never happened cannot look like one that did.
_TARGET_PATTERN_TAG = 1
_INITIATOR_PATTERN_TAG = 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PATTERN_CHUNK_WORDS = 1 << 20


class BenchError(Exception):
    """A failure of the benchmark itself (setup, target, verification)."""


# --------------------------------------------------------------------------
# Sizes


_SIZE_RE = re.compile(
    r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE
)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``4096``, ``4K``, ``64KiB``, ``1.5M``, ``16MiB`` into bytes.

    Raises:
        ValueError: not a size, not a whole number of bytes, or not positive.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"not a size: {text!r} (examples: 4096, 4K, 64KiB, 1M, 16MiB)"
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    value = Fraction(number) * _SIZE_UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)


def parse_size_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of sizes (``4K,64K,1M``)."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"no sizes in {text!r}")
    return tuple(parse_size(part) for part in parts)


def format_size(nbytes: float) -> str:
    """Binary-unit rendering: ``64 KiB``, ``1.5 MiB``, ``512 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _size_argument(nbytes: int) -> str:
    """The shortest exact --xxx-size spelling of ``nbytes`` (``512M``)."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1: {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"must be >= 0: {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0: {text!r}")
    return value


# --------------------------------------------------------------------------
# Memory layout and host buffers


@dataclass(frozen=True)
class Layout:
    """Where each concurrent slot's entries live in the two buffers.

    Entry ``k`` of the run (entry ``j`` of slot ``i``, ``k = i * batch + j``)
    sits at offset ``(k mod per_region) * stride`` on both sides, so each slot
    has its own slice of both buffers unless the whole layout would exceed
    ``max_region``; then entries wrap around (as in tools/baselines), which
    keeps 16 MiB blocks x large batches inside a sane amount of memory.
    Wrapped entries write identical bytes to identical places, so the
    checksum of the distinct ranges, one arithmetic progression, still tells
    whether the data arrived.
    """

    block_size: int
    batch: int
    concurrency: int
    scatter: bool
    max_region: int

    @property
    def stride(self) -> int:
        # Scatter leaves a one-block gap after every entry on both sides, so
        # no two entries are adjacent and the engine cannot coalesce them.
        return 2 * self.block_size if self.scatter else self.block_size

    @property
    def entries(self) -> int:
        """Entries in flight at once: one batch per slot."""
        return self.batch * self.concurrency

    @property
    def distinct_entries(self) -> int:
        """Entries at distinct offsets (fewer than ``entries`` when wrapping)."""
        return min(self.entries, max(1, self.max_region // self.stride))

    @property
    def span(self) -> int:
        """Bytes of each buffer the run touches (including scatter gaps)."""
        return self.distinct_entries * self.stride

    @property
    def batch_bytes(self) -> int:
        return self.batch * self.block_size

    def slot_arrays(
        self, slot: int, local_base: int, remote_base: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (local, remote, lengths) uint64 arrays of one slot's batch."""
        first = slot * self.batch
        index = np.arange(first, first + self.batch, dtype=np.uint64)
        offsets = (index % np.uint64(self.distinct_entries)) * np.uint64(self.stride)
        local = offsets + np.uint64(local_base)
        remote = offsets + np.uint64(remote_base)
        lengths = np.full(self.batch, self.block_size, dtype=np.uint64)
        return local, remote, lengths


def default_target_buffer_size(layouts: Sequence[Layout]) -> int:
    return max([MIN_TARGET_BUFFER, *(layout.span for layout in layouts)])


def _splitmix64(value: int) -> int:
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


class HostBuffer:
    """A page-aligned numpy byte buffer whose pages are all touched up front.

    Touching every page before the run keeps first-touch page faults out of
    the measurement.
    """

    def __init__(self, nbytes: int) -> None:
        nbytes = (nbytes + 7) // 8 * 8  # the fill pattern is written as uint64
        try:
            raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
        except MemoryError:
            raise BenchError(f"cannot allocate a {format_size(nbytes)} buffer") from None
        start = (-raw.ctypes.data) % _PAGE
        self.array = raw[start : start + nbytes]
        self.nbytes = nbytes

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    def fill_pattern(self, seed: int, tag: int) -> None:
        """Fill with ``word[k] = k * golden ^ key(seed, tag)``.

        Position dependent (a block landing at the wrong offset is caught) and
        cheap enough for multi-GiB buffers; written in chunks so no temporary
        the size of the buffer is allocated.
        """
        words = self.array.view(np.uint64)
        key = np.uint64(_splitmix64((tag << 56) ^ seed))
        for start in range(0, words.size, _PATTERN_CHUNK_WORDS):
            stop = min(start + _PATTERN_CHUNK_WORDS, words.size)
            out = words[start:stop]
            np.multiply(np.arange(start, stop, dtype=np.uint64), _GOLDEN, out=out)
            np.bitwise_xor(out, key, out=out)


def ranges_digest(memory: memoryview, offset: int, stride: int, length: int, count: int) -> str:
    """blake2b of ``count`` ranges ``[offset + k*stride, +length)``, concatenated.

    Raises:
        ValueError: the request is malformed or reaches outside ``memory``.
    """
    for name, value in (("offset", offset), ("stride", stride), ("length", length), ("count", count)):
        if type(value) is not int:
            raise ValueError(f"{name} must be an integer")
    if offset < 0 or length < 1 or count < 1 or stride < length:
        raise ValueError("need offset >= 0, length >= 1, count >= 1, stride >= length")
    if count > _MAX_CHECKSUM_RANGES:
        raise ValueError(f"count {count} exceeds {_MAX_CHECKSUM_RANGES}")
    end = offset + (count - 1) * stride + length
    if end > len(memory):
        raise ValueError(f"ranges end at {end}, beyond the {len(memory)}-byte buffer")
    digest = hashlib.blake2b(digest_size=32)
    if stride == length:
        # Hashing is streaming, so one contiguous update gives the same digest.
        digest.update(memory[offset:end])
    else:
        for start in range(offset, end, stride):
            digest.update(memory[start : start + length])
    return digest.hexdigest()


# --------------------------------------------------------------------------
# Request/reply over kvflow notifications


def _encode_message(body: dict[str, Any]) -> bytes:
    return _MESSAGE_PREFIX + json.dumps(body, separators=(",", ":")).encode()


def _decode_message(data: bytes) -> Optional[dict[str, Any]]:
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
                body = _decode_message(data)
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
            await peer.notify(_encode_message({**body, "id": request_id}))
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
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass  # already delivered to the waiters, if any
            self._task = None


# --------------------------------------------------------------------------
# Engine setup


def _make_engine(args: argparse.Namespace, listen: str) -> kvflow.Engine:
    protocols = None if args.protocol == "auto" else (args.protocol,)
    return kvflow.Engine(
        listen=listen,
        protocols=protocols,
        secret=args.secret or os.environ.get(SECRET_ENV) or None,
        tcp_connections=args.tcp_connections,
        **{key: value for key, value in (("slice_size", args.slice_size),
                                         ("rdma_slice_size", args.rdma_slice_size)) if value is not None},
    )


def _log(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(f"kvflow-bench: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Target


async def run_target(args: argparse.Namespace) -> int:
    """Serve one registered buffer until told to stop."""
    layouts = _layouts(args)
    size = args.buffer_size or default_target_buffer_size(layouts)
    buffer = HostBuffer(size)
    # Fills the pages (no first-touch faults during the run) with a pattern an
    # initiator's read can be verified against.
    buffer.fill_pattern(args.seed, _TARGET_PATTERN_TAG)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    helpers: list[asyncio.Task[None]] = []
    try:
        async with _make_engine(args, args.listen) as engine:
            region = engine.register(buffer.array, name=REGION_NAME)
            try:
                print(f"{TARGET_BANNER} {engine.address}", flush=True)
                _log(args, f"target serving {format_size(buffer.nbytes)} region {REGION_NAME!r} at {engine.address}")
                helpers.append(loop.create_task(_serve_requests(engine, buffer, args)))
                if args.stdin_control:
                    helpers.append(loop.create_task(_stop_on_stdin_eof(stop)))
                await stop.wait()
                _log(args, "target stopping")
            finally:
                await _cancel_all(helpers)
                engine.deregister(region)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0


async def _stop_on_stdin_eof(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
        )
    except (ValueError, OSError):
        # stdin is a regular file: connect_read_pipe refuses those, and
        # reading one to EOF does not block for long.
        await asyncio.to_thread(sys.stdin.buffer.read)
    else:
        try:
            while await reader.read(1 << 16):
                pass
        finally:
            transport.close()
    stop.set()


async def _serve_requests(engine: kvflow.Engine, buffer: HostBuffer, args: argparse.Namespace) -> None:
    memory = memoryview(buffer.array)
    async for sender, data in engine.notifications():
        body = _decode_message(data)
        if body is None:
            continue
        reply: dict[str, Any] = {"id": body.get("id"), "op": body.get("op")}
        try:
            if body.get("op") != "checksum":
                raise ValueError(f"unknown request {body.get('op')!r}")
            # hashlib releases the GIL on large updates; the thread keeps the
            # loop (and the engine's completions) running meanwhile.
            reply["digest"] = await asyncio.to_thread(
                ranges_digest, memory,
                body.get("offset"), body.get("stride"), body.get("length"), body.get("count"),
            )
        except ValueError as exc:
            reply["error"] = str(exc)
        _log(args, f"checksum request from {sender}: {reply.get('error', 'ok')}")
        try:
            peer = await engine.connect(sender)
            await peer.notify(_encode_message(reply))
        except kvflow.KVFlowError as exc:
            print(f"kvflow-bench: cannot reply to {sender}: {exc}", file=sys.stderr, flush=True)


async def _cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
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
    try:
        while True:
            await asyncio.sleep(_PROGRESS_INTERVAL_S)
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
            line = f"\r{label}  {format_size(shown):>11}  {rate:8.3f} GB/s  {phase}"
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
        await _cancel_all(helpers)

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


# --------------------------------------------------------------------------
# Initiator and pair


def _layouts(args: argparse.Namespace) -> list[Layout]:
    return [
        Layout(size, args.batch, args.concurrency, args.scatter, args.max_region)
        for size in args.block_sizes
    ]


async def run_initiator(args: argparse.Namespace, target: Optional[str] = None) -> int:
    """Connect to the target and run every requested block size."""
    target = target or args.target
    layouts = _layouts(args)
    needed_span = max(layout.span for layout in layouts)
    buffer = HostBuffer(needed_span)
    buffer.fill_pattern(args.seed, _INITIATOR_PATTERN_TAG)
    reporter = Reporter(args.json, sys.stdout)
    progress = sys.stderr if (not args.json and not args.no_progress and sys.stderr.isatty()) else None
    needed = kvflow.Access.WRITE if args.op == "write" else kvflow.Access.READ
    mismatches = 0

    async with _make_engine(args, args.listen) as engine:
        region = engine.register(buffer.array, name="bench-initiator")
        router = ReplyRouter(engine)
        router.start()
        try:
            peer = await engine.connect(target, timeout=args.connect_timeout)
            try:
                remote = peer.region(REGION_NAME)
            except KeyError:
                raise BenchError(f"{target} has no region {REGION_NAME!r}; is it a kvflow-bench target?") from None
            if remote.length < needed_span:
                raise BenchError(
                    f"the target's buffer is {format_size(remote.length)}, this run needs "
                    f"{format_size(needed_span)}: start the target with --buffer-size "
                    f"{_size_argument(needed_span)} (or the same layout options as this run)"
                )
            if not int(remote.access) & int(needed):
                raise BenchError(f"the target's region does not allow {args.op}")
            if not args.json:
                _log(args, (
                    f"{args.op} to {target} over {peer.transport}: batches of {args.batch} "
                    f"entries, {args.concurrency} in flight, "
                    f"{'scattered' if args.scatter else 'contiguous'} entries"
                ))
            for index, layout in enumerate(layouts):
                if args.verify and index:
                    # Fresh contents per run, so a run that moved nothing
                    # cannot pass on what an earlier run left behind.
                    buffer.fill_pattern(args.seed + index, _INITIATOR_PATTERN_TAG)
                result = await measure(peer, layout, region.addr, remote.addr, args, progress)
                if args.verify:
                    result.verified = await verify_run(router, peer, buffer, layout, 0, args)
                    mismatches += not result.verified
                reporter.row(result)
        finally:
            await router.close()
            engine.deregister(region)
    if mismatches:
        print(f"kvflow-bench: verification FAILED for {mismatches} run(s)", file=sys.stderr, flush=True)
        return 3
    return 0


def _package_parent() -> str:
    # kvflow/cli/bench.py -> the folder holding the kvflow package
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def run_pair(args: argparse.Namespace) -> int:
    """Start a target child process here, run the initiator, stop the target."""
    layouts = _layouts(args)
    buffer_size = args.buffer_size or default_target_buffer_size(layouts)
    command = [
        sys.executable, "-m", "kvflow.cli.bench", "target",
        "--listen", "127.0.0.1:0",
        "--protocol", args.protocol,
        "--tcp-connections", str(args.tcp_connections),
        "--buffer-size", str(buffer_size),
        "--seed", str(args.seed),
        "--stdin-control",
        "--quiet",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_parent(), env.get("PYTHONPATH")]))
    if args.secret:
        # Through the environment, not argv, which any local user can read.
        env[SECRET_ENV] = args.secret
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        address = await asyncio.wait_for(_read_banner(process), args.target_start_timeout)
        return await run_initiator(args, address)
    except asyncio.TimeoutError:
        raise BenchError(
            f"the target did not announce its address within {args.target_start_timeout:g} s"
        ) from None
    finally:
        await _stop_target(process)


async def _read_banner(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    while True:
        line = await process.stdout.readline()
        if not line:
            code = await process.wait()
            raise BenchError(f"the target exited with status {code} before announcing its address")
        text = line.decode(errors="replace").strip()
        if text.startswith(TARGET_BANNER + " "):
            return text[len(TARGET_BANNER) + 1 :].strip()
        print(f"kvflow-bench: target: {text}", file=sys.stderr)


async def _stop_target(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None and process.stdin is not None:
        process.stdin.close()  # --stdin-control: EOF asks the target to stop
    for action, grace in ((None, 10.0), (process.terminate, 5.0), (process.kill, None)):
        if process.returncode is not None:
            break
        if action is not None:
            try:
                action()
            except ProcessLookupError:
                break
        try:
            await asyncio.wait_for(process.wait(), grace)
        except asyncio.TimeoutError:
            continue
    if process.returncode not in (0, None):
        print(f"kvflow-bench: the target exited with status {process.returncode}", file=sys.stderr)


# --------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    size = _argparse_type(parse_size)
    sizes = _argparse_type(parse_size_list)
    count = _argparse_type(_positive_int)
    seconds = _argparse_type(_positive_float)
    seconds0 = _argparse_type(_non_negative_float)

    engine = argparse.ArgumentParser(add_help=False)
    group = engine.add_argument_group("engine")
    group.add_argument("--protocol", choices=("auto", "tcp", "local", "rdma"), default="auto",
                       help="transport to allow (auto: the engine picks; default %(default)s)")
    group.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                       help="this engine's listen address (default %(default)s); an initiator "
                            "on another host must listen where the target can reach it for --verify")
    group.add_argument("--tcp-connections", type=count, default=2, metavar="N",
                       help="TCP connections per peer (default %(default)s)")
    group.add_argument("--slice-size", type=size, default=None, metavar="SIZE",
                       help="tcp/local slice size (default: the engine's, 1 MiB)")
    group.add_argument("--rdma-slice-size", type=size, default=None, metavar="SIZE",
                       help="bytes per rdma work request at most (default: the engine's, 256 KiB)")
    group.add_argument("--secret", default=None, metavar="TEXT",
                       help=f"shared secret for peer authentication (or ${SECRET_ENV})")
    group.add_argument("--seed", type=int, default=1, metavar="N", help="fill-pattern seed (default %(default)s)")

    layout = argparse.ArgumentParser(add_help=False)
    group = layout.add_argument_group("layout")
    group.add_argument("--block-size", type=sizes, default=None, dest="block_sizes", metavar="SIZE[,SIZE...]",
                       help=f"bytes per entry, e.g. 4K, 64KiB, 1M; a list with --sweep "
                            f"(default {DEFAULT_BLOCK_SIZE}, with --sweep {DEFAULT_SWEEP})")
    group.add_argument("--batch", type=count, default=32, metavar="N", help="entries per batch (default %(default)s)")
    group.add_argument("--concurrency", type=count, default=4, metavar="N",
                       help="batches in flight (default %(default)s)")
    group.add_argument("--scatter", action="store_true",
                       help="leave a block-sized gap after each entry on both sides so the "
                            "engine cannot coalesce entries")
    group.add_argument("--max-region", type=size, default=DEFAULT_MAX_REGION, metavar="SIZE",
                       help="bytes of each buffer the entries may span; beyond it they wrap "
                            f"around (default {format_size(DEFAULT_MAX_REGION)})")
    group.add_argument("--sweep", action="store_true",
                       help="run each size of a --block-size list in one target session")

    target_buffer = argparse.ArgumentParser(add_help=False)
    target_buffer.add_argument("--buffer-size", type=size, default=None, metavar="SIZE",
                               help="target buffer size (default: what the layout needs, at least "
                                    f"{format_size(MIN_TARGET_BUFFER)})")

    load = argparse.ArgumentParser(add_help=False)
    group = load.add_argument_group("load")
    group.add_argument("--op", choices=("write", "read"), default="write",
                       help="write: local -> target; read: target -> local (default %(default)s)")
    stop = group.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=seconds, default=5.0, metavar="SECONDS",
                      help="measured seconds per block size (default %(default)s)")
    stop.add_argument("--total-bytes", type=size, default=None, metavar="SIZE",
                      help="measure until this many bytes moved instead of --duration")
    group.add_argument("--warmup", type=seconds0, default=0.5, metavar="SECONDS",
                       help="unmeasured seconds before each run (default %(default)s)")
    group.add_argument("--verify", action="store_true",
                       help="check after each run that both sides hold the same bytes")
    group.add_argument("--json", action="store_true",
                       help="print one JSON object per run instead of a table")
    group.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    group.add_argument("--timeout", type=seconds, default=30.0, metavar="SECONDS",
                       help="per-batch timeout in seconds (default %(default)s)")
    group.add_argument("--connect-timeout", type=seconds, default=10.0, help=argparse.SUPPRESS)
    group.add_argument("--verify-timeout", type=seconds, default=120.0, help=argparse.SUPPRESS)

    parser = argparse.ArgumentParser(
        prog="kvflow-bench",
        description="Throughput and latency of kvflow transfers.",
        epilog="Run '%(prog)s ROLE --help' for a role's options.",
    )
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    target = roles.add_parser("target", parents=[engine, layout, target_buffer],
                              help="serve a registered buffer")
    target.add_argument("--stdin-control", action="store_true",
                        help="also stop when stdin reaches EOF")
    target.add_argument("--quiet", action="store_true", help="log nothing to stderr")
    initiator = roles.add_parser("initiator", parents=[engine, layout, load],
                                 help="run the load against a target")
    initiator.add_argument("--target", required=True, metavar="HOST:PORT", help="the target's address (its KVFLOW_TARGET line)")
    pair = roles.add_parser("pair", parents=[engine, layout, target_buffer, load],
                            help="start a local target process and run the load against it")
    pair.add_argument("--target-start-timeout", type=seconds, default=60.0, help=argparse.SUPPRESS)
    return parser


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_sizes is None:
        default = DEFAULT_SWEEP if args.sweep else DEFAULT_BLOCK_SIZE
        args.block_sizes = parse_size_list(default)
    elif len(args.block_sizes) > 1 and not args.sweep and args.role != "target":
        parser.error("several block sizes need --sweep")
    return args


_ROLES: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {
    "target": run_target,
    "initiator": run_initiator,
    "pair": run_pair,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kvflow-bench`` and ``python -m kvflow.cli.bench``."""
    args = _parse_args(argv)
    try:
        return asyncio.run(_ROLES[args.role](args))
    except KeyboardInterrupt:
        return 130
    except (BenchError, kvflow.KVFlowError) as exc:
        print(f"kvflow-bench: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
