# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The native core's Python face: one `Core` per engine, one channel per peer.

Everything here is thin: arguments are checked and handed to C with the GIL
released; results come back as plain status codes, which kvflow.errors maps
to exceptions in one place.
"""
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t, INT64_MAX
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from cpython.long cimport PyLong_AsUnsignedLongLong
cimport numpy as cnp
import os
import threading
import time
import weakref
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "<sched.h>" nogil:
    int sched_yield()

from kvflow.arrays import as_u64
from kvflow.errors import InvalidArgumentError

cnp.import_array()

from kvflow._native cimport *

# Constants defined once, in the C headers (kvflow/_native/kvf.h, wire.h);
# Python takes them from here (kvflow.status, kvflow.memory, kvflow.control.wire),
# and tests/test_constants.py checks the headers and Python agree.
OK = KVF_OK
OP_WRITE = KVF_OP_WRITE
OP_READ = KVF_OP_READ
STATUS = {"OK": KVF_OK, "EINVAL": KVF_EINVAL, "EUNREG": KVF_EUNREG, "EREMOTE": KVF_EREMOTE,
          "ELOST": KVF_ELOST, "ECANCELLED": KVF_ECANCELLED, "EPROTO": KVF_EPROTO, "ENOMEM": KVF_ENOMEM,
          "EIO": KVF_EIO, "ECLOSED": KVF_ECLOSED}
STATUS_BITS = {"CODE_MASK": KVF_STATUS_CODE_MASK, "WC_SHIFT": KVF_STATUS_WC_SHIFT,
               "WC_MASK": KVF_STATUS_WC_MASK, "DEV_SHIFT": KVF_STATUS_DEV_SHIFT,
               "DEV_MASK": KVF_STATUS_DEV_MASK}
ACCESS = {"READ": KVF_ACCESS_READ, "WRITE": KVF_ACCESS_WRITE, "LOCAL_WRITE": KVF_ACCESS_LOCAL_WRITE}
MAX_DEVS = KVF_MAX_DEVS
PRIO = {"HIGH": KVF_PRIO_HIGH, "NORMAL": KVF_PRIO_NORMAL, "LOW": KVF_PRIO_LOW}
SCHED = {"AGE_NS": KVF_SCHED_AGE_NS}
WIRE = {"MAGIC": KVF_MAGIC, "VERSION": KVF_WIRE_VERSION, "MAX_PAYLOAD": KVF_MAX_PAYLOAD,
        "F_HELLO": KVF_F_HELLO, "F_HELLO_ACK": KVF_F_HELLO_ACK, "F_WRITE": KVF_F_WRITE,
        "F_WRITE_ACK": KVF_F_WRITE_ACK, "F_READ_REQ": KVF_F_READ_REQ, "F_READ_RESP": KVF_F_READ_RESP,
        "F_FENCE": KVF_F_FENCE,
        "ROLE_DATA": KVF_ROLE_DATA, "ROLE_ACK": KVF_ROLE_ACK, "CONN_INDEX_MASK": KVF_CONN_INDEX_MASK,
        "CONN_EPOCH_SHIFT": KVF_CONN_EPOCH_SHIFT, "CONN_EPOCH_MAX": KVF_CONN_EPOCH_MAX,
        "HDR_FLUSH": KVF_HDR_FLUSH, "HEADER_SIZE": sizeof(kvf_hdr)}

# tcp's polled path (TcpChannel._poll_budget): batches up to this size, for
# 3x the recent round trip within these bounds (a loopback round trip is
# 30-60 us here; past half a millisecond the loop would stall too long).
TCP_POLL_MAX_BYTES = 64 << 10
TCP_POLL_MIN_NS = 20_000
TCP_POLL_MAX_NS = 500_000

cdef enum:
    DRAIN_BATCH = 512
    SMALL = 16          # columns up to this long are converted without numpy


cdef class Core:
    """The native context of one engine: its region table, batch pool,
    completion ring (readable through `fileno()`), local workers and the
    tcp server's connection threads."""

    def __cinit__(self, int local_workers=2):
        with nogil:
            self.ctx = kvf_ctx_new(local_workers)
        if self.ctx == NULL:
            raise MemoryError("kvflow: cannot create the native context")
        self.next_region_id = 1
        self.channels = weakref.WeakSet()

    def __dealloc__(self):
        if self.ctx != NULL:
            with nogil:
                kvf_ctx_free(self.ctx)
            self.ctx = NULL

    cdef kvf_ctx *_ctx(self) except NULL:
        if self.ctx == NULL:
            raise RuntimeError("kvflow: the engine is closed")
        return self.ctx

    def fileno(self):
        return self._ctx().efd

    def set_sched_age(self, uint64_t age_ns):
        """The starvation bound of the engine's scheduled queues: a class
        with queued slices is served at least once per age_ns."""
        kvf_sched_set_age(self._ctx(), age_ns)

    def set_sched_fifo(self, bint on):
        """FIFO mode: batches queued from now on go in arrival order, whole
        (priorities, deadlines and fair share ignored)."""
        kvf_sched_set_fifo(self._ctx(), on)

    def add_region(self, uint64_t addr, uint64_t length, uint32_t access):
        """Adds a region to the local table; returns its id, or 0 when it
        overlaps a registered one."""
        cdef kvf_ctx *c = self._ctx()
        cdef uint32_t rid = self.next_region_id
        cdef int rc
        with nogil:
            rc = kvf_rt_add(&c.local, addr, length, access, rid)
            # in the fence too (fence.h): where same-host peers look
            # before every copy
            if rc == KVF_OK and c.fence != NULL and kvf_fence_add(c.fence, rid, addr, length, access) != KVF_OK:
                kvf_rt_remove(&c.local, rid)
                rc = KVF_ENOMEM
        if rc == KVF_ENOMEM:
            raise InvalidArgumentError(f"kvflow: more than {KVF_FENCE_REGIONS} regions registered at once")
        if rc != KVF_OK:
            return 0
        self.next_region_id += 1
        return rid

    def set_incarnation(self, uint64_t incarnation):
        """Names this engine's region fence after its incarnation: how a
        same-host peer in another process knows it attached the right one."""
        cdef kvf_ctx *c = self._ctx()
        if c.fence != NULL:
            kvf_fence_set_incarnation(c.fence, incarnation)

    def fence_shared(self):
        """Whether peers in other processes can attach this engine's
        region fence (it lives in a memfd)."""
        cdef kvf_ctx *c = self._ctx()
        return c.fence != NULL and kvf_fence_fd(c.fence) >= 0

    def fence_busy(self):
        """Copies into or out of this engine's regions by same-host peers
        in progress now (slots of its fence held)."""
        cdef kvf_ctx *c = self.ctx
        return kvf_fence_busy_slots(c.fence) if c != NULL and c.fence != NULL else 0

    def set_keys(self, uint32_t rid, keys):
        """Sets a region's rdma lkeys (one per device)."""
        cdef uint32_t kv[KVF_MAX_DEVS]
        cdef size_t nk = len(keys), i
        if nk > KVF_MAX_DEVS:
            raise ValueError(f"at most {KVF_MAX_DEVS} rdma devices")
        for i in range(nk):
            kv[i] = keys[i]
        return kvf_rt_set_keys(&self._ctx().local, rid, kv, nk) == KVF_OK

    def remove_region(self, uint32_t rid, double local_wait):
        """Removes a region; returns once no receiver is writing into it
        (or reading from it): a tcp payload still moving after a short
        grace has its connection cut off (kvf_srv_quiesce_region); a
        same-host peer's copy (local provider: it cannot be cut off) is
        waited for up to `local_wait` seconds (kvf_fence_quiesce). Returns
        the pids of the processes whose copies were still inside then
        (empty: none, the memory is free)."""
        cdef kvf_ctx *c = self._ctx()
        cdef int rc
        with nogil:
            rc = kvf_rt_remove(&c.local, rid)
            if c.fence != NULL:
                kvf_fence_remove(c.fence, rid)
            if rc == KVF_OK:
                kvf_srv_quiesce_region(c, rid)
        return self.quiesce_region(rid, local_wait)

    def quiesce_region(self, uint32_t rid, double local_wait):
        """Waits again (up to `local_wait` seconds) for same-host copies
        still inside a removed region (remove_region); the pids of those
        still there."""
        cdef kvf_ctx *c = self._ctx()
        cdef int pids[16]
        cdef int stuck = 0
        cdef uint64_t wait_ns = <uint64_t>(local_wait * 1e9) if local_wait > 0 else 0
        if c.fence == NULL:
            return []
        with nogil:
            stuck = kvf_fence_quiesce(c.fence, rid, wait_ns, pids, 16)
        return sorted({pids[i] for i in range(min(stuck, 16))})

    def drain(self):
        """Finished batches since the last call: a list of (id, status, entry)."""
        cdef kvf_ctx *c = self.ctx
        cdef size_t n, i
        out = []
        if c == NULL:
            return out
        while True:
            n = kvf_drain(c, self.comp, DRAIN_BATCH)
            for i in range(n):
                out.append((self.comp[i].id, self.comp[i].status, self.comp[i].entry))
            if n < DRAIN_BATCH:
                return out

    def cancel(self, uint64_t batch_id):
        if self.ctx != NULL:
            kvf_batch_cancel(self.ctx, batch_id)

    def wait_detached(self, uint64_t batch_id, double timeout=0.0, double spin=0.0):
        """Blocks this thread (GIL released) until a batch submitted with
        Channel.submit_detached finished: (KVF_OK, status, entry), its slot
        freed; or (KVF_ECANCELLED, 0, 0) after `timeout` seconds (0: none),
        the batch still running. Spins `spin` seconds before sleeping."""
        cdef kvf_ctx *c = self._ctx()
        cdef int status = 0, rc
        cdef uint64_t entry = 0
        cdef uint64_t to = <uint64_t>(timeout * 1e9) if timeout > 0 else 0
        cdef uint64_t sp = <uint64_t>(spin * 1e9) if spin > 0 else 0
        self.waiting += 1
        try:
            with nogil:
                rc = kvf_batch_wait(c, batch_id, sp, to, &status, &entry)
        finally:
            self.waiting -= 1
        return rc, status, entry

    def add_token(self, bytes token):
        if len(token) != 16:
            raise ValueError("session tokens are 16 bytes")
        return kvf_srv_add_token(self._ctx(), <const uint8_t *><char *>token) == KVF_OK

    def remove_token(self, bytes token):
        if self.ctx != NULL and len(token) == 16:
            kvf_srv_remove_token(self.ctx, <const uint8_t *><char *>token)

    def set_tcp_busy_poll(self, uint64_t ns):
        """How long a served tcp data connection's thread that finds no
        frame keeps looking (yielding the CPU) before it sleeps (0: never);
        for connections served from now on."""
        kvf_srv_set_spin(self._ctx(), ns)

    def set_liveness_grace(self, double seconds):
        """The engine's keepalive for the tcp connections it serves: a frame
        that outlasts its deadline ends only once the peer's kernel has
        answered nothing for this long too (a stopped or starved initiator
        is waited for; 0: the deadline alone). For connections served from
        now on."""
        kvf_srv_set_grace(self._ctx(), <uint32_t>(seconds * 1000) if seconds > 0 else 0)

    def set_receive_window(self, uint64_t window):
        """Caps the write payload bytes in flight toward this engine from
        all initiators together (receiver credits; 0: no cap). Once, before
        the first data connection is served."""
        return kvf_srv_set_window(self._ctx(), window) == KVF_OK

    def receive_window_stats(self):
        """The receive window's pool: window, free, held (granted, not yet
        landed or handed back), max_held (the most ever held at once),
        grants, granted_bytes, recalls, returned_bytes, asks, violations
        (payload bytes that landed without a grant: 0 unless a peer ignores
        credits), holders (data connections) and waiting. None: no window."""
        cdef kvf_credit_stats st
        if self.ctx == NULL or kvf_srv_window_stats(self.ctx, &st) != KVF_OK:
            return None
        return {"window": st.window, "free": st.free, "held": st.held, "max_held": st.max_held,
                "grants": st.grants, "granted_bytes": st.granted_bytes, "recalls": st.recalls,
                "returned_bytes": st.returned_bytes, "asks": st.asks, "violations": st.violations,
                "holders": st.holders, "waiting": st.waiting}

    def serve(self, int fd):
        """Hands an accepted data connection to a native server thread (which
        owns the descriptor from now on)."""
        cdef kvf_ctx *c = self._ctx()
        cdef int rc
        with nogil:
            rc = kvf_srv_serve(c, fd)
        return rc

    def counters(self):
        """Live native resources (the balance the tests check; always
        counted, no debug build needed): sockets, slices in flight, threads,
        batches, and the rdma provider's MRs and QPs; `fenced` counts the
        tcp target's data connections fenced so far (KVF_F_FENCE: their
        work was sent again on another connection), `cut_off` those a
        deregister() shut down because a payload still moved into or out
        of the region after the grace, `wakeups` the eventfd writes that
        woke the loop for completions (a polled batch needs none). Once closed: zeros,
        except MRs and QPs, which keep what was still counted when the
        context was freed (the rdma provider closes first, so anything but
        zero there is a leak)."""
        cdef kvf_ctx *c = self.ctx
        if c == NULL:
            return {"sockets": 0, "slices_inflight": 0, "threads": 0, "batches": 0,
                    "mrs": self.left_mrs, "qps": self.left_qps, "fenced": 0, "cut_off": 0, "wakeups": 0}
        return {"sockets": c.n_sockets, "slices_inflight": c.n_slices_inflight,
                "threads": c.n_threads, "batches": c.in_use, "mrs": c.n_mrs, "qps": c.n_qps,
                "fenced": c.n_fenced, "cut_off": c.n_cut_off, "wakeups": c.n_wakeups}

    def close(self):
        """Closes every channel, stops the server threads and workers, frees
        the context. Idempotent."""
        if self.ctx == NULL:
            return
        for ch in list(self.channels):
            ch.close()
        # closed channels failed every batch: waiting threads return now
        deadline = time.monotonic() + 5
        while self.waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        with nogil:
            kvf_srv_shutdown(self.ctx)
        self.left_mrs = self.ctx.n_mrs
        self.left_qps = self.ctx.n_qps
        with nogil:
            kvf_ctx_free(self.ctx)
        self.ctx = NULL

    def __repr__(self):
        return f"<kvflow._core.Core {'closed' if self.ctx == NULL else 'open'}>"


