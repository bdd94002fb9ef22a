"""Slots of host memory an engine lends to its peers, and the peers' side
of borrowing them.

An Inbox is a bounded pool of slots (a BouncePool registered with the
engine as a host region, so the providers can write into it and send
from it) that peers lease a few at a time over the control session
(`stage_lease`, `stage_release`), write into or read from over the host
path, and then ask the owner to act on (the GPU path lands a slot in GPU
memory or fills it from there; the relay forwards it to a third engine).
A lease belongs to one control session: it ends with a release, or with
the session. Each inbox has a name ("gpu", "relay") that messages carry.

A Lease is the borrowing side: it takes the lease on first use, hands out
the leased slots one at a time (a slot is busy until its user is done),
sends the owner's requests (a timeout is a TransferTimeoutError) and gives
the lease back.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from kvflow.control.wire import field
from kvflow.errors import KVFlowError, PeerLostError, ProtocolError, RemoteAccessError, TransferTimeoutError
from kvflow.paths.base import PathPeer
from kvflow.paths.slots import BouncePool, Slot

__all__ = ["Inbox", "LEASE_SLOTS", "Lease", "REPLIES", "REQUEST_TIMEOUT", "inbox_handlers"]

LEASE_SLOTS = 4                 # slots one transfer asks for
REQUEST_TIMEOUT = 60.0          # a lease or a request the owner does not answer: the transfer fails
# the answers to leases and to requests on their slots (a Peer's session waits for these)
REPLIES = frozenset({"stage_leased", "stage_done", "stage_error"})


@dataclass
class _Held:
    session: Any
    slots: list[Slot]


class Inbox:
    """`pool`'s slots, lent to peers' sessions."""

    def __init__(self, name: str, pool: BouncePool) -> None:
        self.name = name
        self.pool = pool
        self._leases: dict[int, _Held] = {}
        self._next = 0

    @property
    def leased(self) -> int:
        """Leases held now (each of one to LEASE_SLOTS slots)."""
        return len(self._leases)

    def readout(self) -> dict[str, int]:
        """The pool's figures (BouncePool.readout(): `in_use` are the slots
        lent now) and `leases`, the leases held now."""
        return {**self.pool.readout(), "leases": self.leased}

    async def lease(self, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Lends up to msg["slots"] free slots, at least one (waiting for it)."""
        want = field(msg, "slots", int)
        if not 1 <= want <= LEASE_SLOTS:
            raise ProtocolError(f"stage_lease: slots must be 1..{LEASE_SLOTS}")
        slots = [await self.pool.acquire()]
        while len(slots) < want and self.pool.free:
            slots.append(await self.pool.acquire())
        if getattr(session, "is_closing", lambda: False)():     # gone while it waited
            for s in slots:
                self.pool.release(s)
            return {"t": "stage_error", "message": "session closed"}
        self._next += 1
        self._leases[self._next] = _Held(session, slots)
        return {"t": "stage_leased", "lease": self._next, "slot_bytes": self.pool.slot_bytes,
                "slots": [s.addr for s in slots]}

    def slot(self, session: Any, msg: dict[str, Any]) -> Slot | str:
        """The slot a request names (msg's "lease" and "slot"), if that
        session holds it; else why not."""
        held = self._leases.get(field(msg, "lease", int))
        addr = field(msg, "slot", int)
        if held is None or held.session is not session:
            return f"{msg['t']}: no such lease"
        found = next((s for s in held.slots if s.addr == addr), None)
        return found if found is not None else f"{msg['t']}: {addr:#x} is not a slot of this lease"

    def release(self, session: Any, msg: dict[str, Any]) -> None:
        lease = field(msg, "lease", int)
        held = self._leases.get(lease)
        if held is not None and held.session is session:
            self._drop(lease)

    def _drop(self, lease: int) -> None:
        held = self._leases.pop(lease, None)
        if held is not None:
            for s in held.slots:
                self.pool.release(s)

    def drop_session(self, session: Any) -> None:
        for lease in [i for i, h in self._leases.items() if h.session is session]:
            self._drop(lease)


Handler = Callable[[str, Any, dict[str, Any]], Any]


