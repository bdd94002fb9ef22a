"""The names of NIXL's `nixl._bindings` that API-level code touches:
memory kinds, operations, statuses, thread-sync modes, the error classes,
the descriptor lists (picklable), the telemetry record, the agent config,
and `nixlAgent`, here kvflow's agent core (kvflow/compat/nixl/_agent.py).
Values are NIXL 1.5's."""
from __future__ import annotations

import enum
from typing import Any, Iterable

import numpy as np

DEFAULT_COMM_PORT = 8888
HAVE_UCX_GPU_DEVICE_API = False
NIXL_INIT_AGENT = ""


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG, nixl_mem_t.BLK_SEG,
                                                  nixl_mem_t.OBJ_SEG, nixl_mem_t.FILE_SEG)


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED


class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


class nixl_cost_t(enum.IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND


# ---------------------------------------------------------------- errors (NIXL's: plain Exceptions)

class nixlNotPostedError(Exception): pass          # noqa: E701
class nixlInvalidParamError(Exception): pass       # noqa: E701
class nixlBackendError(Exception): pass            # noqa: E701
class nixlNotFoundError(Exception): pass           # noqa: E701
class nixlMismatchError(Exception): pass           # noqa: E701
class nixlNotAllowedError(Exception): pass         # noqa: E701
class nixlRepostActiveError(Exception): pass       # noqa: E701
class nixlUnknownError(Exception): pass            # noqa: E701
class nixlNotSupportedError(Exception): pass       # noqa: E701
class nixlRemoteDisconnectError(Exception): pass   # noqa: E701
class nixlCancelledError(Exception): pass          # noqa: E701
class nixlNoTelemetryError(Exception): pass        # noqa: E701


# ---------------------------------------------------------------- descriptor lists

def _mem_kind(kind: Any) -> nixl_mem_t:
    """A memory kind (nixl_mem_t or its value); TypeError for anything else."""
    try:
        return nixl_mem_t(kind)
    except ValueError:
        raise TypeError(f"{kind!r} is not a NIXL memory kind (nixl_mem_t)") from None


def _rows_of(descs: np.ndarray, what: str) -> np.ndarray:
    """The uint64 (address, length, device ID) rows of an Nx3 integer array
    (a copy); ValueError for any other shape, a non-integer dtype, or a
    negative value."""
    if descs.ndim != 2 or descs.shape[1] != 3:
        raise ValueError(f"a {what} is made from an Nx3 array (address, length, device ID rows), "
                         f"not one of shape {descs.shape}")
    if descs.dtype.kind not in "iu":
        raise ValueError(f"a {what} is made from an integer array, not {descs.dtype}")
    if descs.dtype.kind == "i" and descs.size and int(descs.min()) < 0:
        raise ValueError(f"a {what}: address, length and device ID must be >= 0 (row "
                         f"{int(np.argwhere(descs < 0)[0][0])} has a negative value)")
    return np.array(descs, dtype=np.uint64, order="C")


class _DList:
    """Descriptors of one memory kind: (address, length, device ID) rows in a
    uint64 array, plus a per-row tail for the lists that carry one (the
    registration's metadata bytes, the remote agent's name).

    Made as NIXL's are: from a list of tuples, from an Nx3 integer array
    (address, length, device ID rows; a registration list gets empty
    metadata for each, as NIXL's does), or with `init_size` zeroed rows."""

    _width = 3
    _blank: Any = None          # the tail of a row made from an array or by init_size
    _arrays = True              # made from Nx3 arrays too (NIXL's remote lists are not)
    _compare_tail = True        # index() compares the tail too

    def __init__(self, type: nixl_mem_t, descs: Iterable[Any] | np.ndarray | int | None = None,  # noqa: A002
                 sorted: bool = False, *, init_size: int = 0) -> None:  # noqa: A002 - NIXL's argument names
        self._type = _mem_kind(type)
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._tail: list[Any] = []
        if isinstance(descs, (int, np.integer)) and not isinstance(descs, bool):
            init_size, descs = int(descs), None          # nixlXferDList(DRAM_SEG, 4): NIXL's init_size
        if not isinstance(init_size, (int, np.integer)) or isinstance(init_size, bool) or init_size < 0:
            raise TypeError(f"init_size is a count >= 0, not {init_size!r}")
        if init_size:
            self._rows = np.zeros((int(init_size), 3), dtype=np.uint64)
            if self._width == 4:
                self._tail = [self._blank] * int(init_size)
        if descs is not None:
            self._extend(descs)

    def _extend(self, descs: Iterable[Any] | np.ndarray) -> None:
        if isinstance(descs, np.ndarray):
            if not self._arrays:
                raise TypeError(f"a {type(self).__name__} is made from {self._width}-tuples, not from an array")
            rows = _rows_of(descs, type(self).__name__)
            self._rows = np.concatenate([self._rows, rows]) if len(self._rows) else rows
            if self._width == 4:
                self._tail += [self._blank] * len(rows)
            return
        if isinstance(descs, (str, bytes)) or not hasattr(descs, "__iter__"):
            raise TypeError(f"descriptors are a list of {self._width}-tuples or an Nx3 integer array, "
                            f"not {type(descs).__name__}")
        if isinstance(descs, (list, tuple)) and self._append_tuples(descs):
            return
        new = [self._check(d) for d in descs]           # one by one: the error names the bad descriptor
        if new:
            self._rows = np.concatenate([self._rows, np.array([d[:3] for d in new], dtype=np.uint64)])
            if self._width == 4:
                self._tail += [self._tail_value(d[3]) for d in new]

    def _append_tuples(self, descs: list[Any] | tuple[Any, ...]) -> bool:
        """Appends 8 or more plain tuples of integers in one numpy
        conversion (a million in 0.25-0.45 s, a third or less of checking
        them one by one); False, appending nothing, for anything else."""
        w = self._width
        if len(descs) < 8 or not all(type(d) is tuple and len(d) == w for d in descs):
            return False                    # (below 8 the one-by-one check is as fast: 3.6 us for one)
        try:
            rows = np.array(descs if w == 3 else [d[:3] for d in descs])
        except (ValueError, TypeError, OverflowError):      # ragged or odd: one by one says what
            return False
        # integers fitting uint64, none negative (numpy makes floats of what does not fit int64)
        if rows.dtype.kind not in "iu" or rows.shape != (len(descs), 3) or (rows.dtype.kind == "i"
                                                                             and int(rows.min()) < 0):
            return False
        tail = [self._tail_value(d[3]) for d in descs] if w == 4 else []
        rows = rows.astype(np.uint64)
        self._rows = np.concatenate([self._rows, rows]) if len(self._rows) else rows
        self._tail += tail
        return True

    def _check(self, d: Any) -> tuple[Any, ...]:
        if not isinstance(d, tuple) or len(d) != self._width:
            raise TypeError(f"a {type(self).__name__} descriptor is a {self._width}-tuple, not {d!r}")
        if any(not isinstance(x, (int, np.integer)) or x < 0 or x >= 1 << 64 for x in d[:3]):
            raise TypeError(f"address, length and device ID must be integers in [0, 2**64), not {d[:3]!r}")
        return d

    @staticmethod
    def _tail_value(v: Any) -> Any:
        return v

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return len(self._rows)

    def isEmpty(self) -> bool:
        return len(self._rows) == 0

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        i = self._position(i)
        a, n, dev = (int(x) for x in self._rows[i])
        return (a, n, dev, self._tail[i]) if self._width == 4 else (a, n, dev)

    def __iter__(self):
        return (self[i] for i in range(len(self._rows)))

    def addDesc(self, desc: tuple[Any, ...]) -> None:
        self._extend([desc])

    append = addDesc

    def __setitem__(self, i: int, desc: tuple[Any, ...]) -> None:
        i = self._position(i)
        d = self._check(desc)
        self._rows[i] = np.array(d[:3], dtype=np.uint64)
        if self._width == 4:
            self._tail[i] = self._tail_value(d[3])

    def _position(self, i: Any) -> int:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"a descriptor index is an integer, not {type(i).__name__}")
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError(f"descriptor {i} of {n}")
        return int(i) % n

    def remDesc(self, index: int) -> None:
        index = self._position(index)
        self._rows = np.delete(self._rows, index, axis=0)
        if self._tail:
            del self._tail[index]

    def index(self, desc: tuple[Any, ...]) -> int:
        """The position of the first descriptor equal to `desc`; NIXL's
        nixlNotFoundError when there is none. Registration lists compare
        (address, length, device ID) only, as NIXL's do."""
        d = self._check(desc)
        key = tuple(int(x) for x in d[:3])
        for i, row in enumerate(self._rows.tolist()):
            if tuple(row) == key and (self._width == 3 or self._compare_tail is False
                                      or self._tail[i] == self._tail_value(d[3])):
                return i
        raise nixlNotFoundError(f"{desc!r} is not in the list")

    def clear(self) -> None:
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._tail = []

    def print(self) -> None:
        print(repr(self))

    # the columns kvflow transfers take
    @property
    def addrs(self) -> np.ndarray:
        return self._rows[:, 0]

    @property
    def lens(self) -> np.ndarray:
        return self._rows[:, 1]

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and other._type == self._type  # type: ignore[attr-defined]
                and np.array_equal(other._rows, self._rows) and other._tail == self._tail)  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple[Any, ...]:
        rows = [tuple(int(x) for x in r) + ((self._tail[i],) if self._width == 4 else ())
                for i, r in enumerate(self._rows)]
        return (type(self), (int(self._type), rows))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._type.name}, {len(self._rows)} descriptors)"


