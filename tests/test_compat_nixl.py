"""kvflow.compat.nixl: NIXL's Python API on kvflow. NIXL's own tests and
examples run in tests/test_upstream_nixl.py; these check what they leave
out: every byte, both directions, bad input (typed NIXL errors, nothing
moved, the agent still usable), notifications after the data, prepared
lists by index, reposts, release while in flight, and telemetry numbers."""
from __future__ import annotations

import ctypes
import gc
import pickle
import socket
import time
import uuid

import numpy as np
import pytest

from kvflow.compat.nixl import _bindings as B
from kvflow.compat.nixl import nixl_agent, nixl_agent_config

MiB = 1 << 20


def wait_state(agent, handle, timeout=30.0):
    deadline = time.monotonic() + timeout
    while (st := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "the transfer did not finish"
        time.sleep(0.0005)
    return st


@pytest.fixture
def pair():
    a = nixl_agent(f"a-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent(f"b-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    src = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    ra = a.register_memory([(src.ctypes.data, src.nbytes, 0, "src")], "DRAM")
    rb = b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "dst")], "DRAM")
    assert ra is not None and rb is not None
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    assert b.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
    return a, b, src, dst


def descs(agent, base, offsets, length):
    return agent.get_xfer_descs([(base + o, length, 0) for o in offsets], "DRAM")


def test_write_read_and_notification_after_the_data(pair):
    a, b, src, dst = pair
    offs = [0, 3 * 65536 + 7, MiB + 1, 3 * MiB]
    h = a.initialize_xfer("WRITE", descs(a, src.ctypes.data, offs, 65536),
                          descs(a, dst.ctypes.data, offs, 65536), b.name, b"layer-0")
    assert a.transfer(h) in ("PROC", "DONE")
    # the notification arrives only once the data is there
    deadline = time.monotonic() + 30
    while not b.check_remote_xfer_done(a.name.encode(), b"layer-"):     # the bytes name add_remote_agent gives
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    for o in offs:
        assert np.array_equal(dst[o:o + 65536], src[o:o + 65536])
    assert wait_state(a, h) == "DONE"
    untouched = np.ones(dst.size, bool)
    for o in offs:
        untouched[o:o + 65536] = False
    assert not dst[untouched].any(), "bytes landed outside the descriptors"
    # and back: READ into a fresh part of src's neighbour
    back = np.zeros(65536, np.uint8)
    a.register_memory([(back.ctypes.data, back.nbytes, 0, "")], "DRAM")
    r = a.initialize_xfer("READ", a.get_xfer_descs([(back.ctypes.data, 65536, 0)], "DRAM"),
                          descs(a, dst.ctypes.data, [offs[1]], 65536), b.name)
    a.transfer(r)
    assert wait_state(a, r) == "DONE"
    assert np.array_equal(back, src[offs[1]:offs[1] + 65536])
    a.release_xfer_handle(h)
    a.release_xfer_handle(r)


def test_prepared_lists_by_index_and_reposts(pair):
    a, b, src, dst = pair
    n, size = 64, 16384
    local = a.prep_xfer_dlist("", descs(a, src.ctypes.data, [i * size for i in range(n)], size))
    remote = a.prep_xfer_dlist(b.name, descs(a, dst.ctypes.data, [i * size for i in range(n)], size))
    idx = np.array([3, 7, 9, 63], dtype=np.int32)
    h = a.make_prepped_xfer("WRITE", local, idx, remote, idx[::-1].copy())
    for _ in range(3):                          # a handle is posted again once done
        assert a.transfer(h) != "ERR"
        assert wait_state(a, h) == "DONE"
    for i, j in zip(idx, idx[::-1]):
        assert np.array_equal(dst[j * size:(j + 1) * size], src[i * size:(i + 1) * size])
    with pytest.raises(B.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", local, [0, n], remote, [0, 1])          # index out of range
    with pytest.raises(KeyError):
        a.make_prepped_xfer("COPY", local, [0], remote, [0])
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)


