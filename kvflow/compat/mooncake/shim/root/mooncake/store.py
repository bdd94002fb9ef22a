"""`mooncake.store` as kvflow.compat.mooncake.store provides it: Mooncake
Store's client on kvflow.store (docs/store.md, "Mooncake Store's API"),
with the unified parallelism request types (docs/mooncake.md)."""
from kvflow.compat.mooncake.parallelism import ParallelAxis, ReadTarget, TensorParallelism  # noqa: F401
from kvflow.compat.mooncake.store import (BufferHandle, MooncakeDistributedStore, ObjectDataType,  # noqa: F401
                                          ReplicateConfig, SoftPinAction)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ObjectDataType", "ParallelAxis", "ReadTarget",
           "ReplicateConfig", "SoftPinAction", "TensorParallelism"]
