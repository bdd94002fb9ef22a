"""The store's errors: every one is a kvflow.KVFlowError, and each has a
short code that crosses the master's wire (`CODES`), so a client raises the
same class the master raised."""
from __future__ import annotations

from kvflow.errors import InvalidArgumentError, KVFlowError

__all__ = [
    "StoreError", "InvalidKeyError", "BufferTooSmallError", "ObjectNotFoundError",
    "PutRevokedError", "ObjectExistsError", "ObjectBusyError", "ObjectLeasedError", "NoSpaceError", "SsdBusyError",
    "SpaceFencedError", "QuotaExceededError",
    "ReplicaUnavailableError", "LeaseExpiredError", "MasterUnavailableError", "StoreTimeoutError",
    "SegmentError", "DurabilityError", "TaskNotFoundError", "CODES", "error_code", "error_from_code",
]


class StoreError(KVFlowError):
    """Base of the store's own errors. `key` names the object where there is one."""

    def __init__(self, message: str, *, key: str | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.key = key


class InvalidKeyError(StoreError, InvalidArgumentError):
    """A key that is not a non-empty str (at most 4096 UTF-8 bytes)."""


class BufferTooSmallError(StoreError, InvalidArgumentError):
    """get_into: the object is larger than the buffer it should land in."""


class ObjectNotFoundError(StoreError, KeyError):
    """No complete object with this key (never put, removed, evicted, or
    still being written)."""

    def __str__(self) -> str:            # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PutRevokedError(ObjectNotFoundError):
    """The put's put_end came after the master revoked it: it was not
    committed within its writer's write window (put_timeouts.py). Nothing
    of it is stored; the key may be put again."""


class ObjectExistsError(StoreError):
    """Reserved for callers that ask for a put to fail on an existing key."""


class ObjectBusyError(StoreError):
    """Another put of this key is between put_start and put_end."""


class ObjectLeasedError(StoreError):
    """remove: the object is under a read lease (a get is reading it)."""


class NoSpaceError(StoreError):
    """No segment can hold the object, even after eviction (everything left
    is leased, pinned or being written, or the object is larger than every
    segment)."""


class SsdBusyError(NoSpaceError):
    """No space until an "eager" SSD tier has copied objects it must not
    lose: StoreClient retries the put within its timeout (the Mooncake API
    returns -200 after that, as Mooncake does when the pool is full)."""


class SpaceFencedError(NoSpaceError):
    """Only space fenced after a failover could hold the object (fence.py):
    free again within the fence's window; StoreClient retries the put for
    its own write window."""


class QuotaExceededError(NoSpaceError):
    """The put would take its namespace over its quota, and nothing of the
    namespace's own could be evicted to make room."""


class ReplicaUnavailableError(StoreError):
    """Every replica's holder was lost or unreachable during the get."""


class LeaseExpiredError(StoreError):
    """The read took longer than the lease the master granted: the bytes
    could have been evicted and overwritten under it, so they are not
    returned."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A call's `timeout=` elapsed. What it had started was undone first
    (a put's allocations revoked, a get's lease released, its transfers
    drained), and the client stays usable."""


class MasterUnavailableError(StoreError):
    """The master cannot be reached, or its connection was lost."""


class SegmentError(StoreError):
    """A segment cannot be mounted or unmounted (unknown, duplicate, bad size)."""


class TaskNotFoundError(StoreError):
    """query_task: no copy or move task with this id (never created, or
    finished long ago and forgotten)."""


class DurabilityError(StoreError):
    """The master's etcd cannot be reached, did not answer in time, or
    refused a write, or this master is no longer the cluster's leader (its
    writes are fenced). A master that meets it while serving stops: what it
    holds in memory could no longer be made durable."""


CODES: dict[str, type[KVFlowError]] = {
    "invalid_argument": InvalidArgumentError,
    "invalid_key": InvalidKeyError,
    "buffer_too_small": BufferTooSmallError,
    "not_found": ObjectNotFoundError,
    "put_revoked": PutRevokedError,
    "exists": ObjectExistsError,
    "busy": ObjectBusyError,
    "leased": ObjectLeasedError,
    "no_space": NoSpaceError,
    "ssd_busy": SsdBusyError,
    "space_fenced": SpaceFencedError,
    "quota": QuotaExceededError,
    "replica_unavailable": ReplicaUnavailableError,
    "lease_expired": LeaseExpiredError,
    "master_unavailable": MasterUnavailableError,
    "timeout": StoreTimeoutError,
    "segment": SegmentError,
    "durability": DurabilityError,
    "task_not_found": TaskNotFoundError,
    "store": StoreError,
    "internal": KVFlowError,
}
_BY_CLASS = {cls: code for code, cls in CODES.items()}


def error_code(exc: BaseException) -> str:
    """The wire code of `exc`: its own class's, else its nearest base's."""
    for cls in type(exc).__mro__:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    return "internal"


def error_from_code(code: str, message: str, key: str | None = None) -> KVFlowError:
    cls = CODES.get(code, KVFlowError)
    if issubclass(cls, StoreError):
        return cls(message, key=key)
    return cls(message)
