"""Stopping background tasks: the one way every layer cancels its tasks and
waits until they have finished (their `finally` blocks ran), so a close()
never returns while one of them still touches what is being closed; and
running several at once where the first error stops the rest."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Sequence


async def cancel_and_wait(tasks: Iterable[asyncio.Future | None]) -> None:
    """Cancels every task given (None and finished ones are skipped) and
    waits until all have finished. What they raised, their cancellation
    included, is dropped: a task that failed has reported it already (to its
    waiters, or through the loop's exception handler). A cancellation of the
    caller itself still propagates."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)


def retrieve(task: "asyncio.Future") -> None:
    """A done-callback for a task nobody may await: takes its exception,
    so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def gather_or_cancel(coros: Sequence[Any]) -> None:
    """Runs the coroutines at once; the first error cancels the rest (and
    waits for them) and is raised."""
    tasks = [asyncio.get_running_loop().create_task(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
