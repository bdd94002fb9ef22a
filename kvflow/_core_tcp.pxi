# Included by _core.pyx: the tcp provider's channel over
# kvflow/_native/tcp_client.c, and the reach probe on its sockets.

def socket_unanswered(int fd, double grace):
    """Whether the peer's kernel has answered nothing on tcp socket `fd`
    for `grace` seconds while sent bytes or probes wait for an answer
    (_native/sockio.c, sk_unanswered): the host is gone, not slow. One
    look can catch a send's round trip after a long silence: confirm it
    with a second."""
    return sk_unanswered(fd, <uint32_t>(grace * 1000)) == 1




cdef class TcpChannel(Channel):
    """The tcp provider toward one peer: several connected data sockets, each
    with a native sender and receiver thread."""

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
