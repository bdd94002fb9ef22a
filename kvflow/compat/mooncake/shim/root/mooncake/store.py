"""`mooncake.store` as kvflow.compat.mooncake.store provides it: Mooncake
Store's client on kvflow.store (docs/store.md, "Mooncake Store's API"),
with the unified parallelism request types (docs/mooncake.md)."""
from kvflow.compat.mooncake.parallelism import ParallelAxis, ReadTarget, TensorParallelism  # noqa: F401
from kvflow.compat.mooncake.shm import MooncakeHostMemAllocator  # noqa: F401
from kvflow.compat.mooncake.store import (BufferHandle, Descriptor, DiskDescriptor, MemoryDescriptor,  # noqa: F401
                                          MooncakeDistributedStore, ObjectDataType, QueryTaskResponse,
                                          ReplicaDescriptor, ReplicaStatus, ReplicateConfig, SoftPinAction,
                                          TaskStatus, TaskType)

__all__ = ["BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor", "MooncakeDistributedStore",
           "MooncakeHostMemAllocator", "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget",
           "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType",
           "TensorParallelism"]
