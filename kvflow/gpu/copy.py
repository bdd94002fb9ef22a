"""Copy engines: queue copies of (dst, src, nbytes) pieces and say, on the
event loop, when they have finished.

CudaCopyEngine queues cuMemcpyAsync on the engine's own streams (several
copies in flight, one stream each, taken in turn) and waits for each
copy's event on a thread of its own, so the event loop never blocks on
the GPU. HostCopyEngine copies between host ranges on a worker thread:
the same contract for host memory, with which the staging pipeline runs
and is tested where there is no GPU.
"""
from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Sequence

from kvflow.errors import CudaError

__all__ = ["CopyEngine", "CudaCopyEngine", "HostCopyEngine", "Piece"]

Piece = tuple[int, int, int]        # (dst, src, nbytes)


class CopyEngine(Protocol):
    """copy(pieces) returns once every piece has been copied; copies of
    several calls may be in flight at once. close() waits for none."""

    async def copy(self, pieces: Sequence[Piece]) -> None: ...

    def close(self) -> None: ...


def _memmove_all(pieces: Sequence[Piece]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)


class HostCopyEngine:
    """Copies between host ranges on `threads` worker threads (memmove
    releases the GIL: ctypes calls do)."""

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvflow-copy")

    async def copy(self, pieces: Sequence[Piece]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, _memmove_all, list(pieces))

    def close(self) -> None:
        self._pool.shutdown(wait=True)      # a copy in progress finishes before its memory may go


class _EventWaiter:
    """One thread that waits for CUDA events in the order they were
    recorded (cuEventSynchronize releases the GIL) and resolves each
    event's future on its loop."""

    def __init__(self, device: int) -> None:
        self._device = device
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvflow-cuda{device}-events", daemon=True)
        self._thread.start()

    def wait(self, event: Any, loop: asyncio.AbstractEventLoop, fut: "asyncio.Future[None]") -> None:
        self._queue.put((event, loop, fut))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        from kvflow._cuda import driver as drv
        cu = None
        broken: Exception | None = None
        try:
            drv.use_device(self._device)        # this thread is kvflow's: the context stays
            cu = drv.driver()
        except Exception as e:                  # every copy then fails, none hangs
            broken = e
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, loop, fut = item
            error: Exception | None = broken
            if cu is not None:
                err, = cu.cuEventSynchronize(event.handle)
                if err != cu.CUresult.CUDA_SUCCESS:
                    error = CudaError(f"a copy failed on cuda:{self._device}: {err}", code=int(err))
            try:
                loop.call_soon_threadsafe(_settle, fut, error, event)
            except RuntimeError:            # the loop closed meanwhile
                event.close()


def _settle(fut: "asyncio.Future[None]", error: Exception | None, event: Any) -> None:
    event.close()
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class CudaCopyEngine:
    """Copies with the copy engines of GPU `device`: each copy() call's
    pieces go onto the next of `streams` streams (cuMemcpyAsync, any
    direction: unified addressing tells host from device), an event is
    recorded behind them, and the call returns when it has fired."""

    def __init__(self, device: int, streams: int = 2) -> None:
        from kvflow._cuda import driver as drv
        self._drv = drv
        self.device = device
        self._streams = [drv.Stream(device) for _ in range(max(1, streams))]
        self._next = 0
        self._waiter = _EventWaiter(device)

    async def copy(self, pieces: Sequence[Piece]) -> None:
        drv = self._drv
        stream = self._streams[self._next]
        self._next = (self._next + 1) % len(self._streams)
        event = drv.Event(self.device, blocking=True)      # its waiter sleeps, not spins
        try:
            with drv.on_device(self.device):
                for dst, src, n in pieces:
                    drv.copy_async(dst, src, n, stream)
            event.record(stream)
        except BaseException:
            # what was queued still runs: wait for the stream before the
            # caller may reuse the memory
            with drv.on_device(self.device):
                drv.driver().cuStreamSynchronize(stream.handle)
            event.close()
            raise
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter.wait(event, loop, fut)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the copy runs on: the caller's memory (a staging slot) is
            # not free until it has finished
            if not fut.done():
                await asyncio.wait([fut])
            raise

    def close(self) -> None:
        self._waiter.close()
        for s in self._streams:
            try:
                with self._drv.on_device(self.device):      # the copies queued finish first
                    self._drv.driver().cuStreamSynchronize(s.handle)
                s.close()
            except CudaError:
                pass


