"""Relay lanes in shared memory (kvflow._lanes): the ring's rules on their
own, across real processes: tickets in order per lane, a slot never
reused before it was consumed (credit), a doorbell only after the copy,
wrap-around, producers in several processes with several threads each
against one consumer under contention, a producer killed mid-lane, and
bad input refused with LaneError."""
from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import threading
import time
import uuid

import numpy as np
import pytest

from kvflow._lanes import ERROR_BYTES, LaneError, Lanes

SLOT = 64 << 10


def seg_name() -> str:
    return f"/kvflow-test-{uuid.uuid4().hex[:12]}"


def payload(lane: int, ticket: int, n: int = SLOT) -> np.ndarray:
    return np.random.default_rng(lane * 1_000_003 + ticket).integers(0, 256, n, dtype=np.uint8)


def test_a_slot_round_trip_and_the_credit():
    name = seg_name()
    member = Lanes(name, create=True, lanes=2, slots=4, slot_bytes=SLOT, meta_bytes=8192)
    try:
        producer = Lanes(name)
        assert (producer.lanes, producer.slots, producer.slot_bytes) == (2, 4, SLOT)
        assert producer.consumer_pid == os.getpid()
        lane = producer.claim(os.getpid())
        assert lane == 0 and producer.claim(os.getpid()) == 1 and producer.claim(os.getpid()) == -1
        src = payload(0, 0)
        assert member.take(lane) is None                                 # nothing rung yet
        for t in range(4):
            assert producer.reserve(lane) == t and producer.credit(lane, t)
            producer.fill(lane, t, [src.ctypes.data], [t * 100], [1000], f"req{t}".encode())
        assert producer.reserve(lane) == 4 and not producer.credit(lane, 4)    # slot 0 not consumed yet
        got = [member.take(lane) for _ in range(4)]
        assert [(t, r) for t, r in got] == [(t, f"req{t}".encode()) for t in range(4)]
        assert member.take(lane) is None                                      # ticket 4: reserved, not rung
        view = np.ctypeslib.as_array(ctypes.cast(member.slot_addr(lane, 2), ctypes.POINTER(ctypes.c_uint8)),
                                     (SLOT,))
        assert bytes(view[200:1200]) == bytes(src[:1000])
        assert producer.collect(lane, 0) is None
        member.finish(lane, 0)
        member.finish(lane, 1, 5, "refused: outside the region")
        member.finish(lane, 2)
        assert not producer.credit(lane, 4)                 # done, but its status not collected yet
        assert producer.collect(lane, 0) == (0, "")
        assert producer.collect(lane, 1) == (5, "refused: outside the region")
        assert producer.credit(lane, 4) and producer.credit(lane, 5) and not producer.credit(lane, 6)
        assert producer.pending(lane) == 1
        producer.leave(lane, os.getpid())
        assert producer.owner_of(lane) == 0
        member.retire()
        assert producer.consumer_pid == 0
        producer.close()
    finally:
        member.close()
    with pytest.raises(LaneError, match="shm_open"):
        Lanes(name)                                         # unlinked by its creator


def test_bad_input_is_refused():
    with pytest.raises(LaneError, match="name"):
        Lanes("no-slash", create=True, lanes=1, slots=1, slot_bytes=SLOT, meta_bytes=8192)
    with pytest.raises(LaneError, match="lanes 1..256"):
        Lanes(seg_name(), create=True, lanes=0, slots=1, slot_bytes=SLOT, meta_bytes=8192)
    with pytest.raises(LaneError, match="lanes 1..256"):
        Lanes(seg_name(), create=True, lanes=1, slots=1, slot_bytes=SLOT, meta_bytes=16)
    name = seg_name()
    m = Lanes(name, create=True, lanes=1, slots=2, slot_bytes=SLOT, meta_bytes=8192)
    try:
        with pytest.raises(LaneError, match="shm_open"):
            Lanes(name, create=True, lanes=1, slots=2, slot_bytes=SLOT, meta_bytes=8192)    # exists
        src = np.zeros(16, np.uint8)
        with pytest.raises(LaneError, match="outside the slot"):
            m.fill(0, 0, [src.ctypes.data], [SLOT - 8], [16], b"")
        with pytest.raises(LaneError, match="does not fit"):
            m.fill(0, 0, [], [], [], b"x" * 8192)
        with pytest.raises(LaneError, match="lane 3 of 1"):
            m.reserve(3)
        assert m.take(0) is None                            # nothing was rung by the refused fills
        m.close()
        with pytest.raises(LaneError, match="closed"):
            m.reserve(0)
    finally:
        m.close()
    # a segment that is not a lane segment
    fd = os.open(f"/dev/shm{name}x", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8192)
    os.close(fd)
    try:
        with pytest.raises(LaneError, match="not a kvflow lane segment"):
            Lanes(name + "x")
    finally:
        os.unlink(f"/dev/shm{name}x")


