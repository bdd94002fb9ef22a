"""A standalone master's cyclic garbage collector, kept off its index.

The master's index is a few tracked Python objects per stored object (its
record, its replicas' list and records, its LRU entry). CPython's full
(generation 2) collection walks every tracked object, and runs whenever
what survived into generation 2 since the last one exceeds a quarter of
what was there: an index growing to a million objects meant 14 full
collections, the longest 491 ms, 2.47 s of a 9.6 s load, each one
stopping the master's loop, so every client's call, for its length
(`StoreModel` alone, 256 B objects put one by one; 300k objects: 9
collections of up to 176 ms). Nothing in the index needs the cyclic
collector: its records refer to no cycle and go by reference counting.

So after each full collection its survivors are frozen (`gc.freeze`:
moved to the permanent generation, which no collection walks), and the
next full collection walks only what survived since. The same load: 43
full collections, the longest 16 ms, 0.31 s in all, and the load 30%
faster. A recovered index (durable.py rebuilds it with the collector off)
is frozen as it is, before the master serves (`freeze_now`): otherwise the
first full collection after recovery walks all of it (0.25 s at a million
objects).

What it costs: cyclic garbage made of frozen objects is not collected (a
closed connection's objects frozen while it was open, say). Every
`sweep_s` (an hour) the frozen objects are unfrozen, collected once (one
full walk, what each of those collections was) and the survivors frozen
again, so such garbage lives at most that long.

Only a master in a process of its own installs it (`python -m
kvflow.store master`): one embedded in a client shares its process with
the application, whose collector it must not change.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time

__all__ = ["GcFreezer", "SWEEP_S"]

log = logging.getLogger("kvflow.store.gc_freeze")

SWEEP_S = 3600.0


class GcFreezer:
    """Freezes the survivors of every full collection (see the module's doc)."""

    def __init__(self, sweep_s: float = SWEEP_S) -> None:
        self.sweep_s = sweep_s
        self.freezes = 0            # full collections whose survivors were frozen
        self.sweeps = 0
        self.last_sweep_s = 0.0     # how long the last sweep's full walk took
        self._task: asyncio.Task | None = None
        self._installed = False

    def install(self) -> None:
        """From now on, every full collection's survivors are frozen; a task
        on the running loop (if any) sweeps every sweep_s."""
        if not self._installed:
            gc.callbacks.append(self._after)
            self._installed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None:
            self._task = loop.create_task(self._sweeping())

    def uninstall(self) -> None:
        """Stops freezing and sweeping, and gives the frozen objects back to
        the collector."""
        if self._installed:
            gc.callbacks.remove(self._after)
            self._installed = False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        gc.unfreeze()

    def freeze_now(self) -> None:
        """Freezes every object tracked now (a freshly recovered index)."""
        gc.freeze()

    def sweep(self) -> int:
        """One full walk of everything: what the frozen objects left as
        cyclic garbage is collected, the rest frozen again. Returns what
        gc.collect found unreachable."""
        t0 = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()        # its own callback freezes the survivors
        gc.freeze()                 # (and if the callback is not installed)
        self.last_sweep_s = time.perf_counter() - t0
        self.sweeps += 1
        return found

    def _after(self, phase: str, info: dict) -> None:
        # gc's callback: runs at the start and stop of every collection
        if phase == "stop" and info.get("generation") == 2:
            gc.freeze()
            self.freezes += 1

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            found = self.sweep()
            log.info("gc sweep: %d unreachable objects collected, %.3f s", found, self.last_sweep_s)