cdef class RemoteTable:
    """A peer's regions as last described by its handshake server; batches are
    checked against it before anything is sent."""

    def __cinit__(self):
        kvf_rt_init(&self.t)

    def __dealloc__(self):
        kvf_rt_destroy(&self.t)

    def update(self, regions):
        """regions: sequence of (addr, length, access, rkeys), rkeys being
        the region's rdma keys per device of the peer (may be empty).
        Returns False when the peer sent overlapping or empty regions."""
        cdef size_t n = len(regions), i = 0, j
        cdef kvf_region *v = <kvf_region *>calloc((n if n else 1), sizeof(kvf_region))
        cdef int rc
        if v == NULL:
            raise MemoryError()
        try:
            for addr, length, access, rkeys in regions:
                v[i].addr = addr
                v[i].len = length
                v[i].access = access
                v[i].id = <uint32_t>i
                for j in range(min(len(rkeys), KVF_MAX_DEVS)):
                    v[i].keys[j] = rkeys[j]
                i += 1
            with nogil:
                rc = kvf_rt_replace(&self.t, v, n)
        finally:
            free(v)
        self.version += 1
        return rc == KVF_OK


cdef inline uint64_t mono_ns() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return <uint64_t>t.tv_sec * 1000000000 + <uint64_t>t.tv_nsec


