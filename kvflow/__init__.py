"""kvflow: an asyncio KV-cache transfer engine for prefill/decode
disaggregated LLM serving."""
from kvflow.engine.blocks import Blocks, Prepared
from kvflow.engine.engine import Engine
from kvflow.paths.relay import RelayGroup
from kvflow.errors import (
    AuthenticationError,
    InvalidArgumentError,
    KVFlowError,
    LengthMismatchError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    ProviderUnavailableError,
    RegionBusyError,
    RemoteAccessError,
    TransferCancelledError,
    TransferTimeoutError,
    UnregisteredMemoryError,
)
from kvflow.features import features
from kvflow.memory import Access, Region, RemoteRegion
from kvflow.engine.peer import Peer
from kvflow.engine.transfer import Transfer
from kvflow.schedule.qos import Priority

__version__ = "0.1.0"

__all__ = [
    "Access",
    "AuthenticationError",
    "Blocks",
    "Engine",
    "InvalidArgumentError",
    "KVFlowError",
    "LengthMismatchError",
    "Peer",
    "PeerLostError",
    "PeerUnreachableError",
    "Prepared",
    "Priority",
    "ProtocolError",
    "ProviderUnavailableError",
    "RegionBusyError",
    "Region",
    "RemoteAccessError",
    "RelayGroup",
    "RemoteRegion",
    "Transfer",
    "TransferCancelledError",
    "TransferTimeoutError",
    "UnregisteredMemoryError",
    "features",
]
