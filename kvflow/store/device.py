"""GPU memory as the caller's side of put_from/get_into.

A client whose engine has GPU memory registered (Engine.register of a CUDA
tensor, a `__cuda_array_interface__` object or a raw device pointer, which
the driver identifies) may name it in put_from/get_into. The pool's
segments stay host memory; only the caller's side is on the GPU, so the
bytes go the way kvflow already moves GPU memory, and nothing here copies:

- to or from another holder: the holder's batch is one Peer.write/read
  with device addresses on the local side, which the engine routes to its
  GPU path (the same process or CUDA IPC on one host: one copy; otherwise
  staged through its pinned slots: device -> slot -> wire, and back);
- to or from this client's own segment: never the memmove the host path
  uses (a CPU copy of a device address faults), but a batch through a Peer of
  the engine to itself, which is the engine's one-process GPU copy
  (cuMemcpyAsync on its own streams).

Registration is checked as for host memory: a range outside every
registered region, GPU or host, is UnregisteredMemoryError and nothing of
its object is written. The check of GPU memory runs only where the host
check failed, so a host-only client pays nothing for it.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import kvflow

__all__ = ["DeviceRanges", "by_memory", "split_rows"]


class DeviceRanges:
    """The engine's registered GPU memory as sorted (starts, ends), read
    from Engine.regions when asked (regions change on the loop's thread;
    the check is the rare path, so it is not cached)."""

    __slots__ = ("starts", "ends", "devices")

    def __init__(self, engine: kvflow.Engine) -> None:
        regions = [r for r in engine.regions if r.kind != "host"]
        self.starts = [r.addr for r in regions]
        self.ends = [r.end for r in regions]
        self.devices = [r.device for r in regions]

    def __bool__(self) -> bool:
        return bool(self.starts)

    def holds(self, addr: int, size: int) -> bool:
        """Whether [addr, +size) lies inside one registered GPU region
        (regions never overlap: the one starting at or before addr)."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return i >= 0 and addr + size <= self.ends[i]

    def device_of(self, addr: int) -> int:
        """The GPU whose registered memory holds `addr`; -1: not GPU memory."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.devices[i] if i >= 0 and addr < self.ends[i] else -1

    def touches(self, parts: Iterable[Any]) -> bool:
        """Whether any (address, size) of `parts` starts in GPU memory."""
        return any(self.holds(int(a), 1) for a, _ in parts)


def split_rows(ranges: DeviceRanges, local: Sequence[int], length: Sequence[int],
               rows: Iterable[int]) -> tuple[list[int], list[int]]:
    """`rows` of a call's moves as (host rows, GPU rows) by their local
    address: the host rows may be memmoved, the GPU rows may not."""
    host: list[int] = []
    gpu: list[int] = []
    for j in rows:
        (gpu if ranges.holds(local[j], length[j]) else host).append(j)
    return host, gpu


def by_memory(ranges: DeviceRanges, local: Sequence[int], rows: Iterable[int]) -> list[list[int]]:
    """`rows` of one holder's batch grouped by where their local side is:
    host memory, or each GPU's. kvflow's GPU path stages a batch whose
    local side is one kind (one GPU, or host memory); a call that mixes
    them is one batch per group, all at once."""
    groups: dict[int, list[int]] = {}
    for j in rows:
        groups.setdefault(ranges.device_of(int(local[j])), []).append(j)
    return list(groups.values())