cdef object column(object values, uint64_t *small, const uint64_t **out, Py_ssize_t *n, str what):
    """Points *out at `values` as uint64s. Fast paths: a contiguous uint64
    ndarray (no copy) and a short list/tuple of ints (into `small`); anything
    else goes through kvflow.arrays.as_u64. Returns what must stay alive."""
    cdef cnp.ndarray arr
    cdef Py_ssize_t i, k
    if isinstance(values, cnp.ndarray):
        arr = <cnp.ndarray>values
        if cnp.PyArray_TYPE(arr) != cnp.NPY_UINT64 or cnp.PyArray_NDIM(arr) != 1 \
                or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = as_u64(values, what)
        out[0] = <const uint64_t *>cnp.PyArray_DATA(arr)
        n[0] = cnp.PyArray_DIM(arr, 0)
        return arr
    if type(values) is list or type(values) is tuple:
        k = len(values)
        if k <= SMALL:
            for i in range(k):
                v = values[i]
                if type(v) is not int:
                    break
                try:
                    small[i] = PyLong_AsUnsignedLongLong(v)
                except OverflowError:
                    raise InvalidArgumentError(
                        f"{what}[{i}] = {v} is not an unsigned 64-bit int", index=i) from None
            else:
                out[0] = small
                n[0] = k
                return None
    arr = as_u64(values, what)
    out[0] = <const uint64_t *>cnp.PyArray_DATA(arr)
    n[0] = cnp.PyArray_DIM(arr, 0)
    return arr


