"""StoreClient's copy and move tasks (a mixin; the master's side is
tasks.py) and the description of where an object's replicas are.

    tid = await store.create_copy_task("k", ["node-b", "node-c"])
    info = await store.wait_task(tid)           # TaskInfo, status SUCCESS or FAILED
    await store.create_move_task("k", "node-a", "node-b")

Segments are named by the `segment_name` their clients mounted. A task
runs on the client holding the source replica (it copies its own bytes
over kvflow into a new allocation on the target, as it makes lost replicas
again): this call only creates it and returns its id at once."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.errors import InvalidArgumentError

from .calls import with_timeout
from .tasks import TaskStatus, TaskType

__all__ = ["TaskCalls", "TaskId", "TaskInfo", "ReplicaDesc"]

# Mooncake's UUID: two 64-bit halves
TaskId = tuple[int, int]


@dataclass(frozen=True)
class TaskInfo:
    """A task as query_task reports it. `client`: the client that runs it
    (the source replica's holder); `message`: why it failed ("" otherwise);
    times in ms since the epoch."""
    id: TaskId
    type: TaskType
    status: TaskStatus
    created_ms: int
    updated_ms: int
    client: str
    message: str

    @property
    def finished(self) -> bool:
        return self.status in (TaskStatus.SUCCESS, TaskStatus.FAILED)


@dataclass(frozen=True)
class ReplicaDesc:
    """One replica of an object: in memory, the segment's name and the
    replica's address in its holder's process; on SSD (`segment` ""), the
    holding client in `client`."""
    segment: str
    addr: int
    size: int
    client: str = ""

    @property
    def in_memory(self) -> bool:
        return bool(self.segment)


class TaskCalls:
    @with_timeout
    async def create_copy_task(self, key: str, targets: Sequence[str]) -> TaskId:
        """Starts copying the object to each segment named in `targets` (a
        segment holding a replica already is left as it is); returns the
        task's id at once. ObjectNotFoundError; InvalidArgumentError for no
        targets or a segment that is not mounted."""
        if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
            raise InvalidArgumentError("targets must be a sequence of segment names")
        return _task_id(await self._call("create_copy_task", self._ns([key])[0], list(targets)))

    @with_timeout
    async def create_move_task(self, key: str, source: str, target: str) -> TaskId:
        """Starts moving the object's replica on segment `source` to segment
        `target` (a replica is made there, then the source's is dropped);
        returns the task's id at once. ObjectNotFoundError;
        InvalidArgumentError when source == target, a segment is not
        mounted, or `source` holds no replica of it."""
        if not isinstance(source, str) or not isinstance(target, str):
            raise InvalidArgumentError("source and target must be segment names")
        return _task_id(await self._call("create_move_task", self._ns([key])[0], source, target))

    @with_timeout
    async def query_task(self, task_id: TaskId) -> TaskInfo:
        """The task's state. TaskNotFoundError for an unknown id."""
        if not (isinstance(task_id, (tuple, list)) and len(task_id) == 2
                and all(type(x) is int for x in task_id)):
            raise InvalidArgumentError(f"a task id is a pair of ints, not {task_id!r}")
        tid, kind, status, created, updated, client, message = await self._call("query_task", list(task_id))
        return TaskInfo(_task_id(tid), TaskType(kind), TaskStatus(status), created, updated, client, message)

    @with_timeout
    async def wait_task(self, task_id: TaskId, *, poll: float = 0.05) -> TaskInfo:
        """query_task until the task has finished (SUCCESS or FAILED); the
        call's `timeout=` bounds the wait (StoreTimeoutError)."""
        while True:
            info = await self.query_task(task_id)
            if info.finished:
                return info
            await asyncio.sleep(poll)

    @with_timeout
    async def replica_desc(self, key: str) -> list[ReplicaDesc]:
        """Where the object's replicas are: memory replicas (by segment
        name), then SSD copies. No read lease is taken. ObjectNotFoundError."""
        mem, ssd = await self._call("replica_desc", self._ns([key])[0])
        return [ReplicaDesc(name, addr, size) for name, addr, size in mem] + \
               [ReplicaDesc("", 0, size, client) for client, size in ssd]


def _task_id(value: Any) -> TaskId:
    hi, lo = value
    return (int(hi), int(lo))
