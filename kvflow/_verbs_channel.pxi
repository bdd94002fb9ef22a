# Included by _verbs.pyx: the event queue the data path reports into, and
# the rdma provider's channel over kvflow/_native/rdma_chan.c.

cdef class Events:
    """Notifications that arrived over the data path and QPs that broke,
    readable through `fileno()` (an eventfd)."""

    def __cinit__(self):
        self.q = kvf_rdma_events_new()
        if self.q == NULL:
            raise MemoryError()

    def fileno(self):
        return kvf_rdma_events_fd(self.q)

    def take(self):
        """[(kind, dev, qpn, qp_index, chan_token, wc_status, data)]"""
        cdef kvf_rdma_event ev[64]
        cdef size_t n, i
        out = []
        if self.q == NULL:
            return out
        while True:
            n = kvf_rdma_events_take(self.q, ev, 64)
            for i in range(n):
                data = ev[i].data[:ev[i].len] if ev[i].data != NULL else b""
                free(ev[i].data)
                out.append((ev[i].kind, ev[i].dev, ev[i].qpn, ev[i].qp_index, ev[i].chan,
                            ev[i].wc_status, data))
            if n < 64:
                return out

    def close(self):
        if self.q != NULL:
            kvf_rdma_events_free(self.q)
            self.q = NULL

    def __dealloc__(self):
        self.close()