cdef class Channel:
    """A provider's connection to one peer. submit() takes the three batch
    columns and returns (status, batch_id, aux): on failure aux is the first
    bad entry; on success it is the batch's byte count, and batch_id 0 means
    the batch already completed inline. submit_poll() also returns
    `finished`: a provider may poll for a small batch's completion on the
    caller's thread (_poll_budget), which then needs no wake-up; such a
    batch is returned as (its status, 0, its failed entry, 1)."""

    def __cinit__(self, Core core, RemoteTable table, str peer, *args):
        self.core = core
        self.table = table
        self.peer = peer
        self.use_lock = threading.Lock()
        self.idle = threading.Condition(self.use_lock)
        core.channels.add(self)

    cdef bint _enter(self):
        """A thread starts using the native channel (False: it is closed or
        closing). Several may be inside at once: the native calls are
        thread-safe; only freeing the channel must wait for them."""
        with self.use_lock:
            if self.cch == NULL or self.closing:
                return False
            self.users += 1
            return True

    cdef void _leave(self):
        with self.use_lock:
            self.users -= 1
            if self.closing and self.users == 0:
                self.idle.notify_all()

    cdef void _quiesce(self):
        """With use_lock held (close()): lets no thread in any more and
        waits for those inside (an inline send, an ack spin: microseconds)."""
        self.closing = True
        while self.users:
            self.idle.wait()

    def stats(self):
        """This channel's batch numbers, counted once per batch as it
        finishes (kvf_chan_stats): per op ("write", "read") batches, bytes
        (of those that succeeded), failed, latency_buckets (bucket i: how
        many took under 2^(i+1) us; bucket 0 under 2 us, the last the rest)
        and latency_sum_ns, inflight_batches and inflight_bytes (submitted
        and not finished: queued or on the wire); failures_by_status
        (KVF_E* code -> count). None once the channel is closed."""
        cdef kvf_chan_stats *st
        cdef int o, i
        if self.cch == NULL or self.cch.stats == NULL:
            return None
        st = self.cch.stats
        out = {}
        for o in range(2):
            out["read" if o else "write"] = {
                "batches": st.batches[o], "bytes": st.bytes[o], "failed": st.failed[o],
                "latency_buckets": [st.lat[o][i] for i in range(KVF_LAT_BUCKETS)],
                "latency_sum_ns": st.lat_sum_ns[o],
                "inflight_batches": st.inflight_batches[o], "inflight_bytes": st.inflight_bytes[o]}
        out["failures_by_status"] = {i: st.by_status[i] for i in range(KVF_NSTATUS) if st.by_status[i]}
        return out

    cdef uint64_t _poll_budget(self, uint64_t total):
        """Nanoseconds to poll for a batch of `total` bytes (0: never)."""
        return 0

    cdef _polled(self, uint64_t budget, uint64_t took):
        """Told how long a poll with `budget` took (adaptive providers)."""
        pass

    def abort_batch(self, uint64_t batch_id):
        """A cancelled batch still on the wire after its drain grace: the
        provider makes sure none of its bytes lands later (tcp resets the
        connections still holding its slices: kvf_tcp_channel_abort_batch).
        Returns how many it reset (0 for providers that need not)."""
        cdef int n = 0
        if self._enter():
            try:
                with nogil:
                    n = kvf_channel_abort_batch(self.cch, batch_id)
            finally:
                self._leave()
        return n

    def submit(self, int op, local_addrs, remote_addrs, lengths, int prio=KVF_PRIO_NORMAL,
               uint64_t deadline_ns=0):
        """Submits without polling: for callers that do not await the batch
        at once (write_nowait), whose completions must come through the
        eventfd like any other."""
        return self._submit(op, local_addrs, remote_addrs, lengths, False, prio, deadline_ns)[:3]

    def submit_detached(self, int op, local_addrs, remote_addrs, lengths, int prio=KVF_PRIO_NORMAL,
                        uint64_t deadline_ns=0):
        """submit() for a thread that then blocks in Core.wait_detached()
        (not the event loop's): the batch never reaches the completion
        ring, so neither the submission nor the completion goes through the
        loop. Safe against a concurrent close(); threads submit side by
        side (none waits for another's inline send)."""
        if not self._enter():
            return KVF_ECLOSED, 0, 0
        kvf_set_detached(1)
        try:
            return self._submit(op, local_addrs, remote_addrs, lengths, False, prio, deadline_ns)[:3]
        finally:
            kvf_set_detached(0)
            self._leave()

    def submit_poll(self, int op, local_addrs, remote_addrs, lengths, bint poll=True,
                    int prio=KVF_PRIO_NORMAL, uint64_t deadline_ns=0):
        """Submits, with its priority class (KVF_PRIO_*) and deadline (ns
        from now, 0: none), and for small batches may poll for the
        completion on this thread. Returns (status, batch_id, aux, finished): finished 0 as
        submit(); finished 1: the batch completed while polling, status is
        the batch's (0 or the error of its first failed slice) and aux that
        slice's entry. Only the event loop's thread may poll: completions
        found while polling are pushed as that thread's (no eventfd)."""
        return self._submit(op, local_addrs, remote_addrs, lengths, poll, prio, deadline_ns)

    cdef tuple _submit(self, int op, object local_addrs, object remote_addrs, object lengths, bint poll,
                       int prio, uint64_t deadline_ns):
        cdef uint64_t small[3][SMALL]
        cdef const uint64_t *la
        cdef const uint64_t *ra
        cdef const uint64_t *ln
        cdef Py_ssize_t n1, n2, n3, i
        cdef uint64_t bid = 0, total = 0, budget, t0 = 0, took = 0, entry = 0
        cdef size_t bad = 0
        cdef int rc, finished = 0, status = 0
        cdef kvf_ctx *c = self.core._ctx()
        cdef kvf_qos qos
        qos.prio = prio
        qos.deadline_ns = deadline_ns
        k1 = column(local_addrs, small[0], &la, &n1, "local_addrs")
        k2 = column(remote_addrs, small[1], &ra, &n2, "remote_addrs")
        k3 = column(lengths, small[2], &ln, &n3, "lengths")
        if n1 == 0:
            raise InvalidArgumentError(f"empty batch for {self.peer}", peer=self.peer)
        if n2 != n1 or n3 != n1:
            raise InvalidArgumentError(
                f"batch for {self.peer}: local_addrs, remote_addrs and lengths differ in length "
                f"({n1}, {n2}, {n3})", peer=self.peer)
        for i in range(n1):
            total += ln[i]
        budget = self._poll_budget(total) if poll else 0
        cdef kvf_channel *ch = self.cch
        if ch == NULL:
            return KVF_ECLOSED, 0, 0, 0
        with nogil:
            if budget:
                t0 = mono_ns()
            # one path for every provider (kvflow/_native/provider.h)
            rc = kvf_submit_poll(ch, op, la, ra, ln, n1, &qos, budget, &bid, &bad, &finished)
            if budget and rc == 0:
                took = mono_ns() - t0
                finished = kvf_take(c, bid, &status, &entry)
        if rc:
            return rc, 0, bad, 0
        if budget:
            self._polled(budget, took)
            if finished:
                return status, 0, entry, 1
        return 0, bid, total, 0


