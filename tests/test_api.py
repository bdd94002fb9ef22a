"""The public surface of kvflow: names, exceptions, features, register(), Region,
Engine lifecycle, keyword-only arguments. Transfers here use in-process tcp."""

from __future__ import annotations

import asyncio
import ctypes
import enum
import os
import subprocess
import sys

import numpy as np
import pytest

import kvflow
from _batches import KiB, bounded, sha256
from _target import pattern

# Every name the contract (docs/api-contract.md) puts in the kvflow namespace.
CONTRACT_NAMES = {
    "features",
    "Access",
    "Engine",
    "Transfer",
    "Priority",
    "Blocks",
    "Prepared",
    "KVFlowError",
    "LengthMismatchError",
    "InvalidArgumentError",
    "UnregisteredMemoryError",
    "RemoteAccessError",
    "PeerUnreachableError",
    "PeerLostError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "ProtocolError",
    "AuthenticationError",
}
# Types the contract names in passing; exporting them is allowed, not required.
OPTIONAL_NAMES = {"Region", "RemoteRegion", "Peer", "ProviderUnavailableError", "RegionBusyError", "RelayGroup",
                  "__version__"}

ERRORS = [
    "InvalidArgumentError",
    "UnregisteredMemoryError",
    "RemoteAccessError",
    "PeerUnreachableError",
    "PeerLostError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "ProtocolError",
    "AuthenticationError",
    "LengthMismatchError",
]


# ---------------------------------------------------------------- namespace


def test_contract_names_present():
    missing = sorted(n for n in CONTRACT_NAMES if not hasattr(kvflow, n))
    assert not missing, f"kvflow lacks {missing}"


def test_exported_names_guard():
    """__all__ is exactly the contract's names (plus the optional ones): adding a
    public name is a decision, made by editing this list."""
    assert hasattr(kvflow, "__all__"), "kvflow should define __all__"
    exported = set(kvflow.__all__)
    assert len(exported) == len(kvflow.__all__), "duplicates in __all__"
    for name in exported:
        assert hasattr(kvflow, name), f"__all__ names {name!r}, which does not exist"
    assert CONTRACT_NAMES <= exported, f"not exported: {sorted(CONTRACT_NAMES - exported)}"
    extra = exported - CONTRACT_NAMES - OPTIONAL_NAMES
    assert not extra, f"exported beyond the contract: {sorted(extra)}"


@pytest.mark.parametrize("name", ERRORS)
def test_exception_hierarchy(name):
    cls = getattr(kvflow, name)
    assert isinstance(cls, type) and issubclass(cls, kvflow.KVFlowError)
    assert issubclass(kvflow.KVFlowError, Exception)


def test_exception_special_bases():
    assert issubclass(kvflow.TransferTimeoutError, TimeoutError)
    assert issubclass(kvflow.InvalidArgumentError, ValueError)
    # one tree: none of the others is a ValueError/TimeoutError by accident of mixing
    assert not issubclass(kvflow.PeerLostError, ValueError)


def test_every_exception_is_in_the_tree():
    """Every exception class kvflow.errors defines, VerbsError included, is
    a KVFlowError; the verbs module raises that very class."""
    import inspect
    import kvflow.errors as errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert len(classes) >= 12
    assert all(issubclass(c, kvflow.KVFlowError) for c in classes), classes
    assert issubclass(errors.VerbsError, OSError)        # it was an OSError before it joined
    e = errors.VerbsError(12, "rxe0: cannot register 4096 bytes")
    assert e.errno == 12 and str(e) == "rxe0: cannot register 4096 bytes"
    assert errors.VerbsError("rxe0: no such device").errno is None
    if kvflow.features["verbs"]:
        from kvflow import _verbs
        assert _verbs.VerbsError is errors.VerbsError


def test_features():
    f = kvflow.features
    assert isinstance(f, dict)
    assert set(f) == {"tcp", "local", "verbs", "rdma", "cuda", "debug"}, sorted(f)
    assert f["rdma"] == f["verbs"]
    assert all(isinstance(v, bool) for v in f.values()), f
    assert f["tcp"] is True and f["local"] is True


def test_access_flags():
    A = kvflow.Access
    assert issubclass(A, enum.IntFlag)
    assert int(A.READ) == 1 and int(A.WRITE) == 2
    assert int(A.READ | A.WRITE) == 3