class _AfterWaiter:
    """One thread that polls the events after= waits for (cuEventQuery,
    which takes no context and never blocks) and resolves each wait's
    future on its loop. A wait given up (its write timed out, or was
    cancelled) is dropped at the next look: a stream that never finishes
    holds up no other wait, as a thread blocked in cuEventSynchronize on
    it would hold up every wait queued behind it. Looks every 20 us while
    something finishes, backing off to 1 ms while nothing does; a new wait
    wakes it at once."""

    POLL_MIN, POLL_MAX = 20e-6, 1e-3

    def __init__(self, cu: Any) -> None:
        self._cu = cu
        self._cv = threading.Condition()
        self._items: list[list[Any]] = []       # [event, own Event or None, loop, future, dropped]
        threading.Thread(target=self._run, name="kvflow-cuda-after", daemon=True).start()

    def add(self, event: Any, own: Any, loop: asyncio.AbstractEventLoop, fut: "asyncio.Future[Any]") -> list[Any]:
        item = [event, own, loop, fut, False]
        with self._cv:
            self._items.append(item)
            self._cv.notify()
        return item

    def _run(self) -> None:
        cu = self._cu
        not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        delay = self.POLL_MIN
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                    delay = self.POLL_MIN
                items = list(self._items)
            finished = []
            for item in items:
                event, own, loop, fut, dropped = item
                err = None if dropped else cu.cuEventQuery(event)[0]
                if err == not_ready:
                    continue
                finished.append(item)
                try:
                    loop.call_soon_threadsafe(_after_done, fut, err, own)
                except RuntimeError:            # its loop closed meanwhile
                    if own is not None:
                        own.close()
            with self._cv:
                for item in finished:
                    self._items.remove(item)
                if finished or len(self._items) > len(items):
                    delay = self.POLL_MIN
                else:
                    self._cv.wait(delay)        # a new wait cuts it short
                    delay = min(delay * 2, self.POLL_MAX)


def _after_done(fut: "asyncio.Future[Any]", err: Any, own: Any) -> None:
    if own is not None:
        own.close()                             # the waiter no longer looks at it
    if not fut.done():
        fut.set_result(err)


_after_lock = threading.Lock()
_after_waiter: _AfterWaiter | None = None


async def wait_after(after: Any) -> None:
    """Waits, off the event loop, until `after` has completed: a CUDA event
    or stream (torch.cuda.Event / Stream, cupy.cuda.Event / Stream,
    cuda-python's CUevent / CUstream). For a stream, the work queued on it
    so far. Returns at once when it has completed already (and for a torch
    event never recorded, which torch reports complete). Cancelling it
    (a timeout) leaves nothing waiting."""
    global _after_waiter
    from kvflow._cuda import driver as drv
    cu = drv.driver()
    found = _event_of(after, cu, drv)
    if found is None:
        return
    event, own, _device = found
    err, = cu.cuEventQuery(event)
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        with _after_lock:
            if _after_waiter is None:
                _after_waiter = _AfterWaiter(cu)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        item = _after_waiter.add(event, own, loop, fut)
        own = None                              # the waiter closes it when it lets go of the event
        try:
            err = await fut
        except asyncio.CancelledError:
            item[4] = True                      # dropped at its next look
            raise
    if own is not None:
        own.close()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"waiting for {type(after).__name__}: {err}", code=int(err))


def _event_of(after: Any, cu: Any, drv: Any) -> "tuple[Any, Any, int] | None":
    """(CUevent to wait for, our own Event to destroy after or None, the
    device whose context to wait in), or None: nothing to wait for."""
    kind = type(after).__name__
    if kind == "CUevent":
        return after, None, _current_device(drv)
    if kind == "CUstream":
        return _record(after, drv)
    handle = getattr(after, "cuda_event", None)             # torch.cuda.Event
    if handle is not None:
        if int(handle) == 0:                # never recorded: torch calls it complete
            return None
        device = getattr(getattr(after, "device", None), "index", None)
        return cu.CUevent(int(handle)), None, int(device) if device is not None else _current_device(drv)
    handle = getattr(after, "cuda_stream", None)            # torch.cuda.Stream
    if handle is not None:
        return _record(cu.CUstream(int(handle)), drv)
    module = type(after).__module__ or ""
    if module.startswith("cupy"):
        ptr = int(after.ptr)
        if "Event" in kind:
            return cu.CUevent(ptr), None, _current_device(drv)
        return _record(cu.CUstream(ptr), drv)
    from kvflow.errors import InvalidArgumentError
    raise InvalidArgumentError(
        f"after= takes a CUDA event or stream (torch, cupy or cuda-python), not a {kind}")


def _record(stream: Any, drv: Any) -> tuple[Any, Any, int]:
    """An event of ours recorded on `stream`, in the context of the device
    the stream belongs to (asked of the driver)."""
    cu = drv.driver()
    device = _current_device(drv)
    get_device = getattr(cu, "cuStreamGetDevice", None)
    if get_device is not None:
        err, dev = get_device(stream)
        if err == cu.CUresult.CUDA_SUCCESS:
            device = int(dev)
    ev = drv.Event(device, blocking=True)
    try:
        with drv.on_device(device):
            drv.check(cu.cuEventRecord(ev.handle, stream), "cuEventRecord")
    except BaseException:
        ev.close()
        raise
    return ev.handle, ev, device


def _current_device(drv: Any) -> int:
    cu = drv.driver()
    err, dev = cu.cuCtxGetDevice()
    return int(dev) if err == cu.CUresult.CUDA_SUCCESS else 0
