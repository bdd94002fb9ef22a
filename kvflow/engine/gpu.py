"""An engine's GPU memory: its CUDA regions, and transfers to and from
them over the host providers through the staging pipeline
(kvflow.providers.cuda.staging).

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

import asyncio
import bisect
import logging
from typing import Any, Callable, Sequence

import numpy as np

from kvflow.control.wire import field
from kvflow.errors import (InvalidArgumentError, KVFlowError, ProtocolError,
                           RemoteAccessError, UnregisteredMemoryError)
from kvflow.memory import CUDA, Access, Region, RemoteRegion
from kvflow.providers.cuda.copier import CopyEngine
from kvflow.engine.inbox import Inbox, Lease
from kvflow.providers.cuda.staging import BouncePool, Packed, Slot, pack, run_staged

__all__ = ["GpuMemory", "INBOX", "STAGING_BYTES", "STAGING_SLOT"]

log = logging.getLogger("kvflow")

STAGING_BYTES = 64 << 20        # Engine(staging_bytes=): per engine, outgoing + inbox
STAGING_SLOT = 4 << 20          # one slot: a slice of the pipeline
INBOX = "gpu"                   # the inbox's name in lease messages


class _Table:
    """Regions by start address: the one that holds [addr, addr+n), in
    O(log n); any_in() answers for a whole batch's addresses at once (its
    columns are kept as arrays, rebuilt when the table changes, not per
    batch)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[Any] = []
        self._columns()

    def _columns(self) -> None:
        self._starts_np = np.asarray(self._starts, dtype=np.uint64)
        self._ends_np = np.asarray([r.end for r in self._regions], dtype=np.uint64)

    def set(self, regions: Sequence[Any]) -> None:
        ordered = sorted(regions, key=lambda r: r.addr)
        self._starts = [r.addr for r in ordered]
        self._regions = ordered
        self._columns()

    def add(self, region: Any) -> bool:
        i = bisect.bisect_left(self._starts, region.addr)
        if i > 0 and self._regions[i - 1].end > region.addr:
            return False
        if i < len(self._regions) and self._regions[i].addr < region.end:
            return False
        self._starts.insert(i, region.addr)
        self._regions.insert(i, region)
        self._columns()
        return True

    def remove(self, region: Any) -> None:
        i = bisect.bisect_left(self._starts, region.addr)
        if i < len(self._regions) and self._regions[i] is region:
            del self._starts[i], self._regions[i]
            self._columns()

    def find(self, addr: int, n: int) -> Any:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr + n <= self._regions[i].end:
            return self._regions[i]
        return None

    def any_in(self, addrs: np.ndarray) -> bool:
        """Whether any address lies inside a region (vectorised)."""
        if not self._regions:
            return False
        i = np.searchsorted(self._starts_np, addrs, side="right").astype(np.int64) - 1
        return bool(np.any((i >= 0) & (addrs < self._ends_np[np.maximum(i, 0)])))

    def __bool__(self) -> bool:
        return bool(self._regions)

    def __iter__(self):
        return iter(self._regions)


