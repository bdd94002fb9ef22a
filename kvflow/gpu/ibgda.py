"""The host launcher of IBGDA (seed 001): an IBGDA endpoint's queue
(peer.ibgda_endpoints(), kvflow.providers.rdma.ibgda) mapped into a GPU,
and kvf_ibgda_write (kernels.cu, over ibgda.cuh) launched on it: the
device builds the WQE, rings the doorbell and polls the CQ itself.

NEVER RUN: it needs an mlx5 NIC and a GPU on one machine, and no machine
of this project has both (the H200 machine has no NIC for it; the VM's are
Soft-RoCE). What is tested without them: the struct layouts against
ibgda.cuh (tests/test_ibgda.py) and the page spans (below).

The queue's memory is the mlx5 provider's, in host RAM (send queue, CQ,
doorbell records) and the NIC's UAR page (I/O memory): each is registered
with the GPU (cuMemHostRegister, the UAR with the IOMEMORY flag) and the
device reaches them over PCIe. Placing them in GPU memory (DEVX umem) would
be faster and is not built.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvflow._cuda import driver as drv
from kvflow._cuda import kernels
from kvflow._cuda.limits import check_length
from kvflow.errors import CudaError, InvalidArgumentError

__all__ = ["DeviceQp", "PAGE", "QP_DTYPE", "page_spans"]

PAGE = 4096

# struct kvf_ibgda_qp in ibgda.cuh, as the device reads it
QP_DTYPE = np.dtype([("sq_buf", "<u8"), ("dbrec", "<u8"), ("bf_reg", "<u8"), ("cq_buf", "<u8"),
                     ("cq_dbrec", "<u8"), ("wqe_cnt", "<u4"), ("qpn", "<u4"), ("cqe_cnt", "<u4"),
                     ("pad", "<u4"), ("sq_pi", "<u4"), ("cq_ci", "<u4")])


def page_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages covering `ranges` ((addr, size), size > 0), merged
    where they touch or overlap: each span is registered once (a page
    registered twice is an error to the driver)."""
    pages = sorted((a // PAGE * PAGE, -(-(a + n) // PAGE) * PAGE) for a, n in ranges if n > 0)
    out: list[list[int]] = []
    for lo, hi in pages:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


class DeviceQp:
    """An IBGDA endpoint driven by GPU `device`: its queue mapped into the
    device, the struct the kernel reads and the engine's region table in
    device memory. One kernel at a time posts on it (the device code
    serialises nothing)."""

    def __init__(self, endpoint: Any, device: int = 0) -> None:
        view = endpoint.view()           # ProviderUnavailableError where the NIC is not mlx5
        self.endpoint, self.device = endpoint, device
        self._maps: list[drv.HostMapping] = []
        self._mem: list[drv.DeviceMemory] = []
        try:
            ram = [(view["sq_buf"], view["wqe_cnt"] * 64), (view["dbrec"], 8),
                   (view["cq_buf"], view["cqe_cnt"] * 64), (view["cq_dbrec"], 8)]
            for addr, size in page_spans(ram):
                self._maps.append(drv.HostMapping(addr, size, device))
            uar = view["bf_reg"] // PAGE * PAGE
            self._maps.append(drv.HostMapping(uar, PAGE, device, iomemory=True))
            qp = np.zeros(1, dtype=QP_DTYPE)
            for name in ("sq_buf", "dbrec", "bf_reg", "cq_buf", "cq_dbrec"):
                qp[name] = self._device_addr(view[name])
            qp["wqe_cnt"], qp["qpn"], qp["cqe_cnt"] = view["wqe_cnt"], view["qpn"], view["cqe_cnt"]
            self._qp = self._upload(qp.tobytes())
            self._out = drv.DeviceMemory(16, device)
            self._mem.append(self._out)
            self._mrs = None
            self.refresh_regions()
        except BaseException:
            self.close()
            raise

    def _device_addr(self, host: int) -> int:
        for m in self._maps:
            if m.addr <= host < m.addr + m.size:
                return m.device_addr + (host - m.addr)
        raise CudaError(f"host address {host:#x} is not in a mapped span")

    def _upload(self, data: bytes) -> drv.DeviceMemory:
        mem = drv.DeviceMemory(max(len(data), 8), self.device)
        self._mem.append(mem)
        buf = np.frombuffer(data, dtype=np.uint8)
        with drv.on_device(self.device):
            drv.check(drv.driver().cuMemcpyHtoD(mem.addr, buf.ctypes.data, len(data)), "cuMemcpyHtoD")
        return mem

    def refresh_regions(self) -> None:
        """Uploads the engine's region table again (after a registration)."""
        table = self.endpoint.local_regions()
        self._nmrs = len(table)
        self._mrs = self._upload(table.tobytes()) if len(table) else None

    def write(self, stream: drv.Stream, local_addr: int, remote_addr: int, length: int) -> tuple[int, int]:
        """Launches kvf_ibgda_write (one thread: the WQE, the doorbell, the
        CQ polled) on `stream` and waits for it: (the CQE's opcode, 0: the
        write landed; its WQE counter). Raises InvalidArgumentError for a
        range the peer has not opened or a local range in no region."""
        check_length(length)
        rkey = self.endpoint.remote_key(remote_addr, length)
        self.endpoint.lkey(local_addr, length)          # refused here, not found missing on the device
        kernels.ibgda_write(stream, self._qp.addr, self._mrs.addr if self._mrs else 0, self._nmrs,
                            local_addr, remote_addr, rkey, length, self._out.addr)
        out = np.zeros(2, dtype=np.int64)
        with drv.on_device(self.device):
            drv.check(drv.driver().cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
            drv.check(drv.driver().cuMemcpyDtoH(out.ctypes.data, self._out.addr, 16), "cuMemcpyDtoH")
        if out[0] < 0:
            raise InvalidArgumentError(f"[{local_addr:#x}, +{length}) is in no region of the device's table")
        return int(out[0]), int(out[1])

    def close(self) -> None:
        for m in self._mem:
            m.close()
        for m in self._maps:
            m.close()
        self._mem, self._maps = [], []
