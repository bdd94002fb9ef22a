"""Which master leads a cluster: an etcd key on a lease.

The leader is whoever created `kvflow/store/<cluster>/leader` (a txn that
puts it only if it does not exist, on the candidate's lease); its value is
the leader's address, which clients read to find it. The leader keeps its
lease alive every ttl/3; when it dies (SIGKILL, a crash, a partition) the
lease runs out within `ttl` seconds, etcd deletes the key, and a standby
polling every `poll` seconds creates it. A leader that closes cleanly
revokes its lease: the standby takes over within one poll.

The create revision of the leader key is the fence: every durable write
of the leader is a txn conditional on the key still having that create
revision (durable.py), so a leader that lost its lease without noticing
(stopped, cut off) can no longer write anything its successor would read.
The lease also bounds when this leader may hand out space (master.py):
a put_start's reply lets a client write, and a new leader's fence of its
recovered free space (fence.py) covers only writes allowed before the old
lease ran out. So `held_until` is when the lease certainly still ran, the
send time of the last keep-alive etcd answered plus the TTL it reported
(etcd can expire the lease no sooner), and a reply that hands out space
after it waits for the next keep-alive (`renewed()`): a leader stopped past
its lease and woken (SIGSTOP, a partition) hands out nothing; its
keep-alive finds the lease gone and it stops.
Why not etcd's own election API (v3election): its Campaign call blocks for
as long as the candidate is not elected, which a bounded request over the
JSON gateway cannot express; the txn is the same mechanism underneath.
"""
from __future__ import annotations

import asyncio
import logging
import time

from .errors import DurabilityError
from .etcd import EtcdClient, LeaseNotFound, b64

__all__ = ["Election", "leader_address"]

log = logging.getLogger("kvflow.store.election")


async def leader_address(etcd: EtcdClient, key: bytes) -> str | None:
    """The current leader's address, None when there is none."""
    kv = await etcd.get(key)
    return kv["value"].decode() if kv else None


class Election:
    """One candidate. `await campaign()` returns once it leads (its fence
    revision); `lost` is a future done (with the DurabilityError) when it
    stops leading."""

    def __init__(self, etcd: EtcdClient, key: bytes, value: str, *, ttl: float = 2.0,
                 poll: float = 0.1) -> None:
        self.etcd = etcd
        self.key = key
        self.value = value
        self.ttl = max(1, round(ttl))           # etcd leases are whole seconds
        self.poll = poll
        self.lease = 0
        self.revision = 0
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self._keeper: asyncio.Task | None = None
        self.held_until = 0.0           # time.monotonic() until which the lease certainly runs
        self._renewals: list[asyncio.Future] = []

    def __repr__(self) -> str:
        return f"<Election {self.key.decode()} {'leader' if self.revision else 'candidate'} {self.value}>"

    async def attempt(self) -> bool:
        """One try to lead (True: this candidate leads now, `revision` set)."""
        if self._keeper is None:
            sent = time.monotonic()
            self.lease = await self.etcd.grant(self.ttl)
            self.held_until = sent + self.ttl
            self._keeper = asyncio.get_running_loop().create_task(self._keep())
        if self.lost.done():
            raise self.lost.exception()
        k = b64(self.key)
        doc = await self.etcd.txn(
            [{"target": "CREATE", "key": k, "result": "EQUAL", "create_revision": "0"}],
            [{"request_put": {"key": k, "value": b64(self.value.encode()), "lease": str(self.lease)}}])
        if doc.get("succeeded"):
            self.revision = int(doc["header"]["revision"])
            log.info("leading %s from revision %d", self.key.decode(), self.revision)
        return bool(self.revision)

    async def campaign(self) -> int:
        """Tries every `poll` seconds until this candidate leads; its fence revision."""
        while not await self.attempt():
            await asyncio.sleep(self.poll)
        return self.revision

    async def _keep(self) -> None:
        """Keeps the lease; a lease that cannot be renewed for ttl seconds
        is lost (its key may be gone: someone else may lead now)."""
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.ttl / 3)
            sent = time.monotonic()
            try:
                left = await self.etcd.keepalive(self.lease)
            except LeaseNotFound:
                left = 0
            except DurabilityError as e:
                if asyncio.get_running_loop().time() - last < self.ttl:
                    log.warning("lease keep-alive failed: %s", e)
                    continue
                left, why = 0, e
            else:
                why = None
            if left <= 0:
                if not self.lost.done():
                    self.lost.set_exception(why or DurabilityError(
                        f"etcd {self.etcd.address}: the lease of {self.key.decode()} expired"))
                    self.lost.exception()           # retrieved: a candidate may never look
                for fut in self._renewals:
                    if not fut.done():
                        fut.set_exception(self.lost.exception())
                self._renewals.clear()
                return
            last = asyncio.get_running_loop().time()
            self.held_until = sent + min(left, self.ttl)
            for fut in self._renewals:
                if not fut.done():
                    fut.set_result(None)
            self._renewals.clear()

    def renewed(self) -> asyncio.Future:
        """A future done at the next keep-alive etcd answers (its exception:
        the lease is lost)."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost.done():
            fut.set_exception(self.lost.exception())
        else:
            self._renewals.append(fut)
        return fut

    async def resign(self) -> None:
        """Stops keeping the lease and revokes it (its key goes at once)."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        if self.lease:
            try:
                await self.etcd.revoke(self.lease)
            except DurabilityError:
                pass                                # it runs out by itself
