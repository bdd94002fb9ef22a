"""Whether a peer is gone, told by its kernel, never by its process.

A peer is lost when its process exits (its kernel closes or resets its
sockets: noticed at once) or when its host stops answering: no ACK for
`grace` seconds while our bytes or probes wait for one (a host down, a
cable pulled, a partition). A peer that is only slow is never lost: a
stopped (SIGSTOP), starved or paused process, a server holding the GIL or
its event loop for minutes, a receive buffer left full. Its kernel still
acknowledges what reaches it and answers the window and keepalive probes,
so it looks alive here however long it stalls; transfers to it wait,
bounded by their own timeouts.

Nothing here depends on this process's event loop being scheduled on
time: the kernel sends the probes and keeps the record (TCP_INFO) that a
look reads, so a late look only notices a real loss late, and a loop
starved for any time never finds a false one. The same rule runs natively
for data connections (sk_unanswered in _native/sockio.c, used by the tcp
target's frame deadlines and TcpChannel.check_reach).
"""
from __future__ import annotations

import socket
from typing import Any

from kvflow._core import socket_unanswered

__all__ = ["ReachWatch", "keep_probing", "look_interval"]

KEEPALIVE_PROBES = 3        # unanswered keepalive probes after which the kernel ends an idle connection


def keep_probing(sock: Any, grace: float) -> None:
    """Turns on the kernel's keepalive on a tcp socket so that an idle
    connection to a host that is gone fails (ETIMEDOUT) after about `grace`
    seconds: probes every grace/3 (the kernel counts in whole seconds, at
    least 1) and three unanswered. TCP_USER_TIMEOUT stays off: it also ends
    a connection whose receiver keeps its window closed that long, which a
    stopped or starved peer does while it is alive."""
    probe = max(1, int(grace / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", probe), ("TCP_KEEPINTVL", probe), ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", 0)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def look_interval(grace: float) -> float:
    """How often a ReachWatch of `grace` looks: often enough that a loss is
    noticed soon after the grace, rarely enough to cost nothing."""
    return min(0.5, max(0.05, grace / 8))


class ReachWatch:
    """Looks at one tcp socket: look() is True once the peer's kernel has
    answered nothing for `grace` seconds on this look and the one before
    (one look alone can fall between a send after a long silence and its
    ACK)."""

    __slots__ = ("_sock", "grace", "_unheard")

    def __init__(self, sock: Any, grace: float) -> None:
        self._sock = sock          # its fileno() each look: -1 once closed, never a reused number
        self.grace = grace
        self._unheard = False

    def look(self) -> bool:
        fd = self._sock.fileno()
        if fd < 0:
            return False
        try:
            now = socket_unanswered(fd, self.grace)
        except OSError:
            return False
        gone = now and self._unheard
        self._unheard = now
        return gone
