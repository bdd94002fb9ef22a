"""The faults the soak injects while its lanes run: on the namespace
target (rails down, kill, garbage clients) and on in-process pairs (deregister)."""
from __future__ import annotations

import asyncio
import random
import time

import faults

from soaklib.base import KEEPALIVE, bounded, sleep_or_stop
from soaklib.tally import Tally
from soaklib.lanes import NamespaceLane, NamespaceTarget, PairLane


# --------------------------------------------------------------------- faults
async def namespace_faults(ns: NamespaceTarget, lanes: list[NamespaceLane], stop: asyncio.Event,
                           rng: random.Random, tally: Tally, garbage_sent: list[int],
                           kinds: tuple[str, ...]) -> None:
    """One fault at a time on the namespace target, at random times, each
    kind at least once per cycle (rails twice)."""
    cycle: list[str] = []
    await sleep_or_stop(stop, rng.uniform(2, 4))
    while not stop.is_set():
        if not cycle:
            cycle = [k for k in ("rail", "kill", "garbage", "rail") if k in kinds]
            rng.shuffle(cycle)
        kind = cycle.pop()
        if kind == "rail":
            rail = rng.randrange(2)
            f = tally.begin(f"rail {rail} down", "ns", grace=KEEPALIVE + 5)
            try:
                await ns.topo.set_rail(rail, False)
                await asyncio.sleep(rng.uniform(1, 4))
            finally:
                await ns.topo.set_rail(rail, True)
                f.end = time.monotonic()
        elif kind == "kill":
            f = tally.begin("target killed", "ns", grace=KEEPALIVE + 10)
            try:
                await ns.restart()
            finally:
                f.end = time.monotonic()
        else:
            ports = [(ns.topo.target(0), faults.TARGET_PORT)]
            for lane in lanes:
                if lane.peer is not None and lane.gen == ns.generation:
                    ports += [tuple(ep) for ep in lane.peer.descriptor.data]
                    break
            f = tally.begin("garbage clients", "ns", grace=2.0)
            halt = asyncio.Event()
            junk_rng = random.Random(rng.random())
            junk = [asyncio.get_running_loop().create_task(faults._junk(h, p, halt, junk_rng, garbage_sent))
                    for h, p in sorted(set(ports)) for _ in range(2)]
            try:
                await asyncio.sleep(rng.uniform(2, 5))
            finally:
                halt.set()
                await bounded(asyncio.gather(*junk), "garbage clients to stop", 10)
                f.end = time.monotonic()
        await sleep_or_stop(stop, rng.uniform(2, 6))


async def region_faults(lanes: list[PairLane], stop: asyncio.Event, rng: random.Random, tally: Tally) -> None:
    """deregister() then register() again, either side of an in-process pair."""
    await sleep_or_stop(stop, rng.uniform(1, 3))
    while not stop.is_set():
        lane = rng.choice(lanes)
        side = rng.choice(("dst", "src"))
        engine, buf, region, name = lane.region_of(side)
        f = tally.begin(f"deregister {side}", lane.name, grace=1.0)
        engine.deregister(region)
        fence: list[float | None] = [time.monotonic(), None]
        lane.fences.append(fence)
        try:
            await asyncio.sleep(rng.uniform(0.2, 1.5))
        finally:
            lane.set_region(side, engine.register(buf, name=name))
            fence[1] = f.end = time.monotonic()
        await sleep_or_stop(stop, rng.uniform(1.5, 5))
