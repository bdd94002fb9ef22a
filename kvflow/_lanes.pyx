# cython: boundscheck=False, wraparound=False
"""Relay lanes in shared memory (kvflow.paths.relay.lanes): one segment per relay
member, `lanes` lanes of `slots` slots each, filled by the node's other
ranks (producers, several threads each) and drained by the member (the one
consumer). Every index and offset is checked here; Python never touches
the mapping's raw words.

Layout (each part 64-byte aligned; all counters uint64, accessed with
atomics since several processes map the segment):

    header   magic, version, lanes, slots, slot_bytes, meta_bytes, size,
             consumer pid; the bell (a futex word producers ring after
             each doorbell, so the consumer sleeps while nothing comes)
    lane i   owner (pid of the producer process; 0 = free), reserve (the
             next ticket: producers fetch_add it), consumed (the next
             ticket the consumer takes; only it writes it)
    slot     ready (ticket + 1 once the slot holds ticket's bytes: the
             doorbell), done (ticket + 1 once the consumer finished it),
             status (0 or an error code; the text in the meta area),
             collected (ticket + 1 once its producer read the status)
    meta     per slot, meta_bytes: [u32 n][n bytes of the request]
             ... and, in its last ERROR_BYTES, [u32 n][n bytes of error text]
    data     per slot, slot_bytes

Memory orders (the argument for each pair; __atomic builtins):
  - ticket t of a lane uses slot t % slots. A producer may write the slot
    once load_acquire(collected) == t - slots + 1 (or t < slots): the
    previous ticket's producer stored that with release after it had read
    the status, which it read after load_acquire(done), which the consumer
    stored with release after the write that read the slot's old bytes had
    completed; so the old bytes were read, and their status taken, before
    new ones are written (no slot is overwritten before it was consumed:
    the credit). Threads of one process share a lane, so ticket t + slots
    may belong to another thread than t: without `collected`, t's status
    could be overwritten before t's thread looked.
  - the producer writes the data and the request, then store_release(ready,
    t + 1) (the doorbell). The consumer's load_acquire(ready) == t + 1 makes
    those writes visible before it reads them: a half-copied slot is never
    posted (its doorbell is not rung yet).
  - the consumer writes status and error text, then store_release(done,
    t + 1); the producer's load_acquire(done) == t + 1 sees them.
  - reserve is fetch_add (acq_rel): threads of one producer get distinct
    tickets. The consumer takes a lane's tickets in order, so a ticket
    taken and not yet published holds back the later ones of that lane only
    (other lanes go on); its producer publishes it unless its process died,
    and a dead producer's lane is reclaimed whole (reclaim()).
  - owner: compare_exchange 0 -> pid claims a lane; the producer stores 0
    when it leaves with nothing outstanding; the consumer resets a lane
    whose owner process is gone once it has finished what it took.
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.string cimport memcpy, memset
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from posix.unistd cimport ftruncate, close
from posix.fcntl cimport O_RDWR, O_CREAT, O_EXCL

import os

cdef extern from "<sys/mman.h>" nogil:
    int shm_open(const char *name, int oflag, int mode)
    int shm_unlink(const char *name)

cdef extern from "_native/atomics.h" nogil:
    unsigned long long kvf_ld_acq(unsigned long long *p)
    void kvf_st_rel(unsigned long long *p, unsigned long long v)
    unsigned long long kvf_fetch_add(unsigned long long *p, unsigned long long v)
    int kvf_cas(unsigned long long *p, unsigned long long expect, unsigned long long v)
    void kvf_ring(unsigned int *bell)
    unsigned int kvf_bell(unsigned int *bell)
    void kvf_fence_rel()
    void kvf_wait_bell(unsigned int *bell, unsigned int seen, long timeout_ns)

cdef extern from *:
    """
    #include "_native/atomics.h"
    /* kvf_ring as a CUDA host function (CUhostFn: void (*)(void *)): a
       stream rings the bell after the doorbell it wrote (cuLaunchHostFunc) */
    static void kvf_ring_host(void *bell) { kvf_ring((unsigned int *)bell); }
    static unsigned long long kvf_ring_host_addr(void) { return (unsigned long long)(size_t)&kvf_ring_host; }
    """
    unsigned long long kvf_ring_host_addr() nogil

DEF MAGIC = 0x6b76666c6f776c6e    # "kvflowln"
DEF VERSION = 1
DEF ALIGN = 64
DEF HEADER = 4096
DEF LANE_BYTES = 192               # owner, reserve, consumed: a cache line each
DEF SLOT_BYTES = 256               # ready, done, status, collected: a cache line each
DEF E_BYTES = 1024                 # the end of a slot's meta area: the consumer's error text
ERROR_BYTES = E_BYTES
# the address of `void ring(void *bell)`: what a CUDA stream calls (cuLaunchHostFunc,
# with Lanes.bell_addr) to wake the consumer after a doorbell it wrote itself
RING_FN = kvf_ring_host_addr()

# header words
DEF H_MAGIC = 0
DEF H_VERSION = 1
DEF H_LANES = 2
DEF H_SLOTS = 3
DEF H_SLOT_BYTES = 4
DEF H_META_BYTES = 5
DEF H_SIZE = 6
DEF H_CONSUMER = 7
DEF H_BELL = 8                     # the consumer's futex word (a cache line of its own: words 8..15)


class LaneError(Exception):
    """A lane segment that cannot be made, opened or used as asked."""


cdef inline uint64_t up(uint64_t n) nogil:
    return (n + ALIGN - 1) & ~(<uint64_t>ALIGN - 1)


cdef class Lanes:
    """One member's lane segment, created by the member (create=True) or
    opened by a producer. `name` is the shm name ("/kvflow-...")."""

    cdef char *base
    cdef uint64_t mapped                # what mmap mapped (munmap's length)
    cdef readonly uint64_t size
    cdef readonly uint32_t lanes, slots
    cdef readonly uint64_t slot_bytes, meta_bytes
    cdef uint64_t lane_off, slot_off, meta_off, data_off
    cdef readonly str name
    cdef readonly bint owner

    def __cinit__(self):
        self.base = NULL

    def __init__(self, str name, *, bint create=False, uint32_t lanes=0, uint32_t slots=0,
                 uint64_t slot_bytes=0, uint64_t meta_bytes=0):
        cdef bytes bname = name.encode()
        cdef int fd
        cdef uint64_t *h
        cdef void *p
        cdef uint64_t size
        if not name.startswith("/") or "/" in name[1:] or len(bname) > 200:
            raise LaneError(f"a lane segment's name is /word, not {name!r}")
        self.name, self.owner = name, create
        if create:
            if lanes < 1 or lanes > 256 or slots < 1 or slots > 1024 or slot_bytes < 4096 or \
                    slot_bytes > (1 << 30) or meta_bytes < E_BYTES + 4096 or meta_bytes > (1 << 24):
                raise LaneError(f"lanes 1..256, slots 1..1024, slot_bytes 4 KiB..1 GiB, meta_bytes "
                                f"{E_BYTES + 4096}..16 MiB; not {lanes}, {slots}, {slot_bytes}, {meta_bytes}")
            self._layout(lanes, slots, up(slot_bytes), up(meta_bytes))
            fd = shm_open(bname, O_RDWR | O_CREAT | O_EXCL, 0o600)
            if fd < 0:
                raise LaneError(f"shm_open {name}: {os.strerror(_errno())}")
            if ftruncate(fd, self.size) != 0:
                err = _errno()
                close(fd)
                shm_unlink(bname)
                raise LaneError(f"ftruncate {name} to {self.size}: {os.strerror(err)}")
        else:
            fd = shm_open(bname, O_RDWR, 0)
            if fd < 0:
                raise LaneError(f"shm_open {name}: {os.strerror(_errno())}")
            size = os.fstat(fd).st_size
            if size < HEADER:
                close(fd)
                raise LaneError(f"{name}: {size} bytes, not a lane segment")
            self.size = size
        p = mmap(NULL, self.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        close(fd)
        self.mapped = self.size
        if p == MAP_FAILED:
            if create:
                shm_unlink(bname)
            raise LaneError(f"mmap {name}: {os.strerror(_errno())}")
        self.base = <char *>p
        h = <uint64_t *>self.base
        if create:
            memset(self.base, 0, HEADER + <uint64_t>self.lanes * LANE_BYTES + <uint64_t>self.lanes * self.slots * SLOT_BYTES)
            h[H_VERSION], h[H_LANES], h[H_SLOTS] = VERSION, self.lanes, self.slots
            h[H_SLOT_BYTES], h[H_META_BYTES], h[H_SIZE] = self.slot_bytes, self.meta_bytes, self.size
            h[H_CONSUMER] = os.getpid()
            kvf_st_rel(<unsigned long long *>&h[H_MAGIC], MAGIC)     # last: openers see a whole header
        else:
            if kvf_ld_acq(<unsigned long long *>&h[H_MAGIC]) != MAGIC or h[H_VERSION] != VERSION:
                self.close()
                raise LaneError(f"{name} is not a kvflow lane segment (version {VERSION})")
            if not (1 <= h[H_LANES] <= 256 and 1 <= h[H_SLOTS] <= 1024):
                self.close()
                raise LaneError(f"{name}: a malformed header")
            self._layout(<uint32_t>h[H_LANES], <uint32_t>h[H_SLOTS], h[H_SLOT_BYTES], h[H_META_BYTES])
            if self.size != h[H_SIZE] or self.size > size:
                self.close()
                raise LaneError(f"{name}: its header says {h[H_SIZE]} bytes, the segment has {size}")

    cdef _layout(self, uint32_t lanes, uint32_t slots, uint64_t slot_bytes, uint64_t meta_bytes):
        self.lanes, self.slots, self.slot_bytes, self.meta_bytes = lanes, slots, slot_bytes, meta_bytes
        self.lane_off = HEADER
        self.slot_off = up(self.lane_off + <uint64_t>lanes * LANE_BYTES)
        self.meta_off = up(self.slot_off + <uint64_t>lanes * slots * SLOT_BYTES)
        self.data_off = up(self.meta_off + <uint64_t>lanes * slots * meta_bytes)
        self.size = self.data_off + <uint64_t>lanes * slots * slot_bytes

    def retire(self):
        """The consumer stops: its pid in the header becomes 0, so producers
        waiting on its lanes know it is gone (while its process lives on)."""
        if self.base != NULL:
            kvf_st_rel(<unsigned long long *>&(<uint64_t *>self.base)[H_CONSUMER], 0)

    def close(self):
        """Unmaps (and, for the creator, unlinks) the segment."""
        if self.base != NULL:
            munmap(self.base, self.mapped)
            self.base = NULL
        if self.owner:
            shm_unlink(self.name.encode())
            self.owner = False

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.mapped)

    # ------------------------------------------------------------ words
    cdef inline unsigned long long *_lane(self, uint32_t lane, int word) except NULL:
        if self.base == NULL:
            raise LaneError("the lane segment is closed")
        if lane >= self.lanes:
            raise LaneError(f"lane {lane} of {self.lanes}")
        return <unsigned long long *>(self.base + self.lane_off + <uint64_t>lane * LANE_BYTES + word * ALIGN)

    cdef inline unsigned long long *_slot(self, uint32_t lane, uint64_t ticket, int word) except NULL:
        if self.base == NULL:
            raise LaneError("the lane segment is closed")
        if lane >= self.lanes:
            raise LaneError(f"lane {lane} of {self.lanes}")
        return <unsigned long long *>(self.base + self.slot_off
                                      + (<uint64_t>lane * self.slots + ticket % self.slots) * SLOT_BYTES + word * ALIGN)

    cdef inline char *_meta(self, uint32_t lane, uint64_t ticket):
        return self.base + self.meta_off + (<uint64_t>lane * self.slots + ticket % self.slots) * self.meta_bytes

    @property
    def consumer_pid(self):
        """The consumer's pid; 0 once it retired (or this mapping is closed)."""
        if self.base == NULL:
            return 0
        return kvf_ld_acq(<unsigned long long *>&(<uint64_t *>self.base)[H_CONSUMER])

    @property
    def data_addr(self):
        """Where the slots' data starts (the member registers it with its engine)."""
        return <uint64_t>self.base + self.data_off if self.base != NULL else 0

    @property
    def data_bytes(self):
        return <uint64_t>self.lanes * self.slots * self.slot_bytes

    @property
    def base_addr(self):
        """Where the segment is mapped in this process (page-aligned)."""
        return <uint64_t>self.base if self.base != NULL else 0

    @property
    def control_bytes(self):
        """The header, lane and slot words from base_addr, in whole pages:
        what a producer maps for its GPU (cuMemHostRegister) so that a
        stream can write the doorbells."""
        return (self.meta_off + 4095) & ~(<uint64_t>4095)

    @property
    def bell_addr(self):
        """The bell's address in this mapping (RING_FN's argument)."""
        return <uint64_t>self.base + H_BELL * 8 if self.base != NULL else 0

    def ready_addr(self, uint32_t lane, uint64_t ticket):
        """The address in this mapping of ticket's doorbell word: the
        consumer takes the slot once it holds ticket + 1."""
        return <uint64_t>self._slot(lane, ticket, 0)

    def slot_index(self, uint32_t lane, uint64_t ticket):
        """Ticket's slot, counted over the whole segment (lane-major): where
        its data lies in a slot area of the same shape elsewhere (a member's
        device lanes)."""
        self._slot(lane, ticket, 0)
        return <uint64_t>lane * self.slots + ticket % self.slots

    def slot_addr(self, uint32_t lane, uint64_t ticket):
        """The address of ticket's slot's data in this process's mapping."""
        self._slot(lane, ticket, 0)
        return <uint64_t>self.base + self.data_off + (<uint64_t>lane * self.slots + ticket % self.slots) * self.slot_bytes

    # ------------------------------------------------------------ lanes
    def claim(self, uint64_t pid):
        """A free lane for producer process `pid` (compare-exchange 0 -> pid),
        or -1 when every lane is taken."""
        cdef uint32_t i
        for i in range(self.lanes):
            if kvf_cas(self._lane(i, 0), 0, pid):
                return i
        return -1

    def owner_of(self, uint32_t lane):
        return kvf_ld_acq(self._lane(lane, 0))

    def leave(self, uint32_t lane, uint64_t pid):
        """The producer gives its lane back (nothing of it outstanding)."""
        kvf_cas(self._lane(lane, 0), pid, 0)

    def reclaim(self, uint32_t lane):
        """The consumer resets a lane whose producer is gone, once it has
        finished every ticket it took: counters and slots to zero, then the
        lane free (release: a new owner sees it whole)."""
        cdef uint64_t t
        cdef unsigned long long *w = self._lane(lane, 0)
        self._lane(lane, 1)[0] = 0
        self._lane(lane, 2)[0] = 0
        for t in range(self.slots):
            for word in range(4):
                self._slot(lane, t, word)[0] = 0
        kvf_st_rel(w, 0)

    # ------------------------------------------------------------ producer
    def reserve(self, uint32_t lane):
        """The next ticket of `lane` (several threads may call it at once)."""
        return kvf_fetch_add(self._lane(lane, 1), 1)

    def credit(self, uint32_t lane, uint64_t ticket):
        """Whether ticket's slot is free: its previous ticket was consumed
        and collected."""
        if ticket < self.slots:
            return True
        return kvf_ld_acq(self._slot(lane, ticket, 3)) == ticket - self.slots + 1

    def fill(self, uint32_t lane, uint64_t ticket, addrs, offsets, lengths, bytes request):
        """Copies [addrs[i], +lengths[i]) of this process's memory to
        offsets[i] in ticket's slot, writes the request, and rings the
        doorbell. The caller has checked the source ranges (they are this
        engine's registered memory) and the credit."""
        cdef unsigned long long *ready = self._slot(lane, ticket, 0)
        cdef char *dst = <char *>(<uint64_t>self.slot_addr(lane, ticket))
        cdef char *meta = self._meta(lane, ticket)
        cdef Py_ssize_t n = len(addrs), i
        cdef uint64_t a, off, ln
        cdef uint32_t rn = len(request)
        if len(offsets) != n or len(lengths) != n:
            raise LaneError("fill: addrs, offsets and lengths differ in length")
        if rn + 4 > self.meta_bytes - E_BYTES:
            raise LaneError(f"fill: a request of {rn} bytes does not fit the slot's {self.meta_bytes - E_BYTES}")
        for i in range(n):
            off, ln = offsets[i], lengths[i]
            if off > self.slot_bytes or ln > self.slot_bytes - off:
                raise LaneError(f"fill: {off}+{ln} is outside the slot of {self.slot_bytes}")
        for i in range(n):
            a, off, ln = addrs[i], offsets[i], lengths[i]
            with nogil:
                memcpy(dst + off, <const void *>a, ln)
        memcpy(meta, &rn, 4)
        memcpy(meta + 4, <const char *>request, rn)
        kvf_st_rel(ready, ticket + 1)                   # the doorbell: after the copy
        kvf_ring(<unsigned int *>&(<uint64_t *>self.base)[H_BELL])     # and the consumer woken

    def publish(self, uint32_t lane, uint64_t ticket, bytes request):
        """Writes ticket's request and does not ring its doorbell: for a
        slot whose data another agent copies, which then writes the doorbell
        itself, ordered after its copy (a CUDA stream: cuStreamWriteValue64
        of ticket + 1 at ready_addr, then RING_FN(bell_addr)). The request's
        stores come before the release fence, and the fence before the call
        that queues the copy and the doorbell: by the time the agent writes
        the doorbell, which the consumer reads with acquire, they are
        visible. The caller has checked the credit."""
        cdef char *meta
        cdef uint32_t rn = len(request)
        self._slot(lane, ticket, 0)                     # the segment open, the lane in range
        meta = self._meta(lane, ticket)
        if rn + 4 > self.meta_bytes - E_BYTES:
            raise LaneError(f"publish: a request of {rn} bytes does not fit the slot's {self.meta_bytes - E_BYTES}")
        memcpy(meta, &rn, 4)
        memcpy(meta + 4, <const char *>request, rn)
        kvf_fence_rel()

    def collect(self, uint32_t lane, uint64_t ticket):
        """None while ticket is not done; else (code, error text), and the
        slot is given back (its next ticket may fill it). The producer
        collects each of its tickets once."""
        cdef uint32_t en
        cdef char *meta
        if kvf_ld_acq(self._slot(lane, ticket, 1)) != ticket + 1:
            return None
        code = <int64_t>self._slot(lane, ticket, 2)[0]
        text = ""
        if code != 0:
            meta = self._meta(lane, ticket) + self.meta_bytes - E_BYTES
            memcpy(&en, meta, 4)
            en = min(en, E_BYTES - 4)
            text = meta[4:4 + en].decode("utf-8", "replace")
        kvf_st_rel(self._slot(lane, ticket, 3), ticket + 1)    # after the reads: the slot is free
        return code, text

    # ------------------------------------------------------------ consumer
    def bell(self):
        """The bell's count now (rung once per filled slot)."""
        if self.base == NULL:
            raise LaneError("the lane segment is closed")
        return kvf_bell(<unsigned int *>&(<uint64_t *>self.base)[H_BELL])

    def wait_bell(self, unsigned int seen, double timeout):
        """Blocks (GIL released) until the bell rang since it read `seen`,
        or `timeout` seconds passed; the consumer's, from a thread."""
        if self.base == NULL:
            raise LaneError("the lane segment is closed")
        cdef unsigned int *bell = <unsigned int *>&(<uint64_t *>self.base)[H_BELL]
        cdef long ns = <long>(timeout * 1e9)
        with nogil:
            kvf_wait_bell(bell, seen, ns)

    def ring(self):
        """Rings the bell without a slot (wakes a waiting consumer: close)."""
        if self.base != NULL:
            kvf_ring(<unsigned int *>&(<uint64_t *>self.base)[H_BELL])

    def take(self, uint32_t lane):
        """The lane's next ticket if its doorbell rang, with its request
        bytes: (ticket, request), else None. The consumer's alone."""
        cdef unsigned long long *consumed = self._lane(lane, 2)
        cdef uint64_t t = consumed[0]
        cdef uint32_t rn
        cdef char *meta
        if kvf_ld_acq(self._slot(lane, t, 0)) != t + 1:
            return None
        meta = self._meta(lane, t)
        memcpy(&rn, meta, 4)
        if rn > self.meta_bytes - E_BYTES - 4:
            rn = 0                                      # malformed: the request's check refuses it
        consumed[0] = t + 1
        return t, meta[4:4 + rn]

    def state(self, uint32_t lane):
        """What a lane's counters say now, for anyone to read (stats, tests):
        reserved (tickets handed out), taken (by the consumer), rung (the
        highest ticket + 1 whose doorbell rang), done (the highest finished
        + 1) and collected (the highest collected + 1)."""
        cdef uint32_t i
        rung = done = collected = 0
        for i in range(self.slots):
            rung = max(rung, kvf_ld_acq(self._slot(lane, i, 0)))
            done = max(done, kvf_ld_acq(self._slot(lane, i, 1)))
            collected = max(collected, kvf_ld_acq(self._slot(lane, i, 3)))
        return {"owner": kvf_ld_acq(self._lane(lane, 0)), "reserved": kvf_ld_acq(self._lane(lane, 1)),
                "taken": kvf_ld_acq(self._lane(lane, 2)), "rung": rung, "done": done, "collected": collected}

    def pending(self, uint32_t lane):
        """Tickets reserved and not yet taken (published or not)."""
        return kvf_ld_acq(self._lane(lane, 1)) - self._lane(lane, 2)[0]

    def finish(self, uint32_t lane, uint64_t ticket, int64_t code=0, str error=""):
        """The consumer is done with ticket (its bytes landed, or `code`
        says why not): status and text, then done (release)."""
        cdef bytes text = error.encode()[:E_BYTES - 4]
        cdef uint32_t en = len(text)
        cdef char *meta = self._meta(lane, ticket) + self.meta_bytes - E_BYTES
        memcpy(meta, &en, 4)
        memcpy(meta + 4, <const char *>text, en)
        self._slot(lane, ticket, 2)[0] = <uint64_t>code
        kvf_st_rel(self._slot(lane, ticket, 1), ticket + 1)


cdef extern from "<errno.h>":
    int errno


cdef int _errno():
    return errno
