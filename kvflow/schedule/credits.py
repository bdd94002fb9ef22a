"""Receiver credits: Engine(receive_window=bytes) caps the write payload
bytes in flight toward an engine from all its initiators together.

The target's native pool (kvflow/_native/credit.c) grants credit to each
data connection that asks, one share of the window at a time, over the
connection itself; an initiator frames a write payload only against credit
it holds, and the target takes the bytes back once they have landed. So
with N senders toward one receiver, what is on its wire and in its socket
buffers stays within the window instead of growing with N. A connection
that ends (its sender died, its rail went down) gives back everything it
held. tcp only for now (docs/qos.md).
"""
from __future__ import annotations

from kvflow.errors import InvalidArgumentError

MIN_WINDOW = 256 << 10       # at least a few slices (the initiator cuts slices to a quarter of it)
MAX_WINDOW = 1 << 40


def window_bytes(window: object) -> int:
    """Engine(receive_window=): bytes (0: no cap), or InvalidArgumentError."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or \
            not (window == 0 or MIN_WINDOW <= window <= MAX_WINDOW):
        raise InvalidArgumentError(
            f"receive_window must be None, 0 or bytes in [{MIN_WINDOW}, {MAX_WINDOW}], not {window!r}")
    return window
