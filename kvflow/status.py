"""Native status codes and the one place where they become exceptions.

The codes are defined once, in kvflow/_native/kvf.h; kvflow._core exposes
them and this module names them for Python (tests/test_constants.py checks
that the header and Python agree)."""
from __future__ import annotations

from kvflow._core import OP_READ, OP_WRITE, STATUS, STATUS_BITS
from kvflow.errors import (
    InvalidArgumentError,
    KVFlowError,
    PeerLostError,
    ProtocolError,
    RemoteAccessError,
    TransferCancelledError,
    UnregisteredMemoryError,
)

__all__ = ["OK", "EINVAL", "EUNREG", "EREMOTE", "ELOST", "ECANCELLED", "EPROTO", "ENOMEM", "EIO", "ECLOSED",
           "WC_STATUS", "status_error"]

OK, EINVAL, EUNREG, EREMOTE, ELOST = (STATUS[n] for n in ("OK", "EINVAL", "EUNREG", "EREMOTE", "ELOST"))
ECANCELLED, EPROTO, ENOMEM, EIO, ECLOSED = (STATUS[n] for n in ("ECANCELLED", "EPROTO", "ENOMEM", "EIO", "ECLOSED"))
_CODE_MASK = STATUS_BITS["CODE_MASK"]
_WC_SHIFT, _WC_MASK = STATUS_BITS["WC_SHIFT"], STATUS_BITS["WC_MASK"]
_DEV_SHIFT, _DEV_MASK = STATUS_BITS["DEV_SHIFT"], STATUS_BITS["DEV_MASK"]

_OPS = {OP_WRITE: "write", OP_READ: "read"}


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
    completion error carries the verbs status and the device (index + 1)
    in the bits kvf.h's KVF_STATUS_* say; `devices` names them."""
    what = _OPS.get(op, "transfer")
    at = f" (entry {index})" if index is not None else ""
    wc, dev = (status >> _WC_SHIFT) & _WC_MASK, (status >> _DEV_SHIFT) & _DEV_MASK
    status &= _CODE_MASK
    if dev:
        name = devices[dev - 1] if devices and dev - 1 < len(devices) else f"#{dev - 1}"
        wc_name = WC_STATUS[wc] if wc < len(WC_STATUS) else str(wc)
        at += f" [rdma device {name}, verbs status IBV_WC_{wc_name} ({wc})]"
    if status == EINVAL:
        return InvalidArgumentError(
            f"{what} to {peer}: zero length or address overflow{at}", peer=peer, index=index)
    if status == EUNREG:
        extra = " (or, for a read, its memory is read-only)" if op == OP_READ else ""
        return UnregisteredMemoryError(
            f"{what} to {peer}: local range is not inside a registered region{extra}{at}",
            peer=peer, index=index)
    if status == EREMOTE:
        need = "WRITE" if op == OP_WRITE else "READ"
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
