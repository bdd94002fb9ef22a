"""One back-off state machine for everything that fails and is tried
again: a tcp data connection being rebuilt (its rail "blacklisted"
meanwhile), an rdma QP being repaired, an rdma device being reopened.

A Backoff is down from its first failure until it succeeds. While down,
`due()` says whether the next try may start, `attempted()` records a try
(the next one waits `delay` seconds, and `delay` doubles up to `cap`), and
`succeeded()` ends the outage. The clock is injected (the event loop's
`time`, or a test's), so the state machine is tested without sleeping.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["Backoff"]


class Backoff:
    """Exponential back-off: first `first` seconds, doubling to `cap`."""

    __slots__ = ("first", "cap", "clock", "delay", "next_try", "down_since", "tries")

    def __init__(self, first: float, cap: float, clock: Callable[[], float]) -> None:
        if not 0 < first <= cap:
            raise ValueError("Backoff: 0 < first <= cap")
        self.first = first
        self.cap = cap
        self.clock = clock
        self.delay = first
        self.next_try = 0.0
        self.down_since: float | None = None
        self.tries = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self) -> bool:
        """Notes a failure. True if it starts an outage (the first try is
        then due after `first` seconds); False while one is running."""
        if self.down_since is not None:
            return False
        now = self.clock()
        self.down_since, self.delay, self.tries = now, self.first, 0
        self.next_try = now + self.first
        return True

    def due(self) -> bool:
        """Whether the next try may start now."""
        return self.clock() >= self.next_try

    def attempted(self) -> float:
        """Records a try: the one after it waits the current delay, which
        then doubles (to `cap`). Returns the wait."""
        wait = self.delay
        self.next_try = self.clock() + wait
        self.delay = min(self.delay * 2, self.cap)
        self.tries += 1
        return wait

    def succeeded(self) -> float:
        """Ends the outage; returns how long it lasted (0 if there was none)."""
        if self.down_since is None:
            return 0.0
        lasted = self.clock() - self.down_since
        self.down_since, self.delay, self.tries = None, self.first, 0
        return lasted

    def __repr__(self) -> str:
        state = f"down {self.tries} tries, next in {max(0.0, self.next_try - self.clock()):.2f} s" \
            if self.down else "up"
        return f"<Backoff {self.first:g}..{self.cap:g} s {state}>"
