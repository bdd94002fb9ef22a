"""Transfers posted from a thread that is not the engine's loop and polled
there: NIXL's post-then-poll model (`kvflow.compat.nixl`), for callers that
keep their own loop of work and check for completion now and then.

Where the provider allows it (local, tcp), the batch is submitted on the
calling thread as a detached batch and its completion is checked on that
thread: neither goes through the engine's loop. Otherwise (rdma, a range
the peer's table does not show yet) it runs as write()/read() on the loop
and the poll looks at that future."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

from kvflow.errors import KVFlowError, PeerLostError

__all__ = ["COMPLETED", "PostedTransfer"]

# A poll that finds the batch running waits this long for it (GIL released,
# looking at it and yielding the CPU): a caller polling in a loop leaves the
# engine's threads room to finish it, instead of holding the GIL.
POLL_WAIT = 50e-6
# ... or only looks, where this thread moves it on itself (progress)
POLL_WAIT_SELF = 1e-9
# A batch up to this size that this thread moves on itself has its acks
# read for up to POLL_WAIT per poll (its ack is a round trip away); for a
# larger one the acks already there are read, then the poll waits for the
# batch for up to POLL_WAIT, yielding the CPU (a sleep until another thread
# woke it cost a wake-up per batch: 111-115 us against 95-96 us for 64 x
# 4 KiB over tcp).
SPIN_BYTES = 64 << 10


class PostedTransfer:
    """One posted batch. `poll()` is True once it finished (and raises its
    error if it failed), `wait(timeout)` blocks for it, `cancel()` stops it
    (its queued slices are dropped; poll() then raises)."""

    __slots__ = ("_core", "_batch", "_future", "_error_of", "_done", "_error", "_progress", "_budget")

    def __init__(self, core: Any = None, batch: int = 0, future: concurrent.futures.Future | None = None,
                 error_of: Callable[[int, int], KVFlowError] | None = None,
                 progress: Callable[[int, float], object] | None = None, nbytes: int = 0) -> None:
        self._core, self._batch, self._future, self._error_of = core, batch, future, error_of
        self._progress = progress       # the provider's way to move it on from this thread (tcp: read acks)
        self._budget = POLL_WAIT if nbytes <= SPIN_BYTES else 0.0
        self._done = batch == 0 and future is None          # completed inline
        self._error: BaseException | None = None

    def _finish(self, rc: int, status: int, entry: int) -> bool:
        if rc:
            return False                                    # still running
        self._done = True
        if status and self._error_of is not None:
            self._error = self._error_of(status, entry)
        return True

    def poll(self) -> bool:
        """True once finished; raises its error (KVFlowError) if it failed.
        Waits at most POLL_WAIT (50 us) for it, with the GIL released."""
        if not self._done:
            if self._future is not None:
                if not self._future.done():
                    return False
                self._done = True
                try:
                    self._future.result()
                except concurrent.futures.CancelledError:
                    self._error = PeerLostError("the engine was closed")
                except BaseException as e:  # noqa: BLE001 - reported to the poller
                    self._error = e
            else:
                try:
                    # A small batch this thread moves on itself: its acks
                    # are read (natively, up to POLL_WAIT), then it is only
                    # looked at. Anything else: a native wait of up to
                    # POLL_WAIT that yields the CPU while it looks (a poller
                    # spinning in Python held the GIL and the core its
                    # senders needed).
                    if self._progress is not None:
                        self._progress(self._batch, self._budget)
                    wait = POLL_WAIT_SELF if self._budget and self._progress is not None else POLL_WAIT
                    if not self._finish(*self._core.wait_detached(self._batch, wait, wait)):
                        return False
                except RuntimeError:                        # the engine closed meanwhile
                    self._done, self._error = True, PeerLostError("the engine was closed")
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout: float | None = None, spin: float = 100e-6) -> None:
        """Blocks until finished (raises its error), or TimeoutError after
        `timeout` seconds (None: no limit), the batch still running."""
        if not self._done:
            if self._future is not None:
                try:
                    self._future.result(timeout)
                except concurrent.futures.TimeoutError:
                    raise TimeoutError("the posted transfer is still running") from None
                except BaseException:  # noqa: BLE001 - poll() reports it
                    pass
            else:
                try:
                    if not self._finish(*self._core.wait_detached(self._batch, timeout or 0.0, spin)):
                        raise TimeoutError("the posted transfer is still running")
                except RuntimeError:
                    self._done, self._error = True, PeerLostError("the engine was closed")
        self.poll()

    def cancel(self) -> None:
        """Cancels it if it is still running (a no-op once finished)."""
        if self._done:
            return
        if self._future is not None:
            self._future.cancel()
        else:
            try:
                self._core.cancel(self._batch)
            except RuntimeError:
                pass

    def done(self) -> bool:
        return self._done


# What a post that completed inline returns: finished, no error, and never
# changed again (every method of a finished PostedTransfer only reads), so
# one instance serves every such post.
COMPLETED = PostedTransfer()
