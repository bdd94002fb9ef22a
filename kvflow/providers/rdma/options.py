"""The rdma provider's options and the choices made per device: which
devices an engine uses, the RC ACK timeout and who posts work requests
(hardware NICs and software devices differ), and the constants the
provider's parts share."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvflow.config import env_bool, env_int
from kvflow.errors import InvalidArgumentError

try:
    from kvflow import _verbs
except ImportError:          # built without libibverbs headers
    _verbs = None  # type: ignore[assignment]

__all__ = ["RdmaOptions", "available", "check_ack_timeout", "choose_ack_timeout", "choose_worker_posts",
           "device_names", "is_software"]

QP_DEPTH = 128                 # send-queue entries per QP
QP_UP = 1                      # RdmaChannel.qp_stats() "state": 1 up, 2 probing, 0 broken, -1 closed,
QP_GONE = -2                   # -2 destroyed with its (removed) device
QP_STATES = {1: "up", 2: "probing", 0: "broken", -1: "closed", -2: "gone"}
PROBE_TIMEOUT = 5.0            # reachability read per QP
MAX_TARGET_QPS = 256           # per control session
REPAIR_MIN = 0.2               # first back-off of a broken QP's repair (doubles)
REPAIR_MAX = 8.0
DEAD_AFTER = 10.0              # no QP of a peer up this long (at least keepalive): the peer is lost
NOTIFY_SLOTS = 64              # registered send buffers for notifications
LARGE_REGION = 64 << 20        # registrations at least this big are logged with their time
DEVICE_CHECK = 2.0             # seconds between checks that each device still exists (uevents are faster)
REOPEN_RETRY = 0.1             # first wait before opening a returning device again (doubles to DEVICE_CHECK)
NETLINK_KOBJECT_UEVENT = 15    # linux/netlink.h: the kernel's device add/remove announcements
ACK_TIMEOUT_HW = 14            # RC ACK timeout exponents, see choose_ack_timeout()
ACK_TIMEOUT_SOFT = 17


def available() -> bool:
    return _verbs is not None


def device_names() -> list[str]:
    """RDMA devices on this host ([] when none or not built)."""
    return _verbs.device_names() if _verbs is not None else []


def is_software(name: str, sysfs: str = "/sys/class/infiniband") -> bool:
    """Device `name` has no parent in sysfs: Soft-RoCE or siw, no NIC."""
    return not os.path.exists(f"{sysfs}/{name}/device")


def choose_worker_posts(name: str, sysfs: str = "/sys/class/infiniband") -> bool:
    """Whether device `name`'s worker thread posts the work requests of
    unpolled batches (not the submitting thread): env
    KVFLOW_RDMA_WORKER_POSTS (0 or 1), else for software devices only. On
    Soft-RoCE ibv_post_send does the transfer inside the system call, so
    posting on the event loop's thread stalls the loop for the whole batch;
    a NIC's post is a doorbell write (see kvflow/_native/rdma.h)."""
    env = env_bool("KVFLOW_RDMA_WORKER_POSTS")
    return is_software(name, sysfs) if env is None else env


def choose_ack_timeout(name: str, override: int | None = None, sysfs: str = "/sys/class/infiniband") -> int:
    """The RC ACK timeout exponent (4.096 us * 2^n) for device `name`:
    `override` (the Engine's rdma_ack_timeout), else env
    KVFLOW_RDMA_ACK_TIMEOUT, else 14 (67 ms) for a device with a parent in
    sysfs (a hardware NIC) and 17 (537 ms) for one without (rxe, siw:
    emulated ACKs can be later than 67 ms, see kvflow/_verbs.pyx). Raises
    InvalidArgumentError for a value outside 1..31."""
    if override is None:
        override = env_int("KVFLOW_RDMA_ACK_TIMEOUT")
    if override is not None:
        return check_ack_timeout(override)
    return ACK_TIMEOUT_SOFT if is_software(name, sysfs) else ACK_TIMEOUT_HW


def check_ack_timeout(value: Any) -> int:
    """`value` if it is a valid ACK timeout exponent (1..31), else InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 31:
        raise InvalidArgumentError(f"rdma ACK timeout {value!r} is not a whole number from 1 to 31 "
                                   "(4.096 us * 2^n)")
    return value



@dataclass
class RdmaOptions:
    """The rdma provider's options (Engine(rdma_devices=, rdma_gid_index=,
    rdma_qps=, rdma_slice_size=, rdma_ack_timeout=, rdma_ibgda=)): devices to
    use (None: env KVFLOW_RDMA_DEVICES, else all), GID index override, QPs
    per device pair, bytes per slice (one work request), RC ACK timeout
    exponent, an IBGDA endpoint per device pair (kvflow.providers.rdma.ibgda)."""

    devices: list[str] | None = None
    gid_index: int | None = None
    qps_per_pair: int = 2
    slice_size: int = 256 << 10
    ack_timeout: int | None = None
    ibgda: bool = False

    def __post_init__(self) -> None:
        if self.devices is not None:
            self.devices = list(self.devices)
        if self.ack_timeout is not None:
            self.ack_timeout = check_ack_timeout(self.ack_timeout)

