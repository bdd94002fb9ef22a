"""GPU-initiated puts, proxy mode (issue 21): the CPU side.

A kernel (any GPU) appends put descriptors to a ring in host memory mapped
into the device (kvflow._putring; the device functions kvf_put and
kvf_put_wait are in kvflow/_cuda/putring.cuh) and goes on computing; the
proxy, a thread of the process that owns the engine, takes each one,
posts it through the engine's providers as a write (or read) to the peer
the descriptor names by index, and when it has landed writes the status
and advances the channel's completed counter, which the kernel polls.

    ring = PutRing(channels, slots, addr=pinned.addr, size=pinned.size)   # pinned: PinnedHost(mapped=True)
    with PutProxy(ring, [peer]) as proxy:
        kernels.layer_put(stream, ..., ring=pinned.device_addr, peer=0, remote=dst, out=...)

Host threads can be producers too (PutRing.post and .wait, the same
protocol from the host): the tests drive the proxy that way on machines
without a GPU.

What a status means: 0, the bytes landed at the peer (a put) or here (a
get), as for an awaited write(); else a negative errno that says what
refused it (kvflow._putring's E_* codes: E_INVALID for an unknown op or a
zero length, E_NO_PEER for a peer index outside the proxy's table,
E_UNREGISTERED, E_REMOTE, E_LOST, E_TIMEOUT, E_FAILED; E_CANCELED once the
proxy stopped). The proxy keeps the text of the last errors (`errors`),
and the first failure of each channel stays in the ring (`failure`), so a
kernel that did not wait still learns of it. Nothing is posted for a bad
descriptor, and the proxy goes on with the next.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Sequence

from kvflow._putring import (E_CANCELED, E_FAILED, E_INVALID, E_LOST, E_NO_PEER, E_REMOTE, E_TIMEOUT,
                             E_UNREGISTERED, OP_GET, OP_PUT, PutRing, PutRingError, fine_timer_slack, ring_bytes)
from kvflow.errors import (InvalidArgumentError, KVFlowError, PeerLostError, RemoteAccessError,
                           TransferTimeoutError, UnregisteredMemoryError)

__all__ = ["OP_GET", "OP_PUT", "PutProxy", "PutRing", "PutRingError", "ring_bytes", "status_of"]

log = logging.getLogger("kvflow")

IDLE_WAIT = 2e-3        # the longest native wait for a descriptor before the proxy looks at its stop flag
KEPT_ERRORS = 64


def status_of(error: BaseException) -> int:
    """The ring status for a transfer's error."""
    if isinstance(error, UnregisteredMemoryError):
        return E_UNREGISTERED
    if isinstance(error, RemoteAccessError):
        return E_REMOTE
    if isinstance(error, PeerLostError):
        return E_LOST
    if isinstance(error, TransferTimeoutError):
        return E_TIMEOUT
    if isinstance(error, InvalidArgumentError):
        return E_INVALID
    return E_FAILED


class PutProxy:
    """Takes the descriptors of `ring` and posts them to `peers` (a
    descriptor's peer field indexes this list) from a thread of its own.
    While nothing is posted it waits for a descriptor natively, the GIL
    released (PutRing.wait_any): yielding, then sleeping 2 us, then 20 us
    between looks (its timer slack set to 1 us); `spin=True` never sleeps
    (the lowest latency, a core's worth of polling). While something is posted it polls that (each poll
    waits up to 50 us for it, the GIL released) and takes new descriptors
    between polls. `max_inflight` bounds the transfers it has posted and
    not seen finish."""

    def __init__(self, ring: PutRing, peers: Sequence[Any], *, spin: bool = False, max_inflight: int = 256) -> None:
        if not isinstance(ring, PutRing):
            raise InvalidArgumentError(f"a PutProxy takes a PutRing, not {type(ring).__name__}")
        if max_inflight < 1:
            raise InvalidArgumentError(f"max_inflight {max_inflight} < 1")
        self.ring, self.peers = ring, list(peers)
        self.spin, self.max_inflight = spin, max_inflight
        self.errors: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=KEPT_ERRORS)
        self._stats = {"taken": 0, "finished": 0, "failed": 0, "bytes": 0}
        self._inflight: list[tuple[int, int, Any, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifetime
    def start(self) -> "PutProxy":
        if self._thread is not None:
            raise InvalidArgumentError("this PutProxy was started already")
        self.ring.reopen()
        self._thread = threading.Thread(target=self._run, name="kvflow-put-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stops taking descriptors, lets what it posted finish for up to
        `timeout` s (then cancels it), finishes everything it took, and
        marks the ring shut: a producer waiting on it gets E_CANCELED."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            self._reap()
            time.sleep(1e-5)
        for c, t, posted, _ in self._inflight:
            posted.cancel()
            self._finish(c, t, E_CANCELED, "the proxy stopped before it finished")
        self._inflight = []
        self.ring.shut()

    def __enter__(self) -> "PutProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Descriptors taken and finished, of them failed, bytes moved, and
        posted now."""
        return {**self._stats, "inflight": len(self._inflight)}

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        ring = self.ring
        fine_timer_slack()                  # this thread's 2 us sleeps are 2 us, not 52
        try:
            while not self._stop.is_set():
                if len(self._inflight) < self.max_inflight:
                    for d in ring.take_all():
                        self._post(*d)
                if self._inflight:
                    self._reap()
                else:
                    ring.wait_any(IDLE_WAIT, self.spin)
        except Exception:                   # a bug, not a descriptor: say so, and fail what waits
            log.exception("kvflow put proxy stopped")
            self.ring.shut()

    def _post(self, channel: int, ticket: int, op: int, peer: int, local: int, remote: int, length: int,
              tag: int) -> None:
        self._stats["taken"] += 1
        if op not in (OP_PUT, OP_GET) or length == 0:
            self._finish(channel, ticket, E_INVALID, f"op {op}, length {length}: not a put or a get")
            return
        if peer >= len(self.peers):
            self._finish(channel, ticket, E_NO_PEER, f"peer {peer}: the proxy has {len(self.peers)}")
            return
        target = self.peers[peer]
        try:
            if op == OP_PUT:
                posted = target.post_write([local], [remote], [length])
            else:
                posted = target.post_read([local], [remote], [length])
        except KVFlowError as e:
            self._finish(channel, ticket, status_of(e), str(e))
            return
        self._inflight.append((channel, ticket, posted, length))

    def _reap(self) -> None:
        still = []
        for item in self._inflight:
            channel, ticket, posted, length = item
            try:
                if not posted.poll():
                    still.append(item)
                    continue
            except KVFlowError as e:
                self._finish(channel, ticket, status_of(e), str(e))
                continue
            self._stats["bytes"] += length
            self._finish(channel, ticket, 0)
        self._inflight = still

    def _finish(self, channel: int, ticket: int, status: int, text: str = "") -> None:
        self.ring.finish(channel, ticket, status)
        self._stats["finished"] += 1
        if status:
            self._stats["failed"] += 1
            self.errors.append((channel, ticket, text))
