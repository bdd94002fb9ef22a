"""Random transfer batches for the tests: sizes, non-overlapping placements, checks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import numpy as np

from _target import pattern, sha256

# Default bound for awaits inside tests: generous; it only turns a hang into a failure.
OP_TIMEOUT = 30.0
# Under full emulation (the Soft-RoCE VM runs on TCG) everything is several
# times slower: every bound is stretched by this factor there.
TIME_SCALE = float(os.environ.get("KVFLOW_TEST_TIME_SCALE", "4" if os.environ.get("KVFLOW_IN_VM") else "1"))


async def bounded(aw, timeout: float = OP_TIMEOUT):
    """``await aw``, but fail instead of hanging."""
    return await asyncio.wait_for(aw, timeout * TIME_SCALE)

KiB = 1 << 10
MiB = 1 << 20


def log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    """``n`` integers in [lo, hi], log-uniformly spread (many small, some large)."""
    x = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), int(n)))
    return np.clip(np.floor(x), lo, hi).astype(np.uint64)


def place(rng: np.random.Generator, lengths: np.ndarray, span: int) -> np.ndarray:
    """Offsets for ``lengths`` inside ``[0, span)``: no two ranges overlap, the
    order in memory is a random permutation of the entry order, and the gaps are
    random (so offsets are unaligned)."""
    lengths = np.asarray(lengths, dtype=np.uint64)
    n = len(lengths)
    total = int(lengths.sum())
    slack = span - total
    if slack < 0:
        raise ValueError(f"{total} bytes do not fit in {span}")
    order = rng.permutation(n)
    gaps = np.sort(rng.integers(0, slack + 1, size=n, dtype=np.int64)).astype(np.uint64)
    ordered = lengths[order]
    before = np.concatenate([np.zeros(1, np.uint64), np.cumsum(ordered)[:-1]]).astype(np.uint64)
    offsets = np.empty(n, dtype=np.uint64)
    offsets[order] = gaps + before
    assert int((offsets + lengths).max()) <= span
    return offsets


def split(rng: np.random.Generator, length: int, pieces: int) -> np.ndarray:
    """Cut ``length`` bytes into at most ``pieces`` non-empty consecutive parts."""
    pieces = max(1, min(pieces, length))
    if pieces > 1:
        cuts = np.sort(rng.choice(np.arange(1, length, dtype=np.int64), size=pieces - 1, replace=False))
    else:
        cuts = np.array([], np.int64)
    bounds = np.concatenate([[0], cuts, [length]]).astype(np.uint64)
    return np.diff(bounds).astype(np.uint64)


def as_arg(arr: np.ndarray, style: int):
    """The contract accepts numpy uint64 arrays or any sequence of ints; vary it."""
    if style % 3 == 0:
        return np.ascontiguousarray(arr, dtype=np.uint64)
    if style % 3 == 1:
        return [int(x) for x in arr]
    return tuple(int(x) for x in arr)


def apply_entries(dst: np.ndarray, dst_off, src: np.ndarray, src_off, lengths) -> None:
    """Reference copy: what a transfer of these entries must do."""
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), np.asarray(lengths).tolist()):
        dst[d : d + n] = src[s : s + n]


def first_bad_entry(a: np.ndarray, a_off, b: np.ndarray, b_off, lengths) -> str:
    for i, (x, y, n) in enumerate(zip(a_off.tolist(), b_off.tolist(), np.asarray(lengths).tolist())):
        if not np.array_equal(a[x : x + n], b[y : y + n]):
            diff = int(np.argmax(a[x : x + n] != b[y : y + n]))
            return f"entry {i} (len {n}) differs first at byte {diff}"
    return "every entry matches; bytes outside the entries changed"


@dataclasses.dataclass
class Pair:
    """An initiator engine, a target, and the initiator's peer for that target."""

    provider: Any  # conftest.Provider
    eng: Any  # kvflow.Engine, the initiator
    target: Any  # conftest.Target
    peer: Any  # the initiator's peer object for the target

    def raddr(self, name: str, offset: int = 0) -> int:
        return self.target.raddr(name, offset)


async def assert_still_works(p, local_mem, *, region: str = "rw", seed: int = 99, timeout: float = OP_TIMEOUT) -> None:
    """A random write and read-back over ``p.peer`` (a conftest ``Pair``), both
    verified: the proof that an engine and peer are usable after an error."""
    rng = np.random.default_rng(seed)
    span = min(p.target.regions[region].length, 256 * KiB)
    src = local_mem(p.eng, span)
    src.view[:] = pattern(seed, span)
    dst = local_mem(p.eng, span)
    lengths = log_uniform(rng, 1, 8 * KiB, 16)
    loff = place(rng, lengths, span)
    roff = place(rng, lengths, span)
    raddrs = np.uint64(p.raddr(region)) + roff
    await bounded(p.peer.write(np.uint64(src.addr) + loff, raddrs, lengths), timeout)
    shas = await bounded(p.target.sha_many(region, zip(roff.tolist(), lengths.tolist())))
    want = [sha256(src.view[o : o + n]) for o, n in zip(loff.tolist(), lengths.tolist())]
    assert shas == want, "write after the error did not land correctly"
    await bounded(p.peer.read(np.uint64(dst.addr) + loff, raddrs, lengths), timeout)
    assert first_bad_entry(dst.view, loff, src.view, loff, lengths).startswith("every"), "read after the error wrong"