def test_bad_input_is_refused_and_the_agent_stays_usable(pair):
    a, b, src, dst = pair
    s, d = src.ctypes.data, dst.ctypes.data
    with pytest.raises(B.nixlNotFoundError):                                  # nobody of that name
        a.initialize_xfer("WRITE", descs(a, s, [0], 64), descs(a, d, [0], 64), "nobody")
    with pytest.raises(B.nixlNotFoundError):                                  # past the peer's memory
        a.initialize_xfer("WRITE", descs(a, s, [0], 64), descs(a, d, [dst.nbytes - 32], 64), b.name)
    other = np.zeros(4096, np.uint8)
    with pytest.raises(B.nixlNotFoundError):                                  # local side not registered
        a.initialize_xfer("WRITE", descs(a, other.ctypes.data, [0], 64), descs(a, d, [0], 64), b.name)
    with pytest.raises(B.nixlMismatchError):
        a.initialize_xfer("WRITE", descs(a, s, [0], 64), descs(a, d, [0], 128), b.name)
    with pytest.raises(B.nixlInvalidParamError):
        a.initialize_xfer("WRITE", descs(a, s, [0, 64], 64), descs(a, d, [0], 64), b.name)
    import kvflow.cuda
    if not kvflow.cuda.available():                                         # VRAM needs CUDA here
        with pytest.raises(B.nixlNotSupportedError, match="CUDA is not usable here"):
            a.register_memory([(other.ctypes.data, 4096, 0, "")], "VRAM")
    with pytest.raises(B.nixlNotSupportedError, match="DRAM and VRAM only"):
        a.register_memory([(other.ctypes.data, 4096, 0, "")], "FILE")
    with pytest.raises(B.nixlNotFoundError):
        a.create_backend("GDS")
    assert a.get_xfer_descs([(1, 2)], "DRAM") is None and a.get_reg_descs([(1, 2, 0)], "DRAM") is None
    assert not dst.any(), "a refused transfer moved bytes"
    # still usable
    h = a.initialize_xfer("WRITE", descs(a, s, [0], 4096), descs(a, d, [0], 4096), b.name)
    a.transfer(h)
    assert wait_state(a, h) == "DONE" and np.array_equal(dst[:4096], src[:4096])
    # a removed agent is gone; metadata brings it back
    a.remove_remote_agent(b.name)
    with pytest.raises(B.nixlNotFoundError):
        a.initialize_xfer("WRITE", descs(a, s, [0], 64), descs(a, d, [0], 64), b.name)
    assert not a.check_remote_metadata(b.name)
    a.add_remote_agent(b.get_agent_metadata())
    assert a.check_remote_metadata(b.name, descs(a, d, [0], 64))


def test_repost_while_active_and_release_in_flight(pair):
    a, b, src, dst = pair
    big = np.ones(256 * MiB, np.uint8)
    sink = np.zeros(256 * MiB, np.uint8)
    a.register_memory([(big.ctypes.data, big.nbytes, 0, "")], "DRAM")
    b.register_memory([(sink.ctypes.data, sink.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())            # the new region is in the metadata now
    n = 256
    h = a.initialize_xfer("WRITE", descs(a, big.ctypes.data, [i * MiB for i in range(n)], MiB),
                          descs(a, sink.ctypes.data, [i * MiB for i in range(n)], MiB), b.name)
    assert a.transfer(h) == "PROC"
    with pytest.raises(B.nixlRepostActiveError):
        a.transfer(h)
    a.release_xfer_handle(h)                             # cancels what is still queued
    time.sleep(0.5)
    h2 = a.initialize_xfer("WRITE", descs(a, src.ctypes.data, [0], 4096), descs(a, dst.ctypes.data, [0], 4096),
                           b.name)
    a.transfer(h2)
    assert wait_state(a, h2) == "DONE" and np.array_equal(dst[:4096], src[:4096])


def test_descriptor_lists_pickle_and_trim():
    reg = B.nixlRegDList(B.DRAM_SEG, [(4096, 100, 0, "meta"), (8192, 50, 1, b"x")])
    assert reg[0] == (4096, 100, 0, b"meta") and reg.descCount() == 2
    again = pickle.loads(pickle.dumps(reg))
    assert again == reg and again.getType() == B.DRAM_SEG
    xfer = reg.trim()
    assert isinstance(xfer, B.nixlXferDList) and xfer[1] == (8192, 50, 1)
    with pytest.raises(TypeError):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 3, 4)])
    arr = B.nixlXferDList(B.DRAM_SEG, np.array([[1, 2, 0], [3, 4, 0]], dtype=np.uint64))
    assert arr[1] == (3, 4, 0) and pickle.loads(pickle.dumps(arr)) == arr


