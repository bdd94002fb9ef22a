"""Transfer: the awaitable handle of one batch.

Per-batch state lives in C; a Transfer holds only the batch id and one
future (the asyncpg waiter pattern): its timeout is armed with call_later,
and cancelling the awaiting task cancels the batch in a done-callback.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Generator

from kvflow.errors import TransferCancelledError, TransferTimeoutError, status_error

if TYPE_CHECKING:
    from kvflow.engine import Engine

__all__ = ["Transfer"]


class Transfer:
    """One batch in flight. Await it (returns None when every byte landed,
    raises a KVFlowError otherwise); cancel() it; check done()."""

    __slots__ = ("_engine", "_id", "_future", "_peer", "_op", "nbytes", "_timer")

    def __init__(self, engine: "Engine", batch_id: int, peer: str, op: int, nbytes: int,
                 timeout: float | None) -> None:
        self._engine = engine
        self._id = batch_id
        self._peer = peer
        self._op = op
        self.nbytes = nbytes
        self._future: asyncio.Future[None] = engine._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        if batch_id == 0:               # completed inline
            self._future.set_result(None)
            return
        if timeout is not None:
            self._timer = engine._loop.call_later(timeout, self._on_timeout, timeout)
        self._future.add_done_callback(self._on_future_done)

    def __await__(self) -> Generator[Any, None, None]:
        return self._future.__await__()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancels the batch: queued slices are dropped, posted ones are
        awaited and ignored. Awaiting it then raises TransferCancelledError.
        Returns False if it had already finished."""
        if self._future.done():
            return False
        self._abort(TransferCancelledError(f"transfer to {self._peer} cancelled", peer=self._peer))
        self._future.exception()    # the caller abandoned it: nobody must retrieve this
        return True

    def _abort(self, exc: BaseException) -> None:
        self._engine._core_cancel(self._id)
        if self._timer is not None:
            self._timer.cancel()
        self._future.set_exception(exc)

    def _on_timeout(self, timeout: float) -> None:
        if not self._future.done():
            self._abort(TransferTimeoutError(
                f"transfer to {self._peer} timed out after {timeout:g} s", peer=self._peer))

    def _on_future_done(self, fut: asyncio.Future[None]) -> None:
        # The awaiting task was cancelled: stop the batch too.
        if fut.cancelled():
            self._engine._core_cancel(self._id)
            if self._timer is not None:
                self._timer.cancel()

    def _finish(self, status: int, entry: int) -> None:
        """Called on the loop thread when the native batch completed."""
        if self._timer is not None:
            self._timer.cancel()
        if self._future.done():
            return
        if status == 0:
            self._future.set_result(None)
        else:
            self._future.set_exception(status_error(status, peer=self._peer, index=entry, op=self._op))

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        op = "write" if self._op == 0 else "read"
        return f"<kvflow.Transfer {op} {self.nbytes} B to {self._peer} {state}>"
