"""A node's relay group: RelayGroup (this engine's place in it), the
group's folder (each member's file: who is on which rail, its lanes), and
Relay, one engine's membership, which composes the two roles: sending
(sender.py) and forwarding (member.py). kvflow.paths.relay's docstring
tells the protocol."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NamedTuple

from kvflow.errors import InvalidArgumentError
from kvflow.paths.base import PathContext
from kvflow.paths.relay.member import INBOX, RELAY_SLOT, RELAY_SLOTS, Forwarder
from kvflow.paths.relay.sender import Sender

__all__ = ["INBOX", "Member", "Relay", "RelayGroup", "RELAY_SLOT", "RELAY_SLOTS"]

MEMBERS_TTL = 1.0               # seconds a reading of the group's folder is trusted
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
    lanes (kvflow.paths.relay.lanes); False: by a control message per slot
    into the member's inbox (what the receive side always does).
    `device`: the GPU (this process's ordinal) whose memory holds this
    member's device lanes, into which senders copy their GPU batches'
    slots (kvflow.paths.relay.device_lanes); None: host lanes only."""

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


class Member(NamedTuple):
    """Another member of the group, as its file says."""

    address: str
    pid: int
    path: str
    lanes: str                              # its lane segment's name ("": none)
    device_lanes: dict[str, Any] | None     # its device lanes (DeviceLaneArea.record), or None


class Relay:
    """One engine's membership of its relay group: its file in the group's
    folder, the members it reads there, and the two roles: `forwarder`
    (member.py: its inbox and lanes, lent to the other members, and their
    forwards) and `sender` (sender.py: its own relayed writes). What it
    uses of its engine comes through `ctx` (kvflow.paths.base.PathContext)."""

    def __init__(self, group: RelayGroup, address: str, ctx: PathContext, *,
                 slot_bytes: int = RELAY_SLOT, slots: int = RELAY_SLOTS) -> None:
        assert ctx.connect is not None
        self.group = group
        self.address = group.address or address
        self.forwarder = Forwarder(ctx, self.address, slot_bytes, slots)
        self.sender = Sender(ctx, group, slot_bytes, self._found)
        self._file = os.path.join(group.folder, f"{group.rank}.json")
        self._members: dict[int, Member] = {}     # rail -> the member on it
        self._read_at = -MEMBERS_TTL

    @property
    def inbox(self) -> Any:
        return self.forwarder.inbox

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
        lanes, device = self.forwarder.open_lanes(self.group) if self.group.lanes else (None, None)
        os.makedirs(self.group.folder, exist_ok=True)
        tmp = f"{self._file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.group.rank, "rail": self.group.rail, "address": self.address,
                       "pid": os.getpid(), "lanes": lanes or "", "device_lanes": device}, f)
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
        await self.forwarder.stop()
        await self.sender.stop()

    def close(self, deregister: bool = True) -> None:
        """Frees the inbox's and the lanes' memory: the engine calls this
        after its native core closed (deregister=False), so no channel can
        still be writing into it or sending from it."""
        self.unpublish()
        self.forwarder.close(deregister)

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
        try:
            os.stat(found.path)                 # left the group (its engine closed)
            os.kill(found.pid, 0)               # or its process died: the file is stale
        except OSError:
            self._read_at = -MEMBERS_TTL        # read the folder again next time
            return None
        return found.address

    def _found(self, address: str) -> Member | None:
        """The member at `address`, as the folder last said (the sender's
        lanes toward it)."""
        return next((m for m in self._members.values() if m.address == address), None)

    def _read_members(self) -> dict[int, Member]:
        out: dict[int, Member] = {}
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
                    out.setdefault(int(rec["rail"]), Member(str(rec["address"]), int(rec["pid"]), path,
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

    # ------------------------------------------------------------ the roles
    async def write(self, destination: str, via: str, la: Any, ra: Any, ln: Any,
                    direct: Callable[[Any, Any, Any], Awaitable[None]]) -> None:
        """A write to `destination` through the member at `via`
        (Sender.write); `direct(la, ra, ln)` writes entries straight to the
        destination, around a member lost on the way."""
        await self.sender.write(destination, via, la, ra, ln, direct)

    def on_forward(self, peer: str, session: Any, msg: dict[str, Any]) -> Any:
        return self.forwarder.on_forward(peer, session, msg)

    def stats(self) -> dict[str, int]:
        s, f = self.sender, self.forwarder
        lane_forwarded = f.lanes.forwarded_bytes if f.lanes is not None else 0
        return {"relayed_bytes": s.relayed_bytes, "rerouted_bytes": s.rerouted_bytes,
                "forwarded_bytes": f.forwarded_bytes + lane_forwarded, "leases": f.inbox.leased,
                "lane_forwarded_bytes": lane_forwarded, "device_lane_bytes": s.device_lane_bytes,
                "device_lanes": int(f.lanes is not None and f.lanes.device is not None),
                "lanes_used": s.lanes_used}
