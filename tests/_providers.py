"""The one list of providers every suite runs over, and when each skips.

``PROVIDERS`` names each variant a test may run on (a provider, and whether
the target engine lives in a child process); ``params(...)`` makes the
pytest parameters (rdma ones marked ``rdma``); ``skip_unavailable`` skips
with the reason a variant cannot run here (not built, no RDMA device,
cross-memory attach not permitted).
"""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
from functools import lru_cache

import pytest


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    protocol: str  # what the engines are restricted to, and what peer.transport must say
    xproc: bool  # target Engine in a child process

    @property
    def protocols(self) -> tuple[str, ...]:
        return (self.protocol,)


PROVIDERS = {
    "tcp": Provider("tcp", "tcp", False),
    "local": Provider("local", "local", False),
    "local-xproc": Provider("local-xproc", "local", True),
    "tcp-xproc": Provider("tcp-xproc", "tcp", True),
    "rdma": Provider("rdma", "rdma", False),
    "rdma-xproc": Provider("rdma-xproc", "rdma", True),
}
# one of each provider, in one process: what suites that make their own engines run over
PROTOCOLS = ("local", "tcp", "rdma")


def param(name: str):
    return pytest.param(name, id=name, marks=[pytest.mark.rdma] if PROVIDERS[name].protocol == "rdma" else [])


def params(*names: str) -> list:
    return [param(n) for n in names]


@lru_cache(maxsize=None)
def rdma_devices() -> list[str]:
    from kvflow.providers.rdma import provider as rdma

    return rdma.device_names()


def skip_unavailable(p: Provider | str) -> None:
    """Skips the test (with the reason) when variant `p` cannot run here."""
    import kvflow

    p = PROVIDERS[p] if isinstance(p, str) else p
    if not kvflow.features.get(p.protocol, False):
        pytest.skip(f"kvflow built without the {p.protocol!r} provider")
    if p.protocol == "rdma" and not rdma_devices():
        pytest.skip("no RDMA device on this host (the rdma suite runs in the Soft-RoCE VM: "
                    "tests/test_rdma_vm.py, or python3 tools/rdma_vm.py -- python3 -m pytest -m rdma)")
    if p.xproc and p.protocol == "local":
        ok, why = xproc_vm_probe()
        if not ok:
            pytest.skip(why)


@lru_cache(maxsize=None)
def xproc_vm_probe() -> tuple[bool, str]:
    """Can this process process_vm_readv from a child? (seccomp, Yama, containers)."""
    code = (
        "import ctypes,sys\n"
        "b=ctypes.create_string_buffer(b'kvflow-probe',16)\n"
        "print(ctypes.addressof(b),flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        addr = int(proc.stdout.readline())

        class iovec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        libc = ctypes.CDLL(None, use_errno=True)
        dst = ctypes.create_string_buffer(16)
        local = iovec(ctypes.addressof(dst), 12)
        remote = iovec(addr, 12)
        n = libc.process_vm_readv(proc.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n != 12 or dst.raw[:12] != b"kvflow-probe":
            return False, f"process_vm_readv from a child failed: errno {ctypes.get_errno()}"
        return True, ""
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


# The balance rules (what must be zero once an engine is closed, STYLE rule
# 7; what must be zero while it is idle) are kvflow._testing's, shipped so
# that users' tests check the same.
from kvflow._testing import CLOSED_ZERO, IDLE_ZERO, closed_leaks  # noqa: E402,F401
