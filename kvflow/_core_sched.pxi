# Included by _core.pyx: a scheduled queue outside any channel, for tests
# and for looking at the order kvflow/_native/sched.c gives.

cdef class SchedQueue:
    """One scheduled queue of an engine's core (kvflow/_native/sched.c),
    outside any channel: for tests and for looking at the order the
    scheduler gives. batch() allocates a batch with a class and a deadline,
    push() queues one of its slices, pop() takes the next ones in the
    scheduler's order as (slot, entry, length) (slot: the batch id's low
    32 bits), done() finishes a
    popped slice. Core.cancel() drops a batch's queued slices from it as
    from every other queue of the engine."""

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
        qos.detached = 0
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