class GpuMemory:
    """One engine's CUDA regions and staged transfers. `register_host(addr,
    length)` / `deregister_host(region)` register the staging memory with
    the engine as host regions; `copier(device)` makes a copy engine;
    `allocate(nbytes) -> (addr, keepalive)` the staging memory (pinned);
    `holds_host(addr, n)` says whether a range is in one of the engine's
    host regions."""

    def __init__(self, *, staging_bytes: int, slot_bytes: int,
                 register_host: Callable[[int, int, str], Region], deregister_host: Callable[[Region], None],
                 copier: Callable[[int], CopyEngine], allocate: Callable[[int], tuple[int, Any]],
                 holds_host: Callable[[int, int], bool]) -> None:
        half = max(slot_bytes, staging_bytes // 2)
        count = max(1, half // slot_bytes)
        self.slot_bytes = slot_bytes
        self._register_host = register_host
        self._holds_host = holds_host
        self._deregister_host = deregister_host
        self._make_copier = copier
        self._copiers: dict[int, CopyEngine] = {}
        self._host_regions: list[Region] = []
        self.local = _Table()
        self.outgoing = BouncePool(slot_bytes, count, self._allocator(allocate, "kvflow.staging.out"))
        self.inbox = Inbox(INBOX, BouncePool(slot_bytes, count, self._allocator(allocate, "kvflow.staging.in")))
        # (peer, region addr) -> (region's base here, our ordinal of its GPU), and
        # -> (the mapping cuIpcOpenMemHandle made, that ordinal)
        self._ipc_open: dict[tuple[str, int], tuple[int, int]] = {}
        self._ipc_bases: dict[tuple[str, int], tuple[int, int]] = {}

    def _allocator(self, allocate: Callable[[int], tuple[int, Any]], name: str) -> Callable[[int], tuple[int, Any]]:
        def make(nbytes: int) -> tuple[int, Any]:
            addr, keep = allocate(nbytes)
            self._host_regions.append(self._register_host(addr, nbytes, name))
            return addr, keep
        return make

    def copier(self, device: int) -> CopyEngine:
        c = self._copiers.get(device)
        if c is None:
            c = self._copiers[device] = self._make_copier(device)
        return c

    def close(self, deregister: bool = True) -> None:
        """Frees the staging memory, once nothing can touch it: the copy
        engines are drained first, and the engine calls this after its
        native core closed (deregister=False: the regions went with it)
        or, while running, deregisters the regions first."""
        if deregister:
            for r in self._host_regions:
                try:
                    self._deregister_host(r)
                except KVFlowError:
                    pass
        self._host_regions.clear()
        for address in {k[0] for k in self._ipc_bases}:
            self.forget_peer(address)
        for c in self._copiers.values():
            c.close()                   # waits for the copies it queued
        self._copiers.clear()
        for pool in (self.outgoing, self.inbox.pool):
            keep = pool.close()
            close = getattr(keep, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------ routing
    def touches(self, la: Any, ra: Any, remote: "_Table") -> bool:
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

    def _plan(self, peer: Any, la: Any, ra: Any, ln: Any, remote: "_Table",
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
    async def write(self, peer: Any, la: Any, ra: Any, ln: Any, host_write: Callable[..., Any],
                    remote: "_Table", reach: str = "remote") -> None:
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

    async def read(self, peer: Any, la: Any, ra: Any, ln: Any, host_read: Callable[..., Any],
                   remote: "_Table", reach: str = "remote") -> None:
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
    async def _direct(self, peer: Any, la: Any, ra: Any, ln: Any, remote: "_Table", reach: str,
                      write: bool) -> bool:
        """One copy of the whole batch where the peer's memory is addressable
        here: in this process, all of it; on this host, its GPU regions
        through CUDA IPC (opened once per region). False: not possible,
        stage it."""
        if reach not in ("process", "host"):
            return False
        la = np.asarray(la, dtype=np.uint64).tolist()
        ra = np.asarray(ra, dtype=np.uint64).tolist()
        ln = np.asarray(ln, dtype=np.uint64).tolist()
        if not (len(la) == len(ra) == len(ln)) or not ln or 0 in ln:
            raise InvalidArgumentError("a batch needs entries of equal count and non-zero lengths",
                                       peer=peer.address)
        devices: set[int] = set()       # this process's ordinals of the GPUs the copy touches
        pieces: list[tuple[int, int, int]] = []
        for i, (l, r, n) in enumerate(zip(la, ra, ln)):
            mine = self.local.find(l, n)
            theirs = remote.find(r, n)
            if reach == "host" and (theirs is None or not theirs.ipc):
                return False                    # the peer's host memory, or no IPC handle: staged
            if theirs is not None and not (theirs.access & (Access.WRITE if write else Access.READ)):
                raise RemoteAccessError(f"entry {i}: {r:#x}+{n} is in a GPU region of the peer without "
                                        f"{'WRITE' if write else 'READ'} access", peer=peer.address, index=i)
            if reach == "process":
                if theirs is None and not peer.holds_host(r, n, write):
                    raise RemoteAccessError(f"entry {i}: {r:#x}+{n} is not inside one of the peer's regions "
                                            f"with {'WRITE' if write else 'READ'} access", peer=peer.address,
                                            index=i)
                there = r
            else:
                opened = self._mapped(peer, theirs)
                if opened is None:
                    return False                # no such GPU here, or the driver refused: staged
                there, device = opened
                there += r - theirs.addr
                devices.add(device)
            if mine is None and not self._holds_host(l, n):
                raise UnregisteredMemoryError(f"entry {i}: {l:#x}+{n} is not inside one registered region", peer=peer.address,
                            index=i)
            if mine is not None:
                devices.add(mine.device)
            if reach == "process" and theirs is not None:
                devices.add(theirs.device)     # the same process: the same ordinals
            pieces.append((there, l, n) if write else (l, there, n))
        if not devices:
            return False
        await self.copier(min(devices)).copy(pieces)
        return True

    def _mapped(self, peer: Any, region: RemoteRegion) -> tuple[int, int] | None:
        """(the base, in this process, of a peer's GPU region; this process's
        ordinal of its GPU), opened through CUDA IPC on first use and closed
        with the peer; None where that GPU is not visible here (found by its
        UUID: ordinals differ between processes) or the driver refuses."""
        key = (peer.address, region.addr)
        found = self._ipc_open.get(key)
        if found is not None:
            return found
        from kvflow._cuda import driver as drv
        from kvflow.errors import CudaError
        assert region.ipc is not None
        handle, offset, uuid = region.ipc
        try:
            device = drv.device_of_uuid(uuid)
            if device is None:
                log.info("kvflow: %s's GPU %s is not visible here: staged", peer.address, uuid.hex())
                return None
            opened = drv.ipc_open(handle, device)
        except CudaError as e:
            log.info("kvflow: cannot open %s's CUDA IPC handle (%s): staged", peer.address, e)
            return None
        self._ipc_bases[key] = (opened, device)
        found = self._ipc_open[key] = (opened + offset, device)
        return found

    def forget_peer(self, address: str) -> None:
        """Closes the IPC mappings of a peer that is gone or re-registered."""
        for key in [k for k in self._ipc_bases if k[0] == address]:
            opened, device = self._ipc_bases.pop(key)
            self._ipc_open.pop(key, None)
            try:
                from kvflow._cuda import driver as drv
                drv.ipc_close(opened, device)
            except KVFlowError as e:
                log.warning("kvflow: closing a CUDA IPC mapping of %s: %s", address, e)

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
        entries = field(msg, "entries", list)
        pieces = []
        device = None
        for e in entries:
            if not (isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) for v in e)):
                raise ProtocolError(f"{msg['t']}: an entry is [offset, GPU address, nbytes]")
            off, dst, n = e
            if n <= 0 or off < 0 or off + n > slot.size:
                return {"t": "stage_error", "message": f"{msg['t']}: {off}+{n} is outside the slot"}
            region = self.local.find(dst, n)
            need = Access.READ if fetch else Access.WRITE
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

    def __init__(self, peer: Any, host_write: Callable[..., Any] | None,
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


async def gather_or_cancel(coros: Sequence[Any]) -> None:
    """Runs the coroutines at once; the first error cancels the rest (and
    waits for them) and is raised."""
    tasks = [asyncio.get_running_loop().create_task(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def remote_table(regions: Sequence[RemoteRegion]) -> _Table:
    t = _Table()
    t.set([r for r in regions if r.kind == CUDA])
    return t
