"""kvflow.tasks.cancel_and_wait: what every close() uses to stop its tasks."""
from __future__ import annotations

import asyncio

import pytest

from kvflow.tasks import cancel_and_wait


async def test_waits_until_every_finally_ran():
    ran = []

    async def worker(i):
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)   # a cleanup that itself awaits
            ran.append(i)

    tasks = [asyncio.create_task(worker(i)) for i in range(3)]
    await asyncio.sleep(0)
    await cancel_and_wait([tasks[0], None, tasks[1], tasks[2]])
    assert sorted(ran) == [0, 1, 2]
    assert all(t.cancelled() for t in tasks)


async def test_drops_what_the_tasks_raised_and_skips_finished_ones():
    async def fails():
        raise RuntimeError("reported elsewhere")

    failed = asyncio.create_task(fails())
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await cancel_and_wait([failed, done])          # raises nothing
    assert isinstance(failed.exception(), RuntimeError) and done.result() is None
    await cancel_and_wait([])


async def test_the_callers_own_cancellation_propagates():
    async def stubborn():
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(3600)   # never finishes its cleanup

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    closer = asyncio.create_task(cancel_and_wait([inner]))
    await asyncio.sleep(0.01)
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await inner
