"""A relay sender's side (role A): this engine's writes to another rail,
each slot's worth copied into its lane of the member's segment (a member
of this node: lanes.py; from GPU memory into the member's device lanes:
device_lanes.py), or else written into a leased slot of the member's
inbox and forwarded by it (kvflow.paths.lease). A part whose member is
lost on the way is written directly to the destination instead."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from kvflow._lanes import LaneError
from kvflow.errors import InvalidArgumentError, PeerLostError, PeerUnreachableError, UnregisteredMemoryError
from kvflow.paths.base import PathContext
from kvflow.paths.lease import Lease
from kvflow.paths.relay.lanes import LaneClient
from kvflow.paths.relay.member import INBOX
from kvflow.paths.slots import pack
from kvflow.regions import first_outside
from kvflow.tasks import gather_or_cancel

__all__ = ["Sender"]

log = logging.getLogger("kvflow")

Direct = Callable[[Any, Any, Any], Awaitable[None]]


class Sender:
    """One engine's relayed writes and what they hold: its lanes in other
    members' segments, claimed on first use (`find(address)` gives the
    member's record, as the group's folder said)."""

    def __init__(self, ctx: PathContext, group: Any, slot_bytes: int, find: Callable[[str], Any]) -> None:
        self._ctx = ctx
        self.group = group
        self.slot_bytes = slot_bytes
        self._find = find
        self._clients: dict[str, LaneClient | None] = {}   # member address -> our lane in its segment
        self.relayed_bytes = 0          # this engine's writes that went through another member
        self.device_lane_bytes = 0      # ... of them, copied GPU to GPU into its device lanes
        self.rerouted_bytes = 0         # ... that went directly instead, their member lost on the way

    @property
    def lanes_used(self) -> int:
        return sum(1 for c in self._clients.values() if c is not None)

    async def stop(self) -> None:
        """Gives our lanes in others' segments back."""
        clients, self._clients = self._clients, {}
        for c in clients.values():
            if c is not None:
                await c.close()

    def _lane_to(self, address: str) -> LaneClient | None:
        """Our lane in the segment of the member at `address` (claimed on
        first use), or None: it has none, or none is free (the inbox path)."""
        if address in self._clients:
            return self._clients[address]
        client = None
        found = self._find(address)
        if found is not None and found.lanes:
            try:
                client = LaneClient(found.lanes, found.pid, address, found.device_lanes)
            except LaneError as e:
                log.info("kvflow relay: no lane toward %s (%s): slots go by messages", address, e)
        self._clients[address] = client
        return client

    async def write(self, destination: str, via: str, la: Any, ra: Any, ln: Any, direct: Direct) -> None:
        """Writes the batch to `destination` through the member at `via`;
        returns when every slot has landed. A member that cannot be reached
        has the whole batch written by `direct` (a write of entries
        straight to the destination); one lost on the way, the parts that
        had not come back from it."""
        try:
            assert self._ctx.connect is not None
            member = await self._ctx.connect(via)
        except (PeerUnreachableError, PeerLostError) as e:
            log.warning("kvflow relay: member %s unreachable (%s); writing to %s directly", via, e, destination)
            await direct(la, ra, ln)
            self.rerouted_bytes += int(np.sum(np.asarray(ln, dtype=np.uint64)))
            return
        packed = pack(la, ra, ln, self.slot_bytes)

        async def around(part: Any, lost: PeerLostError) -> None:
            if lost.peer == destination:
                raise lost
            log.warning("kvflow relay: member %s lost (%s); %d bytes go directly to %s",
                        member.address, lost, part.nbytes, destination)
            await direct([l for _, l, _, _ in part.entries], [r for _, _, r, _ in part.entries],
                         [n for _, _, _, n in part.entries])
            self.rerouted_bytes += part.nbytes
        lane = self._lane_to(member.address) if self.group.side == "send" and self.group.lanes else None
        device = self._source_device(la, ln)
        filler = None
        if lane is not None and device is not None:
            filler = lane.filler(device)
            if filler is None:
                lane = None         # GPU memory, no device lanes to reach: the inbox path stages it
        if lane is not None and filler is None:
            # memcpy from our memory: every range must be registered (the
            # inbox path had the native core check them)
            local = np.asarray(la, np.uint64)
            bad = first_outside(self._ctx.host_spans(), local, np.asarray(ln, np.uint64))
            if bad >= 0:
                raise UnregisteredMemoryError(f"relayed write: entry {bad} ({int(local[bad]):#x}) is not in this "
                                              "engine's registered memory", index=bad)
        if lane is not None:

            lost_lane = False

            async def by_lane(part: Any) -> None:
                nonlocal lost_lane
                try:
                    await lane.send(destination, part, filler)
                except PeerLostError as lost:
                    lost_lane = True
                    await around(part, lost)
                    return
                self.relayed_bytes += part.nbytes
                if filler is not None:
                    self.device_lane_bytes += part.nbytes

            try:
                await gather_or_cancel([by_lane(p) for p in packed])
            finally:
                # that segment is retired: drop our lane once no part uses it, ask again next time
                if lost_lane and self._clients.get(member.address) is lane:
                    del self._clients[member.address]
                    asyncio.get_running_loop().create_task(lane.close())
            return
        lease = Lease(member, INBOX)

        async def one(part: Any) -> None:
            try:
                slot = await lease.take()
            except PeerLostError as lost:
                await around(part, lost)
                return
            try:
                await member.write([l for _, l, _, _ in part.entries], [slot + off for off, _, _, _ in part.entries],
                                   [n for _, _, _, n in part.entries])
                await lease.ask("relay_forward", slot, part.nbytes,
                                [[off, r, n] for off, _, r, n in part.entries], to=destination)
            except PeerLostError as lost:
                await around(part, lost)
                return
            finally:
                lease.put(slot)
            self.relayed_bytes += part.nbytes

        try:
            await gather_or_cancel([one(p) for p in packed])
        finally:
            lease.release()

    def _source_device(self, la: Any, ln: Any) -> int | None:
        """The GPU a batch's local entries lie on (each inside one of our
        GPU regions), or None: they are host memory (checked later).
        Raises for a batch that mixes GPUs, or GPU and host memory."""
        table = self._ctx.gpu_regions()
        if not table:
            return None
        local = np.asarray(la, np.uint64)
        if not table.any_in(local):
            return None
        devices = set()
        for i, (l, n) in enumerate(zip(local.tolist(), np.asarray(ln, np.uint64).tolist())):
            region = table.find(l, n)
            if region is None:
                raise InvalidArgumentError(f"a relayed batch's local entries must all be in one GPU's memory or all "
                                           f"in host memory: entry {i} ({l:#x}+{n}) is in no GPU region", index=i)
            devices.add(region.device)
        if len(devices) > 1:
            raise InvalidArgumentError("a relayed batch's local entries must all be on one GPU or all in host "
                                       "memory")
        return devices.pop()
