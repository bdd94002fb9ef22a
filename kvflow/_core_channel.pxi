# Included by _core.pyx (one module, one native image): the Channel base
# every provider's channel derives from (kvflow._verbs' RdmaChannel too),
# and the batch columns it hands to C.

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
        return self._submit(op, local_addrs, remote_addrs, lengths, False, prio, deadline_ns, False)[:3]

    def submit_detached(self, int op, local_addrs, remote_addrs, lengths, int prio=KVF_PRIO_NORMAL,
                        uint64_t deadline_ns=0):
        """submit() for a thread that then blocks in Core.wait_detached()
        (not the event loop's): the batch never reaches the completion
        ring, so neither the submission nor the completion goes through the
        loop. Safe against a concurrent close(); threads submit side by
        side (none waits for another's inline send)."""
        if not self._enter():
            return KVF_ECLOSED, 0, 0
        try:
            return self._submit(op, local_addrs, remote_addrs, lengths, False, prio, deadline_ns, True)[:3]
        finally:
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
        return self._submit(op, local_addrs, remote_addrs, lengths, poll, prio, deadline_ns, False)

    cdef tuple _submit(self, int op, object local_addrs, object remote_addrs, object lengths, bint poll,
                       int prio, uint64_t deadline_ns, bint detached):
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
        qos.detached = detached
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
