"""An Engine on its own event-loop thread, for callers that are not asyncio.

SGLang's scheduler, vLLM's workers and Mooncake-style code call a transfer
engine from plain threads. EngineThread runs one kvflow Engine on a private
loop in a daemon thread; other threads hand it coroutines and either block on
the result (`call`) or keep a concurrent future (`submit`). Asyncio callers
on another loop can `await asyncio.wrap_future(thread.submit(coro))`.

Why a thread and not a loop per call: the engine's completion eventfd, its
handshake server and its peers' control connections live on one loop and must
keep being served while the caller's thread blocks or does other work.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

from kvflow.engine.engine import Engine
from kvflow.errors import KVFlowError
from kvflow.tasks import cancel_and_wait

T = TypeVar("T")


class EngineThread:
    """Runs `Engine(**engine_options)` on a daemon thread's event loop
    (the thread is called `thread_name`; `name=` is the engine's).

    `start()` returns once the engine listens (raises what Engine.start
    raised); `close()` closes the engine and stops the thread (idempotent).
    """

    def __init__(self, thread_name: str = "kvflow-engine", **engine_options: Any) -> None:
        self._options = engine_options
        self._name = thread_name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine: Engine | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.loop_errors: list[dict[str, Any]] = []

    def start(self, timeout: float = 30.0) -> Engine:
        if self.engine is not None:
            return self.engine
        ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self._name, daemon=True)
        self._thread.start()
        self.engine = ready.result(timeout)
        return self.engine

    def _run(self, ready: concurrent.futures.Future[Engine]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._on_loop_error)
        self.loop = loop
        engine = Engine(**self._options)
        try:
            loop.run_until_complete(engine.start())
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            ready.set_exception(e)
            loop.close()
            return
        ready.set_result(engine)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(engine.close())
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            loop.run_until_complete(cancel_and_wait(pending))
            loop.close()

    def on_loop_thread(self) -> bool:
        """True when called from the engine's own loop thread (where
        blocking for a transfer would stop the loop that finishes it)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # Kept for tests (asyncpg-style hygiene: nothing may reach the handler)
        # and logged as the default handler would.
        self.loop_errors.append(context)
        loop.default_exception_handler(context)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules `coro` on the engine's loop; returns a concurrent future."""
        if self.loop is None or self._closed:
            coro.close()
            raise KVFlowError("the engine thread is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the engine's loop and blocks this thread for its
        result. Raises what the coroutine raised; RuntimeError when called
        from the engine's own thread (that would deadlock)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EngineThread.call() from the engine's own thread would deadlock")
        return self.submit(coro).result(timeout)

    def call_sync(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Runs the plain function `fn(*args)` on the engine's loop and returns
        its result: Engine.register/deregister touch loop-owned state (peers
        are told about new regions), so other threads go through here."""
        if self.in_loop():
            return fn(*args)

        async def run() -> T:
            return fn(*args)
        return self.call(run(), timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs `fn(*args)` on the engine's loop (thread-safe, no result)."""
        if self.loop is not None and not self._closed:
            self.loop.call_soon_threadsafe(fn, *args)

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout: float = 30.0) -> None:
        """Closes the engine (in-flight transfers fail) and joins the thread."""
        if self._closed or self.loop is None:
            self._closed = True
            return
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "EngineThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.engine else "new")
        addr = self.engine.address if self.engine else "-"
        return f"<EngineThread {addr} {state}>"