cdef class LocalChannel(Channel):
    """The local provider toward one peer: memcpy (pid 0, same process) or
    process_vm_writev/readv into process `pid`."""

    cdef kvf_local_channel *ch
    cdef bint closed

    def __init__(self, Core core, RemoteTable table, str peer, int pid, uint64_t inline_limit,
                 Core target=None, uint64_t incarnation=0):
        """target: the peer's Core when it is an engine of this process
        (pid 0); else its region fence is attached from process `pid` by
        its `incarnation` (OSError with the errno when it cannot be)."""
        cdef kvf_fence *fence
        cdef int err = 0
        if pid == 0:
            if target is None:
                raise ValueError("a same-process local channel needs the target's Core")
            fence = target._ctx().fence
            if fence == NULL:
                raise MemoryError("kvflow: the target engine has no region fence")
            kvf_fence_ref(fence, 1)
        else:
            with nogil:
                fence = kvf_fence_attach(pid, incarnation, &err)
            if fence == NULL:
                raise OSError(err, f"cannot attach the region fence of process {pid}: {os.strerror(err)}")
        self.ch = kvf_local_channel_new(core._ctx(), &table.t, pid, inline_limit, fence)
        kvf_fence_unref(fence, 1)         # the channel took its own reference
        if self.ch == NULL:
            raise MemoryError()
        self.cch = <kvf_channel *>self.ch

    def _hold(self, uint64_t addr, uint64_t length, bint write=True):
        """Tests: enters the target's fence for [addr, addr+length) as a
        copy would and stays inside (a copier stalled between its check and
        its copy) until _release() or the channel is freed. The status a
        copy would get (KVF_OK: inside)."""
        if self.ch == NULL:
            raise RuntimeError("kvflow: the channel is closed")
        return kvf_local_channel_hold(self.ch, addr, length, KVF_OP_WRITE if write else KVF_OP_READ)

    def _release(self):
        if self.ch != NULL:
            kvf_local_channel_release(self.ch)

    def __dealloc__(self):
        if self.ch != NULL:
            self.cch = NULL
            kvf_channel_free(<kvf_channel *>self.ch)
            self.ch = NULL

    @property
    def alive(self):
        return not self.closed

    def close(self):
        # the C channel stays until dealloc: a thread in submit_poll may
        # hold it; it refuses new batches from now on
        self.closed = True
        if self.ch != NULL:
            kvf_channel_close(self.cch)


def socket_unanswered(int fd, double grace):
    """Whether the peer's kernel has answered nothing on tcp socket `fd`
    for `grace` seconds while sent bytes or probes wait for an answer
    (_native/sockio.c, sk_unanswered): the host is gone, not slow. One
    look can catch a send's round trip after a long silence: confirm it
    with a second."""
    return sk_unanswered(fd, <uint32_t>(grace * 1000)) == 1


def probe_process(int pid, uint64_t addr, size_t length):
    """Reads `length` bytes at `addr` in process `pid` (process_vm_readv):
    returns the bytes, or the errno as an int when not permitted."""
    cdef bytes buf = bytes(length)
    cdef int rc
    rc = kvf_local_probe(pid, addr, <char *>buf, length)
    return rc if rc else buf


def fence_probe(int pid, uint64_t incarnation):
    """0 when the region fence of engine `incarnation` in process `pid` can
    be attached (what a local channel to it needs), else the errno."""
    cdef int err = 0
    cdef kvf_fence *f
    with nogil:
        f = kvf_fence_attach(pid, incarnation, &err)
        kvf_fence_unref(f, 1)
    return 0 if f != NULL else err


cdef inline int64_t index_at(const char *base, int typenum, Py_ssize_t j) noexcept nogil:
    if typenum == cnp.NPY_INT64:
        return (<const int64_t *>base)[j]
    if typenum == cnp.NPY_INT32:
        return (<const int32_t *>base)[j]
    if typenum == cnp.NPY_UINT32:
        return (<const uint32_t *>base)[j]
    cdef uint64_t u = (<const uint64_t *>base)[j]          # NPY_UINT64
    return -1 if u > <uint64_t>INT64_MAX else <int64_t>u


