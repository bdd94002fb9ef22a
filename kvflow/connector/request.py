"""What KVSender and KVReceiver share: the KVPoll state read from the
server's thread, the failure, the completion future behind `await wait()`,
and the per-request metric."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from kvflow.connector.types import KVPoll, KVTransferError, KVTransferMetric

if TYPE_CHECKING:
    from kvflow.connector.manager import KVManager

log = logging.getLogger("kvflow.connector")

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class Request:
    """One request's transfer on one rank. `state` is written on the engine
    loop only; reading it from another thread is safe (one attribute)."""

    def __init__(self, mgr: "KVManager", bootstrap_addr: str, bootstrap_room: int) -> None:
        if not isinstance(bootstrap_room, int) or isinstance(bootstrap_room, bool):
            raise TypeError(f"bootstrap_room must be an int, not {type(bootstrap_room).__name__}")
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = bootstrap_room
        self.state = KVPoll.Bootstrapping
        self.error: KVTransferError | None = None
        self.metric = KVTransferMetric()
        self._done: concurrent.futures.Future[KVPoll] = concurrent.futures.Future()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ server's thread
    def poll(self) -> KVPoll:
        """The request's state (never blocks)."""
        return self.state

    def failure_exception(self) -> None:
        """Raises the KVTransferError that failed the request (SGLang's
        contract: call it once poll() says Failed)."""
        if self.error is not None:
            raise self.error
        raise KVTransferError(self.room, f"failure_exception() called in state {self.state.name}")

    async def wait(self, timeout: float | None = None) -> KVPoll:
        """Awaits Success or Failed on the caller's own loop; returns the
        final KVPoll (Failed does not raise: see failure_exception())."""
        return await asyncio.wait_for(asyncio.wrap_future(self._done), timeout)

    def wait_sync(self, timeout: float | None = None) -> KVPoll:
        """Blocks this thread until Success or Failed."""
        return self._done.result(timeout)

    def get_transfer_metric(self) -> KVTransferMetric:
        return self.metric

    # ------------------------------------------------------------ engine loop
    def _set_state(self, state: KVPoll) -> None:
        if self.state in TERMINAL:
            return
        self.state = state
        if state in TERMINAL and not self._done.done():
            self._done.set_result(state)

    def _fail(self, reason: str, *, peer: str | None = None, tell_peers: bool = True) -> bool:
        """Fails the request once; returns False if it had already ended."""
        if self.state in TERMINAL:
            return False
        self.error = KVTransferError(self.room, reason, peer=peer)
        log.info("kvflow.connector: room %d failed: %s", self.room, reason)
        self._set_state(KVPoll.Failed)
        for addr in self._peer_addresses():
            self.mgr.peer_stats[addr].failures += 1
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._after_fail(reason, tell_peers)
        return True

    def _peer_lost(self, address: str) -> None:
        if address in self._peer_addresses():
            self._fail(f"peer {address} was lost", peer=address, tell_peers=False)

    def _peer_addresses(self) -> list[str]:
        raise NotImplementedError

    def _after_fail(self, reason: str, tell_peers: bool) -> None:
        raise NotImplementedError

    def _spawn(self, coro: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(coro)
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._fail(f"{exc.__class__.__name__}: {exc}", peer=getattr(exc, "peer", None))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.room} {self.state.name}>"
