"""kvflow's exception tree: every error kvflow raises is a KVFlowError.
Native status codes become these exceptions in kvflow.status."""
from __future__ import annotations

__all__ = [
    "KVFlowError",
    "InvalidArgumentError",
    "UnregisteredMemoryError",
    "RemoteAccessError",
    "PeerUnreachableError",
    "PeerLostError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "ProtocolError",
    "AuthenticationError",
    "ProviderUnavailableError",
    "RegionBusyError",
    "TopologyError",
    "VerbsError",
    "CudaError",
]


class KVFlowError(Exception):
    """Base of every kvflow error. `peer` is the peer's address and `index`
    the offending batch entry, where there is one; `errno` where a system
    call failed."""

    def __init__(self, message: str, *, peer: str | None = None, index: int | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.index = index
        self.errno = errno


class InvalidArgumentError(KVFlowError, ValueError):
    """A batch or buffer that cannot be valid: zero or overflowing lengths,
    arrays of different lengths, an empty batch, an unusable buffer."""


class LengthMismatchError(InvalidArgumentError):
    """A local and a remote block paired by a transfer of prepared blocks
    differ in length (`index`: the position in the transfer)."""


class TopologyError(InvalidArgumentError):
    """A topology file (Topology.load, KVFLOW_TOPOLOGY) that cannot be read,
    is not JSON, or does not follow the schema."""


class UnregisteredMemoryError(KVFlowError):
    """A local range is not inside one region registered with this engine."""


class RemoteAccessError(KVFlowError):
    """A remote range is outside the peer's regions or lacks the access the
    operation needs (WRITE for writes, READ for reads)."""


class PeerUnreachableError(KVFlowError):
    """Nobody answers at the peer's address, or it does not speak kvflow."""


class PeerLostError(KVFlowError):
    """The connection to the peer broke while transfers were in flight."""


class TransferTimeoutError(KVFlowError, TimeoutError):
    """The transfer's timeout elapsed before every byte landed."""


class TransferCancelledError(KVFlowError):
    """The transfer was cancelled with Transfer.cancel()."""


class ProtocolError(KVFlowError):
    """A peer sent a malformed, oversized or unexpected message."""


class AuthenticationError(KVFlowError):
    """The peers' secrets do not match (or only one side has one)."""


class ProviderUnavailableError(KVFlowError):
    """No requested provider can reach the peer, or it was not built."""


class RegionBusyError(KVFlowError):
    """deregister() gave up waiting for a same-host peer (local provider)
    still copying into or out of the region: its process stopped, or did
    not run, in the middle of one copy for longer than the wait. The region
    is deregistered (nothing new reaches it) but its memory is not free: the
    engine keeps a reference to the buffer, and the caller must not reuse
    it until a later deregister(region) returns (it waits again). `pids`:
    the processes still inside."""

    def __init__(self, message: str, *, pids: "list[int] | tuple[int, ...]" = (), peer: str | None = None) -> None:
        super().__init__(message, peer=peer)
        self.pids = tuple(pids)


class VerbsError(KVFlowError, OSError):
    """A verbs call failed (device, protection domain, CQ, QP or memory
    registration); `errno` where the call set one. Also an OSError, as it
    was before it joined the tree. Raised as VerbsError(message) or
    VerbsError(errno, message)."""

    def __init__(self, *args: object) -> None:
        errno, message = args if len(args) == 2 else (None, args[0] if args else "")
        KVFlowError.__init__(self, str(message), errno=errno if isinstance(errno, int) else None)


class CudaError(KVFlowError):
    """A CUDA driver call failed; `code` is its CUresult."""

    def __init__(self, message: str, *, code: int | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.code = code
