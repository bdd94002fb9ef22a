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
