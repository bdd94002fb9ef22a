"""A client's link to whichever master leads its cluster, across restarts
and failovers.

`StoreClient("etcd://HOST:PORT/CLUSTER")` finds the leader in etcd (the
address under the cluster's leader key, election.py); a list of
addresses (`["h1:p", "h2:p"]` or "h1:p,h2:p") is tried in turn (a standby
does not listen until it leads, so its address refuses). When the link's
connection closes (the master died or stepped down), the next call or
heartbeat reconnects: find the leader, connect, and run the client's
`attach` (register again with the same client id, mount the same
segment: a master that recovered it from etcd gives it back with its
objects). One reconnect at a time; every caller waits for the same one.

Which calls are retried on the new leader: the ones that are safe to
send twice. Reads and queries are idempotent; put_start carries the put
call's token (a request id: a master that already allocated for it
returns the same replicas, and a new master never saw the first one);
put_end of an object its writer already committed returns the same
count; revoke is a no-op when nothing is left to revoke. remove,
remove_all, mount and unmount are not retried: they raise
MasterUnavailableError (the reconnect still happens in the background).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvflow.errors import InvalidArgumentError, KVFlowError

from .durable import Layout
from .election import leader_address
from .errors import DurabilityError, MasterUnavailableError
from .etcd import EtcdClient
from .rpc import MasterLink, TcpMasterLink

__all__ = ["RETRY_SAFE", "LeaderFinder", "FollowingLink", "finder_for"]

log = logging.getLogger("kvflow.store.follow")

RETRY_SAFE = frozenset({"heartbeat", "batch_get_replicas", "batch_exists", "batch_size", "stats",
                        "batch_put_start", "batch_put_end", "batch_put_revoke"})


class LeaderFinder:
    """Where the leader may be: the address in etcd, or each of a list."""

    def __init__(self, *, etcd: str | None = None, cluster: str = "default",
                 addresses: Sequence[str] = ()) -> None:
        self.etcd = EtcdClient(etcd, timeout=1.0) if etcd else None
        self.key = Layout(cluster).leader if etcd else b""
        self.addresses = list(addresses)
        self._first = 0

    def __repr__(self) -> str:
        return f"etcd://{self.etcd.address}/{self.key.decode()}" if self.etcd else ",".join(self.addresses)

    async def candidates(self) -> list[str]:
        if self.etcd is None:
            n = len(self.addresses)
            return [self.addresses[(self._first + i) % n] for i in range(n)]
        try:
            addr = await leader_address(self.etcd, self.key)
        except DurabilityError as e:
            log.debug("no leader from %s: %s", self, e)
            return []
        return [addr] if addr else []

    def worked(self, address: str) -> None:
        if address in self.addresses:
            self._first = self.addresses.index(address)

    async def close(self) -> None:
        if self.etcd is not None:
            await self.etcd.close()


def finder_for(master: object) -> LeaderFinder | None:
    """The finder for a master spec that follows a leader ("etcd://host:port
    [/cluster]", a list of "host:port", or "h1:p,h2:p"); None for one
    address or a Master object."""
    if isinstance(master, str) and master.startswith("etcd://"):
        where, _, cluster = master[len("etcd://"):].partition("/")
        return LeaderFinder(etcd=where, cluster=cluster or "default")
    if isinstance(master, str) and "," in master:
        master = [a.strip() for a in master.split(",") if a.strip()]
    if isinstance(master, (list, tuple)):
        if not master or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in master):
            raise InvalidArgumentError(f"master addresses must be 'host:port' strings, not {master!r}")
        return LeaderFinder(addresses=master)
    return None


class FollowingLink(MasterLink):
    """A MasterLink that reconnects to the leader (see the module's doc).
    `attach(link)` is the client's registration on a new link; `window`:
    seconds one reconnect keeps looking for a leader."""

    def __init__(self, finder: LeaderFinder, attach: Callable[[TcpMasterLink], Awaitable[None]], *,
                 window: float = 30.0) -> None:
        self.finder = finder
        self.attach = attach
        self.window = window
        self.link: TcpMasterLink | None = None
        self.closed = False
        self.reconnects = 0
        self._reconnect: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"<FollowingLink {self.finder} now {self.address}>"

    @property
    def address(self) -> str | None:
        return self.link.address if self.link is not None else None

    def _notice(self, method: str, args: list) -> None:
        if self.on_notice is not None:
            self.on_notice(method, args)

    async def open(self, timeout: float) -> "FollowingLink":
        await self._connect(time.monotonic() + timeout)
        return self

    async def _connect(self, deadline: float) -> None:
        last: BaseException | None = None
        pause = 0.02
        while not self.closed:
            for addr in await self.finder.candidates():
                try:
                    link = await TcpMasterLink.open(addr, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                except (MasterUnavailableError, InvalidArgumentError) as e:
                    last = e
                    continue
                link.on_notice = self._notice       # whichever leader pushes, the client hears it
                try:
                    await self.attach(link)
                except KVFlowError as e:        # not taken (still lost on it, or it stepped down)
                    await link.close()
                    last = e
                    continue
                self.finder.worked(addr)
                self.link = link
                return
            if time.monotonic() + pause > deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)
        raise MasterUnavailableError(f"no leader of {self.finder} could be reached"
                                     + (f": {last}" if last else ""))

    def _relink(self, dead: TcpMasterLink | None) -> asyncio.Task | None:
        """The reconnect that replaces `dead` (started if none runs)."""
        if self.link is not dead and self.link is not None and not self.link.closed:
            return None                         # someone reconnected already
        if self._reconnect is None or self._reconnect.done():
            self.reconnects += 1
            self._reconnect = asyncio.get_running_loop().create_task(
                self._connect(time.monotonic() + self.window))
            # its failure is each waiter's to see; nobody waiting is no error
            self._reconnect.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._reconnect

    async def call(self, method: str, *args: Any, timeout: float | None = 10.0) -> Any:
        if self.closed:
            raise MasterUnavailableError(f"link to {self.finder} is closed")
        link = self.link
        if link is not None and not link.closed:
            try:
                return await link.call(method, *args, timeout=timeout)
            except MasterUnavailableError:
                if not link.closed or self.closed:
                    raise                       # a slow master, not a lost one
                if method not in RETRY_SAFE:
                    self._relink(link)
                    raise
        task = self._relink(link)
        try:
            async with asyncio.timeout(timeout):
                if task is not None:
                    await asyncio.shield(task)
                return await self.link.call(method, *args, timeout=timeout)
        except TimeoutError:
            raise MasterUnavailableError(f"{method}: no leader of {self.finder} within {timeout} s") from None

    def notify(self, method: str, *args: Any) -> None:
        if self.link is not None and not self.closed:
            self.link.notify(method, *args)

    async def close(self) -> None:
        self.closed = True
        if self._reconnect is not None:
            self._reconnect.cancel()
            await asyncio.gather(self._reconnect, return_exceptions=True)
        if self.link is not None:
            await self.link.close()
        await self.finder.close()
