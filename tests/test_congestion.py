"""The tcp data connections' congestion control (kvflow.providers.congestion):
the option is checked; every data connection of two real engines (both
ends, read from the kernel through this process's own descriptors) uses
what was asked; "auto" never leaves a pacing algorithm on a connection
within this host; and a connection between two hosts (network namespaces
joined by a veth pair) keeps the host's algorithm in either direction."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid

import numpy as np
import pytest

import kvflow
from kvflow.providers import congestion as cc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import faults  # noqa: E402

HOST_DEFAULT = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()


def test_the_option_is_checked(monkeypatch):
    for bad in ("", 3, None, "no-such-algorithm"):
        with pytest.raises(kvflow.InvalidArgumentError, match="tcp_congestion"):
            cc.check_congestion(bad)
    with pytest.raises(kvflow.InvalidArgumentError, match="not offered"):
        kvflow.Engine(tcp_congestion="no-such-algorithm")
    monkeypatch.setenv("KVFLOW_TCP_CONGESTION", "no-such-algorithm")
    with pytest.raises(kvflow.InvalidArgumentError, match="tcp_congestion"):
        kvflow.Engine()
    monkeypatch.setenv("KVFLOW_TCP_CONGESTION", "system")
    kvflow.Engine()
    for good in ("auto", "system", "reno"):
        assert cc.check_congestion(good) == good


def data_sockets(port: int) -> list[tuple[str, str]]:
    """(which end, algorithm) of every TCP socket of this process with
    `port` at one end: the target's accepted ones and the initiator's."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                local, peer = s.getsockname()[1], s.getpeername()[1]
            except OSError:
                continue                        # a listener
            if port in (local, peer):
                found.append(("target" if local == port else "initiator", cc.current(s)))
        finally:
            s.close()
    return found


@pytest.mark.parametrize("choice", ["reno", "system", "auto"])
async def test_every_data_connection_uses_the_choice(choice):
    async with kvflow.Engine(protocols=["tcp"], tcp_congestion=choice) as a, \
            kvflow.Engine(protocols=["tcp"], tcp_congestion=choice) as b:
        src = np.arange(1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, np.uint8)
        rs = a.register(src)
        b.register(dst, name="dst", access=kvflow.Access.WRITE)
        peer = await asyncio.wait_for(a.connect(b.address), 10)
        rd = peer.region("dst")
        offs = np.arange(16, dtype=np.uint64) * 65536
        await asyncio.wait_for(peer.write(rs.addr + offs, rd.addr + offs, np.full(16, 65536, np.uint64)), 10)
        assert np.array_equal(dst, src)
        got = data_sockets(int(b.data_address.rsplit(":", 1)[1]))
        # both ends of the ack connection and of every data connection
        ends = {end for end, _ in got}
        assert ends == {"initiator", "target"} and len(got) >= 2 * 3, got
        algorithms = {name for _, name in got}
        if choice == "reno":
            assert algorithms == {"reno"}, got
        elif choice == "system":
            assert algorithms == {HOST_DEFAULT}, got
        else:
            assert not any(n.startswith(cc.PACING_PREFIX) for n in algorithms), got
            if not HOST_DEFAULT.startswith(cc.PACING_PREFIX):
                assert algorithms == {HOST_DEFAULT}, got


def test_a_route_to_this_host_stays_here():
    assert cc.route_stays_here("127.0.0.1", 80)
    assert cc.route_stays_here("::1", 80) or not socket.has_ipv6
    # an address no interface here has (TEST-NET-3): the route leaves
    assert not cc.route_stays_here("203.0.113.9", 80)


NETNS_WHY = faults.netns_unavailable()


@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair:
    (its name, this end's address, its address)."""
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"kvfcc{tag}", f"kvcca{tag}", f"kvccb{tag}"
    mine, theirs = "198.18.77.1", "198.18.77.2"
    cmds = [("netns", "add", ns), ("link", "add", here, "type", "veth", "peer", "name", there),
            ("link", "set", there, "netns", ns), ("addr", "add", f"{mine}/30", "dev", here),
            ("link", "set", here, "up"), ("-n", ns, "addr", "add", f"{theirs}/30", "dev", there),
            ("-n", ns, "link", "set", there, "up"), ("-n", ns, "link", "set", "lo", "up")]
    try:
        for c in cmds:
            subprocess.run(["ip", *c], check=True, capture_output=True, text=True)
        yield ns, mine, theirs
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(NETNS_WHY is not None, reason=NETNS_WHY or "")
def test_between_hosts_auto_keeps_the_host_algorithm(other_host):
    ns, mine, theirs = other_host
    # accepted from the other host: the listener's unpaced start is undone
    ls = socket.socket()
    host_cc = cc.listener(ls, cc.AUTO)
    ls.bind((mine, 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    client = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c",
         f"import socket; s = socket.create_connection(({mine!r}, {port}), 10); s.recv(1)"])
    try:
        ls.settimeout(10)
        conn, _ = ls.accept()
        assert not cc.within_host(conn)
        cc.accepted(conn, host_cc)
        assert cc.current(conn) == HOST_DEFAULT
        conn.close()
    finally:
        ls.close()
        client.wait(10)
    # connecting to the other host: left as it is
    serve = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c",
         "import socket, sys; l = socket.socket(); l.bind(('0.0.0.0', 0)); l.listen(1); "
         "print(l.getsockname()[1], flush=True); c, _ = l.accept(); c.recv(1)"],
        stdout=subprocess.PIPE, text=True)
    try:
        their_port = int(serve.stdout.readline())
        s = socket.socket()
        cc.before_connect(s, theirs, their_port, cc.AUTO)
        s.settimeout(10)
        s.connect((theirs, their_port))
        assert not cc.route_stays_here(theirs, their_port)
        assert cc.current(s) == HOST_DEFAULT
        s.close()
    finally:
        serve.wait(10)


def test_within_host_auto_starts_unpaced():
    """Loopback: a listener's connections and a connecting socket start
    without pacing where the host's algorithm paces (else keep it)."""
    ls = socket.socket()
    host_cc = cc.listener(ls, cc.AUTO)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    s = socket.socket()
    cc.before_connect(s, "127.0.0.1", ls.getsockname()[1], cc.AUTO)
    s.connect(ls.getsockname())
    conn, _ = ls.accept()
    cc.accepted(conn, host_cc)
    try:
        for sock in (s, conn):
            name = cc.current(sock)
            if HOST_DEFAULT.startswith(cc.PACING_PREFIX):
                assert name in cc.UNPACED, name
            else:
                assert name == HOST_DEFAULT
    finally:
        for sock in (s, conn, ls):
            sock.close()
