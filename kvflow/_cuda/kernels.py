"""kvflow's device code (kernels.cu, compiled by nvcc into a fatbin at
build time), loaded into each device's primary context on first use."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvflow._cuda import FATBIN, built
from kvflow._cuda import driver as drv
from kvflow.errors import ProviderUnavailableError

__all__ = ["doorbells", "flag_write", "ibgda_write", "layer_put"]

_lock = threading.Lock()
_functions: dict[tuple[int, str], Any] = {}
_modules: dict[int, Any] = {}


def _function(device: int, name: str) -> Any:
    key = (device, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    if not built():
        raise ProviderUnavailableError("kvflow was built without its CUDA module (no nvcc at build time)")
    cu = drv.driver()
    with _lock, drv.on_device(device):
        module = _modules.get(device)
        if module is None:
            with open(FATBIN, "rb") as f:
                image = f.read()
            module = drv.check(cu.cuModuleLoadData(image), "cuModuleLoadData(kvflow_kernels.fatbin)")
            _modules[device] = module
        fn = drv.check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
        _functions[key] = fn
    return fn


def _launch(stream: drv.Stream, name: str, args: list[int], grid: int = 1, block: int = 32) -> None:
    # kernelParams as a void** array: one 8-byte slot per argument, every
    # argument of these kernels being a pointer or a 64-bit value (the
    # uint32 count takes a slot's low half, little-endian)
    slots = np.array(args, dtype=np.uint64)
    params = np.array([slots.ctypes.data + 8 * i for i in range(len(args))], dtype=np.uint64)
    fn = _function(stream.device, name)
    with drv.on_device(stream.device):
        drv.check(drv.driver().cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream.handle,
                                              int(params.ctypes.data), 0), f"cuLaunchKernel({name})")
    # the driver copied the parameters at launch: slots may go now


def flag_write(stream: drv.Stream, flag_addr: int, value: int) -> None:
    """Queues, behind the work already on `stream`, the write of `value`
    into the 64-bit flag at `flag_addr` (host-mapped or device memory),
    made visible system-wide after everything before it."""
    _launch(stream, "kvf_flag_write", [flag_addr, value])


def doorbells(stream: drv.Stream, doorbell_addr: int, values_addr: int, count: int) -> None:
    """Queues the ringing of `count` 64-bit doorbells at `doorbell_addr`
    with the values at `values_addr` (device-readable), in index order."""
    _launch(stream, "kvf_doorbells", [doorbell_addr, values_addr, count])


def layer_put(stream: drv.Stream, x: int, w: int, kv: int, rows: int, dim_in: int, dim_out: int,
              rows_per_block: int, ring: int, peer: int, remote: int, out: int, threads: int = 128) -> int:
    """Queues kvf_layer_put (kernels.cu): kv = x @ w (float32, row-major,
    device addresses), each block's rows then put from the device through
    channel b of the put ring at device address `ring` to `remote` + their
    offset on proxy peer `peer`; out (2 int64 per block, device-writable)
    gets each block's status and put-to-completion nanoseconds. Returns the
    number of blocks (the ring needs that many channels)."""
    blocks = -(-rows // rows_per_block)
    _launch(stream, "kvf_layer_put", [x, w, kv, rows, dim_in, dim_out, rows_per_block, ring, peer, remote, out],
            grid=blocks, block=threads)
    return blocks


def ibgda_write(stream: drv.Stream, qp: int, mrs: int, nmrs: int, laddr: int, raddr: int, rkey: int,
                length: int, out: int) -> None:
    """Queues kvf_ibgda_write (kernels.cu; never run on hardware): one RDMA
    write posted by the device on the mlx5 QP whose struct kvf_ibgda_qp is
    at device address `qp`, its lkey found in the `nmrs` sorted regions at
    `mrs`, the CQ polled; out (2 int64, device-writable) gets the CQE's
    opcode (or -1: no region) and its WQE counter. kvflow.gpu.ibgda.DeviceQp
    prepares all of it."""
    _launch(stream, "kvf_ibgda_write", [qp, mrs, nmrs, laddr, raddr, rkey, length, out], grid=1, block=1)
