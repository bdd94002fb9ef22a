"""Which TCP congestion control a tcp data connection uses
(TcpOptions.congestion, Engine(tcp_congestion=), env KVFLOW_TCP_CONGESTION).

"auto" (the default) keeps the host's algorithm on connections between two
hosts, and on a connection within one host (loopback, or both ends on one
of this host's addresses) replaces a pacing one (BBR) by cubic, else reno.
BBR paces every send to its estimate of the path's bandwidth, and on a path
with no link at all that estimate swings from run to run: on this machine
(default BBR) 64 x 4 KiB writes over loopback moved 1.3-6.1 GB/s in runs of
one and the same command, 5.0-6.3 with cubic (docs/results.md). "system"
never touches it; any other value is an algorithm the kernel offers
(tcp_available_congestion_control), set on every data connection.

The algorithm is chosen before the connection exists: a socket that
starts with BBR keeps pacing its sends after a switch to cubic (the kernel
does not undo BBR's pacing request), which measured half of the gain. So
an initiator decides before connect() (does the route to the target's
address stay on this host?), and a listener starts its connections with
the unpaced algorithm; an accepted connection that turns out to come from
another host is switched back to the host's (BBR sets its pacing up again
when it takes over)."""
from __future__ import annotations

import ipaddress
import logging
import socket

from kvflow.errors import InvalidArgumentError

__all__ = ["AUTO", "SYSTEM", "accepted", "available", "before_connect", "check_congestion", "listener",
           "within_host"]

log = logging.getLogger("kvflow")

AUTO, SYSTEM = "auto", "system"
AVAILABLE_PATH = "/proc/sys/net/ipv4/tcp_available_congestion_control"
# algorithms that pace their own sends (the kernel's internal pacing)
PACING_PREFIX = "bbr"
# in order of preference, for a connection within one host
UNPACED = ("cubic", "reno")
HAS_OPTION = hasattr(socket, "TCP_CONGESTION")
_warned: set[str] = set()


def available() -> list[str] | None:
    """The algorithms this kernel offers, or None where it does not say."""
    try:
        with open(AVAILABLE_PATH) as f:
            return f.read().split()
    except OSError:
        return None


def check_congestion(value: object) -> str:
    """The option's value, checked: "auto", "system" or an offered algorithm."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"tcp_congestion must be 'auto', 'system' or an algorithm name, not {value!r}")
    if value in (AUTO, SYSTEM):
        return value
    offered = available()
    if offered is not None and value not in offered:
        raise InvalidArgumentError(f"tcp_congestion {value!r} is not offered by this kernel "
                                   f"(tcp_available_congestion_control: {' '.join(offered)})")
    return value


def current(s: socket.socket) -> str:
    """Socket `s`'s algorithm ("" where the kernel does not say)."""
    if not HAS_OPTION:
        return ""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
    except OSError:
        return ""


def _set(s: socket.socket, name: str, warn: bool = True) -> bool:
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        return True
    except OSError as e:
        # EPERM: not in tcp_allowed_congestion_control and no CAP_NET_ADMIN;
        # ENOENT: its module is not loaded
        if warn and name not in _warned:
            _warned.add(name)
            log.warning("kvflow: tcp congestion control %r refused on a data connection (%s); "
                        "the host's stays", name, e.strerror or e)
        return False


def _unpace(s: socket.socket) -> bool:
    """Gives `s` an unpaced algorithm if it has a pacing one; True if it did."""
    if not current(s).startswith(PACING_PREFIX):
        return False
    # cubic is often not allowed without CAP_NET_ADMIN: only the last
    # refusal is worth a warning
    return any(_set(s, name, warn=name == UNPACED[-1]) for name in UNPACED)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def route_stays_here(host: str, port: int) -> bool:
    """The route to address `host` leaves from `host` itself: it is one of
    this host's addresses (a UDP connect() picks the route; nothing is
    sent). A host name is not looked up (that would block the caller's
    event loop): False."""
    if _is_loopback(host):
        return True
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as u:
            u.connect((host, port or 9))
            return u.getsockname()[0] == host
    except OSError:
        return False


def within_host(s: socket.socket) -> bool:
    """Both ends of connected socket `s` are on this host."""
    try:
        local, peer = s.getsockname()[0], s.getpeername()[0]
    except OSError:
        return False
    return local == peer or _is_loopback(peer)


def before_connect(s: socket.socket, host: str, port: int, choice: str) -> None:
    """Sets the algorithm of unconnected socket `s`, about to connect to
    host:port, as `choice` says (never raises: a refused algorithm leaves
    the host's, with one warning)."""
    if choice == SYSTEM or not HAS_OPTION:
        return
    if choice != AUTO:
        _set(s, choice)
    elif current(s).startswith(PACING_PREFIX) and route_stays_here(host, port):
        _unpace(s)


def listener(s: socket.socket, choice: str) -> str:
    """Sets listening socket `s`'s algorithm, which the connections it
    accepts start with. Returns the host's algorithm where it was replaced
    for "auto" (accepted() switches a connection from another host back to
    it), else ""."""
    if choice == SYSTEM or not HAS_OPTION:
        return ""
    if choice != AUTO:
        _set(s, choice)
        return ""
    host_default = current(s)
    return host_default if _unpace(s) else ""


def accepted(s: socket.socket, host_default: str) -> None:
    """An accepted connection from another host goes back to the host's
    algorithm (`host_default`: what listener() returned; "" leaves it)."""
    if host_default and not within_host(s):
        _set(s, host_default)
