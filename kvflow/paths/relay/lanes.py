"""The relay's intra-node hop through shared-memory lanes (issue 21): the
roles of kvflow._lanes' segment inside the engines.

A relay member owns one segment (`LaneServer`): a lane per other rank of its
node, each a ring of slots. A sender (`LaneClient`, role A) claims a lane
once, and per slot's worth of a relayed batch reserves a ticket, waits for
its credit, copies the bytes in (a plain memcpy from its registered memory:
the segment is mapped in both processes), writes the request (destination,
and per piece the slot offset, the remote address and the length) and rings
the doorbell; the member's drain task (role B) takes rung slots lane by
lane, in ticket order, and turns each into one write to the destination
(role C is the engine's provider, which posts it), then finishes the
ticket with its status. The sender's write completes when every ticket it
used is collected. No control message per slot, no copy through a socket:
what the inbox path (kvflow.paths.lease) did with a lease and a
relay_forward request per slot.

The member sleeps on the segment's bell (a futex word every fill rings)
in a thread of its loop's executor, so an idle member costs nothing; a
sender polls for its credits and completions from its loop (20 us, then
up to 100 us apart) while it has slots out, and copies a slot on the loop
(a 4 MiB slot: about 1 ms; handing it to an executor thread measured
slower on this machine). A sender checks its member's process while it waits (a member
that died fails the write with PeerLostError); a member reclaims the lane
of a sender whose process is gone once it has finished what it took. A
cancelled write's tickets are still seen through, in the background: a
reserved ticket is published empty, a filled one collected, so the lane
never stalls; bytes already rung may still land (as with any write whose
slices reached the wire).

A member with device lanes (device_lanes.py) also takes slots
whose data a sender's GPU copied into its GPU memory; the request says
which ("m": 1).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

from kvflow._lanes import LaneError, Lanes
from kvflow.paths.relay.device_lanes import DeviceLaneArea, DeviceLaneFiller, close_control, map_control
from kvflow.errors import CudaError, KVFlowError, PeerLostError, ProtocolError, RemoteAccessError
from kvflow.memory import Access
from kvflow.paths.slots import slot_pieces

__all__ = ["LANES", "LANE_SLOTS", "LaneClient", "LaneServer"]

log = logging.getLogger("kvflow")

LANES = 8                   # senders one member serves through lanes (the seed: 7 other ranks)
LANE_SLOTS = 4              # slots per lane: 16 MiB of 4 MiB slots, touched only when used
META_BYTES = 64 << 10       # per slot: the request (up to ~2700 pieces) and the error text
POLL_MIN, POLL_MAX = 20e-6, 100e-6
LIVENESS = 0.05             # how often a waiter checks that the other process still runs
# a ticket's status: 0 landed; REFUSED by the destination (or a malformed
# request); UNDELIVERED for any other reason (the member's or the
# destination's connection lost, the member closing): the sender writes
# that part directly instead
REFUSED, UNDELIVERED = 1, 2
INLINE_COPY = 8 << 20     # slots filled on the loop up to this (a 4 MiB slot: ~1 ms); larger in a thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Poll:
    """Adaptive sleep between looks: quick while things move, slow when idle."""

    __slots__ = ("delay",)

    def __init__(self) -> None:
        self.delay = POLL_MIN

    async def wait(self, moved: bool) -> None:
        self.delay = POLL_MIN if moved else min(POLL_MAX, self.delay * 2)
        await asyncio.sleep(self.delay)


class LaneServer:
    """A member's lanes: the segment, registered with the engine as the
    source of its forwards, and the drain task."""

    def __init__(self, name: str, slot_bytes: int, *, register_host: Callable[..., Any],
                 deregister_host: Callable[[Any], None], connect: Callable[[str], Awaitable[Any]],
                 relay_address: str) -> None:
        self.seg = Lanes(name, create=True, lanes=LANES, slots=LANE_SLOTS, slot_bytes=slot_bytes,
                         meta_bytes=META_BYTES)
        self.name = name
        self._deregister_host = deregister_host
        self._connect = connect
        self._relay_address = relay_address
        try:
            # the source of our forwards only: peers may neither read the
            # senders' slots nor write into them
            self._region = register_host(self.seg.data_addr, self.seg.data_bytes, "kvflow.relay.lanes", Access(0))
        except BaseException:
            self.seg.close()
            raise
        self._inflight = [0] * LANES
        self._task: asyncio.Task[None] | None = None
        self.device: DeviceLaneArea | None = None      # device lanes, when the member has them
        self.forwarded_bytes = 0
        self.reclaimed = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        checked = 0.0
        seg = self.seg
        loop = asyncio.get_running_loop()
        while True:
            seen = seg.bell()
            moved = False
            now = time.monotonic()
            check = now - checked > LIVENESS
            if check:
                checked = now
            for lane in range(LANES):
                owner = seg.owner_of(lane)
                if not owner:
                    continue
                while (got := seg.take(lane)) is not None:
                    moved = True
                    self._inflight[lane] += 1
                    asyncio.get_running_loop().create_task(self._forward(lane, *got))
                if check and not self._inflight[lane] and not _alive(owner):
                    seg.reclaim(lane)       # its sender is gone and nothing of it is ours any more
                    self.reclaimed += 1
                    log.info("kvflow relay: lane %d of %s reclaimed (process %d is gone)", lane, self.name, owner)
            if not moved:
                # asleep on the bell (a futex in the segment) until a sender
                # rings it; at most LIVENESS, to look at dead senders' lanes
                await loop.run_in_executor(None, seg.wait_bell, seen, LIVENESS)

    async def _forward(self, lane: int, ticket: int, request: bytes) -> None:
        seg = self.seg
        try:
            if not request:
                seg.finish(lane, ticket)        # a ticket its sender gave up before filling
                return
            try:
                msg = msgpack.unpackb(request, raw=False)
                to, pieces = msg["to"], msg["e"]
                if not isinstance(to, str) or not isinstance(pieces, list) or not pieces:
                    raise ValueError
                if msg.get("m"):                        # its data is in our device lanes
                    if self.device is None:
                        seg.finish(lane, ticket, REFUSED, f"relay via {self._relay_address}: no device lanes")
                        return
                    base = self.device.slot_addr(seg, lane, ticket)
                else:
                    base = seg.slot_addr(lane, ticket)
                checked = slot_pieces("a lane request", pieces, seg.slot_bytes)
                if isinstance(checked, str):
                    raise ValueError(checked)
                la = [base + off for off, _, _ in checked]
                ra = [remote for _, remote, _ in checked]
                ln = [n for _, _, n in checked]
            except (ValueError, TypeError, KeyError, ProtocolError, msgpack.UnpackException):
                seg.finish(lane, ticket, REFUSED, f"relay via {self._relay_address}: a malformed lane request")
                return
            destination = await self._connect(to)
            await destination.write(np.asarray(la, np.uint64), np.asarray(ra, np.uint64), np.asarray(ln, np.uint64))
            self.forwarded_bytes += sum(ln)
            seg.finish(lane, ticket)
        except RemoteAccessError as e:      # the destination refused: the sender is told why
            seg.finish(lane, ticket, REFUSED, f"relay via {self._relay_address}: {e}")
        except KVFlowError as e:            # not delivered (gone, closing, timed out): the sender writes around us
            seg.finish(lane, ticket, UNDELIVERED, f"relay via {self._relay_address}: {e}")
        except LaneError:
            pass                            # closed meanwhile
        finally:
            self._inflight[lane] -= 1

    async def close(self) -> None:
        self.seg.retire()                   # senders waiting on our lanes fail at once
        self.seg.ring()                     # and the drain's waiting thread returns
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.device is not None:
            await self._copies_landed()

    async def _copies_landed(self, limit: float = 2.0) -> None:
        """Before the device lanes may be freed: waits (at most `limit` s)
        until every ticket reserved on a lane whose sender lives has its
        doorbell rung, so no sender's copy is still writing into them (a
        sender checks that we have not retired before it queues one)."""
        poll, until = _Poll(), time.monotonic() + limit
        while time.monotonic() < until:
            busy = [lane for lane in range(LANES) if (owner := self.seg.owner_of(lane)) and _alive(owner)
                    and (s := self.seg.state(lane))["rung"] < s["reserved"]]
            if not busy:
                return
            await poll.wait(False)
        log.warning("kvflow relay: freeing the device lanes of %s with copies possibly in flight", self.name)

    def free(self, deregister: bool = True) -> None:
        """Unmaps and unlinks the segment, frees the device lanes (after the
        engine's core closed)."""
        if deregister:
            try:
                self._deregister_host(self._region)
            except KVFlowError:
                pass
        if self.device is not None:
            self.device.free(deregister)
            self.device = None
        self.seg.close()


class LaneClient:
    """A sender's lane in one member's segment."""

    def __init__(self, name: str, member_pid: int, member: str, device_lanes: dict[str, Any] | None = None) -> None:
        self.seg = Lanes(name)
        self.member, self.member_pid = member, member_pid
        self._device_lanes = device_lanes           # the member's record of them, or None
        self._fillers: dict[int, DeviceLaneFiller | None] = {}
        self._control: Any = None                   # the segment's control words mapped for our GPUs
        self.lane = self.seg.claim(os.getpid())
        if self.lane < 0:
            self.seg.close()
            raise LaneError(f"{member}: every lane of {name} is taken")
        self._background: set[asyncio.Task[None]] = set()
        # Set when the member could not deliver a slot: no slot of this lane
        # is filled again. The member's write of that slot may still be in
        # the kernel, sending from the slot's pages (tcp splices them), and
        # its bytes may land after the sender's direct write of the same
        # part: harmless while the slot holds that part, wrong once it
        # holds another.
        self.lost: str | None = None

    def _credit(self, ticket: int) -> Any:
        if self.lost is not None:
            raise PeerLostError(f"relay member {self.member} could not forward: {self.lost}", peer=self.member)
        return self.seg.credit(self.lane, ticket)

    def _check_member(self) -> None:
        if not _alive(self.member_pid) or self.seg.consumer_pid != self.member_pid:
            raise PeerLostError(f"relay member {self.member} is gone", peer=self.member)

    async def _until(self, look: Callable[[], Any]) -> Any:
        poll, checked = _Poll(), time.monotonic()
        while True:
            got = look()
            if got:
                return got
            if time.monotonic() - checked > LIVENESS:
                checked = time.monotonic()
                self._check_member()
            await poll.wait(False)

    def filler(self, device: int) -> DeviceLaneFiller | None:
        """The way into the member's device lanes from our GPU `device`
        (made on first use), or None: the member has none, or they cannot
        be reached from it (another node's GPU, no stream memory
        operations, the driver refused): then slots go through host memory."""
        if device in self._fillers:
            return self._fillers[device]
        made = None
        if self._device_lanes is not None:
            try:
                if self._control is None:
                    self._control = map_control(self.seg, device)
                made = DeviceLaneFiller(self.seg, self._device_lanes, device, self._control)
            except (CudaError, KVFlowError, KeyError, ValueError) as e:
                log.info("kvflow relay: no device lanes of %s from cuda:%d (%s)", self.member, device, e)
        self._fillers[device] = made
        return made

    async def send(self, destination: str, part: Any, filler: DeviceLaneFiller | None = None) -> None:
        """One slot's worth of a batch (a Packed part: entries of (slot
        offset, local address, remote address, length)) to `destination`
        through the member; returns once it landed there. With `filler`
        the local addresses are GPU memory, copied into the member's device
        lanes by our stream."""
        seg, lane = self.seg, self.lane
        body: dict[str, Any] = {"to": destination, "e": [[off, r, n] for off, _, r, n in part.entries]}
        if filler is not None:
            body["m"] = 1
        request = msgpack.packb(body)
        if len(request) + 4 > META_BYTES - 1024:
            raise ProtocolError(f"a relayed slot of {len(part.entries)} pieces does not fit a lane request")
        ticket = seg.reserve(lane)
        fill: Any = None
        event: Any = None
        try:
            await self._until(lambda: self._credit(ticket))
            if filler is not None:
                self._check_member()        # not into device lanes a retired member may be freeing
                try:
                    event = filler.fill(seg, lane, ticket, [(off, l, n) for off, l, _, n in part.entries], request)
                except CudaError:
                    fill = True             # published empty
                    raise
                fill = True
                def look() -> Any:
                    got = seg.collect(lane, ticket)
                    if got is None and not event.done():    # raises CudaError if a copy failed
                        return None
                    return got
                code, text = await self._until(look)
            else:
                args = (lane, ticket, [l for _, l, _, _ in part.entries], [off for off, _, _, _ in part.entries],
                        [n for _, _, _, n in part.entries], request)
                if part.nbytes <= INLINE_COPY:
                    seg.fill(*args)
                    fill = True
                else:
                    fill = asyncio.get_running_loop().run_in_executor(None, seg.fill, *args)
                    await asyncio.shield(fill)
                code, text = await self._until(lambda: seg.collect(lane, ticket))
        except CudaError:
            if filler is not None and event is not None:
                filler.give_up(seg, lane, ticket)       # the copy failed: the doorbell never comes
            self._see_through(ticket, fill)
            raise
        except BaseException:
            self._see_through(ticket, fill)
            raise
        finally:
            if event is not None:
                try:
                    event.close()
                except CudaError as e:      # a sticky error from other work: this part is decided already
                    log.warning("kvflow relay: closing a slot's event: %s", e)
        if code == UNDELIVERED:
            self.lost = text          # before any await: no send waiting for credit may fill a slot now
            raise PeerLostError(f"relay member {self.member} could not forward: {text}", peer=self.member)
        if code:
            raise RemoteAccessError(f"{self.member}: {text}", peer=destination)

    def _see_through(self, ticket: int, fill: Any) -> None:
        """A ticket whose write stopped (cancelled, or the member looked
        gone): published empty if it was never filled, then collected, in
        the background, so that the lane does not stall behind it."""
        seg, lane = self.seg, self.lane

        async def finish() -> None:
            try:
                if fill is None:
                    await self._until(lambda: seg.credit(lane, ticket))
                    seg.fill(lane, ticket, [], [], [], b"")
                elif fill is not True:
                    await fill
                await self._until(lambda: seg.collect(lane, ticket))
            except (KVFlowError, LaneError):
                pass                                # the member is gone: nothing to see through
        task = asyncio.get_running_loop().create_task(finish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for f in self._fillers.values():
            if f is not None:
                f.close(self.seg)
        self._fillers.clear()
        if self._control is not None:
            close_control(self.seg, self._control)
            self._control = None
        try:
            if self.seg.pending(self.lane) == 0:
                self.seg.leave(self.lane, os.getpid())
        except LaneError:
            pass
        self.seg.close()
