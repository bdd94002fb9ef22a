"""Copy and move tasks: the master's side (a mixin of StoreModel, model.py;
Mooncake Store's create_copy_task / create_move_task / query_task).

A copy task makes new replicas of an object on named segments; a move
makes one on the target and then drops the source segment's. The task is
checked when it is created (the object exists, the segments are mounted,
a move's source holds a replica and differs from its target: typed errors
then, and no task) and runs later: it is handed to the client holding the
source replica through the same path as a lost replica's repair
(repair.py): that client's heartbeat learns there is work, batch_repair_start
gives it a new allocation on the target and its own replica to copy from,
it writes the bytes over kvflow, and batch_repair_end makes the replica
visible (and, for a move, drops the source). One copy of a key runs at a
time, so a copy to several targets is handed out one target per round.

Status: PENDING until handed out, PROCESSING while copying, then SUCCESS or
FAILED (with a message: no room on the target, the object or a segment
gone, the copy failed). Finished tasks stay queryable until
MAX_FINISHED_TASKS newer ones have finished.

Durability (a master given etcd): a task is recorded (`row()`, durable.py's
`t/<id>`) when it is created (create_copy_task replies once it is in
etcd), as each target's copy joins, and when it finishes; a finished one
leaves etcd with its last queryable day. A new leader restores them
(`restore_task`): finished ones answer query_task as before; unfinished
ones start again from PENDING on the recovered object (the same put's:
its writer, token and size), their targets holding a replica already
skipped (the copy that joined before the crash is in the object's record,
written in the same flush as the task's progress); a copy in flight at
the crash is made again (its allocation was never recorded, and its late
bytes fall in space the failover fence holds: fence.py). A task whose
object is gone, or was put again, fails at recovery."""
from __future__ import annotations

import enum
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvflow.errors import InvalidArgumentError

from .errors import ObjectNotFoundError, TaskNotFoundError
from .records import Object, Segment, State

__all__ = ["ReplicaTasks", "Task", "TaskStatus", "TaskType", "MAX_FINISHED_TASKS"]

MAX_FINISHED_TASKS = 65536


class TaskType(enum.IntEnum):
    # Mooncake's values (task_manager.h)
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    # Mooncake's values (task_manager.h): FAILED before SUCCESS
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


@dataclass(eq=False)
class Task:
    id: tuple[int, int]
    type: TaskType
    key: str
    client: str                 # the client holding the source replica: it copies
    source: int                 # segment id of the replica copied from
    targets: list[int]          # segment ids still to receive a replica, in order
    obj: Object | None          # the object copied: a new object of the same key is never touched
                                # (None: a finished task restored from etcd)
    created_ms: int
    updated_ms: int = 0
    status: TaskStatus = TaskStatus.PENDING
    message: str = ""
    copied: list[int] = field(default_factory=list)     # targets that received their replica

    def row(self) -> list:
        """What query_task returns: [id, type, status, created ms, updated
        ms, assigned client, message]."""
        return [list(self.id), int(self.type), int(self.status), self.created_ms, self.updated_ms or self.created_ms,
                self.client, self.message]


    def record(self) -> list:
        """What etcd keeps of it (durable.py; restore_task reads it back)."""
        obj = self.obj
        return [int(self.type), self.key, self.client, self.source, self.targets, self.copied, int(self.status),
                self.message, self.created_ms, self.updated_ms, obj.writer if obj else "", obj.token if obj else 0,
                obj.size if obj else 0]


def _ms() -> int:
    return int(time.time() * 1000)


