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

class _DList:
    """Descriptors of one memory kind: (address, length, device ID) rows in a
    uint64 array, plus a per-row tail for the lists that carry one (the
    registration's metadata bytes, the remote agent's name)."""

    _width = 3

    def __init__(self, mem_type: nixl_mem_t, descs: Iterable[Any] | np.ndarray | None = None,
                 sorted: bool = False) -> None:      # noqa: A002 - NIXL's argument name
        self._type = nixl_mem_t(mem_type)
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._tail: list[Any] = []
        if descs is not None:
            self._extend(descs)

    def _extend(self, descs: Iterable[Any] | np.ndarray) -> None:
        if isinstance(descs, np.ndarray):
            if descs.ndim != 2 or descs.shape[1] != 3 or self._width != 3:
                raise ValueError(f"a descriptor array must be Nx3, not {descs.shape}")
            rows = descs.astype(np.uint64, copy=False)
            self._rows = np.concatenate([self._rows, rows]) if len(self._rows) else np.array(rows, np.uint64)
            return
        new = [self._check(d) for d in descs]
        if new:
            self._rows = np.concatenate([self._rows, np.array([d[:3] for d in new], dtype=np.uint64)])
            if self._width == 4:
                self._tail += [self._tail_value(d[3]) for d in new]

    def _check(self, d: Any) -> tuple[Any, ...]:
        if not isinstance(d, tuple) or len(d) != self._width:
            raise TypeError(f"a {type(self).__name__} descriptor is a {self._width}-tuple, not {d!r}")
        if any(not isinstance(x, (int, np.integer)) or x < 0 for x in d[:3]):
            raise TypeError(f"address, length and device ID must be integers >= 0, not {d[:3]!r}")
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
        a, n, dev = (int(x) for x in self._rows[i])
        return (a, n, dev, self._tail[i]) if self._width == 4 else (a, n, dev)

    def __iter__(self):
        return (self[i] for i in range(len(self._rows)))

    def addDesc(self, desc: tuple[Any, ...]) -> None:
        self._extend([desc])

    append = addDesc

    def remDesc(self, index: int) -> None:
        self._rows = np.delete(self._rows, index, axis=0)
        if self._tail:
            del self._tail[index]

    def index(self, desc: tuple[Any, ...]) -> int:
        for i, d in enumerate(self):
            if d == desc:
                return i
        raise ValueError(f"{desc!r} is not in the list")

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

    @staticmethod
    def _tail_value(v: Any) -> bytes:
        return v if isinstance(v, bytes) else str(v).encode()

    def trim(self) -> "nixlXferDList":
        """The same descriptors as a transfer list (without the metadata)."""
        return nixlXferDList(self._type, self._rows.copy())


class nixlRemoteDList(_DList):
    """Descriptors of remote agents' memory: (address, length, device ID,
    agent name)."""

    _width = 4

    @staticmethod
    def _tail_value(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)


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