def test_import_is_light():
    """``import kvflow`` pulls in nothing heavy (STYLE rule 12)."""
    code = "import sys, kvflow; print(','.join(m for m in ('torch', 'cupy', 'pycuda', 'tensorflow', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import kvflow imported {out.stdout.strip()}"


def test_py_typed():
    assert os.path.exists(os.path.join(os.path.dirname(kvflow.__file__), "py.typed"))


# ---------------------------------------------------------------- register()


class ArrayInterfaceOnly:
    """Exposes memory only through __array_interface__ (like many GPU/CPU libs)."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr
        self.__array_interface__ = arr.__array_interface__


class TensorWithNbytes:
    def __init__(self, arr: np.ndarray):
        self._arr = arr
        self.nbytes = arr.nbytes

    def data_ptr(self) -> int:
        return int(self._arr.ctypes.data)


class TensorWithNumel:
    """torch.Tensor's shape of API: data_ptr(), numel(), element_size(); no nbytes."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def data_ptr(self) -> int:
        return int(self._arr.ctypes.data)

    def numel(self) -> int:
        return int(self._arr.size)

    def element_size(self) -> int:
        return int(self._arr.itemsize)


def _buffer_address(obj) -> int:
    return ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj))


def _make_buffer(kind: str, n: int):
    """(object to register, expected addr, expected length, numpy view of the memory)."""
    if kind == "numpy-u8":
        a = np.zeros(n, np.uint8)
        return a, a.ctypes.data, n, a
    if kind == "numpy-f32-2d":
        a = np.zeros((n // 16, 4), np.float32)
        return a, a.ctypes.data, a.nbytes, a.view(np.uint8).reshape(-1)
    if kind == "bytearray":
        b = bytearray(n)
        return b, _buffer_address(b), n, np.frombuffer(b, np.uint8)
    if kind == "memoryview":
        b = bytearray(n)
        return memoryview(b), _buffer_address(b), n, np.frombuffer(b, np.uint8)
    if kind == "memoryview-slice":
        b = bytearray(n + 10)
        return memoryview(b)[5 : n + 5], _buffer_address(b) + 5, n, np.frombuffer(b, np.uint8)[5 : n + 5]
    if kind == "array-interface":
        a = np.zeros(n, np.uint8)
        return ArrayInterfaceOnly(a), a.ctypes.data, n, a
    if kind == "data_ptr+nbytes":
        a = np.zeros(n // 8, np.float64)
        return TensorWithNbytes(a), a.ctypes.data, a.nbytes, a.view(np.uint8)
    if kind == "data_ptr+numel":
        a = np.zeros(n // 2, np.float16)
        return TensorWithNumel(a), a.ctypes.data, a.nbytes, a.view(np.uint8)
    if kind == "ptr-tuple":
        a = np.zeros(n, np.uint8)
        return (int(a.ctypes.data) + 1, n - 1), a.ctypes.data + 1, n - 1, a[1:]
    raise AssertionError(kind)


BUFFER_KINDS = [
    "numpy-u8",
    "numpy-f32-2d",
    "bytearray",
    "memoryview",
    "memoryview-slice",
    "array-interface",
    "data_ptr+nbytes",
    "data_ptr+numel",
    "ptr-tuple",
]


@pytest.mark.parametrize("kind", BUFFER_KINDS)
async def test_register_buffer_kinds(kind, make_engine, make_target):
    """register() finds the right address and length for each kind of buffer,
    and a transfer through the region moves the right bytes both ways."""
    eng = await make_engine()
    target = await make_target()
    obj, addr, length, mem = _make_buffer(kind, 64 * KiB)
    region = eng.register(obj, name=f"buf-{kind}")
    assert int(region.addr) == int(addr)
    assert int(region.length) == int(length)
    assert region.name == f"buf-{kind}"
    assert region.access == kvflow.Access.READ | kvflow.Access.WRITE

    peer = await bounded(eng.connect(target.address))
    mem[:] = pattern(1, len(mem))
    await bounded(peer.write([region.addr], [target.raddr("rw", 3)], [region.length]))
    assert await bounded(target.sha("rw", 3, length)) == sha256(mem)
    await bounded(target.fill("rw", 2))
    await bounded(peer.read([region.addr], [target.raddr("rw")], [region.length]))
    assert np.array_equal(mem, pattern(2, target.regions["rw"].length)[:length])
    eng.deregister(region)
    del obj


@pytest.mark.parametrize(
    "kind",
    ["non-contiguous", "readonly-memoryview", "bytes", "int", "str", "object", "negative-tuple", "none"],
)
async def test_register_rejects_bad_buffers(kind, make_engine):
    eng = await make_engine()
    backing = np.zeros(4096, np.uint8)
    bad = {
        "non-contiguous": backing[::2],
        "readonly-memoryview": memoryview(b"immutable bytes"),
        "bytes": b"immutable bytes",
        "int": 12345,
        "str": "not a buffer",
        "object": object(),
        "negative-tuple": (int(backing.ctypes.data), -1),
        "none": None,
    }[kind]
    with pytest.raises(kvflow.InvalidArgumentError):
        eng.register(bad)


class _CudaArrayInterface:
    """What CuPy/Numba device arrays expose (the pointer is never touched)."""

    __cuda_array_interface__ = {"data": (0x7F0000000000, False), "shape": (4096,), "typestr": "|u1",
                                "version": 3}


class _DlpackDevice:
    """A DLPack producer on a CUDA device (kDLCUDA = 2)."""

    def __dlpack_device__(self):
        return (2, 0)

    def data_ptr(self):
        return 0x7F0000000000

    nbytes = 4096


@pytest.mark.parametrize("kind", ["cuda-array-interface", "dlpack-cuda"])
async def test_register_device_memory_without_cuda(kind, make_engine):
    """GPU memory where CUDA is not usable (no driver: these machines) would
    crash the CPU copy paths: refused with a typed error that says why, and
    the engine stays usable. (With a GPU, tests/test_cuda.py registers it.)"""
    import kvflow.cuda
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here: tests/test_cuda.py registers GPU memory")
    bad = _CudaArrayInterface() if kind == "cuda-array-interface" else _DlpackDevice()
    eng = await make_engine()
    with pytest.raises(kvflow.ProviderUnavailableError, match="CUDA is not usable here"):
        eng.register(bad)
    ok = eng.register(np.zeros(4096, np.uint8))
    eng.deregister(ok)


async def test_register_other_device_memory_refused(make_engine):
    """Memory on a device that is neither host nor CUDA (a DLPack ROCm array,
    kDLROCM = 10) is refused as such."""
    class Rocm(_DlpackDevice):
        def __dlpack_device__(self):
            return (10, 0)
    eng = await make_engine()
    with pytest.raises(kvflow.InvalidArgumentError, match="host and CUDA memory only"):
        eng.register(Rocm())


async def test_region_fields_and_access(make_engine):
    eng = await make_engine()
    a = np.zeros(1000, np.uint8)
    r = eng.register(a, name="ro-region", access=kvflow.Access.READ)
    assert (int(r.addr), int(r.length), r.name, r.access) == (a.ctypes.data, 1000, "ro-region", kvflow.Access.READ)
    r2 = eng.register(np.zeros(10, np.uint8))
    assert r2.name is None or isinstance(r2.name, str)
    assert r2.access == kvflow.Access.READ | kvflow.Access.WRITE
    eng.deregister(r)
    eng.deregister(r2)


async def test_deregister_then_register_again(make_engine, make_target):
    eng = await make_engine()
    target = await make_target()
    peer = await bounded(eng.connect(target.address))
    a = np.arange(4096, dtype=np.uint32).view(np.uint8)
    r = eng.register(a)
    eng.deregister(r)
    with pytest.raises(kvflow.UnregisteredMemoryError):
        await bounded(peer.write([a.ctypes.data], [target.raddr("rw")], [a.nbytes]))
    r = eng.register(a, name="again")
    await bounded(peer.write([r.addr], [target.raddr("rw")], [r.length]))
    assert await bounded(target.sha("rw", 0, a.nbytes)) == sha256(a)


async def test_region_names_visible_to_peer(make_engine, make_target):
    eng = await make_engine()
    target = await make_target()
    peer = await bounded(eng.connect(target.address))
    r = peer.region("ro")
    assert r.name == "ro"
    assert r.access == kvflow.Access.READ
    assert isinstance(peer.regions, list)


# ---------------------------------------------------------------- Engine lifecycle


async def test_engine_context_manager_and_address():
    eng = kvflow.Engine(listen="127.0.0.1:0", protocols=("tcp",))
    async with eng:
        host, port = eng.address.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        assert eng.address in repr(eng)
    # close() again after the context manager closed it: a no-op
    await bounded(eng.close())


async def test_start_close_idempotent_close():
    eng = kvflow.Engine(listen="127.0.0.1:0")
    await bounded(eng.start())
    await bounded(eng.close())
    await bounded(eng.close())


async def test_closed_engine_releases_port():
    eng = kvflow.Engine(listen="127.0.0.1:0", protocols=("tcp",))
    async with eng:
        address = eng.address
    other = kvflow.Engine(listen="127.0.0.1:0", protocols=("tcp",))
    async with other:
        with pytest.raises(kvflow.PeerUnreachableError):
            await bounded(other.connect(address, timeout=5.0))


async def test_auto_protocol_same_process(make_engine, make_target):
    eng = await make_engine(protocols="auto")
    target = await make_target(protocols="auto")
    peer = await bounded(eng.connect(target.address))
    assert peer.transport == "local"
    assert target.address in repr(peer)


async def test_auto_protocol_other_process(make_engine, make_target):
    from _providers import xproc_vm_probe

    eng = await make_engine(protocols="auto")
    target = await make_target(protocols="auto", xproc=True)
    peer = await bounded(eng.connect(target.address))
    assert peer.transport == ("local" if xproc_vm_probe()[0] else "tcp")


async def test_unknown_protocol_rejected():
    with pytest.raises((ValueError, kvflow.KVFlowError)):
        eng = kvflow.Engine(listen="127.0.0.1:0", protocols=("carrier-pigeon",))
        await bounded(eng.start())
        await bounded(eng.close())


async def test_keyword_only_arguments(make_engine, make_target):
    eng = await make_engine()
    target = await make_target()
    with pytest.raises(TypeError):
        kvflow.Engine("127.0.0.1:0", ("tcp",))
    with pytest.raises(TypeError):
        await eng.connect(target.address, 5.0)
    peer = await bounded(eng.connect(target.address))
    a = np.zeros(16, np.uint8)
    r = eng.register(a)
    with pytest.raises(TypeError):
        await peer.write([r.addr], [target.raddr("rw")], [16], 5.0)
    with pytest.raises(TypeError):
        await peer.read([r.addr], [target.raddr("rw")], [16], 5.0)
    with pytest.raises(TypeError):
        eng.register(a, "name")


async def test_transfer_object(make_engine, make_target):
    eng = await make_engine()
    target = await make_target()
    peer = await bounded(eng.connect(target.address))
    a = np.ones(100 * KiB, np.uint8)
    r = eng.register(a)
    t = peer.write_nowait([r.addr, r.addr + 10], [target.raddr("rw"), target.raddr("rw", 50 * KiB)], [10, 40 * KiB])
    assert isinstance(t, kvflow.Transfer)
    assert t.nbytes == 10 + 40 * KiB
    assert await bounded(t) is None
    assert t.done()


def test_tcp_busy_poll_is_validated(monkeypatch):
    for bad in (-1e-6, 0.5, True, "50us", float("nan")):
        with pytest.raises(kvflow.InvalidArgumentError, match="tcp_busy_poll"):
            kvflow.Engine(tcp_busy_poll=bad)
    monkeypatch.setenv("KVFLOW_TCP_BUSY_POLL", "0.02")
    with pytest.raises(kvflow.InvalidArgumentError, match="tcp_busy_poll"):
        kvflow.Engine()
    monkeypatch.setenv("KVFLOW_TCP_BUSY_POLL", "0")
    kvflow.Engine()
    kvflow.Engine(tcp_busy_poll=0.001)


@pytest.mark.parametrize("busy_poll", [0, 0.002])
async def test_tcp_moves_bytes_with_and_without_busy_poll(busy_poll):
    """The target's serving thread either sleeps at once or looks again for
    2 ms first: the bytes land either way, one small write after another."""
    async with kvflow.Engine(protocols=["tcp"], tcp_busy_poll=busy_poll) as a, \
            kvflow.Engine(protocols=["tcp"], tcp_busy_poll=busy_poll) as b:
        src = np.arange(1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, np.uint8)
        rs = a.register(src)
        b.register(dst, name="dst", access=kvflow.Access.WRITE)
        peer = await asyncio.wait_for(a.connect(b.address), 10)
        rd = peer.region("dst")
        for i in range(16):
            await asyncio.wait_for(peer.write([rs.addr + i * 4096], [rd.addr + i * 4096], [4096]), 10)
            await asyncio.sleep(0.003 if i % 4 == 0 else 0)      # sometimes past the busy poll
        assert np.array_equal(dst, src)