def test_telemetry_numbers(monkeypatch, pair):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    a = nixl_agent(f"t-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    _, b, src, dst = pair
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", descs(a, src.ctypes.data, [0, MiB], MiB),
                          descs(a, dst.ctypes.data, [0, MiB], MiB), b.name)
    t0 = time.time()
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes) == (2, 2 * MiB)
    assert abs(t.startTime / 1e6 - t0) < 5
    assert 0 < t.postDuration <= t.xferDuration < 30e6
    assert ctypes.string_at(dst.ctypes.data, 8) == src[:8].tobytes()
    # With a notification the engine's loop runs the transfer and may finish
    # it before the posting thread is back from the post: the transfer still
    # reports at least its post (NIXL's own test asserts it; it once failed).
    for i in range(50):
        h = a.initialize_xfer("WRITE", descs(a, src.ctypes.data, [0], 64), descs(a, dst.ctypes.data, [0], 64),
                              b.name, b"t%d" % i)
        a.transfer(h)
        assert wait_state(a, h) == "DONE"
        t = a.get_xfer_telemetry(h)
        assert 0 < t.postDuration <= t.xferDuration, (i, t)
        a.release_xfer_handle(h)


def test_listener_with_port_zero(capfd):
    a = nixl_agent(f"l-{uuid.uuid4()}", nixl_agent_config(True, True, 0))
    port = a.agent.listen_port
    assert port > 0 and f"MD listener is listening on port {port}" in capfd.readouterr().err
    b = nixl_agent(f"m-{uuid.uuid4()}", nixl_agent_config(True, True, 0))
    b.send_local_metadata("127.0.0.1", port)
    b.fetch_remote_metadata(a.name, "127.0.0.1", port)
    deadline = time.monotonic() + 10
    while not (a.check_remote_metadata(b.name) and b.check_remote_metadata(a.name)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.send_notif(a.name, b"hello")
    while not a.check_remote_xfer_done(b.name, b"hello"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.invalidate_local_metadata("127.0.0.1", port)
    while a.check_remote_metadata(b.name):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_dropped_agent_is_released(capfd):
    """NIXL's agent is a C++ object freed with its Python wrapper; kvflow's
    must go the same way: its thread, its listener and its engine stop once
    nothing holds it (in-flight work on its loop must not keep it alive, or
    every agent a server ever made would run on and keep pinging its peers)."""
    a = nixl_agent(f"r-{uuid.uuid4()}", nixl_agent_config(True, True, 0))
    b = nixl_agent(f"s-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    assert b.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    b.send_notif(a.name, b"hello")
    deadline = time.monotonic() + 10
    while not a.check_remote_xfer_done(b.name, b"hello"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    port, threads = a.agent.listen_port, {a.agent._thread._thread, b.agent._thread._thread}
    del a, b
    gc.collect()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), f"{t.name} still runs after its agent was dropped"
    with socket.socket() as s:       # the listener's port is closed
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_prepared_indices_are_checked_natively(pair):
    """make_prepped_xfer picks, bounds-checks and compares in one native
    pass (kvflow._core.take_pairs): every index form NIXL callers use, and
    every bad one refused with NIXL's error and nothing moved."""
    a, b, src, dst = pair
    n, size = 8, 4096
    remote_name = a.add_remote_agent(b.get_agent_metadata())       # bytes, as NIXL returns it
    local = a.prep_xfer_dlist("", descs(a, src.ctypes.data, [i * size for i in range(n)], size))
    remote = a.prep_xfer_dlist(remote_name, descs(a, dst.ctypes.data, [i * size for i in range(n)], size))
    odd = a.prep_xfer_dlist(b.name, a.get_xfer_descs([(dst.ctypes.data, size, 0),
                                                      (dst.ctypes.data + size, 2 * size, 0)], "DRAM"))
    bad = [([n], [0]), ([-1], [0]), ([0], [-1]), (np.array([2 ** 63 + 1], np.uint64), [0]),
           ([0, 1], [0]), ([0.5], [0]), ([[0]], [[0]])]
    for li, ri in bad:
        with pytest.raises(B.nixlInvalidParamError):
            a.make_prepped_xfer("WRITE", local, li, remote, ri)
    with pytest.raises(B.nixlMismatchError):                                # 4 KiB against 8 KiB
        a.make_prepped_xfer("WRITE", local, [0, 1], odd, [0, 1])
    assert not dst.any(), "a refused transfer moved bytes"
    forms = [[1, 2], (3,), np.array([4], np.int64), np.array([5], np.uint32), np.array([6, 7], np.uint64),
             np.arange(8, dtype=np.int32)[::7]]                       # strided: copied to contiguous
    for li in forms:
        h = a.make_prepped_xfer("WRITE", local, li, remote, li)
        st = a.transfer(h)
        assert st in ("PROC", "DONE"), st
        assert wait_state(a, h) == "DONE"
        assert a.transfer(h) != "ERR" and wait_state(a, h) == "DONE"     # posted again once done
        a.release_xfer_handle(h)
        for i in np.asarray(li).tolist():
            assert np.array_equal(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size])
    for h in (local, remote, odd):
        a.release_dlist_handle(h)


def _send_and_check(a, b, local_descs, dst, expect: bytes) -> None:
    """WRITE `local_descs` (a nixlXferDList) into the start of b's `dst`;
    the bytes that land must be `expect`."""
    n = local_descs.descCount()
    offs, off = [], 0
    for i in range(n):
        offs.append(off)
        off += local_descs[i][1]
    remote = a.get_xfer_descs([(dst.ctypes.data + o, local_descs[i][1], 0) for i, o in enumerate(offs)], "DRAM")
    h = a.initialize_xfer("WRITE", local_descs, remote, b.name)
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    a.release_xfer_handle(h)
    assert dst[:off].tobytes() == expect


def test_register_memory_from_an_array_of_rows(pair):
    """An Nx3 array of (address, length, device ID) rows with a mem_type, as
    NIXL's register_memory takes it (NIXL's prep_xfer_perf.py `array`); a
    registration list with empty metadata, usable like any other."""
    a, b, _, dst = pair
    bufs = [np.full(8192, 0x11, np.uint8), np.full(4096, 0x22, np.uint8)]
    for dtype in (np.uint64, np.int64):
        rows = np.array([[x.ctypes.data, x.nbytes, 0] for x in bufs], dtype=dtype)
        reg = a.register_memory(rows, "DRAM")
        assert isinstance(reg, B.nixlRegDList) and reg.getType() == B.DRAM_SEG and reg.descCount() == 2
        assert [reg[i] for i in range(2)] == [(x.ctypes.data, x.nbytes, 0, b"") for x in bufs]
        assert a.query_memory(rows, "UCX", "DRAM") == [{"mem_type": "DRAM", "registered": "true"}] * 2
        xfer = a.get_xfer_descs(rows, "DRAM")
        _send_and_check(a, b, xfer, dst, bufs[0].tobytes() + bufs[1].tobytes())
        local = a.prep_xfer_dlist("", rows, "DRAM")                   # prepared from the same array
        a.release_dlist_handle(local)
        a.deregister_memory(reg)
        remote = a.get_xfer_descs([(dst.ctypes.data, 8192, 0), (dst.ctypes.data + 8192, 4096, 0)], "DRAM")
        with pytest.raises(B.nixlNotFoundError):                      # gone: not a local descriptor any more
            a.initialize_xfer("WRITE", xfer, remote, b.name)
        dst[:] = 0
    # the list constructors take the same arrays
    rows = np.array([[4096, 100, 0], [8192, 50, 1]], np.uint64)
    assert B.nixlRegDList(B.DRAM_SEG, rows)[1] == (8192, 50, 1, b"")
    assert B.nixlRegDList(B.DRAM_SEG, rows).trim() == B.nixlXferDList(B.DRAM_SEG, rows)
    assert B.nixlXferDList(B.DRAM_SEG, rows[:, :][::-1])[0] == (8192, 50, 1)   # any layout: copied


def test_register_memory_from_tensors(pair):
    """A tensor, a list or a tuple of tensors (NIXL's forms): one descriptor
    each (address, bytes, device 0 for host memory), empty metadata."""
    torch = pytest.importorskip("torch")
    a, b, _, dst = pair
    t = torch.arange(4096, dtype=torch.int32)                                      # 16 KiB
    reg = a.register_memory(t)
    assert reg.getType() == B.DRAM_SEG and reg[0] == (t.data_ptr(), 16384, 0, b"")
    _send_and_check(a, b, a.get_xfer_descs(t), dst, t.numpy().tobytes())
    a.deregister_memory(reg)
    dst[:] = 0
    ts = [torch.full((1024,), 7, dtype=torch.uint8), torch.ones(256, dtype=torch.float64)]
    for form in (ts, tuple(ts)):
        reg = a.register_memory(form)
        assert [reg[i] for i in range(2)] == [(x.data_ptr(), x.numel() * x.element_size(), 0, b"") for x in ts]
        _send_and_check(a, b, a.get_xfer_descs(form), dst, b"".join(x.numpy().tobytes() for x in ts))
        a.deregister_memory(reg)
        dst[:] = 0
    # a mem_type given with tensors is the tensors' own, as in NIXL
    reg = a.register_memory(t, "DRAM")
    assert reg.getType() == B.DRAM_SEG
    a.deregister_memory(reg)
    # not contiguous: refused, nothing registered
    with pytest.raises(B.nixlInvalidParamError, match="contiguous tensors"):
        a.register_memory(t.view(64, 64).t())
    with pytest.raises(B.nixlInvalidParamError):
        a.register_memory([t, t.view(64, 64).t()])
    assert a.get_reg_descs(t.view(64, 64).t()) is None           # NIXL's get_reg_descs says None (and logs)


def test_registration_bad_input_is_typed_and_changes_nothing(pair):
    a, b, src, dst = pair
    buf = np.zeros(8192, np.uint8)
    rows = np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64)
    bad = [(rows, None),                                   # an array without its mem_type
           (np.zeros((2, 4), np.uint64), "DRAM"),          # not Nx3
           (np.zeros(3, np.uint64), "DRAM"),
           ([(buf.ctypes.data, buf.nbytes, 0)], "DRAM"),   # 3-tuples where 4 are needed
           ([(buf.ctypes.data, buf.nbytes, 0, "")], None),  # tuples without a mem_type
           (5, "DRAM"), (None, "DRAM"), ("DRAM", "DRAM"),
           (a.get_xfer_descs(rows, "DRAM"), None)]         # a transfer list
    for what, mem in bad:
        with pytest.raises(B.nixlInvalidParamError, match="register_memory"):
            a.register_memory(what, mem)
    with pytest.raises(ValueError, match="integer array"):
        a.register_memory(rows.astype(np.float64), "DRAM")
    with pytest.raises(ValueError, match="negative"):
        a.register_memory(np.array([[buf.ctypes.data, -1, 0]], np.int64), "DRAM")
    with pytest.raises(B.nixlInvalidParamError, match="deregisterMem takes a nixlRegDList"):
        a.deregister_memory(rows)
    with pytest.raises(B.nixlInvalidParamError, match="query_memory"):
        a.query_memory(rows, "UCX")
    # nothing of it was registered: the buffer is not a local descriptor
    with pytest.raises(B.nixlNotFoundError):
        a.initialize_xfer("WRITE", a.get_xfer_descs(rows, "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data, 8192, 0)], "DRAM"), b.name)
    # and the agent still registers and moves
    reg = a.register_memory(rows, "DRAM")
    buf[:] = 0x5A
    _send_and_check(a, b, a.get_xfer_descs(rows, "DRAM"), dst, buf.tobytes())
    a.deregister_memory(reg)


def test_descriptor_lists_as_nixl_makes_them():
    assert B.nixlRegDList(B.DRAM_SEG, 2)[1] == (0, 0, 0, b"")                     # init_size
    assert B.nixlXferDList(type=B.DRAM_SEG, init_size=3).descCount() == 3
    lst = B.nixlXferDList(B.DRAM_SEG, [(1, 2, 0), (3, 4, 0)])
    lst[0] = (7, 8, 9)
    assert lst[0] == (7, 8, 9) and lst.index((3, 4, 0)) == 1
    with pytest.raises(B.nixlNotFoundError):
        lst.index((5, 5, 5))
    reg = B.nixlRegDList(B.DRAM_SEG, [(1, 2, 0, "a"), (3, 4, 0, "b")])
    reg[1] = (5, 6, 0, "m")
    assert reg[1] == (5, 6, 0, b"m") and reg.index((5, 6, 0, "other")) == 1    # metadata not compared
    with pytest.raises(IndexError):
        reg.remDesc(2)
    with pytest.raises(IndexError):
        reg[2] = (1, 2, 0, "")
    with pytest.raises(TypeError):
        B.nixlRemoteDList(B.DRAM_SEG, np.zeros((1, 3), np.uint64))                 # tuples only, as NIXL's
    with pytest.raises(TypeError):
        B.nixlRegDList(B.DRAM_SEG, [(1, 2, 0, 5)])                                 # metadata: str or bytes
    with pytest.raises(TypeError):
        B.nixlXferDList(9, [(1, 2, 0)])
    with pytest.raises(TypeError):
        B.nixlXferDList(B.DRAM_SEG, "1,2,0")


def test_utils_buffers():
    from kvflow.compat.nixl import _utils as U
    a, b = U.malloc_passthru(1000), U.malloc_passthru(1000)
    try:
        assert a % 4096 == 0 and b % 4096 == 0                 # aligned, as NIXL's (O_DIRECT)
        U.ba_buf(a, 1000)
        assert ctypes.string_at(a, 1000) == b"\xba" * 1000
        ctypes.memmove(b, a, 1000)
        U.verify_transfer(a, b, 1000)
        ctypes.memset(b + 999, 0, 1)
        with pytest.raises(AssertionError, match="byte 999 of 1000"):
            U.verify_transfer(a, b, 1000)
        U.verify_transfer(a, b, 999)
        with pytest.raises(ValueError):
            U.ba_buf(0, 8)
        with pytest.raises(ValueError):
            U.ba_buf(a, -1)
        with pytest.raises(TypeError):
            U.ba_buf(a, 1.5)
        with pytest.raises(ValueError):
            U.malloc_passthru(-1)
    finally:
        U.free_passthru(a)
        U.free_passthru(b)


def test_raw_agent_statuses_and_local_prep_overload(pair):
    """The raw agent (`nixl._bindings.nixlAgent`) as NIXL's bindings have it:
    registerMem and friends return NIXL_SUCCESS, and prepXferDlist(descs)
    without an agent name prepares a local list."""
    a, b, src, dst = pair
    raw = a.agent
    buf = np.arange(4096, dtype=np.uint8)
    reg = B.nixlRegDList(B.DRAM_SEG, np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64))
    assert raw.registerMem(reg, []) == B.NIXL_SUCCESS
    local = raw.prepXferDlist(reg.trim(), [])                                  # NIXL's local overload
    remote = raw.prepXferDlist(b.name, B.nixlXferDList(B.DRAM_SEG, [(dst.ctypes.data, 4096, 0)]), [])
    h = raw.makeXferReq(B.NIXL_WRITE, local, [0], remote, [0])
    assert raw.postXferReq(h) in (B.NIXL_SUCCESS, B.NIXL_IN_PROG)
    deadline = time.monotonic() + 30
    while raw.getXferStatus(h) != B.NIXL_SUCCESS:
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert np.array_equal(dst[:4096], buf)
    assert raw.releaseXferReq(h) == B.NIXL_SUCCESS
    assert raw.releasedDlistH(local) == B.NIXL_SUCCESS and raw.releasedDlistH(remote) == B.NIXL_SUCCESS
    assert raw.makeConnection(b.name, []) == B.NIXL_SUCCESS
    assert raw.genNotif(b.name, b"raw", []) == B.NIXL_SUCCESS
    assert raw.deregisterMem(reg, []) == B.NIXL_SUCCESS
    with pytest.raises(B.nixlInvalidParamError):
        raw.prepXferDlist([(1, 2, 0)], [])
    assert raw.invalidateRemoteMD(b.name) == B.NIXL_SUCCESS
    with pytest.raises(B.nixlNotFoundError):
        raw.invalidateRemoteMD(b.name)
