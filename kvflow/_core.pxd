# The native core's Cython classes (fields here, code in _core.pyx and the
# _core_*.pxi it includes), shared with kvflow._verbs (the rdma provider's
# channel is a Channel too).
from libc.stdint cimport int64_t, uint32_t, uint64_t

from kvflow._native cimport (kvf_ctx, kvf_region_table, kvf_completion, kvf_channel, kvf_local_channel,
                             kvf_tcp_channel, kvf_queue)


cdef class Core:
    cdef kvf_ctx *ctx
    cdef uint32_t next_region_id
    cdef object channels          # weakref.WeakSet of channels, closed first
    cdef kvf_completion comp[512]
    cdef int waiting              # threads in wait_detached (close waits for them)
    cdef int64_t left_mrs, left_qps   # MRs and QPs still counted when the context was freed
    cdef kvf_ctx *_ctx(self) except NULL


cdef class RemoteTable:
    cdef kvf_region_table t
    cdef readonly uint64_t version


cdef class Channel:
    cdef object __weakref__
    cdef Core core
    cdef RemoteTable table
    cdef readonly str peer
    # Threads other than the loop's (submit_detached, poll_acks_here,
    # abort) use the native channel outside any lock, counted in `users`
    # under use_lock; close() waits (idle) until none is left inside.
    cdef object use_lock
    cdef object idle
    cdef int users
    cdef bint closing
    # The provider's native channel (provider.h): every batch goes through
    # kvf_submit_poll on it. NULL before it exists and once it is closed.
    cdef kvf_channel *cch
    cdef uint64_t _poll_budget(self, uint64_t total)
    cdef _polled(self, uint64_t budget, uint64_t took)
    cdef bint _enter(self)
    cdef void _leave(self)
    cdef void _quiesce(self)
    cdef tuple _submit(self, int op, object local_addrs, object remote_addrs, object lengths, bint poll,
                       int prio, uint64_t deadline_ns, bint detached)


cdef class LocalChannel(Channel):       # _core_local.pxi
    cdef kvf_local_channel *ch
    cdef bint closed


cdef class TcpChannel(Channel):         # _core_tcp.pxi
    cdef kvf_tcp_channel *ch
    cdef readonly int ack_fd
    cdef int nfds
    cdef public double poll_ewma_ns    # recent time to a polled completion (a round trip)
    cdef public uint64_t poll_max_ns   # 0: never poll on the caller's thread
    cdef uint64_t _poll_budget(self, uint64_t total)
    cdef _polled(self, uint64_t budget, uint64_t took)


cdef class SchedQueue:                  # _core_sched.pxi
    cdef Core core
    cdef kvf_queue q
    cdef bint ready
