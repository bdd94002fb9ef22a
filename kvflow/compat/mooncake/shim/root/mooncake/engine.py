"""`mooncake.engine` as kvflow.compat.mooncake provides it (docs/mooncake.md)."""
from kvflow.compat.mooncake import (P2PHANDSHAKE, SUPPORT_CUDA, SUPPORT_EFA, SUPPORT_HIP,  # noqa: F401
                                    SUPPORT_INTRA_NVLINK, SUPPORT_MNNVL, SUPPORT_MUSA, Read, TransferEngine,
                                    TransferNotify, TransferOpcode, Write)

__all__ = ["P2PHANDSHAKE", "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL",
           "SUPPORT_MUSA", "Read", "TransferEngine", "TransferNotify", "TransferOpcode", "Write"]