class ReplicaTasks:
    """State (set up by _init_tasks): `tasks` (id -> Task), `_task_queue`
    (client -> its unfinished tasks' ids, in creation order)."""

    def _init_tasks(self) -> None:
        self.tasks: dict[tuple[int, int], Task] = {}
        self._task_queue: dict[str, list[tuple[int, int]]] = {}
        self._finished: deque[tuple[int, int]] = deque()     # finished tasks' ids, oldest first
        # Mooncake's task ids are UUIDs (two uint64): a random half per
        # master, so ids from a master that restarted are not confused with
        # the new one's, and a counter
        self._task_epoch = random.SystemRandom().getrandbits(63) | 1
        self._task_seq = itertools.count(1)
        self.dirty_tasks: set[tuple[int, int]] | None = None    # tasks to write to etcd (model.track())

    def _task_changed(self, tid: tuple[int, int]) -> None:
        if self.dirty_tasks is not None:
            self.dirty_tasks.add(tid)

    def restore_task(self, tid: tuple[int, int], rec: list) -> Task:
        """A task recorded in etcd (Task.record()), after the objects: see
        the module's doc. Restored in creation order, so each client's queue
        keeps it."""
        kind, key, client, source, targets, copied, status, message, created, updated, writer, token, size = rec[:13]
        task = Task(tid, TaskType(kind), key, client, int(source), [int(t) for t in targets], None, int(created),
                    int(updated), TaskStatus(status), str(message), [int(t) for t in copied])
        self.tasks[tid] = task
        if task.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            self._finished.append(tid)
            return task
        obj = self.objects.get(key)
        seg = self.segments.get(task.source)
        task.status = TaskStatus.PENDING           # a copy in flight died with the old master
        if obj is None or obj.state is not State.COMPLETE or (obj.writer, obj.token, obj.size) != (writer, token, size):
            self._finish(task, TaskStatus.FAILED, "the object was removed or evicted")
        elif seg is None:
            self._finish(task, TaskStatus.FAILED, "the source replica is gone")
        else:
            task.obj, task.client = obj, seg.client
            self._task_queue.setdefault(seg.client, []).append(tid)
        return task

    def segment_named(self, name: object) -> Segment | None:
        """The attached segment mounted under `name` (the newest, should an
        old holder of the name not be lost yet), or None."""
        if type(name) is not str or not name:
            return None
        best = None
        for seg in self.segments.values():
            if seg.name == name and seg.attached and (best is None or seg.id > best.id):
                best = seg
        return best

    def describe(self, key: str) -> Object:
        """The COMPLETE object, with no lease (replica_desc: a description,
        not a read). ObjectNotFoundError."""
        return self._complete(key)

    def preferred_ids(self, preferred: object) -> list[int] | None:
        """A put's preferred segments given by name (a str, or a list of
        names or ids) as segment ids; names not mounted are left out, as
        Mooncake ignores them."""
        out = []
        for p in preferred if isinstance(preferred, list) else [preferred]:
            if type(p) is int:
                out.append(p)
            elif (seg := self.segment_named(p)) is not None:
                out.append(seg.id)
        return out or None

    def _target(self, name: object) -> Segment:
        seg = self.segment_named(name)
        if seg is None:
            raise InvalidArgumentError(f"no segment named {name!r} is mounted")
        return seg

    def _task_object(self, key: object) -> Object:
        obj = self._complete(key)
        if not obj.replicas:
            raise ObjectNotFoundError(f"{key!r} has no replica in memory to copy (only SSD copies)", key=key)
        return obj

    def create_copy_task(self, key: str, targets: list) -> tuple[int, int]:
        """A task copying `key` to each of the segments named in `targets`
        (those already holding a replica are left as they are), from a
        replica picked at random. InvalidArgumentError for no targets or an
        unknown segment name; ObjectNotFoundError. Returns the task id."""
        if type(targets) is not list or not targets:
            raise InvalidArgumentError(f"a copy needs a non-empty list of target segment names, not {targets!r}")
        obj = self._task_object(key)
        segs = [self._target(name) for name in targets]
        src = self._rng.choice(obj.replicas)
        return self._submit(TaskType.REPLICA_COPY, obj, src.segment, list(dict.fromkeys(s.id for s in segs)))

    def create_move_task(self, key: str, source: str, target: str) -> tuple[int, int]:
        """A task moving `key`'s replica on segment `source` to segment
        `target`: a replica made there, then the source's dropped.
        ObjectNotFoundError; InvalidArgumentError when source == target, a
        segment is not mounted, or `source` holds no replica of it (Mooncake's
        checks, in its order). Returns the task id."""
        obj = self._task_object(key)
        if source == target:
            raise InvalidArgumentError(f"a move needs two different segments, not {source!r} twice")
        dst = self._target(target)
        src = self.segment_named(source)
        if src is None or all(r.segment != src.id for r in obj.replicas):
            raise InvalidArgumentError(f"segment {source!r} holds no replica of {key!r}")
        return self._submit(TaskType.REPLICA_MOVE, obj, src.id, [dst.id])

    def _submit(self, kind: TaskType, obj: Object, source: int, targets: list[int]) -> tuple[int, int]:
        tid = (self._task_epoch, next(self._task_seq))
        client = self.segments[source].client
        task = self.tasks[tid] = Task(tid, kind, obj.key, client, source, targets, obj, _ms())
        self._task_queue.setdefault(client, []).append(tid)
        self._task_changed(tid)
        if not self._skip_held(task):
            self._task_done(task)           # every target holds a replica already: nothing to copy
        return task.id

    def _skip_held(self, task: Task) -> int:
        """Drops the leading targets that hold a replica already (nothing
        to copy there); returns how many targets are left."""
        held = {r.segment for r in task.obj.replicas}
        while task.targets and task.targets[0] in held:
            task.copied.append(task.targets.pop(0))
        return len(task.targets)

    def query_task(self, task_id: object) -> Task:
        """The task. TaskNotFoundError for an id never given out, or one
        finished long ago (MAX_FINISHED_TASKS newer ones since)."""
        tid = tuple(task_id) if isinstance(task_id, (list, tuple)) else None
        task = self.tasks.get(tid) if tid is not None and len(tid) == 2 else None
        if task is None:
            raise TaskNotFoundError(f"no task {task_id!r}")
        return task

    def _tasks_waiting(self, client_id: str) -> int:
        return len(self._task_queue.get(client_id, ()))

    def _finish(self, task: Task, status: TaskStatus, message: str = "") -> None:
        task.status, task.message, task.updated_ms = status, message, _ms()
        q = self._task_queue.get(task.client)
        if q is not None and task.id in q:
            q.remove(task.id)
            if not q:
                del self._task_queue[task.client]
        self._finished.append(task.id)
        self._task_changed(task.id)
        while len(self._finished) > MAX_FINISHED_TASKS:     # the oldest finished go first
            gone = self._finished.popleft()
            self.tasks.pop(gone, None)
            self._task_changed(gone)                        # (its record is deleted)

    def _task_jobs(self, client_id: str, now: float, lease: int, limit: int) -> list:
        """repair_start's share of tasks: up to `limit` copies from this
        client's replicas, one per key, each with its new allocation
        (recorded in `_repairs` with its task). [(key, size, source, new), ...]."""
        jobs: list = []
        for tid in list(self._task_queue.get(client_id, ())):
            if len(jobs) >= limit:
                break
            task = self.tasks[tid]
            if task.key in self._repairs:
                continue                    # one copy of a key at a time: the next round
            job = self._next_copy(task, now, lease)
            if job is not None:
                jobs.append(job)
        return jobs

    def _next_copy(self, task: Task, now: float, lease: int):
        obj = task.obj
        if self.objects.get(task.key) is not obj or obj.state is not State.COMPLETE:
            self._finish(task, TaskStatus.FAILED, "the object was removed or evicted")
            return None
        src = next((r for r in obj.replicas if r.segment == task.source), None)
        if src is None:
            self._finish(task, TaskStatus.FAILED, "the source replica is gone")
            return None
        if not self._skip_held(task):
            self._task_done(task)
            return None
        seg = self.segments.get(task.targets[0])
        if seg is None:
            self._finish(task, TaskStatus.FAILED, f"target segment {task.targets[0]} was unmounted")
            return None
        if not seg.attached:
            return None                     # recovered, its holder not back yet (lost after the grace)
        new = self._start_copy(task.client, obj, seg, now, lease, task)     # repair.py's
        if new is None and seg.alloc.fenced:
            return None                     # space fenced after a failover: tried again at its end (fence.py)
        if new is None:
            self._finish(task, TaskStatus.FAILED, f"no room for {obj.size} bytes on segment {seg.name!r}")
            return None
        task.status, task.updated_ms = TaskStatus.PROCESSING, _ms()
        return (task.key, obj.size, src, new)

    def _task_done(self, task: Task) -> None:
        if task.type is TaskType.REPLICA_MOVE:
            self._drop_replica(task.obj, task.source)
        self._finish(task, TaskStatus.SUCCESS)

    def _task_copied(self, task: Task, ok: bool, joined: bool) -> None:
        """One target's copy ended (repair.py's _end_repair): the task goes
        on to its next target, finishes, or fails."""
        if not ok:
            self._finish(task, TaskStatus.FAILED, "copying the bytes failed")
        elif not joined:
            self._finish(task, TaskStatus.FAILED, "the object or the target segment went during the copy")
        else:
            task.copied.append(task.targets.pop(0))
            task.updated_ms = _ms()
            self._task_changed(task.id)
            if not self._skip_held(task):
                self._task_done(task)

    def _drop_replica(self, obj: Object, segment: int) -> None:
        """A move's end: the source's replica leaves the object. Its space is
        freed at once, or once the object's read leases end (a reader may
        still be copying from it: model.py's quarantine)."""
        r = next((r for r in obj.replicas if r.segment == segment), None)
        if r is None or len(obj.replicas) < 2:
            return
        obj.replicas.remove(r)
        seg = self.segments.get(segment)
        if seg is not None:
            seg.keys.discard(obj.key)
        if obj.leases:
            self._quarantine.append((obj, [r]))
        elif seg is not None:
            self._used -= seg.alloc.release(r.offset)
        if self.dirty_objects is not None:
            self.dirty_objects.add(obj.key)

    def _tasks_client_lost(self, client_id: str) -> None:
        """The copying client is gone: its tasks not yet handed out fail."""
        for tid in list(self._task_queue.get(client_id, ())):
            self._finish(self.tasks[tid], TaskStatus.FAILED, "the client holding the source was lost")