cdef cnp.ndarray index_column(object values, str what):
    """`values` as a contiguous 1-D ndarray of int32, int64, uint32 or
    uint64 (no copy where it already is one)."""
    cdef cnp.ndarray arr
    cdef int t
    if isinstance(values, cnp.ndarray):
        arr = <cnp.ndarray>values
        t = cnp.PyArray_TYPE(arr)
        if cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISNOTSWAPPED(arr) and \
                (t == cnp.NPY_INT64 or t == cnp.NPY_INT32 or t == cnp.NPY_UINT32 or t == cnp.NPY_UINT64):
            return arr
    arr = cnp.PyArray_FROM_O(values)
    if cnp.PyArray_NDIM(arr) != 1:
        raise IndexError(f"{what}: a 1-D list of indices, not {cnp.PyArray_NDIM(arr)}-D")
    if cnp.PyArray_SIZE(arr) == 0:
        return cnp.PyArray_ZEROS(1, cnp.PyArray_DIMS(arr), cnp.NPY_INT64, 0)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"{what}: integer indices, not {arr.dtype}")
    if arr.dtype.kind == "u":
        return cnp.PyArray_FROMANY(arr, cnp.NPY_UINT64, 1, 1, cnp.NPY_ARRAY_C_CONTIGUOUS)
    return cnp.PyArray_FROMANY(arr, cnp.NPY_INT64, 1, 1, cnp.NPY_ARRAY_C_CONTIGUOUS)


cdef inline bint u64_column(cnp.ndarray col):
    return cnp.PyArray_TYPE(col) == cnp.NPY_UINT64 and cnp.PyArray_NDIM(col) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(col)


cdef inline bint span_column(cnp.ndarray col, Py_ssize_t n):
    return cnp.PyArray_TYPE(col) == cnp.NPY_INT64 and cnp.PyArray_NDIM(col) == 1 and \
        cnp.PyArray_IS_C_CONTIGUOUS(col) and cnp.PyArray_DIM(col, 0) == n


cdef enum:
    PICK_STACK = 256      # take_pairs: picks built on the stack up to this many


def take_pairs(cnp.ndarray laddrs not None, cnp.ndarray llens not None, cnp.ndarray raddrs not None,
               cnp.ndarray rlens not None, local_idx, remote_idx, cnp.ndarray lspans=None,
               cnp.ndarray rspans=None):
    """Entries picked by index from two descriptor tables (a local and a
    remote one, each as contiguous uint64 address and length columns):
    returns (local_addrs, remote_addrs, lengths, mismatch), three new
    uint64 columns and the first position whose local and remote lengths
    differ (-1: none). Indices are 1-D integer arrays or lists; one outside
    its table, or counts that differ, raise IndexError naming it. NIXL's
    make_prepped_xfer in one call, without a numpy temporary.

    With lspans and rspans (int64 columns: the region each block lies in),
    consecutive picks that continue the previous entry on both sides, in the
    same regions, are merged into it (NIXL's descriptor merge): a run of
    adjacent blocks is one entry."""
    cdef Py_ssize_t nl = cnp.PyArray_DIM(laddrs, 0), nr = cnp.PyArray_DIM(raddrs, 0), k, j, m = 0
    cdef int64_t a, b, pa = -1, pb = -1
    cdef int64_t mismatch = -1
    cdef bint merge = lspans is not None and rspans is not None
    if not (u64_column(laddrs) and u64_column(llens) and u64_column(raddrs) and u64_column(rlens)):
        raise TypeError("take_pairs: the tables are contiguous 1-D uint64 columns")
    if cnp.PyArray_DIM(llens, 0) != nl or cnp.PyArray_DIM(rlens, 0) != nr:
        raise TypeError("take_pairs: a table's columns differ in length")
    cdef const int64_t *lsp = NULL
    cdef const int64_t *rsp = NULL
    if merge:
        if not span_column(lspans, nl) or not span_column(rspans, nr):
            raise TypeError("take_pairs: the span columns are contiguous 1-D int64, one per block")
        lsp = <const int64_t *>cnp.PyArray_DATA(lspans)
        rsp = <const int64_t *>cnp.PyArray_DATA(rspans)
    cdef cnp.ndarray li = index_column(local_idx, "local indices")
    cdef cnp.ndarray ri = index_column(remote_idx, "remote indices")
    k = cnp.PyArray_DIM(li, 0)
    if cnp.PyArray_DIM(ri, 0) != k:
        raise IndexError(f"{k} local and {cnp.PyArray_DIM(ri, 0)} remote indices")
    cdef cnp.npy_intp dims[1]
    cdef const char *lip = <const char *>cnp.PyArray_DATA(li)
    cdef const char *rip = <const char *>cnp.PyArray_DATA(ri)
    cdef int lt = cnp.PyArray_TYPE(li), rt = cnp.PyArray_TYPE(ri)
    cdef const uint64_t *sla = <const uint64_t *>cnp.PyArray_DATA(laddrs)
    cdef const uint64_t *sll = <const uint64_t *>cnp.PyArray_DATA(llens)
    cdef const uint64_t *sra = <const uint64_t *>cnp.PyArray_DATA(raddrs)
    cdef const uint64_t *srl = <const uint64_t *>cnp.PyArray_DATA(rlens)
    # built in scratch (the stack for up to PICK_STACK picks), then copied
    # into three columns of the merged length: one allocation each
    cdef uint64_t stack[3 * PICK_STACK]
    cdef uint64_t *dla = stack
    if k > PICK_STACK:
        dla = <uint64_t *>malloc(3 * k * sizeof(uint64_t))
        if dla == NULL:
            raise MemoryError()
    cdef uint64_t *dra = dla + (k if k > PICK_STACK else PICK_STACK)
    cdef uint64_t *dln = dra + (k if k > PICK_STACK else PICK_STACK)
    try:
        for j in range(k):
            a = index_at(lip, lt, j)
            b = index_at(rip, rt, j)
            if a < 0 or a >= nl:
                raise IndexError(f"local index {a if a >= 0 else local_idx[j]} at position {j} is outside "
                                 f"its list of {nl}")
            if b < 0 or b >= nr:
                raise IndexError(f"remote index {b if b >= 0 else remote_idx[j]} at position {j} is outside "
                                 f"its list of {nr}")
            if mismatch < 0 and sll[a] != srl[b]:
                mismatch = j
            if merge and m > 0 and lsp[a] == lsp[pa] and rsp[b] == rsp[pb] and \
                    dla[m - 1] + dln[m - 1] == sla[a] and dra[m - 1] + dln[m - 1] == sra[b]:
                dln[m - 1] += sll[a]        # continues the previous entry on both sides, in the same regions
            else:
                dla[m] = sla[a]
                dra[m] = sra[b]
                dln[m] = sll[a]
                m += 1
            pa, pb = a, b
        dims[0] = m
        la = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        ra = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        ln = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        memcpy(cnp.PyArray_DATA(la), dla, m * sizeof(uint64_t))
        memcpy(cnp.PyArray_DATA(ra), dra, m * sizeof(uint64_t))
        memcpy(cnp.PyArray_DATA(ln), dln, m * sizeof(uint64_t))
    finally:
        if dla != stack:
            free(dla)
    return la, ra, ln, mismatch


