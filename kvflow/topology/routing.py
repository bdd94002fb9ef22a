"""Rails between two hosts: which local and remote NICs pair up, in which
order an engine prefers its NICs for a memory location, and which local
netdev a route to an address leaves by."""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.errors import InvalidArgumentError
from kvflow.topology.model import NicKind, Topology

__all__ = ["Route", "match_rails", "on_subnet", "pair_tcp_rails", "rail_order", "route_to"]


def match_rails(local: Sequence[str], remote: Sequence[str]) -> list[tuple[str, str]]:
    """Pairs two ends' ordered NIC lists into rails: rail i is (local[i %
    nl], remote[i % nr]) for i in range(max(nl, nr)). Equal lists pair one
    to one in order (each side's first NIC with the other's first); the
    shorter side's NICs are reused round-robin, so every NIC of the longer
    side carries a rail. Each list is one end's preferred NICs for its
    memory location (its fallback where nothing is preferred). The rule is
    symmetric (match_rails(b, a) is match_rails(a, b) with each pair
    swapped), so both ends derive the same rails from the two published
    lists. Returns [] when either side has none; raises
    InvalidArgumentError for a list that names a NIC twice."""
    for side, names in (("local", local), ("remote", remote)):
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"{side} rail list names a NIC twice: {list(names)}")
    if not local or not remote:
        return []
    return [(local[i % len(local)], remote[i % len(remote)]) for i in range(max(len(local), len(remote)))]


def rail_order(nics: Sequence[str], topology: Topology | None, location: str | None) -> list[int]:
    """Indices of rails (each named by its NIC, "" where unknown) in the
    order `topology` prefers netdevs for memory at `location`: preferred,
    then fallback, then unknown, keeping the given order among equals (so
    without a topology or location it is the given order)."""
    if topology is None or location is None:
        return list(range(len(nics)))
    try:
        preferred, fallback = topology.preferred(location, NicKind.NETDEV)
    except InvalidArgumentError:
        return list(range(len(nics)))
    rank = {n: k for k, n in enumerate(preferred + fallback)}
    return sorted(range(len(nics)), key=lambda i: rank.get(nics[i], len(rank)))


def on_subnet(ip: str, interface: str) -> bool:
    """Whether address `ip` lies in the subnet of `interface` ("ip/prefixlen";
    False for a bare ip, whose prefix is unknown, for the other family, and
    for a malformed one)."""
    if "/" not in interface:
        return False
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_interface(interface).network
    except ValueError:
        return False


@dataclass
class Route:
    """Where the kernel sends packets for an address: the source it picks,
    the netdev holding that source, whether the address is on that
    source's subnet; `error` when there is no route at all."""
    source: str | None = None
    netdev: str | None = None
    on_link: bool = False
    error: OSError | None = None


def route_to(ip: str, topology: Topology) -> Route:
    """The source address the kernel picks for `ip` (a UDP connect() sends
    nothing; getsockname() reads the routing decision), the netdev holding
    that address (in `topology`), and whether `ip` lies in that address's
    subnet. Never raises: a failed lookup is the Route's `error`."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            src = s.getsockname()[0]
    except OSError as e:
        return Route(error=e)
    found = topology.interface_of(src)
    if found is None:
        return Route(src)
    return Route(src, found[0], on_subnet(ip, found[1]))


def pair_tcp_rails(local: Sequence[str], remote: Sequence[str], networks: Sequence[str] = (), *,
                   nics: Sequence[str] = (),
                   route: Callable[[str], str | None] | None = None) -> list[tuple[int | None, int]]:
    """Which local tcp rail each data connection to a peer's rails leaves
    from: distinct (local index, remote index) pairs, in order, the local
    index None where the kernel should choose the source. `local` is this
    end's rail addresses ("ip/prefixlen", or a bare ip where the prefix is
    unknown), `remote` the peer's (ip), each in its end's preference order
    (rail_order); `networks` every "ip/prefixlen" of this host; `nics` the
    netdev of each local rail ("" unknown) and `route` the netdev the
    kernel's route to an address leaves by (None: unknown; route_to()).

    The orders pair rail i with rail i (match_rails); a pair whose local
    rail is not on the remote address's subnet is moved to a local rail
    that is (two hosts that order their NICs differently still get
    same-subnet pairs); where no rail is, but another interface of this
    host is, the source is left to the kernel (a rail's address bound to
    leave by another link would have the replies come back by the rail and
    strict rp_filter drop them); so it is for a remote address this host
    holds itself (it is reached over loopback: no rail to pick). Where
    nothing local is (routed rails), the ordered pair keeps its local rail
    only when the kernel's route to the remote address already leaves by
    that rail's netdev; otherwise the kernel chooses. Pairs that come out
    the same (more local rails than remote ones on a subnet) are listed
    once: a group of connections per pair, never two to one endpoint from
    one source."""
    if not local or not remote:
        return []
    own = {str(ipaddress.ip_interface(a).ip) for a in networks}
    routes: dict[str, str | None] = {}

    def leaves_by(ip: str) -> str | None:
        if route is None:
            return None
        if ip not in routes:
            routes[ip] = route(ip)
        return routes[ip]

    out: list[tuple[int | None, int]] = []
    for li, ri in match_rails([str(i) for i in range(len(local))], [str(j) for j in range(len(remote))]):
        i, j = int(li), int(ri)
        ip = str(ipaddress.ip_address(remote[j]))
        near = [k for k, a in enumerate(local) if on_subnet(ip, a)]
        if ip in own:
            out.append((None, j))
        elif near:
            out.append((i if i in near else near[j % len(near)], j))
        elif any(on_subnet(ip, a) for a in networks):
            out.append((None, j))
        else:
            nic = nics[i] if i < len(nics) else ""
            same_family = ipaddress.ip_interface(local[i]).ip.version == ipaddress.ip_address(ip).version
            out.append((i if same_family and nic and leaves_by(ip) == nic else None, j))
    return list(dict.fromkeys(out))
