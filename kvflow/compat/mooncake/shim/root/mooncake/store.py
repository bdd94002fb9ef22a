"""`mooncake.store` as kvflow.compat.mooncake.store provides it: Mooncake
Store's client on kvflow.store (docs/store.md, "Mooncake Store's API")."""
from kvflow.compat.mooncake.store import (BufferHandle, MooncakeDistributedStore, ObjectDataType,  # noqa: F401
                                          ReplicateConfig, SoftPinAction)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ObjectDataType", "ReplicateConfig", "SoftPinAction"]
