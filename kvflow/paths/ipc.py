"""The direct path for GPU memory: one copy of a whole batch where the
peer's memory is addressable here. In this process (an engine of the same
process: every address is), and on this host through CUDA IPC: a peer
publishes a handle for each GPU region (ipc_handle(), in its descriptor),
and this side opens it once per region (IpcMaps), closing it when the
peer goes or its regions change. Where neither works (another host, a GPU
not visible here, a driver that refuses) the batch is staged instead
(staged.py)."""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from kvflow.errors import (CudaError, InvalidArgumentError, KVFlowError, ProviderUnavailableError,
                           RemoteAccessError, UnregisteredMemoryError)
from kvflow.memory import Access, RemoteRegion
from kvflow.paths.base import PathPeer
from kvflow.regions import RegionTable

__all__ = ["IpcMaps", "copy_direct", "ipc_handle"]

log = logging.getLogger("kvflow")


def ipc_handle(span: Any) -> "tuple[bytes, int, bytes] | None":
    """The CUDA IPC handle of a GPU span's allocation, the span's offset in
    it and its GPU's UUID, for peers on this host; None where the driver
    gives none (memory from a stream-ordered pool, say): such peers stage."""
    from kvflow._cuda import driver as drv
    try:
        base = span.base or span.addr
        return drv.ipc_handle(base, span.device), span.addr - base, drv.device_uuid(span.device)
    except (CudaError, ProviderUnavailableError) as e:
        log.debug("kvflow: no CUDA IPC handle for %#x: %s", span.addr, e)
        return None


class IpcMaps:
    """Peers' GPU regions opened here through CUDA IPC, by (peer, region)."""

    def __init__(self) -> None:
        # (peer, region addr) -> (region's base here, our ordinal of its GPU), and
        # -> (the mapping cuIpcOpenMemHandle made, that ordinal)
        self._open: dict[tuple[str, int], tuple[int, int]] = {}
        self._bases: dict[tuple[str, int], tuple[int, int]] = {}

    def mapped(self, address: str, region: RemoteRegion) -> tuple[int, int] | None:
        """(the base, in this process, of a peer's GPU region; this process's
        ordinal of its GPU), opened through CUDA IPC on first use and closed
        with the peer; None where that GPU is not visible here (found by its
        UUID: ordinals differ between processes) or the driver refuses."""
        key = (address, region.addr)
        found = self._open.get(key)
        if found is not None:
            return found
        from kvflow._cuda import driver as drv
        assert region.ipc is not None
        handle, offset, uuid = region.ipc
        try:
            device = drv.device_of_uuid(uuid)
            if device is None:
                log.info("kvflow: %s's GPU %s is not visible here: staged", address, uuid.hex())
                return None
            opened = drv.ipc_open(handle, device)
        except CudaError as e:
            log.info("kvflow: cannot open %s's CUDA IPC handle (%s): staged", address, e)
            return None
        self._bases[key] = (opened, device)
        found = self._open[key] = (opened + offset, device)
        return found

    def forget_peer(self, address: str) -> None:
        """Closes the IPC mappings of a peer that is gone or re-registered."""
        for key in [k for k in self._bases if k[0] == address]:
            opened, device = self._bases.pop(key)
            self._open.pop(key, None)
            try:
                from kvflow._cuda import driver as drv
                drv.ipc_close(opened, device)
            except KVFlowError as e:
                log.warning("kvflow: closing a CUDA IPC mapping of %s: %s", address, e)

    def close(self) -> None:
        for address in {k[0] for k in self._bases}:
            self.forget_peer(address)


async def copy_direct(peer: PathPeer, la: Any, ra: Any, ln: Any, *, local: RegionTable, remote: RegionTable,
                      reach: str, write: bool, maps: IpcMaps, holds_host: Callable[[int, int], bool],
                      copier: Callable[[int], Any]) -> bool:
    """One copy of the whole batch where the peer's memory is addressable
    here: in this process (reach "process"), all of it; on this host
    ("host"), its GPU regions through CUDA IPC. `local`, `remote`: the GPU
    regions here and there; holds_host(addr, n): a range in one of this
    engine's host regions; copier(device): a copy engine. False: not
    possible, stage it. Raises (before anything moves) for an entry outside
    the memory it may touch."""
    if reach not in ("process", "host"):
        return False
    la = np.asarray(la, dtype=np.uint64).tolist()
    ra = np.asarray(ra, dtype=np.uint64).tolist()
    ln = np.asarray(ln, dtype=np.uint64).tolist()
    if not (len(la) == len(ra) == len(ln)) or not ln or 0 in ln:
        raise InvalidArgumentError("a batch needs entries of equal count and non-zero lengths",
                                   peer=peer.address)
    verb = "WRITE" if write else "READ"
    devices: set[int] = set()       # this process's ordinals of the GPUs the copy touches
    pieces: list[tuple[int, int, int]] = []
    for i, (l, r, n) in enumerate(zip(la, ra, ln)):
        mine = local.find(l, n)
        theirs = remote.find(r, n)
        if reach == "host" and (theirs is None or not theirs.ipc):
            return False                    # the peer's host memory, or no IPC handle: staged
        if theirs is not None and not (theirs.access & (Access.WRITE if write else Access.READ)):
            raise RemoteAccessError(f"entry {i}: {r:#x}+{n} is in a GPU region of the peer without "
                                    f"{verb} access", peer=peer.address, index=i)
        if reach == "process":
            if theirs is None and not peer.holds_host(r, n, write):
                raise RemoteAccessError(f"entry {i}: {r:#x}+{n} is not inside one of the peer's regions "
                                        f"with {verb} access", peer=peer.address, index=i)
            there = r
        else:
            opened = maps.mapped(peer.address, theirs)
            if opened is None:
                return False                # no such GPU here, or the driver refused: staged
            there, device = opened
            there += r - theirs.addr
            devices.add(device)
        if mine is None and not holds_host(l, n):
            raise UnregisteredMemoryError(f"entry {i}: {l:#x}+{n} is not inside one registered region",
                                          peer=peer.address, index=i)
        if mine is not None:
            devices.add(mine.device)
        if reach == "process" and theirs is not None:
            devices.add(theirs.device)     # the same process: the same ordinals
        pieces.append((there, l, n) if write else (l, there, n))
    if not devices:
        return False
    await copier(min(devices)).copy(pieces)
    return True
