"""`mooncake.store` as kvflow.compat.mooncake.store provides it: Mooncake
Store's client on kvflow.store (docs/store.md, "Mooncake Store's API")."""
from kvflow.compat.mooncake.store import (BufferHandle, Descriptor, DiskDescriptor, MemoryDescriptor,  # noqa: F401
                                          MooncakeDistributedStore, ObjectDataType, QueryTaskResponse,
                                          ReplicaDescriptor, ReplicaStatus, ReplicateConfig, SoftPinAction,
                                          TaskStatus, TaskType)

__all__ = ["BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor", "MooncakeDistributedStore",
           "ObjectDataType", "QueryTaskResponse", "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig",
           "SoftPinAction", "TaskStatus", "TaskType"]