class nixlXferDList(_DList):
    """Transfer descriptors: (address, length, device ID)."""


class nixlRegDList(_DList):
    """Registration descriptors: (address, length, device ID, metadata); the
    metadata comes back as bytes."""

    _width = 4
    _blank = b""
    _compare_tail = False

    @staticmethod
    def _tail_value(v: Any) -> bytes:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return bytes(v)
        if isinstance(v, str):
            return v.encode()
        raise TypeError(f"a registration's metadata is str or bytes, not {type(v).__name__}")

    def trim(self) -> "nixlXferDList":
        """The same descriptors as a transfer list (without the metadata)."""
        return nixlXferDList(self._type, self._rows.copy())


class nixlRemoteDList(_DList):
    """Descriptors of remote agents' memory: (address, length, device ID,
    agent name)."""

    _width = 4
    _blank = ""
    _arrays = False

    @staticmethod
    def _tail_value(v: Any) -> str:
        if isinstance(v, (bytes, bytearray)):
            return bytes(v).decode()
        if isinstance(v, str):
            return v
        raise TypeError(f"a remote descriptor's agent name is str or bytes, not {type(v).__name__}")


class nixlXferTelemetry:
    """One transfer's numbers: start (us since the epoch), post and transfer
    durations (us), bytes and descriptors."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,
                 totalBytes: int = 0, descCount: int = 0) -> None:
        self.startTime, self.postDuration, self.xferDuration = startTime, postDuration, xferDuration
        self.totalBytes, self.descCount = totalBytes, descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})")


class nixlAgentConfig:
    """The agent's settings (NIXL's field names)."""

    def __init__(self) -> None:
        self.useProgThread = True
        self.useListenThread = False
        self.listenPort = DEFAULT_COMM_PORT
        self.syncMode = int(NIXL_THREAD_SYNC_DEFAULT)
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.captureTelemetry = False
        self.etcdWatchTimeout = 5000000


from kvflow.compat.nixl._agent import AgentCore as nixlAgent  # noqa: E402 - it uses the names above

__all__ = ["nixlAgent"]     # and the names above; `from ... import *` is not how NIXL code uses it
