"""Turning what callers pass as a batch column into a uint64 array."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError

_U64 = np.dtype(np.uint64)


def as_u64(values: Any, what: str) -> np.ndarray:
    """One batch column as a contiguous one-dimensional uint64 array;
    InvalidArgumentError for negative, too large or non-integer input."""
    try:
        if isinstance(values, np.ndarray):
            if values.dtype.kind not in "ui":
                raise TypeError(f"dtype {values.dtype}")
            if values.dtype.kind == "i" and values.size and values.min() < 0:
                raise ValueError("negative value")
            arr = np.ascontiguousarray(values, dtype=_U64)
        else:
            values = list(values)
            # Python ints only: numpy would silently truncate 1.9 or parse "12"
            if not all(type(v) is int or isinstance(v, np.integer) for v in values):
                raise TypeError("entries must be ints")
            if any(v < 0 for v in values):
                raise ValueError("negative value")
            arr = np.array(values, dtype=_U64)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgumentError(f"{what}: not a sequence of unsigned 64-bit ints ({e})") from None
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what}: expected a one-dimensional array")
    return arr


MAX_PIECES = 1 << 26


def expand_strided(la: Any, ra: Any, ln: Any, counts: Any, local_strides: Any,
                   remote_strides: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Strided entries → plain entries, vectorised (no Python per piece).

    Entry i stands for counts[i] pieces of ln[i] bytes, piece k moving
    la[i] + k*local_strides[i] → ra[i] + k*remote_strides[i] (a head slice
    of every token of a run of pages is one entry). Returns the plain
    columns and `first`, the index of each entry's first piece, so that a
    piece's error maps back to its entry (entry_of)."""
    cols = [as_u64(v, name) for v, name in ((la, "local_addrs"), (ra, "remote_addrs"), (ln, "lengths"),
                                            (counts, "counts"), (local_strides, "local_strides"),
                                            (remote_strides, "remote_strides"))]
    la, ra, ln, counts, ls, rs = cols
    n = la.size
    if any(c.size != n for c in cols):
        raise InvalidArgumentError("strided batch: all six columns must have the same length")
    if n == 0:
        raise InvalidArgumentError("empty batch")
    if counts.min() == 0:
        raise InvalidArgumentError(f"strided batch: entry {int(np.argmin(counts))} has a count of 0",
                                   index=int(np.argmin(counts)))
    total = int(counts.sum(dtype=np.uint64))
    if total > MAX_PIECES:
        raise InvalidArgumentError(f"strided batch expands to {total} pieces (limit {MAX_PIECES})")
    last = counts - np.uint64(1)
    for base, stride, what in ((la, ls, "local"), (ra, rs, "remote")):
        # base + (count-1)*stride + length must not wrap around 2^64
        limit = np.iinfo(np.uint64).max - base
        with np.errstate(divide="ignore"):
            room = np.where(stride > 0, limit // np.maximum(stride, np.uint64(1)), np.uint64(0))
        bad = np.flatnonzero((stride > 0) & (last > room))
        if bad.size:
            raise InvalidArgumentError(f"strided batch: entry {int(bad[0])}'s {what} range overflows",
                                       index=int(bad[0]))
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    owner = np.repeat(np.arange(n), counts.astype(np.int64))
    k = (np.arange(total, dtype=np.int64) - first[owner]).astype(np.uint64)
    return (la[owner] + k * ls[owner], ra[owner] + k * rs[owner], ln[owner], first)


def entry_of(first: np.ndarray, piece: int) -> int:
    """The strided entry a piece index belongs to (see expand_strided)."""
    return int(np.searchsorted(first, piece, side="right")) - 1
