"""Mooncake Store's copy/move tasks and replica descriptors on kvflow.store
(the calls of MooncakeDistributedStore that scripts/test_copy_move_api.py
uses; StoreClient's side is kvflow/store/task_calls.py).

    task_id, err = store.create_copy_task("k", ["10.0.0.2:12345"])   # ((hi, lo), 0)
    resp, err = store.query_task(task_id)       # (QueryTaskResponse, 0), or (None, code)
    resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED)
    [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
     for d in store.get_replica_desc("k")]      # the segments holding it

Segments are named by their store's get_hostname() (what Mooncake's
segment names are). Return conventions are the binding's (store_py.cpp):
create_*_task give (task id, 0) or ((0, 0), code) with -704 for a missing
object and -600 for no targets, an unknown segment, a move's source that
holds no replica or equals its target; query_task gives (None, -1400) for
an unknown task. get_replica_desc gives the memory replicas (kvflow's SSD
copies are not described: the master does not know their files), [] for a
missing key."""
from __future__ import annotations

import enum
from typing import Any

from kvflow.errors import KVFlowError
from kvflow.store import TaskStatus, TaskType
from kvflow.store.task_calls import TaskInfo

from .codes import STORE_INTERNAL_ERROR

__all__ = ["Descriptor", "DiskDescriptor", "MemoryDescriptor", "QueryTaskResponse", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicaTaskCalls", "TaskStatus", "TaskType"]

NO_TASK = (0, 0)        # the binding's UUID{0, 0} returned with an error


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """An allocated buffer: `transport_endpoint` is the holding segment's
    name (its store's hostname), `buffer_address` the replica's address in
    the holder's process."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica (memory replicas only here: see the module's doc)."""

    def __init__(self, memory: MemoryDescriptor, status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self.status = status
        self._memory = memory

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("not a disk replica")       # the binding's std::get throws

    def __repr__(self) -> str:
        return f"<ReplicaDescriptor {self.status.name} {self._memory.buffer_descriptor!r}>"


class QueryTaskResponse:
    """query_task's answer: `id` (hi, lo), `type` (TaskType), `status`
    (TaskStatus), times in ms since the epoch, `assigned_client` (the
    kvflow client id that copies), `message` (why it failed)."""

    def __init__(self, info: TaskInfo | None = None) -> None:
        self.id = info.id if info else NO_TASK
        self.type = info.type if info else TaskType.REPLICA_COPY
        self.status = info.status if info else TaskStatus.PENDING
        self.created_at_ms_epoch = info.created_ms if info else 0
        self.last_updated_at_ms_epoch = info.updated_ms if info else 0
        self.assigned_client = info.client if info else ""
        self.message = info.message if info else ""

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id}, type={int(self.type)}, status={int(self.status)}, "
                f"created_at={self.created_at_ms_epoch}, last_updated_at={self.last_updated_at_ms_epoch}, "
                f"assigned_client={self.assigned_client}, message=\"{self.message}\")")


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    return value


class ReplicaTaskCalls:
    """MooncakeDistributedStore's task and descriptor calls (a mixin: it
    uses the store's _client, _call, _fail, _not_ready and _code)."""

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[tuple[int, int], int]:
        """Copies the object to each segment named in `targets`: (task id, 0)
        or ((0, 0), code)."""
        key = _str(key, "key")
        if not isinstance(targets, (list, tuple)):
            raise TypeError("targets must be a list of str")
        targets = [_str(t, "a target") for t in targets]
        return self._task(lambda c: c.create_copy_task(key, targets))

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """Moves the object's replica on segment `source` to segment
        `target`: (task id, 0) or ((0, 0), code)."""
        key, source, target = _str(key, "key"), _str(source, "source"), _str(target, "target")
        return self._task(lambda c: c.create_move_task(key, source, target))

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        """(QueryTaskResponse, 0), or (None, code): -1400 an unknown task."""
        if not (isinstance(task_id, (tuple, list)) and len(task_id) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64 for x in task_id)):
            raise TypeError("task_id must be a pair of unsigned 64-bit ints")
        if self._client is None:
            return None, self._fail(self._not_ready(), STORE_INTERNAL_ERROR)
        try:
            return QueryTaskResponse(self._call(self._client.query_task(tuple(task_id)))), 0
        except KVFlowError as e:
            return None, self._fail(e, self._code(e))

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's memory replicas; [] when it is missing (or on any
        failure, as Mooncake's)."""
        key = _str(key, "key")
        if self._client is None:
            self._fail(self._not_ready(), STORE_INTERNAL_ERROR)
            return []
        try:
            descs = self._call(self._client.replica_desc(key))
        except KVFlowError as e:
            self._fail(e, self._code(e))
            return []
        return [ReplicaDescriptor(MemoryDescriptor(Descriptor(d.size, d.addr, d.segment)))
                for d in descs if d.in_memory]

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """{key: its memory replicas} for the keys found (missing ones are
        left out, as Mooncake's)."""
        if not isinstance(keys, (list, tuple)):
            raise TypeError("keys must be a list of str")
        out = {}
        for key in keys:
            descs = self.get_replica_desc(key)
            if descs:
                out[key] = descs
        return out

    def _task(self, create) -> tuple[tuple[int, int], int]:
        if self._client is None:
            return NO_TASK, self._fail(self._not_ready(), STORE_INTERNAL_ERROR)
        try:
            return self._call(create(self._client)), 0
        except KVFlowError as e:
            return NO_TASK, self._fail(e, self._code(e))
