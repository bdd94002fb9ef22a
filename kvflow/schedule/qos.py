"""Transfer QoS: a batch's priority class and deadline, which the native
scheduler (kvflow/_native/sched.c) orders every provider's queued slices by.

- Priority: HIGH before NORMAL before LOW. No class starves: one that has
  queued slices is served at least once per `aging` interval (Engine(qos_aging=
  seconds), default AGING) whatever runs above it.
- deadline: an urgency hint, seconds from the call: within a class, batches
  with a deadline go first, earliest deadline first; then the one with the
  fewest bytes left (a small request passes a huge one queued before it),
  the class's oldest batch served at least once per aging interval. A
  deadline never fails a batch (timeout= does).
"""
from __future__ import annotations

import enum
import math

from kvflow import _core
from kvflow.errors import InvalidArgumentError

AGING = _core.SCHED["AGE_NS"] / 1e9
SCHEDULING = ("qos", "fifo")       # Engine(scheduling=)


class Priority(enum.IntEnum):
    """A batch's class (peer.write(..., priority=Priority.HIGH))."""

    HIGH = _core.PRIO["HIGH"]
    NORMAL = _core.PRIO["NORMAL"]
    LOW = _core.PRIO["LOW"]


_DEFAULT = Priority.NORMAL        # a module global: the class attribute costs an enum lookup (70 ns)
_NORMAL = int(_DEFAULT)


def qos_args(priority: object, deadline: object) -> tuple[int, int]:
    """(class, deadline in ns from now; 0: none) for the native submit, or
    InvalidArgumentError naming what is wrong."""
    if deadline is None and priority is _DEFAULT:
        return _NORMAL, 0                   # the default, on every write: no enum lookup
    try:
        prio = Priority(priority)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            f"priority must be a kvflow.Priority (HIGH, NORMAL, LOW), not {priority!r}") from None
    if deadline is None:
        return int(prio), 0
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or \
            not math.isfinite(deadline) or deadline < 0:
        raise InvalidArgumentError(f"deadline must be seconds >= 0 or None, not {deadline!r}")
    return int(prio), max(1, int(deadline * 1e9))


def aging_ns(seconds: object) -> int:
    """Engine(qos_aging=): the starvation bound in ns (> 0)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not math.isfinite(seconds) or not 0 < seconds <= 60:
        raise InvalidArgumentError(f"qos_aging must be seconds in (0, 60], not {seconds!r}")
    return max(1000, int(seconds * 1e9))
