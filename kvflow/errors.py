"""kvflow's exception tree, and the one place where native status codes
become exceptions."""
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
    "TopologyError",
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


# Native status codes (kvflow/_native/kvf.h).
OK, EINVAL, EUNREG, EREMOTE, ELOST, ECANCELLED, EPROTO, ENOMEM, EIO, ECLOSED = range(10)

_OPS = {0: "write", 1: "read"}


# ibv_wc_status values (infiniband/verbs.h), for messages.
WC_STATUS = (
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR",
    "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR", "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR",
)


def status_error(status: int, *, peer: str, index: int | None, op: int,
                 devices: list[str] | None = None) -> KVFlowError:
    """Maps a native status to the exception a caller sees. An rdma
    completion error carries the verbs status in bits 8-15 and the device
    (index + 1) in bits 16-22; `devices` names them."""
    what = _OPS.get(op, "transfer")
    at = f" (entry {index})" if index is not None else ""
    wc, dev = (status >> 8) & 0xFF, (status >> 16) & 0x7F
    status &= 0xFF
    if dev:
        name = devices[dev - 1] if devices and dev - 1 < len(devices) else f"#{dev - 1}"
        wc_name = WC_STATUS[wc] if wc < len(WC_STATUS) else str(wc)
        at += f" [rdma device {name}, verbs status IBV_WC_{wc_name} ({wc})]"
    if status == EINVAL:
        return InvalidArgumentError(
            f"{what} to {peer}: zero length or address overflow{at}", peer=peer, index=index)
    if status == EUNREG:
        extra = " (or, for a read, its memory is read-only)" if op == 1 else ""
        return UnregisteredMemoryError(
            f"{what} to {peer}: local range is not inside a registered region{extra}{at}",
            peer=peer, index=index)
    if status == EREMOTE:
        need = "WRITE" if op == 0 else "READ"
        return RemoteAccessError(
            f"{what} to {peer}: remote range is outside the peer's regions or lacks {need} access{at}",
            peer=peer, index=index)
    if status in (ELOST, EIO):
        return PeerLostError(f"{what} to {peer}: connection to the peer lost{at}", peer=peer, index=index)
    if status == ECANCELLED:
        return TransferCancelledError(f"{what} to {peer} cancelled", peer=peer, index=index)
    if status == EPROTO:
        return ProtocolError(f"{what} to {peer}: malformed frame from the peer{at}", peer=peer, index=index)
    if status == ENOMEM:
        return KVFlowError(f"{what} to {peer}: out of memory or batch slots (too many batches in flight)",
                           peer=peer, index=index)
    if status == ECLOSED:
        return PeerLostError(f"{what} to {peer}: the peer or engine was closed", peer=peer, index=index)
    return KVFlowError(f"{what} to {peer}: native status {status}{at}", peer=peer, index=index)
