"""What the soak counted: operations and their outcomes, the faults
that were live when a transfer failed, and corruption with its context."""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine.transfer import DRAIN_GRACE


# -------------------------------------------------------------------- tally
@dataclass
class Fault:
    kind: str
    scope: str             # "ns" (every namespace lane) or a lane's name
    start: float
    end: float | None = None
    grace: float = 0.0     # how long after `end` failures are still its doing

    def covers(self, t0: float, t1: float) -> bool:
        end = math.inf if self.end is None else self.end + self.grace
        return t0 <= end and t1 >= self.start


@dataclass
class Tally:
    ops: Counter = field(default_factory=Counter)           # operation -> count
    outcomes: Counter = field(default_factory=Counter)      # "op outcome" -> count
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_verified: int = 0
    bytes_swept: int = 0
    unverified: int = 0          # a write's target restarted before it could be hashed
    failed_by_error: Counter = field(default_factory=Counter)
    failed_by_fault: Counter = field(default_factory=Counter)
    unexplained: list[dict[str, Any]] = field(default_factory=list)
    corrupted: int = 0
    late_landings: int = 0       # of which: bytes of a write abandoned after DRAIN_GRACE, landed late
    corruption: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    fence_violations: list[dict[str, Any]] = field(default_factory=list)
    notifications_sent: int = 0
    notifications_checked: int = 0
    notifications_unmatched: int = 0
    faults: list[Fault] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)      # times in reports are relative to this

    def begin(self, kind: str, scope: str, grace: float) -> Fault:
        f = Fault(kind, scope, time.monotonic(), grace=grace)
        self.faults.append(f)
        return f

    def explain(self, scopes: tuple[str, ...], t0: float, t1: float) -> str | None:
        hit = [f for f in self.faults if f.scope in scopes and f.covers(t0, t1)]
        return hit[-1].kind if hit else None

    def corrupt(self, lane: str, what: str, **detail: Any) -> None:
        self.corrupted += 1
        if late_landing(detail):
            self.late_landings += 1
            detail["late_landing"] = True
        if len(self.corruption) < 50:
            now = time.monotonic()
            recent = [f"{f.kind} at {f.start - self.t0:.1f} s"
                      + ("" if f.end is None else f" for {f.end - f.start:.1f} s")
                      for f in self.faults if f.start > now - 15]
            self.corruption.append({"lane": lane, "what": what, "t": round(now - self.t0, 2), **detail,
                                    "faults in the last 15 s": recent})


def late_landing(detail: dict[str, Any]) -> bool:
    """Whether a mismatch holds (far more than by chance: 1/256) the bytes of
    an earlier write whose await gave up waiting for its drain (DRAIN_GRACE)
    and raised while slices of it were still on the wire. Those land late,
    over whatever was written there since: a known engine bug (the tcp
    sender's slices on a stalled but live connection are neither recalled
    nor fenced), reported apart from other corruption."""
    for piece in [detail, *detail.get("pieces", [])]:
        for s in piece.get("abandoned_writes_over_this_range", []):
            if s["took"] >= DRAIN_GRACE - 0.05 and s["bytes_now_equal_to_it"] > max(16, s["overlap"] // 16):
                return True