cdef class TcpChannel(Channel):
    """The tcp provider toward one peer: several connected data sockets, each
    with a native sender and receiver thread."""

    cdef kvf_tcp_channel *ch
    cdef readonly int ack_fd
    cdef int nfds
    cdef public double poll_ewma_ns    # recent time to a polled completion (a round trip)
    cdef public uint64_t poll_max_ns   # 0: never poll on the caller's thread

    def __init__(self, Core core, RemoteTable table, str peer, fds, int ack_fd, uint64_t slice_size,
                 int express=-1, uint64_t window=0):
        cdef int n = len(fds), i
        cdef int *v = <int *>malloc(n * sizeof(int))
        if v == NULL:
            raise MemoryError()
        for i in range(n):
            v[i] = fds[i]
        cdef kvf_ctx *c = core._ctx()
        with nogil:
            self.ch = kvf_tcp_channel_new(c, &table.t, v, n, ack_fd, slice_size, express, window)
        free(v)
        if self.ch == NULL:
            raise MemoryError()
        self.cch = <kvf_channel *>self.ch
        self.ack_fd = ack_fd
        self.nfds = n
        self.poll_ewma_ns = TCP_POLL_MIN_NS
        self.poll_max_ns = TCP_POLL_MAX_NS

    def __dealloc__(self):
        if self.ch != NULL:
            self.cch = NULL
            with nogil:
                kvf_channel_free(<kvf_channel *>self.ch)
            self.ch = NULL

    cdef uint64_t _poll_budget(self, uint64_t total):
        # Awaited small batches on an idle channel with an ack connection
        # wait for their ack on this thread (kvf_submit_poll, tcp_poll):
        # a few round trips at most; never while other batches are in
        # flight, which would wait behind this one on the loop.
        if total > TCP_POLL_MAX_BYTES or not self.poll_max_ns or self.ch == NULL or \
                not kvf_tcp_channel_idle(self.ch):
            return 0
        return <uint64_t>min(max(3 * self.poll_ewma_ns, TCP_POLL_MIN_NS), self.poll_max_ns)

    cdef _polled(self, uint64_t budget, uint64_t took):
        # a miss counts as the whole budget, so a slow peer widens it up to poll_max_ns
        self.poll_ewma_ns = 0.8 * self.poll_ewma_ns + 0.2 * took

    def poll_acks(self):
        """Reads waiting write acks (event loop thread; never blocks). Their
        completions skip the eventfd: the caller drains the core right
        after. Returns False once the ack connection is gone."""
        cdef int rc
        if self.ch == NULL:
            return False
        cdef kvf_ctx *c = self.core._ctx()
        with nogil:
            kvf_set_loop_thread(c, 1)
            rc = kvf_tcp_poll_acks(self.ch)
            kvf_set_loop_thread(c, 0)
        return rc == 0

    def poll_acks_here(self, uint64_t batch_id=0, double budget=0.0):
        """poll_acks() for a thread that is not the loop's, polling for its
        own detached batches (PostedTransfer): their acks finish them here,
        with no wait for the loop; completions of the loop's batches go to
        it as usual. With a batch and a budget (seconds), it keeps reading,
        yielding the CPU, until that batch finished or the budget passed:
        the ack is a round trip away, and the GIL stays released meanwhile
        (a GIL hand-off to the loop's thread and back would cost two
        wake-ups). Returns False once the ack connection is gone."""
        cdef int rc = 0
        cdef uint64_t until = mono_ns() + <uint64_t>(budget * 1e9) if budget > 0 else 0
        cdef kvf_ctx *c = self.core._ctx()
        if self.ack_fd < 0 or not self._enter():
            return False
        try:
            with nogil:
                rc = kvf_tcp_poll_acks(self.ch)
                while rc == 0 and batch_id and until and not kvf_batch_finished(c, batch_id) \
                        and mono_ns() < until:
                    sched_yield()
                    rc = kvf_tcp_poll_acks(self.ch)
        finally:
            self._leave()
        return rc == 0

    @property
    def alive(self):
        return self.ch != NULL and kvf_tcp_channel_alive(self.ch)

    @property
    def nconns(self):
        return self.nfds

    def dead_conns(self):
        """Indexes of the data connections that failed (their slices moved
        to the others) and wait for replace()."""
        if self.ch == NULL:
            return []
        return [i for i in range(self.nfds) if kvf_tcp_channel_conn_dead(self.ch, i) == 1]

    def check_reach(self, double grace):
        """Fails the data connections whose peer's kernel answered nothing
        for `grace` seconds on this look and the last (a rail or host that
        is gone; a slow peer never is): their slices move to the others.
        Returns how many. The caller looks every fraction of the grace."""
        cdef uint32_t ms = <uint32_t>(grace * 1000)
        cdef int n
        if self.ch == NULL or ms == 0:
            return 0
        with nogil:
            n = kvf_tcp_channel_check_reach(self.ch, ms)
        return n

    def conn_stats(self):
        """Per data connection: up, payload bytes sent, slices moved away
        when it failed, failures, fences (fence frames it sent for failed
        connections whose work it took); its queue: slices and bytes
        waiting for it (queued_slices, queued_bytes) and slices sent and
        not yet acknowledged (inflight_slices)."""
        cdef uint64_t sent = 0, moved = 0, failures = 0, fences = 0
        cdef uint64_t q[3]
        cdef int i, dead
        out = []
        if self.ch == NULL:
            return out
        for i in range(self.nfds):
            dead = kvf_tcp_channel_conn_stats(self.ch, i, &sent, &moved, &failures, &fences)
            kvf_tcp_channel_conn_queue(self.ch, i, q)
            out.append({"up": dead == 0, "bytes": sent, "moved": moved, "failures": failures, "fences": fences,
                        "queued_slices": q[0], "queued_bytes": q[1], "inflight_slices": q[2]})
        return out

    def credit_stats(self):
        """Per data connection, its receiver credits (when the target has a
        receive window): credit held, asked for, waits for credit, grants,
        recalls, and the slice length it waits to afford (0: none)."""
        cdef uint64_t v[6]
        cdef int i
        out = []
        if self.ch == NULL:
            return out
        for i in range(self.nfds):
            if kvf_tcp_channel_credit_stats(self.ch, i, v) == 0:
                out.append({"credit": v[0], "asked": v[1], "waits": v[2], "grants": v[3],
                            "recalls": v[4], "need": v[5]})
        return out

    def replace(self, int index, int fd):
        """Hands a new connected socket (hello done) to dead connection
        `index`; the channel owns fd afterwards (closed on failure too)."""
        cdef int rc
        if self.ch == NULL:
            os.close(fd)
            return False
        with nogil:
            rc = kvf_tcp_channel_replace(self.ch, index, fd)
        if rc == KVF_EINVAL:
            os.close(fd)
        return rc == 0

    def close(self):
        """Fails what is still queued or in flight, joins the threads, closes
        the sockets. Idempotent."""
        with self.use_lock:
            self._quiesce()
            if self.ch != NULL:
                self.cch = NULL
                with nogil:
                    kvf_channel_free(<kvf_channel *>self.ch)
                self.ch = NULL


