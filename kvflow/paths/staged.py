"""An engine's GPU memory: its CUDA regions, and transfers to and from
them over the host providers through the staging pipeline (slots.py),
or in one direct copy where the peer's memory is addressable here (ipc.py).

CUDA regions never enter the native core's region tables, so no CPU path
(memcpy, sendmsg, recv, a verbs MR) is ever handed a device address. A
batch that touches one goes here instead:

- write from local GPU memory: each slot is filled by a device→host copy
  and drained by a host write of the slot to the peer;
- read into local GPU memory: each slot is filled by a host read from the
  peer and drained by a host→device copy;
- write into a peer's GPU memory: the peer lends slots of its inbox (a
  host region it registered for this, `stage_lease`), the slot is written
  there over the host path, and the peer copies it into its GPU memory
  (`stage_land`) before it answers; the write completes after the last
  answer. The peer checks every destination against its own CUDA regions
  (WRITE access) and the slot against the lease, so nothing lands outside
  registered memory.
- read from a peer's GPU memory: the peer fills leased inbox slots from
  its GPU memory (`stage_fetch`, READ access checked) and they are read
  over the host path.

Staging memory is bounded per engine (Engine(staging_bytes=)),
half for outgoing slots and half for the inbox, allocated once when first
used.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from kvflow.errors import InvalidArgumentError, KVFlowError, RemoteAccessError, UnregisteredMemoryError
from kvflow.memory import Access
from kvflow.paths.base import PathContext, PathPeer
from kvflow.paths.ipc import IpcMaps, copy_direct
from kvflow.paths.lease import Inbox, Lease
from kvflow.paths.slots import BouncePool, Packed, Slot, pack, run_staged, slot_pieces
from kvflow.regions import RegionTable
from kvflow.tasks import gather_or_cancel

__all__ = ["GpuMemory", "INBOX", "STAGING_BYTES", "STAGING_SLOT"]

STAGING_BYTES = 64 << 20        # Engine(staging_bytes=): per engine, outgoing + inbox
STAGING_SLOT = 4 << 20          # one slot: a slice of the pipeline
INBOX = "gpu"                   # the inbox's name in lease messages


class GpuMemory:
    """One engine's CUDA regions (`local`) and staged transfers; what it
    uses of its engine comes through `ctx` (kvflow.paths.base.PathContext):
    the staging memory is registered with the engine as host regions, copy
    engines and staging memory are CUDA's unless the context gives others."""

    def __init__(self, ctx: PathContext, *, staging_bytes: int, slot_bytes: int) -> None:
        half = max(slot_bytes, staging_bytes // 2)
        count = max(1, half // slot_bytes)
        self.slot_bytes = slot_bytes
        self._ctx = ctx
        self._copiers: dict[int, Any] = {}
        self._host_regions: list[Any] = []
        self.local = RegionTable()
        self.outgoing = BouncePool(slot_bytes, count, self._allocator("kvflow.staging.out"))
        self.inbox = Inbox(INBOX, BouncePool(slot_bytes, count, self._allocator("kvflow.staging.in")))
        self.ipc = IpcMaps()

    def _allocator(self, name: str) -> Callable[[int], tuple[int, Any]]:
        def make(nbytes: int) -> tuple[int, Any]:
            addr, keep = (self._ctx.allocate or self._pinned)(nbytes)
            self._host_regions.append(self._ctx.register_host(addr, nbytes, name))
            return addr, keep
        return make

    def _pinned(self, nbytes: int) -> tuple[int, Any]:
        """Pinned host memory, in the context of a GPU this engine uses
        (portable to all)."""
        from kvflow._cuda import driver as drv
        gpu = next(iter(self.local), None)
        buf = drv.PinnedHost(nbytes, gpu.device if gpu is not None else 0)
        return buf.addr, buf

    def copier(self, device: int) -> Any:
        """The copy engine of GPU `device` (kvflow.gpu.copy), made on first use."""
        c = self._copiers.get(device)
        if c is None:
            if self._ctx.copier is not None:
                c = self._ctx.copier(device)
            else:
                from kvflow.gpu.copy import CudaCopyEngine
                c = CudaCopyEngine(device)
            self._copiers[device] = c
        return c

    def close(self, deregister: bool = True) -> None:
        """Frees the staging memory, once nothing can touch it: the copy
        engines are drained first, and the engine calls this after its
        native core closed (deregister=False: the regions went with it)
        or, while running, deregisters the regions first."""
        self._ctx.let_go(self._host_regions, deregister)
        self.ipc.close()
        for c in self._copiers.values():
            c.close()                   # waits for the copies it queued
        self._copiers.clear()
        for pool in (self.outgoing, self.inbox.pool):
            keep = pool.close()
            close = getattr(keep, "close", None)
            if close is not None:
                close()

    def readout(self) -> dict[str, dict[str, int]]:
        """The staging pools' figures: "outgoing" (the slots this engine's
        staged transfers fill and drain, BouncePool.readout()) and "inbox"
        (the slots it lends its peers, Inbox.readout())."""
        return {"outgoing": self.outgoing.readout(), "inbox": self.inbox.readout()}

    # ------------------------------------------------------------ routing
    def touches(self, la: Any, ra: Any, remote: RegionTable) -> bool:
        """Whether a batch reads or writes GPU memory on either side."""
        if not self.local and not remote:
            return False
        return self.local.any_in(np.asarray(la, dtype=np.uint64)) or \
            remote.any_in(np.asarray(ra, dtype=np.uint64))

    def _device_of(self, entries: list[tuple[int, int, int, int]], peer: str) -> int | None:
        """The one GPU the entries' local addresses lie on (None: all in host
        memory); raises if they mix GPUs, or host and GPU memory."""
        devices = set()
        for _, la, _, n in entries:
            r = self.local.find(la, n)
            devices.add(None if r is None else r.device)
        if len(devices) > 1:
            raise InvalidArgumentError(
                "a staged batch's local entries must all be in one GPU's memory or all in host memory", peer=peer)
        return devices.pop()

    def _plan(self, peer: PathPeer, la: Any, ra: Any, ln: Any, remote: RegionTable,
              need: Access) -> tuple[list[Packed], bool, int | None]:
        """A staged batch, checked: its slots, whether it reaches the
        peer's GPU memory (then every remote entry must lie in one of its
        GPU regions with `need`), and the one GPU its local entries are on
        (None: host memory). Raises before anything moves."""
        packed = pack(la, ra, ln, self.slot_bytes)
        remote_gpu = remote.any_in(np.asarray(ra, dtype=np.uint64))
        verb = "write" if need == Access.WRITE else "read"
        if remote_gpu:
            for part in packed:
                for _, _, r, n in part.entries:
                    region = remote.find(r, n)
                    if region is None or not (region.access & need):
                        raise RemoteAccessError(
                            f"{r:#x}+{n} is not inside one of the peer's GPU regions it may {verb} "
                            "(a staged batch reaches GPU memory only)", peer=peer.address)
        device = self._device_of(packed[0].entries, peer.address) if self.local else None
        for part in packed[1:]:
            if self.local and self._device_of(part.entries, peer.address) != device:
                raise InvalidArgumentError("a staged batch's local entries must all be on one GPU or all in "
                                           "host memory", peer=peer.address)
        if device is None and not remote_gpu:
            raise UnregisteredMemoryError(
                "a local entry starts in GPU memory and runs past the end of its region", peer=peer.address)
        return packed, remote_gpu, device

    # ------------------------------------------------------------ initiator
    async def write(self, peer: PathPeer, la: Any, ra: Any, ln: Any, host_write: Callable[..., Any],
                    remote: RegionTable, reach: str = "remote") -> None:
        """A write that reads local GPU memory or lands in the peer's (or
        both). `reach`: "process" (the peer is in this process: one direct
        copy), "host" (on this host: a direct copy into its GPU memory
        through CUDA IPC where every destination is GPU memory), else
        staged; `host_write(local, remote, lengths)` is the peer's
        host-memory write."""
        if await self._direct(peer, la, ra, ln, remote, reach, write=True):
            return
        packed, remote_gpu, src_device = self._plan(peer, la, ra, ln, remote, Access.WRITE)
        landing = _Landing(peer, host_write) if remote_gpu else None
        try:
            if src_device is None:          # host source: straight into the peer's inbox
                assert landing is not None
                await landing.run_direct(packed)
                return
            copier = self.copier(src_device)

            async def fill(slot: Slot, part: Packed) -> None:     # device -> host slot
                await copier.copy([(slot.addr + off, l, n) for off, l, _, n in part.entries])

            async def drain(slot: Slot, part: Packed) -> None:    # host slot -> peer
                if landing is not None:
                    await landing.land(slot, part)
                else:
                    await host_write([slot.addr + off for off, _, _, _ in part.entries],
                                     [r for _, _, r, _ in part.entries], [n for _, _, _, n in part.entries])

            await run_staged(self.outgoing, packed, fill, drain)
        finally:
            if landing is not None:
                landing.release()

    async def read(self, peer: PathPeer, la: Any, ra: Any, ln: Any, host_read: Callable[..., Any],
                   remote: RegionTable, reach: str = "remote") -> None:
        """A read into local GPU memory, or from the peer's (or both): a
        direct copy where `reach` allows it (as write()), else staged; from
        a peer's GPU memory the peer fills slots of its inbox (stage_fetch)
        that are then read over the host path."""
        if await self._direct(peer, la, ra, ln, remote, reach, write=False):
            return
        packed, remote_gpu, device = self._plan(peer, la, ra, ln, remote, Access.READ)
        fetching = _Landing(peer, None, host_read) if remote_gpu else None
        try:
            if device is None:              # into host memory: straight from the peer's inbox
                assert fetching is not None
                await fetching.run_direct(packed, write=False)
                return
            copier = self.copier(device)

            async def fill(slot: Slot, part: Packed) -> None:     # peer -> host slot
                if fetching is not None:
                    await fetching.fetch(slot, part)
                else:
                    await host_read([slot.addr + off for off, _, _, _ in part.entries],
                                    [r for _, _, r, _ in part.entries], [n for _, _, _, n in part.entries])

            async def drain(slot: Slot, part: Packed) -> None:    # host slot -> device
                await copier.copy([(l, slot.addr + off, n) for off, l, _, n in part.entries])

            await run_staged(self.outgoing, packed, fill, drain)
        finally:
            if fetching is not None:
                fetching.release()

    # ------------------------------------------------------------ direct: same process, CUDA IPC
    async def _direct(self, peer: PathPeer, la: Any, ra: Any, ln: Any, remote: RegionTable, reach: str,
                      write: bool) -> bool:
        return await copy_direct(peer, la, ra, ln, local=self.local, remote=remote, reach=reach, write=write,
                                 maps=self.ipc, holds_host=self._ctx.holds_host, copier=self.copier)

    def forget_peer(self, address: str) -> None:
        """Closes the IPC mappings of a peer that is gone or re-registered."""
        self.ipc.forget_peer(address)

    # ------------------------------------------------------------ target
    async def on_land(self, peer: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._land(session, msg)
        except KVFlowError as e:            # a CudaError, a malformed message
            return {"t": "stage_error", "message": str(e)}

    async def on_fetch(self, peer: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._land(session, msg, fetch=True)
        except KVFlowError as e:
            return {"t": "stage_error", "message": str(e)}

    async def _land(self, session: Any, msg: dict[str, Any], fetch: bool = False) -> dict[str, Any]:
        """Copies a written inbox slot into this engine's GPU memory (fetch:
        fills the slot from it, for the peer to read)."""
        slot = self.inbox.slot(session, msg)
        if isinstance(slot, str):
            return {"t": "stage_error", "message": slot}
        checked = slot_pieces(msg["t"], msg.get("entries"), slot.size)
        if isinstance(checked, str):
            return {"t": "stage_error", "message": checked}
        pieces = []
        device = None
        need = Access.READ if fetch else Access.WRITE
        for off, dst, n in checked:
            region = self.local.find(dst, n)
            if region is None or not (region.access & need):
                return {"t": "stage_error", "message": f"{msg['t']}: {dst:#x}+{n} is not inside a GPU region "
                                                       f"peers may {'read' if fetch else 'write'}"}
            if device is not None and region.device != device:
                return {"t": "stage_error", "message": f"{msg['t']}: entries on two GPUs"}
            device = region.device
            pieces.append((slot.addr + off, dst, n) if fetch else (dst, slot.addr + off, n))
        if pieces:
            assert device is not None
            await self.copier(device).copy(pieces)
        return {"t": "stage_done"}


class _Landing:
    """The initiator's side of staged transfers to and from a peer's GPU
    memory: a lease of the peer's "gpu" inbox slots, each written over the
    host path and landed, or fetched and read."""

    def __init__(self, peer: PathPeer, host_write: Callable[..., Any] | None,
                 host_read: Callable[..., Any] | None = None) -> None:
        self._lease = Lease(peer, INBOX)
        self._host_write = host_write
        self._host_read = host_read

    async def land(self, slot: Slot, part: Packed) -> None:
        """Writes a filled local slot into one of the peer's inbox slots and
        has the peer copy it into its GPU memory."""
        remote_slot = await self._lease.take()
        try:
            assert self._host_write is not None
            await self._host_write([slot.addr], [remote_slot], [part.nbytes])
            await self._ask(remote_slot, part)
        finally:
            self._lease.put(remote_slot)

    async def fetch(self, slot: Slot, part: Packed) -> None:
        """Has the peer fill one of its inbox slots from its GPU memory and
        reads it into a local slot."""
        remote_slot = await self._lease.take()
        try:
            await self._ask(remote_slot, part, fetch=True)
            assert self._host_read is not None
            await self._host_read([slot.addr], [remote_slot], [part.nbytes])
        finally:
            self._lease.put(remote_slot)

    async def run_direct(self, packed: Sequence[Packed], write: bool = True) -> None:
        """Host memory on this side: each part written from where it is into
        a leased slot and landed, or (a read) fetched into a slot and read
        from there to where it goes; several in flight, one per slot."""
        async def one(part: Packed) -> None:
            remote_slot = await self._lease.take()
            local = [l for _, l, _, _ in part.entries]
            there = [remote_slot + off for off, _, _, _ in part.entries]
            sizes = [n for _, _, _, n in part.entries]
            try:
                if write:
                    assert self._host_write is not None
                    await self._host_write(local, there, sizes)
                    await self._ask(remote_slot, part)
                else:
                    await self._ask(remote_slot, part, fetch=True)
                    assert self._host_read is not None
                    await self._host_read(local, there, sizes)
            finally:
                self._lease.put(remote_slot)

        await gather_or_cancel([one(p) for p in packed])

    async def _ask(self, remote_slot: int, part: Packed, fetch: bool = False) -> None:
        await self._lease.ask("stage_fetch" if fetch else "stage_land", remote_slot, part.nbytes,
                              [[off, r, n] for off, _, r, n in part.entries])

    def release(self) -> None:
        self._lease.release()
