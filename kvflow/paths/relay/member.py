"""A relay member's side (roles B and C): the inbox and the shared-memory
lanes it lends the other members of its group, and the forwards it posts
for them to their destinations over its own provider. A forward is an
ordinary write of this engine's: the destination checks the ranges
against its own regions as it does for any write."""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from kvflow._lanes import LaneError
from kvflow.control.wire import field
from kvflow.errors import KVFlowError, RemoteAccessError
from kvflow.paths.base import PathContext
from kvflow.paths.lease import Inbox
from kvflow.paths.relay.device_lanes import DeviceLaneArea
from kvflow.paths.relay.lanes import LaneServer
from kvflow.paths.slots import BouncePool, slot_pieces

__all__ = ["Forwarder", "INBOX", "RELAY_SLOT", "RELAY_SLOTS"]

log = logging.getLogger("kvflow")

RELAY_SLOT = 4 << 20            # one slot: what one forward carries
RELAY_SLOTS = 8                 # a member's inbox: 32 MiB, lent LEASE_SLOTS at a time
INBOX = "relay"                 # the inbox's name in lease messages


class Forwarder:
    """A member's inbox (lent to the other members, slot by slot, through
    leases) and lanes (a segment the node's senders write into), and the
    forwards of what they hold. `address` is the member's, as its group
    reaches it (in the errors a sender is told)."""

    def __init__(self, ctx: PathContext, address: str, slot_bytes: int, slots: int) -> None:
        self._ctx = ctx
        self.address = address
        self.slot_bytes = slot_bytes
        self._regions: list[Any] = []
        self.lanes: LaneServer | None = None           # ours, drained by this engine
        self.forwarded_bytes = 0                       # forwards of inbox slots (the lanes count theirs)

        def allocate(nbytes: int) -> tuple[int, Any]:
            buf = np.zeros(nbytes, np.uint8)
            self._regions.append(ctx.register_host(buf.ctypes.data, nbytes, "kvflow.relay.in"))
            return buf.ctypes.data, buf

        self.inbox = Inbox(INBOX, BouncePool(slot_bytes, slots, allocate))

    def open_lanes(self, group: Any) -> tuple[str | None, dict[str, Any] | None]:
        """Makes our lane segment (with its drain task, on the running loop)
        and, with `group.device`, its device lanes; (the segment's name,
        the device lanes' record) for the group's file, None for what
        could not be made (senders then use the inbox, or stage)."""
        if self.lanes is None:
            name = f"/kvflow-relay-{group.name}-{group.rank}-{os.getpid()}-{id(self):x}"
            try:
                assert self._ctx.connect is not None
                self.lanes = LaneServer(name, self.slot_bytes, register_host=self._ctx.register_host,
                                        deregister_host=self._ctx.deregister, connect=self._ctx.connect,
                                        relay_address=self.address)
                self.lanes.start()
            except LaneError as e:      # no shared memory here: the members use the inbox path with us
                log.warning("kvflow relay: no lanes for %s (%s); relayed slots go by messages", self.address, e)
        lanes = self.lanes
        if lanes is not None and group.device is not None and lanes.device is None and \
                self._ctx.register_device is not None:
            try:
                lanes.device = DeviceLaneArea(lanes.seg, group.device, self._ctx.register_device,
                                              self._ctx.deregister)
            except KVFlowError as e:    # no CUDA here, no memory, no stream memory operations
                log.warning("kvflow relay: no device lanes on cuda:%d for %s (%s); GPU batches are staged",
                            group.device, self.address, e)
        if lanes is None:
            return None, None
        return lanes.name, lanes.device.record if lanes.device is not None else None

    async def on_forward(self, peer: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Posts a filled slot of a member's lease to its destination."""
        try:
            slot = self.inbox.slot(session, msg)
            if isinstance(slot, str):
                return {"t": "stage_error", "message": slot}
            to = field(msg, "to", str)
            pieces = slot_pieces("relay_forward", field(msg, "entries", list), slot.size)
            if isinstance(pieces, str):
                return {"t": "stage_error", "message": pieces}
            if not pieces:
                return {"t": "stage_done"}
            assert self._ctx.connect is not None
            destination = await self._ctx.connect(to)
            await destination.write([slot.addr + off for off, _, _ in pieces], [r for _, r, _ in pieces],
                                    [n for _, _, n in pieces])
            self.forwarded_bytes += sum(n for _, _, n in pieces)
            return {"t": "stage_done"}
        except RemoteAccessError as e:  # the destination refused: the sender is told why
            return {"t": "stage_error", "message": f"relay via {self.address}: {e}"}
        except KVFlowError as e:        # not delivered otherwise: the sender writes around us
            return {"t": "stage_error", "message": f"relay via {self.address}: {e}", "undelivered": True}

    async def stop(self) -> None:
        """Stops draining our lanes (senders waiting on them fail at once)."""
        if self.lanes is not None:
            await self.lanes.close()

    def close(self, deregister: bool = True) -> None:
        """Frees the inbox's and the lanes' memory (after the engine's core
        closed: deregister=False)."""
        self._ctx.let_go(self._regions, deregister)
        self.inbox.pool.close()
        if self.lanes is not None:
            lanes, self.lanes = self.lanes, None
            lanes.free(deregister)
