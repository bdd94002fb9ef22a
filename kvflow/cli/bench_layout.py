"""kvflow-bench's sizes, memory layout and host buffers: how a run's
entries sit in the local and the remote buffer, the fill patterns, and the
digests --verify compares."""
from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

REGION_NAME = "bench"
TARGET_BANNER = "KVFLOW_TARGET"
DEFAULT_BLOCK_SIZE = "64K"
DEFAULT_SWEEP = "4K,16K,64K,256K,1M"
MIN_TARGET_BUFFER = 64 << 20
# Same default as tools/baselines, so both sides of a comparison touch the
# same amount of memory.
DEFAULT_MAX_REGION = 256 << 20
SECRET_ENV = "KVFLOW_SECRET"          # the Engine reads it too (kvflow.config)

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
TARGET_PATTERN_TAG = 1
INITIATOR_PATTERN_TAG = 2
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


def size_argument(nbytes: int) -> str:
    """The shortest exact --xxx-size spelling of ``nbytes`` (``512M``)."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1: {text!r}")
    return value


def parse_count_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of positive counts (``16,64``)."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"no counts in {text!r}")
    return tuple(positive_int(part) for part in parts)


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"must be >= 0: {text!r}")
    return value


def positive_float(text: str) -> float:
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


