"""An engine's end of the metadata service: publishes the engine's record,
keeps it alive in the background, and resolves other engines' names."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kvflow.errors import KVFlowError, PeerUnreachableError, ProtocolError
from kvflow.metadata.store import EngineRecord, MetadataStore
from kvflow.tasks import cancel_and_wait

__all__ = ["MetadataClient"]

log = logging.getLogger("kvflow")


class MetadataClient:
    """Publishes `make_record()` under `name` with a TTL of `ttl` seconds.

    The keeper task wakes every ttl/3 (so two refreshes may be lost before
    the record expires) or when the engine's regions change, and then
    refreshes the record, or publishes it again when it is gone (expired
    while the server was unreachable, or the server restarted empty) or
    out of date. While the server is unreachable it logs once, keeps
    serving peer-to-peer, and retries every period.
    """

    def __init__(self, store: MetadataStore, name: str, ttl: float,
                 make_record: Callable[[], EngineRecord]) -> None:
        self.store = store
        self.name = name
        self.ttl = ttl
        self._make_record = make_record
        self._wake = asyncio.Event()
        self._dirty = True            # the stored record is not (known to be) the current one
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        """Publishes once (bounded by the store's timeout), then keeps the
        record alive in the background. A server that is unreachable now
        is logged, not raised: the engine works peer-to-peer meanwhile and
        the record appears once the server answers."""
        await self._step()
        self._task = asyncio.get_running_loop().create_task(self._keep())

    def changed(self) -> None:
        """The engine's descriptor changed: publish it again soon. Cheap:
        a burst of changes costs one publish."""
        self._dirty = True
        self._wake.set()

    async def _keep(self) -> None:
        period = self.ttl / 3
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._step()
            except Exception:     # a bug here must not end the keeper silently
                log.exception("kvflow: metadata keeper for %r", self.name)

    async def _step(self) -> None:
        try:
            if self._dirty:
                await self._publish()
            elif not await self.store.refresh(self.name, self.ttl):
                log.info("kvflow: the record %r on %s was gone; publishing it again", self.name, self.store.url)
                await self._publish()
        except KVFlowError as e:
            self._dirty = True        # publish in full once the server answers
            if not self._failing:
                log.warning("kvflow: cannot publish %r on %s (retrying every %.3g s): %s",
                            self.name, self.store.url, self.ttl / 3, e)
            self._failing = True
            return
        if self._failing:
            log.info("kvflow: %r is published on %s again", self.name, self.store.url)
        self._failing = False

    async def _publish(self) -> None:
        self._dirty = False           # a change during the publish sets it again
        await self.store.publish(self.name, self._make_record().to_bytes(), self.ttl)

    async def lookup(self, name: str) -> EngineRecord:
        """The record published under `name`. Raises PeerUnreachableError
        when there is none or the server cannot be reached (in the store's
        timeout), ProtocolError when the record is malformed."""
        try:
            data = await self.store.lookup(name)
        except PeerUnreachableError as e:
            raise PeerUnreachableError(f"cannot resolve {name!r}: {e}", peer=name, errno=e.errno) from None
        if data is None:
            raise PeerUnreachableError(f"no engine named {name!r} is published on {self.store.url}", peer=name)
        return EngineRecord.from_bytes(name, data)

    async def directory(self) -> dict[str, EngineRecord]:
        """Every engine published on the server, by name. A malformed record
        is logged and left out (one bad writer must not hide the others)."""
        out = {}
        for name, data in sorted((await self.store.list()).items()):
            try:
                out[name] = EngineRecord.from_bytes(name, data)
            except ProtocolError as e:
                log.warning("kvflow: ignoring a malformed record on %s: %s", self.store.url, e)
        return out

    async def close(self) -> None:
        """Stops the keeper and deletes the record (bounded by the store's
        timeout; an unreachable server is logged: the record then expires
        after its TTL). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait([self._task])
        try:
            await self.store.remove(self.name)
        except KVFlowError as e:
            log.info("kvflow: could not delete %r on %s (it expires in %.3g s): %s",
                     self.name, self.store.url, self.ttl, e)
        await self.store.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failing" if self._failing else "published"
        return f"<kvflow.metadata.MetadataClient {self.name!r} on {self.store.url} {state}>"
