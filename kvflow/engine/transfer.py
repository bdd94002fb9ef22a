"""Transfer: the awaitable handle of one batch; BatchTable: the one table of
an engine's pending batches.

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
from typing import Any, Callable, Generator

from kvflow.arrays import entry_of
from kvflow.errors import KVFlowError, TransferCancelledError, TransferTimeoutError
from kvflow.status import status_error

__all__ = ["BatchTable", "Transfer"]

DRAIN_GRACE = 2.0


class BatchTable:
    """An engine's batches in flight: batch id -> Transfer, from the post
    to the completion drain. Providers get it (through their
    ProviderContext) to track batches they post themselves (rdma probes
    and notifications); the engine's completion reader drains it.

    `abort(peer, batch_id)` resets what carries a batch still on the wire
    after its drain grace (tcp: the peer's connections holding it), and
    `devices()` names the rdma devices for error messages."""

    def __init__(self, core: Any, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str, int], None], devices: Callable[[], "list[str] | None"]) -> None:
        self.core = core
        self.loop = loop
        self._abort = abort
        self._devices = devices
        self._pending: dict[int, Transfer] = {}

    def track(self, batch_id: int, peer: str, op: int, nbytes: int, timeout: float | None) -> "Transfer":
        """The Transfer of a posted batch (batch_id 0: completed inline)."""
        t = Transfer(self, batch_id, peer, op, nbytes, timeout)
        if batch_id:
            self._pending[batch_id] = t
        return t

    def on_completions(self) -> None:
        """Finishes every batch the native core completed. One wake-up per
        burst of finished batches (see kvf.h). A batch polled to completion
        on the loop's thread never gets here (kvf_take)."""
        pending = self._pending
        for batch_id, status, entry in self.core.drain():
            t = pending.pop(batch_id, None)
            if t is not None:
                t._finish(status, entry)

    def cancel(self, batch_id: int) -> None:
        """Marks a batch cancelled in the native core: its queued slices are dropped."""
        if self.core is not None:
            self.core.cancel(batch_id)

    def abort(self, peer: str, batch_id: int) -> None:
        self._abort(peer, batch_id)

    def devices(self) -> "list[str] | None":
        return self._devices()

    def fail_all(self, exc: Callable[[str], KVFlowError]) -> None:
        """Fails every batch still pending (the engine closed): exc(peer)."""
        pending, self._pending = self._pending, {}
        for t in pending.values():
            if not t.done():
                t._future.set_exception(exc(t._peer))
                t._future.exception()

    def __len__(self) -> int:
        return len(self._pending)


class Transfer:
    """One batch in flight. Await it (returns None when every byte landed,
    raises a KVFlowError otherwise); cancel() it; check done()."""

    __slots__ = ("_table", "_id", "_future", "_peer", "_op", "nbytes", "_timer", "_abort_exc",
                 "_drained", "_drain_waiter", "_first_piece")

    def __init__(self, table: BatchTable, batch_id: int, peer: str, op: int, nbytes: int,
                 timeout: float | None) -> None:
        self._table = table
        self._id = batch_id
        self._peer = peer
        self._op = op
        self.nbytes = nbytes
        self._future: asyncio.Future[None] = table.loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._abort_exc: KVFlowError | None = None
        self._drained = batch_id == 0
        self._drain_waiter: asyncio.Future[None] | None = None
        self._first_piece: Any = None       # strided batch: first piece of each entry
        if batch_id == 0:               # completed inline
            self._future.set_result(None)
            return
        if timeout is not None:
            self._timer = table.loop.call_later(timeout, self._on_timeout, timeout)

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
                self._table.cancel(self._id)
                if self._timer is not None:
                    self._timer.cancel()
                # Cancelled again meanwhile (asyncio.timeout around a
                # cancelled task, a second task.cancel()): wait on all the
                # same, or the caller could reuse its buffer while bytes of
                # it are still on the wire. Bounded all the same: DRAIN_GRACE
                # from the first cancel, after which the connections still
                # carrying the batch are reset (nothing of it lands later).
                loop = self._table.loop
                end = loop.time() + DRAIN_GRACE
                while not self._drained:
                    try:
                        yield from self._wait_drained(max(0.0, end - loop.time())).__await__()
                        break
                    except asyncio.CancelledError:
                        continue
            raise

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, callback: "Callable[[Transfer], object]") -> None:
        """Calls `callback(transfer)` on the loop once the transfer is done
        (succeeded or failed; at once, on the loop's next turn, if it is)."""
        self._future.add_done_callback(lambda _: callback(self))

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
        self._table.cancel(self._id)
        self._timer = self._table.loop.call_later(DRAIN_GRACE, self._give_up)
        if retrieved:
            # The caller abandoned it: a failure nobody awaits must not be
            # reported as "exception never retrieved".
            self._future.add_done_callback(_silence)

    def _give_up(self) -> None:
        if not self._future.done() and self._abort_exc is not None:
            self._table.abort(self._peer, self._id)
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
            self._drain_waiter = self._table.loop.create_future()
        await asyncio.wait([self._drain_waiter], timeout=timeout)
        if not self._drained:
            self._table.abort(self._peer, self._id)

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
            self._future.set_exception(batch_error(self._table, self._peer, self._op, status, entry,
                                                   self._first_piece))

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        op = "write" if self._op == 0 else "read"
        return f"<kvflow.Transfer {op} {self.nbytes} B to {self._peer} {state}>"


def batch_error(table: BatchTable, peer: str, op: int, status: int, entry: int,
                first_piece: Any) -> KVFlowError:
    """The error of a batch that finished with `status`, naming the entry
    the caller passed (a strided entry, not its piece)."""
    if first_piece is not None:
        entry = entry_of(first_piece, entry)
    return status_error(status, peer=peer, index=entry, op=op, devices=table.devices())


def _silence(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class TaskTransfer:
    """A transfer that runs as a task on the loop rather than as one native
    batch: staged GPU memory (kvflow.paths.staged), or a batch that waits for
    a CUDA event first (`after=`). The same face as Transfer: await it,
    cancel() it (what is still queued is dropped, what is on the wire is
    waited for), done(), add_done_callback(), nbytes."""

    __slots__ = ("_task", "_peer", "nbytes", "_cancelled")

    def __init__(self, coro: Any, peer: str, nbytes: int) -> None:
        self._peer = peer
        self.nbytes = nbytes
        self._cancelled = False
        self._task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)

    def __await__(self) -> Generator[Any, None, None]:
        try:
            return (yield from asyncio.shield(self._task).__await__())
        except asyncio.CancelledError:
            if self._cancelled and self._task.done():
                raise TransferCancelledError(f"transfer to {self._peer} cancelled", peer=self._peer) from None
            if not self._task.done():       # the awaiting task was cancelled: so is the transfer
                self._task.cancel()
                # and its cancellation is let through once the transfer has
                # stopped: its own transfers wait for what is on the wire
                # (each bounded by DRAIN_GRACE); the caller must not reuse
                # its buffers before. Cancelled again meanwhile: still waits.
                while not self._task.done():
                    try:
                        yield from asyncio.wait([self._task]).__await__()
                    except asyncio.CancelledError:
                        continue
            raise

    def done(self) -> bool:
        return self._task.done()

    def add_done_callback(self, callback: "Callable[[TaskTransfer], object]") -> None:
        self._task.add_done_callback(lambda _: callback(self))

    def cancel(self) -> bool:
        if self._task.done():
            return False
        self._cancelled = True
        self._task.cancel()
        return True

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "pending"
        return f"<kvflow.Transfer staged {self.nbytes} B to {self._peer} {state}>"
