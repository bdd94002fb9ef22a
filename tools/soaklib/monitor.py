"""What the soak watches besides its lanes: RSS and descriptors,
the loop's lag, and the engine's warnings."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from soaklib.base import SAMPLE_S, fd_count, rss_mib
from soaklib.tally import Tally
from soaklib.lanes import NamespaceTarget


# ------------------------------------------------------------------- monitors
@dataclass
class Monitors:
    samples: list[dict[str, Any]] = field(default_factory=list)
    lag_max: float = 0.0
    stalls: list[tuple[float, float]] = field(default_factory=list)     # (t, seconds) over 1 s
    warnings: list[tuple[float, str]] = field(default_factory=list)
    loop_errors: list[str] = field(default_factory=list)


async def sample(mon: Monitors, t0: float, ns: NamespaceTarget, tally: Tally,
                 say: Callable[[str], None]) -> None:
    """Samples this process and the target; a progress line every 10 s."""
    n = 0
    while True:
        pid = ns.pid
        s = {"t": round(time.monotonic() - t0, 2), "rss": rss_mib(), "fds": fd_count(),
             "target_rss": rss_mib(pid) if pid else None, "target_fds": fd_count(pid) if pid else None,
             "target_gen": ns.generation}
        mon.samples.append(s)
        if n % max(1, round(10 / SAMPLE_S)) == 0:
            say(f"soak: t={s['t']:.0f} s ops={sum(tally.ops.values())} verified={tally.bytes_verified >> 20} MiB "
                f"faults={len(tally.faults)} failed={sum(tally.failed_by_error.values())} "
                f"corrupted={tally.corrupted} hangs={len(tally.hangs)} rss={s['rss']:.0f} MiB fds={s['fds']}")
        n += 1
        await asyncio.sleep(SAMPLE_S)


async def watch_lag(mon: Monitors, t0: float) -> None:
    """How late the loop runs a 0.1 s timer: starvation shows here before
    it shows as a keepalive firing."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(0.1)
        late = loop.time() - before - 0.1
        mon.lag_max = max(mon.lag_max, late)
        if late > 1.0:
            mon.stalls.append((round(before - t0, 2), round(late, 2)))


class WarningLog(logging.Handler):
    def __init__(self, mon: Monitors, t0: float) -> None:
        super().__init__(logging.WARNING)
        self.mon, self.t0 = mon, t0

    def emit(self, record: logging.LogRecord) -> None:
        self.mon.warnings.append((round(time.monotonic() - self.t0, 2), record.getMessage()))


def warning_kind(msg: str) -> str:
    for pattern, kind in ((r"silent for", "keepalive: peer declared lost"),
                          (r"data connection \d+ .* failed", "data connection failed"),
                          (r"data connection \d+ .* is back", "data connection rebuilt"),
                          (r"down at connect", "rail down at connect")):
        if re.search(pattern, msg):
            return kind
    return re.sub(r"[\d.:]+", "#", msg)[:70]