def _produce(name: str, tickets: int, threads: int, sizes: list[int], out: "mp.Queue[tuple]") -> None:
    """A producer process: one lane, `threads` threads reserving tickets
    side by side; each slot holds payload(lane, ticket)."""
    seg = Lanes(name)
    lane = seg.claim(os.getpid())
    srcs: dict[int, np.ndarray] = {}
    lock = threading.Lock()
    total = [0]

    def run() -> None:
        while True:
            with lock:
                if total[0] >= tickets:
                    return
                total[0] += 1
            t = seg.reserve(lane)
            while not seg.credit(lane, t):
                time.sleep(0)
            n = sizes[t % len(sizes)]
            src = payload(lane, t, n)
            srcs[t] = src
            seg.fill(lane, t, [src.ctypes.data], [0], [n], f"{lane}:{t}:{n}".encode())
            while seg.collect(lane, t) is None:
                time.sleep(0)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    out.put((lane, tickets))
    seg.leave(lane, os.getpid())
    seg.close()


def test_several_processes_and_threads_against_one_consumer():
    """4 producer processes x 3 threads, 200 tickets each, through 4-slot
    lanes (so every slot wraps 50 times): the consumer takes each lane's
    tickets in order, every slot it takes holds exactly its ticket's bytes
    (a slot overwritten before it was consumed, or rung before its copy
    finished, shows as a wrong hash), and none is lost."""
    name = seg_name()
    seg = Lanes(name, create=True, lanes=4, slots=4, slot_bytes=SLOT, meta_bytes=8192)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    sizes = [SLOT, 1, 4096, SLOT - 7]
    procs = [ctx.Process(target=_produce, args=(name, 200, 3, sizes, out)) for _ in range(4)]
    try:
        for p in procs:
            p.start()
        seen = {lane: 0 for lane in range(4)}
        bad = []
        deadline = time.monotonic() + 120
        while sum(seen.values()) < 800 and time.monotonic() < deadline:
            idle = True
            for lane in range(4):
                got = seg.take(lane)
                if got is None:
                    continue
                idle = False
                t, req = got
                lane_s, t_s, n_s = req.decode().split(":")
                n = int(n_s)
                if (int(lane_s), int(t_s)) != (lane, t) or t != seen[lane]:
                    bad.append((lane, t, req))
                view = np.ctypeslib.as_array(ctypes.cast(seg.slot_addr(lane, t), ctypes.POINTER(ctypes.c_uint8)),
                                             (n,))
                if hashlib.sha256(view).digest() != hashlib.sha256(payload(lane, t, n)).digest():
                    bad.append((lane, t, "bytes"))
                seen[lane] += 1
                seg.finish(lane, t)
            if idle:
                time.sleep(0)
        for p in procs:
            p.join(30)
        assert not bad, bad[:5]
        assert seen == {lane: 200 for lane in range(4)}
        assert sorted(out.get(timeout=5) for _ in procs) == [(lane, 200) for lane in range(4)]
        assert all(p.exitcode == 0 for p in procs)
        assert all(seg.owner_of(lane) == 0 for lane in range(4))      # each left its lane
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        seg.close()


def _die_mid_lane(name: str) -> None:
    seg = Lanes(name)
    lane = seg.claim(os.getpid())
    src = payload(lane, 0, 100)
    seg.fill(lane, seg.reserve(lane), [src.ctypes.data], [0], [100], b"whole")
    seg.reserve(lane)                   # ticket 1: taken, never filled
    os._exit(0)