def inbox_handlers(find: Callable[[Any], "Inbox | str"]) -> dict[str, Handler]:
    """The control handlers of leases (stage_lease, stage_release), for the
    inbox a message names: `find(name)` gives it, or why there is none
    here (then a lease is refused; a release needs no answer)."""
    async def refuse(why: str) -> dict[str, Any]:
        return {"t": "stage_error", "message": why}

    def on(act: Callable[[Inbox, Any, dict[str, Any]], Any]) -> Handler:
        def handle(peer: str, session: Any, msg: dict[str, Any]) -> Any:
            inbox = find(msg.get("inbox"))
            if isinstance(inbox, str):
                return None if msg.get("t") == "stage_release" else refuse(inbox)
            return act(inbox, session, msg)
        return handle

    return {"stage_lease": on(lambda inbox, session, msg: inbox.lease(session, msg)),
            "stage_release": on(lambda inbox, session, msg: inbox.release(session, msg))}


class Lease:
    """A lease of `inbox` slots of `peer` (its link sends the requests),
    taken on first use."""

    def __init__(self, peer: PathPeer, inbox: str) -> None:
        self.peer = peer
        self.inbox = inbox
        self.id: int | None = None
        self.slot_bytes = 0
        self._free: asyncio.Queue[int] = asyncio.Queue()
        self._leasing: asyncio.Task[None] | None = None

    async def take(self) -> int:
        """A leased slot's address (waiting until one is free); give it
        back with put()."""
        if self.id is None:
            if self._leasing is None:
                self._leasing = asyncio.get_running_loop().create_task(self._take_lease())
            await asyncio.shield(self._leasing)
        return await self._free.get()

    def put(self, slot: int) -> None:
        self._free.put_nowait(slot)

    async def _take_lease(self) -> None:
        reply = await self.request({"t": "stage_lease", "inbox": self.inbox, "slots": LEASE_SLOTS})
        if reply.get("t") != "stage_leased":
            raise RemoteAccessError(f"{self.peer.address} lends no {self.inbox} slots: {reply.get('message')}",
                                    peer=self.peer.address)
        self.id = int(reply["lease"])
        self.slot_bytes = int(reply["slot_bytes"])
        for a in reply["slots"]:
            self._free.put_nowait(int(a))

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.peer.link.request(msg, timeout=REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"{self.peer.address} did not answer {msg['t']} within "
                                       f"{REQUEST_TIMEOUT:g} s", peer=self.peer.address) from None

    async def ask(self, kind: str, slot: int, nbytes: int, entries: list[list[int]], **extra: Any) -> None:
        """Asks the owner to act on a leased slot (`kind`: stage_land,
        stage_fetch, relay_forward); raises RemoteAccessError with its
        reason if it refuses."""
        if nbytes > self.slot_bytes:
            raise ProtocolError(f"{self.peer.address} lends slots of {self.slot_bytes} bytes, smaller than "
                                f"{nbytes}", peer=self.peer.address)
        reply = await self.request({"t": kind, "inbox": self.inbox, "lease": self.id, "slot": slot,
                                    "entries": entries, **extra})
        if reply.get("t") != "stage_done":
            if reply.get("undelivered") is True:        # a relay member that could not forward it
                raise PeerLostError(f"{self.peer.address} could not forward: {reply.get('message')}",
                                    peer=self.peer.address)
            raise RemoteAccessError(f"{self.peer.address}: {reply.get('message')}", peer=self.peer.address)

    def release(self) -> None:
        """Gives the lease back; one still being granted (its user was
        cancelled meanwhile) is given back once it is, or the owner's slots
        would stay lent to nobody until the session ends."""
        if self._leasing is not None and not self._leasing.done():
            self._leasing.add_done_callback(self._release_granted)
            return
        self._send_release()

    def _release_granted(self, task: "asyncio.Task[None]") -> None:
        if not task.cancelled():
            task.exception()            # retrieved: its user saw it, or is gone
        self._send_release()

    def _send_release(self) -> None:
        if self.id is not None:
            try:
                self.peer.link.send({"t": "stage_release", "inbox": self.inbox, "lease": self.id})
            except KVFlowError:
                pass
            self.id = None
