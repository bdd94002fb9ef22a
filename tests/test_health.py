"""The one back-off state machine (kvflow.schedule.health.Backoff) that
tcp rail rebuilds, rdma QP repairs and rdma device reopens share, driven
by an injected clock: no sleeping."""
from __future__ import annotations

import pytest

from kvflow.schedule.health import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_backs_off_doubling_to_the_cap_and_ends_on_success():
    clock = Clock()
    b = Backoff(0.5, 8.0, clock)
    assert not b.down and b.due() and b.succeeded() == 0.0
    assert b.failed() is True and b.down
    assert b.failed() is False                      # the same outage
    assert not b.due()                              # the first try waits `first`
    clock.now += 0.5
    assert b.due()
    waits = []
    for _ in range(7):
        waits.append(b.attempted())
        assert not b.due()
        clock.now += waits[-1]
        assert b.due()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.tries == 7
    assert b.succeeded() == pytest.approx(0.5 + sum(waits))
    assert not b.down and b.delay == 0.5 and b.tries == 0
    # a new outage starts from `first` again
    assert b.failed() and b.attempted() == 0.5


def test_a_delay_used_without_a_try_does_not_advance():
    b = Backoff(0.1, 2.0, Clock())
    b.failed()
    assert b.delay == 0.1 and b.delay == 0.1       # reading it (a sleep before the try) changes nothing
    assert [b.attempted() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert b.delay == 2.0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        Backoff(0, 1, Clock())
    with pytest.raises(ValueError):
        Backoff(2, 1, Clock())
