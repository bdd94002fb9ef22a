"""Handing an operation's outcome from the engine's loop thread to the
threads that wait for it, and starting a coroutine on that loop without a
Task."""
from __future__ import annotations

import asyncio
import collections
import functools
import os
import select
import sys
import threading
from typing import Any, Coroutine

from kvflow.engine.thread import EngineThread
from kvflow.errors import KVFlowError


class Wakeup:
    """An eventfd one thread sleeps on while it waits for the loop. A read
    and a write of an eventfd hand a thread over in about half the time a
    threading.Lock takes (17 vs 31 us per round trip measured on a 2-core
    VM), which is most of what a small sync transfer costs on top of the
    transfer itself. Closed when the last waiter holding it is gone, so the
    loop never writes into a descriptor number that was reused."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC)

    def __del__(self) -> None:
        os.close(self.fd)


_tls = threading.local()


def thread_wakeup() -> Wakeup:
    """This thread's eventfd: a thread waits for one operation at a time."""
    try:
        return _tls.wakeup
    except AttributeError:
        _tls.wakeup = w = Wakeup()
        return w


class Waiter:
    """One operation's outcome, handed from the loop thread to whichever
    threads wait for it (the caller of a sync transfer; any caller of
    get_batch_transfer_status).

    No lock: finish() sets `finished` before it reads `_sleepers`, and
    wait() appends to `_sleepers` before it reads `finished`, so a waiter
    either sees the flag or is in the list when finish() wakes it. A wake-up
    that comes after its waiter already left stays in that thread's eventfd;
    the `while` loop of its next wait absorbs it."""

    __slots__ = ("error", "finished", "_sleepers")

    def __init__(self) -> None:
        self.error: KVFlowError | None = None
        self.finished = False
        self._sleepers: list[Wakeup] = []

    def finish(self, error: KVFlowError | None) -> None:
        if self.finished:
            return
        self.error = error
        self.finished = True
        for w in self._sleepers:
            os.eventfd_write(w.fd, 1)

    def wait(self) -> KVFlowError | None:
        if not self.finished:
            wakeup = thread_wakeup()
            self._sleepers.append(wakeup)
            while not self.finished:
                os.eventfd_read(wakeup.fd)      # blocks with the GIL released
        return self.error



class _Outcome:
    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done, self.result, self.error = False, None, None


def run_blocking(thread: EngineThread, coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs `coro` as a Task on the thread's loop and blocks the calling
    thread, on its eventfd, until it is done; returns its result or raises
    its exception. About half the hand-off cost of EngineThread.call
    (run_coroutine_threadsafe and a concurrent Future's lock): 20 vs 40 us
    per call with a no-op coroutine on a 2-core VM. Same stale-wake rule as
    Waiter: a wake-up left in this thread's eventfd by a call whose caller
    had already seen `done` is absorbed by the `while`. If the loop stops
    before the task ran (close() racing this call), the wait notices
    within a second and raises KVFlowError."""
    if thread.on_loop_thread():
        coro.close()
        raise RuntimeError("run_blocking() from the loop's own thread would deadlock")
    loop = thread.loop
    out = _Outcome()
    wakeup = thread_wakeup()

    def finished(task: asyncio.Task) -> None:
        if task.cancelled():
            out.error = KVFlowError("the call was cancelled (the store's loop stopped)")
        elif (e := task.exception()) is not None:
            out.error = e
        else:
            out.result = task.result()
        out.done = True
        os.eventfd_write(wakeup.fd, 1)

    def start() -> None:
        loop.create_task(coro).add_done_callback(finished)

    try:
        loop.call_soon_threadsafe(start)
    except (RuntimeError, AttributeError):      # the loop is closed (or was never started)
        coro.close()
        raise KVFlowError("the store's loop is not running") from None
    while not out.done:
        if select.select([wakeup.fd], [], [], 1.0)[0]:
            os.eventfd_read(wakeup.fd)
        elif loop.is_closed() and not out.done:
            raise KVFlowError("the store's loop stopped before the call finished")
    if out.error is not None:
        raise out.error
    return out.result


def shutdown(thread: EngineThread, inflight: set[Waiter], queued: collections.deque[Any]) -> None:
    """Closes the engine thread, then fails what never reached its loop (a
    call racing close()). A function, not a method: weakref.finalize must
    not hold the TransferEngine. Safe to run again, from any thread."""
    thread.close()
    while True:
        try:
            queued.popleft().close()        # never started: nothing of it ran
        except IndexError:
            break
    for w in list(inflight):
        w.finish(KVFlowError("the transfer engine was closed"))
    inflight.clear()



EAGER_TASKS = sys.version_info >= (3, 12)


def drive(coro: Coroutine[Any, Any, None], _done: Any = None) -> None:
    """Advances `coro` to its next suspension and resumes it when the future
    it waits for is done: what a Task does, minus the first loop iteration
    and the cancellation plumbing, for TransferEngine._run only (it catches
    its own errors, and the engine fails what is left when it closes). Loop
    thread only; asyncio.current_task() is None inside."""
    try:
        fut = coro.send(None)
    except (StopIteration, asyncio.CancelledError):
        # done, or a future it awaited was cancelled (the engine closing):
        # _run has finished its waiter either way; no Task takes the error
        return
    if fut is None:                          # a bare yield (asyncio.sleep(0))
        asyncio.get_running_loop().call_soon(drive, coro)
    else:
        fut._asyncio_future_blocking = False  # what Task does with what a coroutine yields
        fut.add_done_callback(functools.partial(drive, coro))
