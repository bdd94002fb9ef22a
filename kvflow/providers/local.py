"""The local provider: memcpy between engines of one process, cross-memory
attach (process_vm_writev/readv) between processes of one host.

A peer on this host proves that this process may use process_vm_readv on
it when this side reads its probe cookie back (the kernel's ptrace rules:
Yama, seccomp and containers decide); an engine of this very process is
recognised from this process's own registry of engines, never from what a
descriptor claims.

Every copy enters the target engine's region fence first (kvflow/_native/
fence.h): a record of its live regions, and of the copies in progress,
that deregister() on the target waits on, so nothing is copied into or out
of a region after its deregister() returned, whether the copy was queued
here or this side's table was stale. A peer in another process maps the
target's record (a memfd) through /proc/<pid>/fd; one that cannot is not
reached over this provider."""
from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

from kvflow import _core
from kvflow.control.descriptor import Descriptor
from kvflow.errors import ProviderUnavailableError
from kvflow.providers.base import Caps, PeerLink, Provider, ProviderContext

__all__ = ["LocalProvider", "process_identity"]


def _host_identity() -> str:
    """Same string on two engines iff they share a kernel and a pid namespace
    (so that a pid names the same process for process_vm_writev)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


class _ProcessIdentity:
    """Per-process token and a probe cookie in this process's memory: a peer
    on the same host proves it may use process_vm_readv on us by reading the
    cookie back."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = os.urandom(16)
        self.cookie = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        self.host = _host_identity()

    @property
    def probe_addr(self) -> int:
        return int(self.cookie.__array_interface__["data"][0])


_identity: _ProcessIdentity | None = None


def process_identity() -> _ProcessIdentity:
    global _identity
    if _identity is None or _identity.pid != os.getpid():   # new after fork
        _identity = _ProcessIdentity()
    return _identity


class LocalProvider(Provider):
    """Same host: one worker pool per engine copies with memcpy (same
    process) or process_vm_writev/readv; a batch up to `inline_limit`
    bytes is copied in the caller's thread."""

    name = "local"
    caps = Caps(remote=False, same_host=True, detached=True, lifeline=True)
    # memcpy or cross-memory attach of cached memory, for estimate()
    LATENCY_S = 2e-6
    BYTES_PER_S = 8e9

    def __init__(self, ctx: ProviderContext, *, inline_limit: int) -> None:
        self.ctx = ctx
        self.inline_limit = inline_limit

    def describe(self) -> dict[str, Any]:
        ident = process_identity()
        return {"host": ident.host, "pid": ident.pid, "process": ident.token,
                "probe_addr": ident.probe_addr, "probe_cookie": ident.cookie.tobytes()}

    def reaches(self, address: str, remote: Descriptor) -> str | None:
        ident = process_identity()
        if remote.host != ident.host:
            return "the peer is on another host"
        if self.ctx.same_process(address, remote):
            return None
        if remote.pid == ident.pid:
            return "the peer claims this process's pid but is not one of its engines"
        got = _core.probe_process(remote.pid, remote.probe_addr, len(remote.probe_cookie))
        if got != remote.probe_cookie:
            return (f"process_vm_readv on pid {remote.pid} not permitted ({os.strerror(got)})"
                    if isinstance(got, int) else "cross-memory probe mismatch")
        err = _core.fence_probe(remote.pid, remote.incarnation)
        if err:
            return f"the region fence of pid {remote.pid} cannot be attached ({os.strerror(err)})"
        return None

    async def connect(self, link: PeerLink, remote: Descriptor, token: bytes) -> Any:
        if self.ctx.same_process(link.address, remote):
            target = self.ctx.process_core(link.address)
            try:
                if target is None:
                    raise RuntimeError("closed")
                return _core.LocalChannel(self.ctx.core, link.table, link.address, 0, self.inline_limit, target)
            except RuntimeError:       # its core closed meanwhile
                raise ProviderUnavailableError(f"the engine at {link.address} closed", peer=link.address) from None
        try:
            return _core.LocalChannel(self.ctx.core, link.table, link.address, remote.pid, self.inline_limit,
                                      None, remote.incarnation)
        except OSError as e:
            raise ProviderUnavailableError(f"{link.address}: {e.strerror}", peer=link.address,
                                           errno=e.errno) from None

    def estimate(self, nbytes: int, entries: int) -> float:
        return self.LATENCY_S + nbytes / self.BYTES_PER_S
