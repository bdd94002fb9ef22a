"""IBGDA endpoints (seed 001), the provider's side: with
`Engine(rdma_ibgda=True)` every rdma channel gets, beside its RC QPs, one
more RC QP per (local device, peer device) pair that no worker posts on: a
GPU drives it (kvflow/_cuda/ibgda.cuh builds the WQEs and rings the
doorbell; kvflow/gpu/ibgda.py maps the queue into the device and
launches it). Its QP information travels in the same rdma_connect
handshake as the channel's (an "ibgda" list beside "qps"); the peer makes a
plain target QP for each, outside its receive window (the device's writes
take no credit).

`peer.ibgda_endpoints()` lists them. Where the device is not mlx5 (here:
Soft-RoCE) `view()` raises ProviderUnavailableError with the reason, and
`write_from_host()` posts through the same QP from the host, which is what
proves the handshake connected it to the right peer QP.

NEVER RUN ON AN mlx5 NIC: no machine of this project has one.

Not built: repairing a broken IBGDA QP (it errors every later WQE: the
device sees an error CQE; a new channel makes new ones), and GPU memory as
the source (that takes GPUDirect registration of GPU memory with the NIC:
nvidia-peermem or dma-buf; here the source is registered host memory,
which the NIC reads while the GPU only writes the WQE).
"""
from __future__ import annotations

import asyncio
import bisect
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow._cuda.limits import check_length
from kvflow.errors import (InvalidArgumentError, ProviderUnavailableError, RemoteAccessError,
                           TransferTimeoutError, UnregisteredMemoryError, VerbsError)
from kvflow.memory import Access
from kvflow.status import WC_STATUS

if TYPE_CHECKING:
    from kvflow.providers.rdma.provider import RdmaProvider

__all__ = ["IBGDA_DEPTH", "IbgdaEndpoint", "MR_DTYPE", "check_length"]

IBGDA_DEPTH = 128              # send-queue entries (and CQ entries) per IBGDA QP
ETIMEDOUT = 110
EBUSY = 16

# struct kvf_mr in kvflow/_cuda/ibgda.cuh: the region table the device code
# searches by address (sorted by addr, no overlaps)
MR_DTYPE = np.dtype([("addr", "<u8"), ("length", "<u8"), ("lkey", "<u4"), ("rkey", "<u4")])


class IbgdaEndpoint:
    """One IBGDA QP of a peer's channel: `device` (this side's device
    name) to the peer's device `remote_device` (an index into the rkeys of
    the peer's regions), `qpn` to `remote_qpn`."""

    def __init__(self, provider: "RdmaProvider", peer: Any, qp: Any, remote_device: int, remote_qpn: int) -> None:
        self._provider = provider
        self._peer = peer
        self._qp = qp
        self._lock = threading.Lock()       # one host write at a time on the QP
        self.device = qp.dev.name
        self.device_index = qp.dev.index
        self.remote_device = remote_device
        self.qpn = qp.qpn
        self.remote_qpn = remote_qpn

    def __repr__(self) -> str:
        return (f"<kvflow IBGDA endpoint {self.device} QP {self.qpn} -> {self._peer.address} "
                f"device {self.remote_device} QP {self.remote_qpn}>")

    @property
    def capable(self) -> bool:
        """Whether a GPU can drive it: the device is mlx5."""
        return bool(self._qp.dev.ibgda_capable)

    def view(self) -> dict[str, Any]:
        """What a GPU needs to drive the QP (host addresses of its send
        queue, doorbell records, UAR register and CQ, and their sizes). Raises
        ProviderUnavailableError where the device is not mlx5, or once
        write_from_host() was used (the device starts from a fresh queue).
        After it, write_from_host() is refused: the device owns the queue."""
        try:
            return self._qp.view()
        except VerbsError as e:
            raise ProviderUnavailableError(f"IBGDA on {self.device}: {e}") from None

    def local_regions(self) -> np.ndarray:
        """This engine's registered regions as the device code's sorted
        table (MR_DTYPE: addr, length, lkey and rkey on this endpoint's
        device), for the O(log n) lookup by address (kvf_ibgda_find_mr)."""
        return np.array(self._provider.regions_on(self.device_index), dtype=MR_DTYPE)

    def lkey(self, addr: int, length: int) -> int:
        """The lkey of the registered region holding [addr, +length) on this
        endpoint's device; UnregisteredMemoryError if none does."""
        rows = self._provider.regions_on(self.device_index)
        i = bisect.bisect_right(rows, (addr, 1 << 64)) - 1
        if length <= 0 or i < 0 or addr + length > rows[i][0] + rows[i][1]:
            raise UnregisteredMemoryError(f"[{addr:#x}, +{length}) is not inside a region registered on "
                                          f"{self.device}")
        return rows[i][2]

    def remote_key(self, addr: int, length: int) -> int:
        """The peer's rkey for [addr, +length) on its device `remote_device`
        (a region it registered writable); RemoteAccessError otherwise."""
        for r in self._peer.descriptor.regions:
            if r.kind == "host" and r.addr <= addr and addr + length <= r.end and Access.WRITE in r.access \
                    and self.remote_device < len(r.rkeys):
                return int(r.rkeys[self.remote_device])
        raise RemoteAccessError(f"{self._peer.address}: [{addr:#x}, +{length}) is not inside a writable "
                                "region of the peer's", peer=self._peer.address)

    async def write_from_host(self, local_addr: int, remote_addr: int, length: int, *,
                              timeout: float = 5.0) -> None:
        """One RDMA write posted from the host on this endpoint's QP and
        waited for (in a thread: the loop is not blocked). For checking the
        endpoint where no GPU drives it; raises the typed error of a bad
        range before anything is posted, TransferTimeoutError, or
        VerbsError with the completion's status."""
        check_length(length)
        lkey = self.lkey(local_addr, length)
        rkey = self.remote_key(remote_addr, length)

        def post() -> int:
            with self._lock:
                return int(self._qp.host_write(local_addr, lkey, remote_addr, rkey, length, timeout))

        rc = await asyncio.to_thread(post)
        if rc == -ETIMEDOUT:
            raise TransferTimeoutError(f"IBGDA write on {self.device} QP {self.qpn}: no completion in {timeout} s")
        if rc == -EBUSY:
            raise InvalidArgumentError(f"IBGDA QP {self.qpn} on {self.device} is driven by a device (view() "
                                       "was taken): the host does not post on it")
        if rc < 0:
            raise VerbsError(-rc, f"IBGDA write on {self.device} QP {self.qpn}: post failed")
        if rc:
            name = WC_STATUS[rc] if rc < len(WC_STATUS) else str(rc)
            raise VerbsError(f"IBGDA write on {self.device} QP {self.qpn}: completion IBV_WC_{name}")

    def destroy(self) -> None:
        self._qp.destroy()
