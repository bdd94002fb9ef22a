"""Transfer: the awaitable handle of one batch.

Per-batch state lives in C; a Transfer holds only the batch id and one
future (the asyncpg waiter pattern): its timeout is armed with call_later,
and cancelling the awaiting task cancels the batch.

Timeout and cancel() resolve the future only once the native batch has
drained (queued slices dropped, slices already on the wire finished), so
when `await` raises, no byte of that batch can land afterwards and overwrite
a later transfer to the same range. A peer that stops reading cannot hold
the caller past DRAIN_GRACE seconds.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Generator

from kvflow.arrays import entry_of
from kvflow.errors import KVFlowError, TransferCancelledError, TransferTimeoutError, status_error

if TYPE_CHECKING:
    from kvflow.engine.engine import Engine

__all__ = ["Transfer"]

DRAIN_GRACE = 2.0


class Transfer:
    """One batch in flight. Await it (returns None when every byte landed,
    raises a KVFlowError otherwise); cancel() it; check done()."""

    __slots__ = ("_engine", "_id", "_future", "_peer", "_op", "nbytes", "_timer", "_abort_exc",
                 "_drained", "_drain_waiter", "_first_piece")

    def __init__(self, engine: "Engine", batch_id: int, peer: str, op: int, nbytes: int,
                 timeout: float | None) -> None:
        self._engine = engine
        self._id = batch_id
        self._peer = peer
        self._op = op
        self.nbytes = nbytes
        self._future: asyncio.Future[None] = engine._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._abort_exc: KVFlowError | None = None
        self._drained = batch_id == 0
        self._drain_waiter: asyncio.Future[None] | None = None
        self._first_piece: Any = None       # strided batch: first piece of each entry
        if batch_id == 0:               # completed inline
            self._future.set_result(None)
            return
        if timeout is not None:
            self._timer = engine._loop.call_later(timeout, self._on_timeout, timeout)

    def __await__(self) -> Generator[Any, None, None]:
        try:
            return (yield from self._future.__await__())
        except asyncio.CancelledError:
            # The awaiting task was cancelled (task.cancel, asyncio.timeout):
            # stop the batch too, and do not let the cancellation through
            # while bytes of it may still land (bounded by DRAIN_GRACE). A
            # generator, not a done-callback, so that a completed transfer
            # costs no extra loop callback.
            if not self._drained:
                self._engine._core_cancel(self._id)
                if self._timer is not None:
                    self._timer.cancel()
                yield from self._wait_drained().__await__()
            raise

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancels the batch: queued slices are dropped, slices on the wire
        finish and are ignored. Awaiting it raises TransferCancelledError
        (once nothing of it is in flight). Returns False if it had already
        finished."""
        if self._future.done() or self._abort_exc is not None:
            return False
        self._abort(TransferCancelledError(f"transfer to {self._peer} cancelled", peer=self._peer),
                    retrieved=True)
        return True

    def _abort(self, exc: KVFlowError, *, retrieved: bool = False) -> None:
        self._abort_exc = exc
        if self._timer is not None:
            self._timer.cancel()
        self._engine._core_cancel(self._id)
        self._timer = self._engine._loop.call_later(DRAIN_GRACE, self._give_up)
        if retrieved:
            # The caller abandoned it: a failure nobody awaits must not be
            # reported as "exception never retrieved".
            self._future.add_done_callback(_silence)

    def _give_up(self) -> None:
        if not self._future.done() and self._abort_exc is not None:
            self._engine._abort_batch(self._peer, self._id)
            self._future.set_exception(self._abort_exc)

    def _on_timeout(self, timeout: float) -> None:
        if not self._future.done() and self._abort_exc is None:
            self._abort(TransferTimeoutError(
                f"transfer to {self._peer} timed out after {timeout:g} s", peer=self._peer))

    async def _wait_drained(self, timeout: float = DRAIN_GRACE) -> None:
        """Waits (bounded) until no slice of this batch is in flight."""
        if self._drained:
            return
        if self._drain_waiter is None:
            self._drain_waiter = self._engine._loop.create_future()
        await asyncio.wait([self._drain_waiter], timeout=timeout)
        if not self._drained:
            self._engine._abort_batch(self._peer, self._id)

    def _finish(self, status: int, entry: int) -> None:
        """Called on the loop thread when the native batch completed."""
        self._drained = True
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
        if self._future.done():
            return
        if self._abort_exc is not None:
            self._future.set_exception(self._abort_exc)
        elif status == 0:
            self._future.set_result(None)
        else:
            self._future.set_exception(batch_error(self._engine, self._peer, self._op, status, entry,
                                                   self._first_piece))

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        op = "write" if self._op == 0 else "read"
        return f"<kvflow.Transfer {op} {self.nbytes} B to {self._peer} {state}>"


def batch_error(engine: "Engine", peer: str, op: int, status: int, entry: int,
                first_piece: Any) -> KVFlowError:
    """The error of a batch that finished with `status`, naming the entry
    the caller passed (a strided entry, not its piece)."""
    if first_piece is not None:
        entry = entry_of(first_piece, entry)
    return status_error(status, peer=peer, index=entry, op=op, devices=engine._rdma_device_names())


def _silence(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()