cdef class SchedQueue:
    """One scheduled queue of an engine's core (kvflow/_native/sched.c),
    outside any channel: for tests and for looking at the order the
    scheduler gives. batch() allocates a batch with a class and a deadline,
    push() queues one of its slices, pop() takes the next ones in the
    scheduler's order as (slot, entry, length) (slot: the batch id's low
    32 bits), done() finishes a
    popped slice. Core.cancel() drops a batch's queued slices from it as
    from every other queue of the engine."""

    cdef Core core
    cdef kvf_queue q
    cdef bint ready

    def __cinit__(self, Core core):
        self.core = core
        if kvf_queue_init_sched(&self.q, core._ctx(), 0, NULL) != KVF_OK:
            raise MemoryError()
        self.ready = True

    def __dealloc__(self):
        if self.ready:
            # (a freed context forgot it already: kvf_sched_orphan_all)
            kvf_queue_destroy(&self.q)
            self.ready = False

    def batch(self, uint64_t nslices, int prio=KVF_PRIO_NORMAL, uint64_t deadline_ns=0):
        """A new batch of `nslices` slices (its guard released: it completes
        once that many were done()). Returns its id."""
        cdef uint64_t bid
        cdef kvf_qos qos
        cdef kvf_ctx *c = self.core._ctx()
        qos.prio = prio
        qos.deadline_ns = deadline_ns
        if kvf_batch_alloc(c, nslices, &bid) != KVF_OK:
            raise MemoryError("out of batch slots")
        kvf_batch_set_qos(c, bid, &qos)
        kvf_batch_release_guard(c, bid)
        return bid

    def push(self, uint64_t batch_id, uint64_t length, uint64_t entry=0):
        cdef kvf_slice s
        memset(&s, 0, sizeof(s))
        s.len = length
        s.entry = entry
        s.slot = <uint32_t>batch_id
        self.core._ctx()
        if kvf_queue_push(&self.q, &s) != KVF_OK:
            raise MemoryError()

    def pop(self, size_t max=1, budget=None):
        """The next `max` slices (at most 64). With `budget` (bytes), the
        strict budget a sender holding credit pops with: slices (all are
        writes here) take at most that many bytes in all, and the pop stops
        at the first that does not fit; returns (slices, the length of
        that one or 0)."""
        cdef kvf_slice out[64]
        cdef size_t n, i
        cdef kvf_pop_budget b
        self.core._ctx()
        if budget is None:
            n = kvf_queue_pop(&self.q, out, max if max < 64 else 64)
            return [(out[i].slot, out[i].entry, out[i].len) for i in range(n)]
        b.bytes = budget
        b.op = KVF_OP_WRITE
        b.blocked = 0
        n = kvf_queue_pop_fit(&self.q, out, max if max < 64 else 64, 0, &b)
        return [(out[i].slot, out[i].entry, out[i].len) for i in range(n)], b.blocked

    def done(self, uint64_t batch_id, uint64_t entry=0, int status=KVF_OK):
        kvf_slice_done(self.core._ctx(), <uint32_t>batch_id, status, entry)

    def __len__(self):
        return self.q.count

    @property
    def bytes(self):
        return self.q.bytes
