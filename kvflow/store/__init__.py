"""kvflow.store: a global KVCache pool over kvflow engines (Mooncake
Store's job). Clients mount segments of registered memory; a master only
allocates and remembers (objects -> replicas, segment space, leases,
liveness); bytes move between clients with kvflow's own transfers.

    async with StoreClient() as a, StoreClient() as b:      # embedded master
        await a.put("k", b"...")
        assert await b.get("k") == b"..."

Layering: uses kvflow's public API only (tests/test_layers.py); nothing in
the library imports it. docs/store.md has what works and what is measured.
"""
from .allocator import Allocator
from .client import Replica, StoreClient
from .errors import (BufferTooSmallError, DurabilityError, InvalidKeyError, LeaseExpiredError, MasterUnavailableError,
                     NoSpaceError, ObjectBusyError, ObjectExistsError, ObjectLeasedError,
                     ObjectNotFoundError, ReplicaUnavailableError, SegmentError, StoreError,
                     StoreTimeoutError, TaskNotFoundError)
from .master import Master
from .model import State, StoreModel
from .task_calls import ReplicaDesc, TaskInfo
from .tasks import TaskStatus, TaskType

__all__ = [
    "Allocator", "BufferTooSmallError", "DurabilityError", "InvalidKeyError", "LeaseExpiredError", "Master",
    "MasterUnavailableError", "NoSpaceError", "ObjectBusyError", "ObjectExistsError",
    "ObjectLeasedError", "ObjectNotFoundError", "Replica", "ReplicaDesc", "ReplicaUnavailableError",
    "SegmentError", "State", "StoreClient", "StoreError", "StoreModel", "StoreTimeoutError", "TaskInfo",
    "TaskNotFoundError", "TaskStatus", "TaskType",
]