cdef class RdmaChannel(Channel):
    """The rdma provider toward one peer: its QPs (several per device pair)
    and the native channel that stripes slices over them."""

    def __init__(self, Core core, RemoteTable table, str peer, uint64_t slice_size, uint64_t token):
        cdef kvf_ctx *c = core._ctx()
        self.ch = kvf_rdma_chan_new(c, &table.t, slice_size, token)
        if self.ch == NULL:
            raise MemoryError()
        self.cch = <kvf_channel *>self.ch
        self.token = token
        self.devs = []
        self.depths = []
        self.poll_ewma_ns = 100_000
        self.poll_max_ns = POLL_MAX_NS

    cdef uint64_t _poll_budget(self, uint64_t total):
        if total > POLL_MAX_BYTES or not self.poll_max_ns or self.ch == NULL:
            return 0
        return <uint64_t>min(max(3 * self.poll_ewma_ns, POLL_MIN_NS), self.poll_max_ns)

    cdef _polled(self, uint64_t budget, uint64_t took):
        # a miss counts as the whole budget, so a slow path widens it
        self.poll_ewma_ns = 0.8 * self.poll_ewma_ns + 0.2 * took

    def add_qp(self, Qp qp, int rdev, bint up=True):
        """Hands a connected QP to the native channel; returns its index.
        up=False: it carries only post_one() work (its probe) until qp_up()."""
        if self.ch == NULL:
            raise VerbsError("channel closed")
        cdef Device d = qp.dev
        cdef int depth = qp.depth
        if d.dev == NULL:
            raise VerbsError(f"{d.name}: device closed")
        cdef ibv_qp *q = qp.take()
        cdef int index = kvf_rdma_chan_add_qp(self.ch, d.dev, <uint32_t>rdev, q, <uint32_t>depth, up)
        if index < 0:
            kvf_rdma_destroy_qp(d.kc, q)
            raise VerbsError(f"{self.peer}: too many queue pairs")
        self.devs.append(d)
        self.depths.append(depth)
        return index

    def replace_qp(self, int index, Qp qp, bint up=True):
        """Puts a newly connected QP in place of broken QP `index`; with
        up=False it carries only post_one() work (its probe) until qp_up().
        A QP destroyed with its device (QP_GONE) takes a QP of the device
        reopened under the same index (another Device object): the slot
        moves to it, with its share of that device's completion queue."""
        if self.ch == NULL:
            raise VerbsError("channel closed")
        cdef Device d = qp.dev
        cdef Device old = self.qp_device(index)
        cdef int depth = self.depths[index]
        cdef int rc
        moved = d is not old
        if moved and not d.reserve(depth):
            return False               # `qp` stays the caller's to destroy
        cdef ibv_qp *q = qp.take()
        with self.use_lock:            # leaving QP_GONE: never at once with close() or drop_device()
            rc = KVF_ECLOSED
            if self.ch != NULL:
                rc = kvf_rdma_chan_replace_qp(self.ch, index, d.dev, q, up)
        if rc != KVF_OK:
            kvf_rdma_destroy_qp(d.kc, q)
            if moved:
                d.release(depth)
            return False
        if moved:
            self.devs[index] = d       # the closed one's share went with it
        return True

    def qp_up(self, int index):
        """Puts probed QP `index` in service; what waited is posted."""
        return self.ch != NULL and kvf_rdma_chan_qp_up(self.ch, index) == KVF_OK

    def break_qp(self, int index):
        """Takes live QP `index` out of service (its work moves to the others)."""
        cdef int rc = -1
        if self.ch != NULL:
            with nogil:
                rc = kvf_rdma_chan_break_qp(self.ch, index)
        return rc == KVF_OK

    def drop_device(self, Device d):
        """Destroys the QPs on device `d` (it is gone): their work moves to
        the other devices' QPs; they are never repaired. Returns how many."""
        cdef int n = 0
        with self.use_lock:                # never at once with close(): see kvf_rdma_chan_close
            if self.ch != NULL and d.dev != NULL:
                with nogil:
                    n = kvf_rdma_chan_drop_dev(self.ch, d.dev)
        return n

    def qp_device(self, int index):
        """The Device of QP `index`. VerbsError once the channel is closed
        (its lists are emptied then; this module does no bounds checks)."""
        if index < 0 or index >= len(self.devs):
            raise VerbsError(f"{self.peer}: no QP {index} (channel closed?)")
        return self.devs[index]

    def post_one(self, int index, int op, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                 uint32_t rkey, uint32_t length):
        """One work request with explicit keys (notify SEND, probe READ);
        returns (status, batch_id)."""
        cdef uint64_t bid = 0
        cdef int rc
        if self.ch == NULL:
            return KVF_ECLOSED, 0
        with nogil:
            rc = kvf_rdma_post_one(self.ch, index, op, laddr, lkey, raddr, rkey, length, &bid)
        return rc, bid

    def qp_stats(self):
        """Per QP: device index, remote device index, state, work requests
        and bytes posted, its verbs QP number (0 once destroyed), and its
        queue under the names tcp connections use: work requests posted and
        not retired (inflight_slices) and their bytes (inflight_bytes),
        slices and bytes waiting to be posted (queued_slices, queued_bytes).
        (Channel.stats() is the batch numbers every channel has.)"""
        cdef uint32_t dev, rdev, qpn
        cdef uint64_t wrs, nbytes
        cdef uint64_t q[4]
        cdef int i, st
        out = []
        if self.ch == NULL:
            return out
        for i in range(kvf_rdma_chan_nqps(self.ch)):
            st = kvf_rdma_chan_qp_stats(self.ch, i, &dev, &rdev, &wrs, &nbytes, &qpn)
            q[0] = q[1] = q[2] = q[3] = 0
            kvf_rdma_chan_qp_queue(self.ch, i, q)
            out.append({"dev": dev, "rdev": rdev, "state": st, "wrs": wrs, "bytes": nbytes, "qpn": qpn,
                        "inflight_slices": q[0], "inflight_bytes": q[1], "queued_slices": q[2],
                        "queued_bytes": q[3]})
        return out

    def set_window(self, uint64_t window):
        """The target's receive window (its accept says it; 0: none):
        write slices then go only against credit it granted, each at most a
        quarter of the window. Before the channel is used."""
        if self.ch != NULL and window:
            kvf_rdma_chan_set_window(self.ch, window)

    def credit_stats(self):
        """Per QP, its receiver credits (when the target has a receive
        window): credit held, asked for, waits for credit, grants, recalls,
        and the slice length it waits to afford (0: none)."""
        cdef uint64_t v[6]
        cdef int i
        out = []
        if self.ch == NULL:
            return out
        for i in range(kvf_rdma_chan_nqps(self.ch)):
            if kvf_rdma_chan_credit_stats(self.ch, i, v) == 0:
                out.append({"credit": v[0], "asked": v[1], "waits": v[2], "grants": v[3],
                            "recalls": v[4], "need": v[5]})
        return out

    @property
    def alive(self):
        return self.ch != NULL

    def close(self):
        """Destroys the QPs (nothing touches memory after this returns) and
        fails what was queued or in flight. Idempotent."""
        with self.use_lock:
            self._quiesce()
            if self.ch != NULL:
                self.cch = NULL
                with nogil:
                    kvf_channel_free(<kvf_channel *>self.ch)
                self.ch = NULL
                for d, depth in zip(self.devs, self.depths):
                    (<Device>d).release(depth)
                self.devs = []
                self.depths = []

    def __dealloc__(self):
        if self.ch != NULL:
            self.cch = NULL
            kvf_channel_free(<kvf_channel *>self.ch)
            self.ch = NULL



def event_name(int event_type):
    """ibv_event_type_str: e.g. "port error", "local catastrophic error"."""
    return ibv_event_type_str(<ibv_event_type>event_type).decode()
