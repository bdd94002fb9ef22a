"""Mooncake's return codes, opcodes and notification type, and the
constants of kvflow's Mooncake-compatible API."""
from __future__ import annotations

import enum
import os

from kvflow.features import features as _features

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's module flags (mooncake.engine.SUPPORT_*), with what kvflow can
# do: GPU memory where its CUDA module was built (kvflow.features["cuda"];
# a device is looked for at run time), and no EFA, ROCm, NVLink (intra-node
# or multi-node) or MUSA transports.
SUPPORT_CUDA = _features["cuda"]
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False

# Mooncake's return codes (mooncake-transfer-engine/include/error.h).
OK = 0
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
# transfer_check_status
STATUS_DONE, STATUS_PENDING, STATUS_FAILED, STATUS_TIMEOUT = 1, 0, -1, -2

PROTOCOLS: dict[str, tuple[str, ...] | None] = {"tcp": ("tcp",), "rdma": ("rdma",), "auto": None}
CONNECT_TIMEOUT = 10.0
# Up to this many entries kvflow copies a list of ints without numpy
# (_core.pyx SMALL); longer columns become uint64 arrays here (_u64).
SMALL_BATCH = 16
# Region names carry the registration order, which peers need for
# get_first_buffer_address (kvflow describes regions sorted by address).
REGION_PREFIX = "mooncake:"
NOTIFY_TAG = "mooncake.notify"


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode values (Read 0, Write 1); Mooncake's own enum is
    accepted too."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent with a transfer: `name` and `msg`, both str."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def mooncake_flag(name: str) -> bool:
    """A Mooncake flag variable (MC_FORCE_TCP=1/true/yes/on) is set."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def transfer_timeout() -> float:
    """Mooncake's MC_TRANSFER_TIMEOUT: seconds, at least 5, default 30."""
    try:
        return float(max(5, int(os.environ["MC_TRANSFER_TIMEOUT"])))
    except (KeyError, ValueError):
        return 30.0


# Mooncake Store's return codes (mooncake-store/include/types.h, ErrorCode):
# what MooncakeDistributedStore's int-returning calls give, checked against
# the mooncake-transfer-engine-non-cuda wheel (tests/test_compat_mooncake_store.py).
STORE_INTERNAL_ERROR = -1
STORE_SEGMENT_NOT_FOUND = -101
STORE_NO_AVAILABLE_HANDLE = -200        # no space, even after eviction
STORE_INVALID_KEY = -400
STORE_INVALID_PARAMS = -600
STORE_OBJECT_NOT_FOUND = -704
STORE_OBJECT_ALREADY_EXISTS = -705
STORE_OBJECT_HAS_LEASE = -706
STORE_LEASE_EXPIRED = -707
STORE_TRANSFER_FAIL = -800
STORE_RPC_FAIL = -900
STORE_RPC_TIMEOUT = -901
STORE_NOT_SUPPORTED = -1012
STORE_TASK_NOT_FOUND = -1400
