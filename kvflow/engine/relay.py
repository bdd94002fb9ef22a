"""The PXN relay ("stay", and "pass" below): a write whose destination sits on
another rail than this engine's goes through the member of this node's
relay group that owns that rail, which posts it on its own NIC, so that
every flow is rail-aligned and nothing crosses the spine (issue 21).

A node's engines form a relay group (`Engine(relay=RelayGroup(name, rank,
rail))`). Each member publishes itself (rank, rail, the address its group
reaches it at) as one file in a directory the node's processes share
(default /dev/shm/kvflow-relay-<name>/), removed at close; a file whose
process is gone is ignored. Engines put their group and rail in their
descriptor, so a sender knows a destination's rail.

The hop inside the node goes through the member's shared-memory lanes
(kvflow.engine.lanes): the sender copies a slot's worth of the batch into
its lane, rings the slot's doorbell, and the member writes the slot to the
destination, which checks the ranges against its own regions as it does
for any write; the member finishes the ticket when the bytes have landed
there, and the sender's write completes once it collected its last ticket,
so a notification after it finds the data in place. Several slots are in
flight at once: while one is on the member's NIC the next is being copied.

Where there is no lane (`RelayGroup(lanes=False)`, no free lane, no shared
memory) the hop reuses the inbox machinery (kvflow.engine.inbox): the
member lends slots of its "relay" inbox, the sender writes a slot's worth
into one over the provider that joins them (cross-memory attach on one
host) and asks the member to forward it (`relay_forward`: the
destination's address and, per piece, the slot offset, the remote address
and the length), and the member answers once it landed.

On the receive side ("pass", `RelayGroup(side="receive")`) the hop runs
the other way round, over the network, by the inbox path: the sender
writes over its own rail into the inbox of the destination node's member
on that rail (the destination's descriptor lists its node's members), and
that member copies the slot to the destination inside its node.

A member that is lost while a write goes through it (its process died,
its segment retired, its connection dropped) does not fail the write: the
parts that had not come back from it are written directly to the
destination (`rerouted_bytes`); a part it may have forwarded already is
written again, the same bytes to the same place. Later writes go directly
while the group lists no live member on that rail. A refusal by the
destination itself is not rerouted: it fails the write as any refusal does.

GPU memory: a member with `RelayGroup(device=N)` also has device lanes
(kvflow.engine.device_lanes), the data of its lane slots in GPU N's
memory. A sender whose batch lies in GPU memory copies each slot's worth
there with its copy engine (CUDA IPC) and its stream writes the slot's
doorbell after the copy (cuStreamWriteValue64); the member forwards it
from its GPU memory as any write from there. A GPU batch toward a member
without device lanes (or whose lanes our GPU cannot reach) takes the
inbox path, which stages it through host memory; a GPU batch written
directly (no member, one lost) is staged as any other. Host-memory
batches may land in the destination's GPU memory either way: the member
writes them there as it writes any. The device path has not run on a GPU
yet (tools/gpu_check.sh runs it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NamedTuple

import numpy as np

from kvflow.control.wire import field
from kvflow.engine.gpu import gather_or_cancel
from kvflow._lanes import LaneError
from kvflow.engine.blocks import first_outside
from kvflow.engine.inbox import Inbox, Lease
from kvflow.engine.lanes import LaneClient, LaneServer
from kvflow.engine.device_lanes import DeviceLaneArea
from kvflow.errors import (InvalidArgumentError, KVFlowError, PeerLostError, ProtocolError,
                           RemoteAccessError, UnregisteredMemoryError)
from kvflow.providers.cuda.staging import BouncePool, pack

__all__ = ["INBOX", "Relay", "RelayGroup", "RELAY_SLOT", "RELAY_SLOTS"]

log = logging.getLogger("kvflow")

RELAY_SLOT = 4 << 20            # one slot: what one forward carries
RELAY_SLOTS = 8                 # a member's inbox: 32 MiB, lent LEASE_SLOTS at a time
MEMBERS_TTL = 1.0               # seconds a reading of the group's folder is trusted
INBOX = "relay"                 # the inbox's name in lease messages
SIDES = ("send", "receive")     # which node's member relays this engine's cross-rail writes


@dataclass(frozen=True)
class RelayGroup:
    """This engine's place in its node's relay group: the group's `name`
    (one per node), its `rank` in it, the `rail` its NIC is on, and the
    address the other members reach it at (default: the engine's own).
    `side` says where this engine's cross-rail writes change rail: "send"
    (stay: through the member of this node on the destination's rail, so
    every sender NIC is busy) or "receive" (pass: over this engine's own
    rail to the destination node's member on it, which copies them to the
    destination inside its node: the decode side takes NIC + copy).
    `lanes`: the send side's hop inside the node goes through shared-memory
    lanes (kvflow.engine.lanes); False: by a control message per slot into
    the member's inbox (what the receive side always does).
    `device`: the GPU (this process's ordinal) whose memory holds this
    member's device lanes, into which senders copy their GPU batches'
    slots (kvflow.engine.device_lanes); None: host lanes only."""

    name: str
    rank: int
    rail: int
    address: str | None = None
    directory: str = "/dev/shm"
    side: str = "send"
    lanes: bool = True
    device: int | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise InvalidArgumentError(f"a relay group's name is a plain word, not {self.name!r}")
        if not (isinstance(self.rank, int) and isinstance(self.rail, int) and self.rank >= 0 and self.rail >= 0):
            raise InvalidArgumentError("a relay group's rank and rail are non-negative ints")
        if self.side not in SIDES:
            raise InvalidArgumentError(f"a relay group's side is one of {', '.join(SIDES)}, not {self.side!r}")
        if self.device is not None and not (isinstance(self.device, int) and self.device >= 0):
            raise InvalidArgumentError("a relay group's device is a GPU's ordinal (a non-negative int) or None")

    @property
    def folder(self) -> str:
        return os.path.join(self.directory, f"kvflow-relay-{self.name}")


class _Member(NamedTuple):
    """Another member of the group, as its file says."""

    address: str
    pid: int
    path: str
    lanes: str                              # its lane segment's name ("": none)
    device_lanes: dict[str, Any] | None     # its device lanes (DeviceLaneArea.record), or None


class Relay:
    """One engine's membership of its relay group: its inbox (lent to the
    other members), their forwards, and its own relayed writes.
    `register_host(addr, n, name[, access])` registers the inbox (and the
    lanes, without remote access) with the engine,
    `register_device(addr, n, name)` device lanes (a GPU region peers may
    not touch); `connect(address)` reaches a peer (the destinations and
    the members); `local_spans()` the engine's host regions, `gpu_regions()`
    its GPU regions' table (None: it has none)."""

    def __init__(self, group: RelayGroup, address: str, *, register_host: Callable[..., Any],
                 deregister_host: Callable[[Any], None], connect: Callable[[str], Any],
                 local_spans: Callable[[], list[tuple[int, int]]],
                 gpu_regions: Callable[[], Any] = lambda: None,
                 register_device: Callable[[int, int, str], Any] | None = None,
                 slot_bytes: int = RELAY_SLOT, slots: int = RELAY_SLOTS) -> None:
        self.group = group
        self.address = group.address or address
        self._connect = connect
        self._register_host = register_host
        self._register_device = register_device
        self._deregister_host = deregister_host
        self._local_spans = local_spans
        self._gpu_regions = gpu_regions
        self._regions: list[Any] = []
        self._lanes: LaneServer | None = None           # ours, drained by this engine
        self._clients: dict[str, LaneClient | None] = {}   # member address -> our lane in its segment

        def allocate(nbytes: int) -> tuple[int, Any]:
            buf = np.zeros(nbytes, np.uint8)
            self._regions.append(register_host(buf.ctypes.data, nbytes, "kvflow.relay.in"))
            return buf.ctypes.data, buf

        self.inbox = Inbox(INBOX, BouncePool(slot_bytes, slots, allocate))
        self.slot_bytes = slot_bytes
        self.relayed_bytes = 0          # this engine's writes that went through another member
        self.device_lane_bytes = 0      # ... of them, copied GPU to GPU into its device lanes
        self.rerouted_bytes = 0         # ... that went directly instead, their member lost on the way
        self.forwarded_bytes = 0        # other members' writes this engine posted
        self._file = os.path.join(group.folder, f"{group.rank}.json")
        self._members: dict[int, _Member] = {}     # rail -> the member on it
        self._read_at = -MEMBERS_TTL

    def describe(self) -> dict[str, Any]:
        """The descriptor's relay part: group, rank, rail, and the node's live
        members as [rail, address] pairs (this engine's too), for senders
        that relay on the receive side."""
        members = [[self.group.rail, self.address]]
        for rail in sorted(self._read_members()):
            address = self.member(rail)
            if address is not None:
                members.append([rail, address])
        return {"group": self.group.name, "rank": self.group.rank, "rail": self.group.rail, "members": members}

    # ------------------------------------------------------------ membership
    def publish(self) -> None:
        """Joins the group: the lane segment first (with its drain task, on
        the running loop), then the file that names it."""
        if self._lanes is None and self.group.lanes:
            name = f"/kvflow-relay-{self.group.name}-{self.group.rank}-{os.getpid()}-{id(self):x}"
            try:
                self._lanes = LaneServer(name, self.slot_bytes, register_host=self._register_host,
                                         deregister_host=self._deregister_host, connect=self._connect,
                                         relay_address=self.address)
                self._lanes.start()
            except LaneError as e:      # no shared memory here: the members use the inbox path with us
                log.warning("kvflow relay: no lanes for %s (%s); relayed slots go by messages", self.address, e)
        if self._lanes is not None and self.group.device is not None and self._lanes.device is None and \
                self._register_device is not None:
            try:
                self._lanes.device = DeviceLaneArea(self._lanes.seg, self.group.device, self._register_device,
                                                    self._deregister_host)
            except KVFlowError as e:    # no CUDA here, no memory, no stream memory operations
                log.warning("kvflow relay: no device lanes on cuda:%d for %s (%s); GPU batches are staged",
                            self.group.device, self.address, e)
        device = self._lanes.device if self._lanes is not None else None
        os.makedirs(self.group.folder, exist_ok=True)
        tmp = f"{self._file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.group.rank, "rail": self.group.rail, "address": self.address,
                       "pid": os.getpid(), "lanes": self._lanes.name if self._lanes is not None else "",
                       "device_lanes": device.record if device is not None else None}, f)
        os.replace(tmp, self._file)             # readers see the whole file or none

    def unpublish(self) -> None:
        """Leaves the group: no member routes through this engine from now."""
        try:
            os.unlink(self._file)
        except OSError:
            pass

    async def stop(self) -> None:
        """Stops draining our lanes and gives our lanes in others' back
        (before the engine closes its peers and core)."""
        self.unpublish()
        if self._lanes is not None:
            await self._lanes.close()
        clients, self._clients = self._clients, {}
        for c in clients.values():
            if c is not None:
                await c.close()

    def close(self, deregister: bool = True) -> None:
        """Frees the inbox's and the lanes' memory: the engine calls this
        after its native core closed (deregister=False), so no channel can
        still be writing into it or sending from it."""
        self.unpublish()
        if deregister:
            for r in self._regions:
                try:
                    self._deregister_host(r)
                except KVFlowError:
                    pass
        self._regions.clear()
        self.inbox.pool.close()
        if self._lanes is not None:
            lanes, self._lanes = self._lanes, None
            lanes.free(deregister)

    def _lane_to(self, address: str) -> LaneClient | None:
        """Our lane in the segment of the member at `address` (claimed on
        first use), or None: it has none, or none is free (the inbox path)."""
        if address in self._clients:
            return self._clients[address]
        client = None
        for found in self._members.values():
            if found.address == address and found.lanes:
                try:
                    client = LaneClient(found.lanes, found.pid, address, found.device_lanes)
                except LaneError as e:
                    log.info("kvflow relay: no lane toward %s (%s): slots go by messages", address, e)
                break
        self._clients[address] = client
        return client

    def member(self, rail: int) -> str | None:
        """The address of the live member on `rail` (not this engine), or
        None. The group's folder is read at most once per MEMBERS_TTL
        (writes ask on every call); a member is live while its file is
        there and its process runs."""
        now = time.monotonic()
        if now - self._read_at > MEMBERS_TTL:
            self._members = self._read_members()
            self._read_at = now
        found = self._members.get(rail)
        if found is None:
            return None
        address, pid, path = found.address, found.pid, found.path
        try:
            os.stat(path)                       # left the group (its engine closed)
            os.kill(pid, 0)                     # or its process died: the file is stale
        except OSError:
            self._read_at = -MEMBERS_TTL        # read the folder again next time
            return None
        return address

    def _read_members(self) -> dict[int, _Member]:
        out: dict[int, _Member] = {}
        try:
            names = sorted(os.listdir(self.group.folder))
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.group.folder, name)
            try:
                with open(path) as f:
                    rec = json.load(f)
                if rec["rank"] != self.group.rank:
                    device = rec.get("device_lanes")
                    out.setdefault(int(rec["rail"]), _Member(str(rec["address"]), int(rec["pid"]), path,
                                                             str(rec.get("lanes", "")),
                                                             device if isinstance(device, dict) else None))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def route(self, descriptor: Any) -> str | None:
        """The member to relay a write to this destination through, when its
        rail is not ours and it is in another group: on the send side our
        group's live member on its rail; on the receive side its group's
        member on our rail (as its descriptor lists them). None: write it
        directly."""
        theirs = descriptor.relay
        if theirs is None or theirs["rail"] == self.group.rail or theirs["group"] == self.group.name:
            return None
        if self.group.side == "send":
            return self.member(theirs["rail"])
        for rail, address in theirs.get("members", ()):
            if rail == self.group.rail and address != descriptor.address:
                return address
        return None

    # ------------------------------------------------------------ sender
    async def write(self, destination: str, member: Any, la: Any, ra: Any, ln: Any,
                    direct: Callable[[Any, Any, Any], Awaitable[None]]) -> None:
        """Writes the batch to `destination` through `member` (a Peer): each
        slot's worth copied into our lane of the member's segment (a member
        of our node, kvflow.engine.lanes), or else into a leased slot of its
        inbox, then forwarded by it; returns when every slot has landed. A
        part whose member was lost on the way goes by `direct` (a write of
        those entries straight to the destination)."""
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
            bad = first_outside(self._local_spans(), local, np.asarray(ln, np.uint64))
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
        table = self._gpu_regions()
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

    # ------------------------------------------------------------ member
    async def on_forward(self, peer: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Posts a filled slot of a member's lease to its destination."""
        try:
            slot = self.inbox.slot(session, msg)
            if isinstance(slot, str):
                return {"t": "stage_error", "message": slot}
            to = field(msg, "to", str)
            entries = field(msg, "entries", list)
            pieces: list[tuple[int, int, int]] = []
            for e in entries:
                if not (isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) for v in e)):
                    raise ProtocolError("relay_forward: an entry is [offset, remote address, nbytes]")
                off, remote, n = e
                if n <= 0 or off < 0 or off + n > slot.size:
                    return {"t": "stage_error", "message": f"relay_forward: {off}+{n} is outside the slot"}
                pieces.append((slot.addr + off, remote, n))
            if not pieces:
                return {"t": "stage_done"}
            destination = await self._connect(to)
            await destination.write([p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces])
            self.forwarded_bytes += sum(p[2] for p in pieces)
            return {"t": "stage_done"}
        except RemoteAccessError as e:  # the destination refused: the sender is told why
            return {"t": "stage_error", "message": f"relay via {self.address}: {e}"}
        except KVFlowError as e:        # not delivered otherwise: the sender writes around us
            return {"t": "stage_error", "message": f"relay via {self.address}: {e}", "undelivered": True}

    def stats(self) -> dict[str, int]:
        lanes = self._lanes
        return {"relayed_bytes": self.relayed_bytes, "rerouted_bytes": self.rerouted_bytes,
                "forwarded_bytes": self.forwarded_bytes + (lanes.forwarded_bytes if lanes is not None else 0),
                "leases": self.inbox.leased,
                "lane_forwarded_bytes": lanes.forwarded_bytes if lanes is not None else 0,
                "device_lane_bytes": self.device_lane_bytes,
                "device_lanes": int(lanes is not None and lanes.device is not None),
                "lanes_used": sum(1 for c in self._clients.values() if c is not None)}

