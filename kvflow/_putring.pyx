# cython: boundscheck=False, wraparound=False
"""GPU-initiated puts, proxy mode (issue 21): the ring a kernel appends put
descriptors to and a CPU proxy (kvflow.gpu.proxy) takes them from, in
memory both reach: host memory mapped into the device (cuMemHostAlloc with
DEVICEMAP) for a kernel, any host memory for host producers. The device
side is kvflow/_cuda/putring.cuh; it must agree with the layout here
(tests/test_putring.py compiles a host program against that header and
checks it does).

One ring has `channels` channels of `slots` slots. A channel has exactly
one producer (a kernel's block, a host thread): no atomics are needed
between producers, which matters on a GPU, where a system-scope atomic on
host memory over PCIe is not guaranteed to exist. The proxy is the one
consumer of every channel.

Layout (little-endian, 64-bit words, cache-line aligned):
    header     HEADER bytes: magic, version, channels, slots, size, closed
    channel c  at HEADER + c * (CTL + slots * SLOT):
      line 0   the producer's: head (tickets posted)
      line 1   the proxy's: taken (tickets taken), completed (every ticket
               below it is finished), failed (the first failed ticket + 1,
               sticky), fail_code
      slot i   SLOT bytes, ticket t in slot t % slots:
                 0 seq      t + 1 once the descriptor is whole (the doorbell)
                 8 op (u32) | peer (u32)
                 16 local   24 remote   32 length   40 tag
                 48 status  (0, or a negative code: the proxy's)
                 56 done    t + 1 once finished (the proxy's)

Memory orders:
  - producer: writes op..tag, then store_release(seq, t + 1) (on the
    device: the stores, __threadfence_system(), then the seq store). The
    proxy's load_acquire(seq) == t + 1 makes the fields visible before it
    reads them: a half-written descriptor is never posted.
  - the proxy reads every field at take(), before it posts anything; it
    writes status, then store_release(done, t + 1), then advances
    completed over the finished prefix with store_release. A producer may
    write ticket t's slot once load_acquire(completed) >= t - slots + 1:
    the slot's previous ticket was taken (its fields read) and finished
    (its status written) before completed passed it, so no descriptor is
    overwritten before it was consumed (the credit).
  - a waiter for ticket t: load_acquire(completed) > t, then reads the
    slot's status (valid until its producer posts ticket t + slots; the
    first failure is also kept in failed/fail_code, so none is lost).
  - closed (header): store_release(1) by the proxy when it stops; a
    producer waiting for credit or completion gives up (-ECANCELED).
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.string cimport memset
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

cdef extern from "<sys/mman.h>" nogil:
    int MAP_ANONYMOUS

cdef extern from "_native/atomics.h" nogil:
    unsigned long long kvf_ld_acq(unsigned long long *p)
    void kvf_st_rel(unsigned long long *p, unsigned long long v)

cdef extern from *:
    """
    #include <time.h>
    #include <sched.h>
    static inline double kvr_now(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    #include <sys/prctl.h>
    /* waits: yield first (a nanosleep costs the thread's timer slack, 50 us by
       default, whatever it asks for), then short sleeps, then longer ones */
    static inline void kvr_pause(unsigned int round) {
        if (round < 512) { sched_yield(); return; }
        struct timespec ts = {0, round < 4096 ? 2000 : 20000}; nanosleep(&ts, NULL);
    }
    static inline int kvr_fine_slack(void) { return prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); }
    """
    double kvr_now() nogil
    void kvr_pause(unsigned int round) nogil
    int kvr_fine_slack() nogil

DEF C_MAGIC = 0x3172747570666b76     # "kvfputr1"
DEF C_VERSION = 1
DEF C_HEADER = 256
DEF C_CTL = 128
DEF C_SLOT = 64
MAGIC, VERSION, HEADER, CTL, SLOT = C_MAGIC, C_VERSION, C_HEADER, C_CTL, C_SLOT
OP_PUT = 1                        # a write: local -> remote
OP_GET = 2                        # a read: remote -> local
# statuses the proxy writes (negative errno values, as the device sees them)
OK = 0
E_INVALID = -22                   # EINVAL: unknown op, zero length
E_NO_PEER = -19                   # ENODEV: no peer at that index
E_UNREGISTERED = -14              # EFAULT: the local range is not registered memory
E_REMOTE = -13                    # EACCES: the peer refused the remote range
E_LOST = -104                     # ECONNRESET: the peer was lost
E_TIMEOUT = -110                  # ETIMEDOUT
E_FAILED = -5                     # EIO: anything else
E_CANCELED = -125                 # ECANCELED: the proxy stopped


def fine_timer_slack():
    """Sets the calling thread's timer slack to 1 us (Linux: 50 us by
    default), so that its short sleeps are short: the proxy's thread calls
    it."""
    return kvr_fine_slack() == 0


class PutRingError(Exception):
    """Bad arguments to the ring, or a wait that ran out (the engine's
    layer turns these into KVFlowError subclasses)."""


def ring_bytes(uint32_t channels, uint32_t slots):
    """The bytes a ring of `channels` x `slots` takes."""
    return C_HEADER + <uint64_t>channels * (C_CTL + <uint64_t>slots * C_SLOT)


cdef class PutRing:
    """A put ring over `addr` (memory the caller owns and keeps, e.g. pinned
    host memory mapped into a device), or over an anonymous mapping of its
    own when addr is 0. create=True lays the header out (zeroing it all);
    False attaches to one already laid out there."""

    cdef char *base
    cdef uint64_t size
    cdef bint owned
    cdef readonly uint32_t channels, slots

    def __cinit__(self):
        self.base = NULL
        self.owned = False

    def __init__(self, uint32_t channels=1, uint32_t slots=64, *, uint64_t addr=0, uint64_t size=0,
                 bint create=True):
        cdef void *p
        cdef uint64_t need
        if addr == 0:
            if not create:
                raise PutRingError("attach needs the ring's address")
            if channels == 0 or slots == 0 or channels > 65536 or slots > (1 << 20):
                raise PutRingError(f"a ring of {channels} channels x {slots} slots")
            need = ring_bytes(channels, slots)
            p = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)
            if p == MAP_FAILED:
                raise PutRingError(f"mmap of {need} bytes failed")
            self.base, self.size, self.owned = <char *>p, need, True
        else:
            if addr % 64:
                raise PutRingError(f"the ring's address {addr:#x} is not 64-byte aligned")
            self.base = <char *>addr
            if create:
                if channels == 0 or slots == 0 or channels > 65536 or slots > (1 << 20):
                    raise PutRingError(f"a ring of {channels} channels x {slots} slots")
                need = ring_bytes(channels, slots)
                if size < need:
                    self.base = NULL
                    raise PutRingError(f"{size} bytes at {addr:#x} do not hold a ring of {channels} x {slots} "
                                       f"({need} bytes)")
                self.size = need
            else:
                if size and size < C_HEADER:
                    self.base = NULL
                    raise PutRingError(f"{size} bytes cannot hold a ring's header")
                if self._w(0)[0] != C_MAGIC or self._w(1)[0] != C_VERSION:
                    self.base = NULL
                    raise PutRingError(f"no put ring at {addr:#x}")
                channels, slots = <uint32_t>self._w(2)[0], <uint32_t>self._w(3)[0]
                self.size = self._w(4)[0]
                if size and size < self.size:
                    self.base = NULL
                    raise PutRingError(f"the ring at {addr:#x} needs {self.size} bytes, {size} given")
        self.channels, self.slots = channels, slots
        if create:
            memset(self.base, 0, self.size)
            self._w(1)[0] = C_VERSION
            self._w(2)[0] = channels
            self._w(3)[0] = slots
            self._w(4)[0] = self.size
            self._w(5)[0] = 0
            kvf_st_rel(self._w(0), C_MAGIC)

    def close(self):
        """Unmaps a ring this object mapped; forgets one it was given."""
        if self.base != NULL and self.owned:
            munmap(self.base, self.size)
        self.base = NULL

    def __dealloc__(self):
        if self.base != NULL and self.owned:
            munmap(self.base, self.size)
        self.base = NULL

    @property
    def addr(self):
        """The ring's address in this process (what a kernel is given, after
        the driver's translation where the mapping differs)."""
        return <uint64_t>self.base

    @property
    def nbytes(self):
        return self.size

    cdef inline unsigned long long *_w(self, int word) except NULL:
        if self.base == NULL:
            raise PutRingError("the put ring is closed")
        return <unsigned long long *>(self.base + word * 8)

    cdef inline char *_ch(self, uint32_t channel) except NULL:
        if self.base == NULL:
            raise PutRingError("the put ring is closed")
        if channel >= self.channels:
            raise PutRingError(f"channel {channel} of {self.channels}")
        return self.base + C_HEADER + <uint64_t>channel * (C_CTL + <uint64_t>self.slots * C_SLOT)

    cdef inline unsigned long long *_ctl(self, uint32_t channel, int word) except NULL:
        # words 0..7: the producer's line; 8..15: the proxy's
        return <unsigned long long *>(self._ch(channel) + word * 8)

    cdef inline unsigned long long *_slot(self, uint32_t channel, uint64_t ticket, int word) except NULL:
        return <unsigned long long *>(self._ch(channel) + C_CTL + (ticket % self.slots) * C_SLOT + word * 8)

    # ------------------------------------------------------------ the producer's (a host thread)
    def post(self, uint32_t channel, uint32_t op, uint32_t peer, uint64_t local, uint64_t remote,
             uint64_t length, uint64_t tag=0, double timeout=10.0):
        """Appends one descriptor to `channel` (this thread its only
        producer), waiting up to `timeout` s for a free slot; returns its
        ticket. What the device's kvf_put() does, from the host."""
        cdef unsigned long long *headp = self._ctl(channel, 0)
        cdef unsigned long long *completed = self._ctl(channel, 9)
        cdef unsigned long long *closed = self._w(5)
        cdef uint64_t t = headp[0]
        cdef unsigned long long *s = self._slot(channel, t, 0)
        cdef double until = kvr_now() + timeout
        cdef unsigned int round = 0
        cdef bint ok = True
        with nogil:
            while t >= self.slots and kvf_ld_acq(completed) < t - self.slots + 1:
                if kvf_ld_acq(closed) or kvr_now() > until:
                    ok = False
                    break
                kvr_pause(round)
                round += 1
        if not ok:
            if kvf_ld_acq(closed):
                raise PutRingError("the proxy stopped")
            raise PutRingError(f"channel {channel}: no free slot after {timeout:g} s (the proxy is not taking)")
        s[1] = (<uint64_t>peer << 32) | op
        s[2] = local
        s[3] = remote
        s[4] = length
        s[5] = tag
        kvf_st_rel(s, t + 1)                        # the doorbell, after the fields
        headp[0] = t + 1
        return t

    def wait(self, uint32_t channel, uint64_t ticket, double timeout=10.0):
        """Waits up to `timeout` s for `ticket` of `channel` to finish;
        returns its status (0, or a negative code: E_*). What kvf_put_wait()
        does on the device."""
        cdef unsigned long long *completed = self._ctl(channel, 9)
        cdef unsigned long long *closed = self._w(5)
        cdef unsigned long long *s = self._slot(channel, ticket, 0)
        cdef double until = kvr_now() + timeout
        cdef unsigned int round = 0
        cdef int outcome = 0
        if ticket >= self._ctl(channel, 0)[0]:
            raise PutRingError(f"channel {channel}: ticket {ticket} was never posted")
        with nogil:
            while kvf_ld_acq(completed) <= ticket:
                if kvf_ld_acq(closed):
                    outcome = 1
                    break
                if kvr_now() > until:
                    outcome = 2
                    break
                kvr_pause(round)
                round += 1
        if outcome == 1:
            return E_CANCELED
        if outcome == 2:
            raise PutRingError(f"channel {channel}: ticket {ticket} not finished after {timeout:g} s")
        if kvf_ld_acq(&s[7]) != ticket + 1:
            raise PutRingError(f"channel {channel}: ticket {ticket}'s slot was reused, its status is gone "
                               f"(wait for a ticket before posting {self.slots} more)")
        return <int64_t>s[6]

    # ------------------------------------------------------------ the proxy's
    def take(self, uint32_t channel):
        """The channel's next whole descriptor, as (ticket, op, peer, local,
        remote, length, tag), or None. The proxy's alone."""
        cdef unsigned long long *taken = self._ctl(channel, 8)
        cdef uint64_t t = taken[0]
        cdef unsigned long long *s = self._slot(channel, t, 0)
        cdef uint64_t opeer
        if kvf_ld_acq(s) != t + 1:
            return None
        opeer = s[1]
        d = (t, <uint32_t>(opeer & 0xffffffff), <uint32_t>(opeer >> 32), s[2], s[3], s[4], s[5])
        kvf_st_rel(taken, t + 1)
        return d

    def take_all(self):
        """Every channel's whole descriptors, in ticket order per channel:
        a list of (channel, ticket, op, peer, local, remote, length, tag)."""
        cdef uint32_t c
        out = []
        for c in range(self.channels):
            while True:
                d = self.take(c)
                if d is None:
                    break
                out.append((c,) + d)
        return out

    def wait_any(self, double timeout, bint spin=False):
        """Blocks, the GIL released, until some channel's next descriptor is
        whole (True), or the ring is shut or `timeout` s passed (False).
        spin: never sleep (a core's worth of polling, the lowest latency);
        else yield, then sleep 2 us, then 20 us between looks (with the
        calling thread's timer slack added: fine_timer_slack). The proxy's."""
        cdef uint32_t c
        cdef uint64_t t
        cdef unsigned long long *closed = self._w(5)
        cdef char *ch
        cdef double until = kvr_now() + timeout
        cdef unsigned int round = 0
        cdef bint found = False
        if self.base == NULL:
            raise PutRingError("the put ring is closed")
        with nogil:
            while True:
                for c in range(self.channels):
                    ch = self.base + C_HEADER + <uint64_t>c * (C_CTL + <uint64_t>self.slots * C_SLOT)
                    t = kvf_ld_acq(<unsigned long long *>(ch + 64))
                    if kvf_ld_acq(<unsigned long long *>(ch + C_CTL + (t % self.slots) * C_SLOT)) == t + 1:
                        found = True
                        break
                if found or kvf_ld_acq(closed) or kvr_now() > until:
                    break
                if not spin:
                    kvr_pause(round)
                round += 1
        return found

    def finish(self, uint32_t channel, uint64_t ticket, int64_t status=0):
        """Ticket is finished with `status`: written, then done (release),
        then completed advanced over the finished prefix. The proxy's
        alone; tickets may finish in any order."""
        cdef unsigned long long *s = self._slot(channel, ticket, 0)
        cdef unsigned long long *completed = self._ctl(channel, 9)
        cdef uint64_t c
        if ticket >= self._ctl(channel, 8)[0]:
            raise PutRingError(f"channel {channel}: ticket {ticket} was not taken")
        if kvf_ld_acq(&s[7]) == ticket + 1:
            raise PutRingError(f"channel {channel}: ticket {ticket} already finished")
        s[6] = <uint64_t>status
        if status != 0 and self._ctl(channel, 10)[0] == 0:
            self._ctl(channel, 11)[0] = <uint64_t>status
            kvf_st_rel(self._ctl(channel, 10), ticket + 1)
        kvf_st_rel(&s[7], ticket + 1)
        c = completed[0]
        while c < self._ctl(channel, 8)[0] and kvf_ld_acq(self._slot(channel, c, 7)) == c + 1:
            c += 1
        kvf_st_rel(completed, c)

    def shut(self):
        """The proxy stopped: producers waiting give up (E_CANCELED)."""
        kvf_st_rel(self._w(5), 1)

    def reopen(self):
        kvf_st_rel(self._w(5), 0)

    @property
    def closed(self):
        return bool(kvf_ld_acq(self._w(5))) if self.base != NULL else True

    def failure(self, uint32_t channel):
        """The channel's first failure, (ticket, status), or None."""
        cdef uint64_t f = kvf_ld_acq(self._ctl(channel, 10))
        if f == 0:
            return None
        return f - 1, <int64_t>self._ctl(channel, 11)[0]

    def state(self, uint32_t channel):
        """The channel's counters: head, taken, completed."""
        return {"head": kvf_ld_acq(self._ctl(channel, 0)), "taken": kvf_ld_acq(self._ctl(channel, 8)),
                "completed": kvf_ld_acq(self._ctl(channel, 9))}

    def offsets(self):
        """Where the layout puts things (checked against putring.cuh)."""
        return {"header": HEADER, "ctl": CTL, "slot": SLOT, "head": 0, "taken": 64, "completed": 72,
                "failed": 80, "fail_code": 88, "seq": 0, "op_peer": 8, "local": 16, "remote": 24,
                "length": 32, "tag": 40, "status": 48, "done": 56, "closed": 40}
