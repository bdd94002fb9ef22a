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


# The rest of the module, one job a file. Included rather than cimported as
# modules of their own: kvflow._core stays one extension, so the C core is
# linked once and its static state (the context, batch table, schedulers)
# exists once, and the classes keep sharing cdef helpers without a C-API.
include "_core_channel.pxi"
include "_core_local.pxi"
include "_core_pairs.pxi"
include "_core_tcp.pxi"
include "_core_sched.pxi"
