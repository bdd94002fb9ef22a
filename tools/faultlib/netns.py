"""The fault suite's network: namespace hosts joined by a control
network and two rails (bridges, veth links) that go down, lose packets or are shaped."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time



SUBNETS = ("198.19.20", "198.19.21", "198.19.22")     # control, rail 0, rail 1


# ------------------------------------------------------------------ namespace
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `ip ARGS`; with `check`, a failure raises RuntimeError naming
    the command and saying what ip said (its stderr)."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None: tries, in a namespace
    of its own (deleted with all in it), each kind of thing Topology.up()
    creates: a namespace, a bridge, a veth pair."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"kvfprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        for what, args in (("bridge", ("link", "add", "kvfbr", "type", "bridge")),
                           ("veth pair", ("link", "add", "kvfa", "type", "veth", "peer", "name", "kvfb"))):
            r = _ip("-n", name, *args, check=False)
            if r.returncode:
                return f"cannot create a {what}: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


class Topology:
    """Hosts as network namespaces, joined with this host by three networks
    (control, rail 0, rail 1), each a bridge in a switch namespace of its
    own (so this host's firewall never sees their traffic). This host is .1
    on every network, namespace host k is .(k+2); inside a namespace the
    links are called ctl, rail0, rail1 (as on identical machines)."""

    LINKS = ("ctl", "rail0", "rail1")

    def __init__(self, hosts: int = 2, tag: str | None = None) -> None:
        # names carry a tag (default: this process's) so that two
        # topologies, or two runs, never remove each other's
        tag = tag or f"{os.getpid() % 100000}"
        self.switch = f"kvfs{tag}"
        self.hosts = [f"kvff{tag}" if k == 0 else f"kvff{tag}n{k}" for k in range(hosts)]
        self.ns = self.hosts[0]
        self.links = [f"kv{tag}{c}" for c in "cab"]                 # this host's links

    def host(self, i: int) -> str:
        return f"{SUBNETS[i]}.1"

    def target(self, i: int, host: int = 0) -> str:
        return f"{SUBNETS[i]}.{host + 2}"

    def up(self) -> "Topology":
        """Creates it (after removing what a previous run left); on a
        failure removes what it created and raises RuntimeError (what ip
        said)."""
        self.down()
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    def _create(self) -> None:
        for ns in (self.switch, *self.hosts):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i in range(3):
            _ip("-n", self.switch, "link", "add", f"br{i}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br{i}", "up")
            _ip("link", "add", self.links[i], "type", "veth", "peer", "name", f"h{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"h{i}", "master", f"br{i}", "up")
            _ip("addr", "add", f"{self.host(i)}/24", "dev", self.links[i])
            _ip("link", "set", self.links[i], "up")
            for k, ns in enumerate(self.hosts):
                _ip("-n", self.switch, "link", "add", f"p{k}x{i}", "type", "veth", "peer", "name", self.LINKS[i],
                    "netns", ns)
                _ip("-n", self.switch, "link", "set", f"p{k}x{i}", "master", f"br{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.target(i, k)}/24", "dev", self.LINKS[i])
                _ip("-n", ns, "link", "set", self.LINKS[i], "up")

    async def set_rail(self, rail: int, up: bool, host: int = 0) -> float:
        """Takes rail `rail` of namespace host `host` down or up (its switch
        port: the host sees its link lose carrier), without blocking the
        event loop (the engine under test shares it). Returns how long `ip`
        took."""
        return await self.set_link(1 + rail, up, host)

    async def set_link(self, link: int, up: bool, host: int = 0) -> float:
        """set_rail() for any of a host's links (0 is its control link)."""
        t0 = time.monotonic()
        port = f"p{host}x{link}"
        p = await asyncio.create_subprocess_exec("ip", "-n", self.switch, "link", "set", port,
                                                 "up" if up else "down", stderr=asyncio.subprocess.PIPE)
        _, err = await p.communicate()
        if p.returncode:
            raise RuntimeError(f"ip -n {self.switch} link set {port} failed: {err.decode().strip()}")
        return time.monotonic() - t0

    async def netem(self, rail: int, spec: str | None) -> None:
        """Puts netem (`spec`, e.g. "loss 1% delay 5ms") on both ends of a
        rail between this host and host 0, or removes it (None)."""
        for where, dev in (([], self.links[1 + rail]), (["-n", self.ns], self.LINKS[1 + rail])):
            args = ["tc", *where, "qdisc", "replace" if spec else "del", "dev", dev, "root"]
            if spec:
                args += ["netem", *spec.split()]
            p = await asyncio.create_subprocess_exec(*args, stderr=asyncio.subprocess.PIPE)
            _, err = await p.communicate()
            if p.returncode and spec:
                raise RuntimeError(f"{' '.join(args)}: {err.decode().strip()}")

    def down(self) -> None:
        for a in self.links:
            _ip("link", "del", a, check=False)
        for ns in (*self.hosts, self.switch):
            _ip("netns", "del", ns, check=False)


def _tc(*args: str, check: bool = True) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"tc {' '.join(args)} failed: {r.stderr.strip()}")


NETEM = "loss 1% delay 5ms"


def netem_unavailable() -> str | None:
    """Why netem cannot be used here, or None (tries it on a veth link)."""
    if shutil.which("tc") is None:
        return "needs tc (iproute2)"
    name = f"kvfq{os.getpid() % 100000}"
    if _ip("link", "add", name, "type", "veth", "peer", "name", name + "p", check=False).returncode:
        return "cannot create a veth pair"
    try:
        r = subprocess.run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
        return None if r.returncode == 0 else f"no netem qdisc in this kernel ({r.stderr.strip()})"
    finally:
        _ip("link", "del", name, check=False)