def test_a_producer_killed_mid_lane():
    """Its published slot is taken, the half-made one never is (no doorbell),
    and the consumer reclaims the lane once the process is gone; the lane
    is then free and starts again from ticket 0."""
    name = seg_name()
    seg = Lanes(name, create=True, lanes=1, slots=4, slot_bytes=SLOT, meta_bytes=8192)
    try:
        p = mp.get_context("fork").Process(target=_die_mid_lane, args=(name,))
        p.start()
        p.join(30)
        owner = seg.owner_of(0)
        assert owner == p.pid
        assert seg.take(0) == (0, b"whole")
        assert seg.take(0) is None and seg.pending(0) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(owner, 0)
        seg.finish(0, 0)
        seg.reclaim(0)
        assert seg.owner_of(0) == 0 and seg.pending(0) == 0
        assert seg.claim(os.getpid()) == 0 and seg.reserve(0) == 0 and seg.credit(0, 0)
    finally:
        seg.close()


def test_error_text_is_bounded():
    name = seg_name()
    seg = Lanes(name, create=True, lanes=1, slots=1, slot_bytes=SLOT, meta_bytes=8192)
    try:
        seg.claim(1)
        t = seg.reserve(0)
        seg.fill(0, t, [], [], [], b"")
        assert seg.take(0) == (0, b"")
        seg.finish(0, 0, 9, "x" * 5000)
        code, text = seg.collect(0, 0)
        assert code == 9 and len(text) == ERROR_BYTES - 4
    finally:
        seg.close()


def test_a_doorbell_written_by_another_agent():
    """The device lanes' protocol on host memory: publish() writes a request
    and rings nothing; the slot is taken only once another agent (here a
    thread, as a CUDA stream would) stores ticket + 1 at ready_addr, and
    RING_FN(bell_addr), called as a C function (as cuLaunchHostFunc calls
    it), wakes a consumer asleep on the bell. The addresses a GPU is given
    lie where the segment's words are: inside control_bytes (whole pages)."""
    from kvflow._lanes import RING_FN
    name = seg_name()
    member = Lanes(name, create=True, lanes=3, slots=4, slot_bytes=SLOT, meta_bytes=8192)
    try:
        producer = Lanes(name)
        assert producer.base_addr % 4096 == 0 and producer.control_bytes % 4096 == 0
        for lane in range(3):
            for t in range(4):
                word = producer.ready_addr(lane, t)
                assert producer.base_addr <= word and word + 8 <= producer.base_addr + producer.control_bytes
                assert word % 8 == 0
                i = producer.slot_index(lane, t)
                assert member.slot_addr(lane, t) == member.data_addr + i * SLOT and i == lane * 4 + t
        assert producer.control_bytes < producer.size                  # the meta and data areas stay out
        assert producer.slot_index(1, 6) == producer.slot_index(1, 2)    # ticket 6 wraps onto slot 2
        lane = producer.claim(os.getpid())
        assert producer.reserve(lane) == 0
        producer.publish(lane, 0, b"device request")
        seen = member.bell()
        assert member.take(lane) is None and member.bell() == seen    # published, no doorbell, no bell

        ring = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(RING_FN)
        woke = threading.Event()

        def consumer():
            member.wait_bell(seen, 10.0)
            woke.set()

        t = threading.Thread(target=consumer)
        t.start()
        time.sleep(0.2)
        assert not woke.is_set()                                       # asleep on the bell
        ctypes.c_uint64.from_address(producer.ready_addr(lane, 0)).value = 1     # the doorbell: ticket + 1
        ring(producer.bell_addr)
        t.join(5)
        assert woke.is_set() and member.bell() == seen + 1
        assert member.take(lane) == (0, b"device request")
        member.finish(lane, 0)
        assert producer.collect(lane, 0) == (0, "")
        assert producer.reserve(lane) == 1
        with pytest.raises(LaneError, match="does not fit"):
            producer.publish(lane, 1, b"x" * 8192)
        with pytest.raises(LaneError):
            producer.ready_addr(3, 0)
        producer.close()
        with pytest.raises(LaneError, match="closed"):
            producer.publish(lane, 1, b"")
    finally:
        member.close()
