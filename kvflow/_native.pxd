# C declarations of the native core (kvflow/_native/kvf.h, wire.h).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "_native/wire.h" nogil:
    enum:
        KVF_MAGIC
        KVF_WIRE_VERSION
        KVF_MAX_PAYLOAD
        KVF_F_HELLO
        KVF_F_HELLO_ACK
        KVF_F_WRITE
        KVF_F_WRITE_ACK
        KVF_F_READ_REQ
        KVF_F_READ_RESP
        KVF_F_FENCE
        KVF_ROLE_DATA
        KVF_ROLE_ACK
        KVF_CONN_INDEX_MASK
        KVF_CONN_EPOCH_SHIFT
        KVF_CONN_EPOCH_MAX
        KVF_HDR_FLUSH
    ctypedef struct kvf_hdr:
        pass

cdef extern from "_native/fence.h" nogil:
    enum:
        KVF_FENCE_SLOTS
        KVF_FENCE_REGIONS
    ctypedef struct kvf_fence:
        pass
    void kvf_fence_set_incarnation(kvf_fence *f, uint64_t incarnation)
    int kvf_fence_fd(const kvf_fence *f)
    kvf_fence *kvf_fence_attach(int pid, uint64_t incarnation, int *err)
    void kvf_fence_ref(kvf_fence *f, int64_t n)
    void kvf_fence_unref(kvf_fence *f, int64_t n)
    int kvf_fence_add(kvf_fence *f, uint32_t rid, uint64_t addr, uint64_t len, uint32_t access)
    int kvf_fence_remove(kvf_fence *f, uint32_t rid)
    int kvf_fence_quiesce(kvf_fence *f, uint32_t rid, uint64_t timeout_ns, int *pids, int max)
    int kvf_fence_busy_slots(const kvf_fence *f)

cdef extern from "_native/kvf.h" nogil:
    enum:
        KVF_OK
        KVF_EINVAL
        KVF_EUNREG
        KVF_EREMOTE
        KVF_ELOST
        KVF_ECANCELLED
        KVF_EPROTO
        KVF_ENOMEM
        KVF_EIO
        KVF_ECLOSED
        KVF_OP_WRITE
        KVF_OP_READ
        KVF_ACCESS_READ
        KVF_ACCESS_WRITE
        KVF_ACCESS_LOCAL_WRITE
        KVF_MAX_DEVS
        KVF_STATUS_CODE_MASK
        KVF_STATUS_WC_SHIFT
        KVF_STATUS_WC_MASK
        KVF_STATUS_DEV_SHIFT
        KVF_STATUS_DEV_MASK
        KVF_PRIO_HIGH
        KVF_PRIO_NORMAL
        KVF_PRIO_LOW
        KVF_NPRIO
        KVF_SCHED_AGE_NS

    ctypedef struct kvf_region:
        uint64_t addr
        uint64_t len
        uint32_t access
        uint32_t id
        uint32_t keys[8]

    ctypedef struct kvf_region_table:
        uint64_t generation

    ctypedef struct kvf_slice:
        uint64_t local
        uint64_t remote
        uint64_t len
        uint64_t entry
        uint32_t slot
        uint32_t op

    ctypedef struct kvf_qos:
        int32_t prio
        uint64_t deadline_ns
        int32_t detached

    ctypedef struct kvf_queue:
        size_t count
        uint64_t bytes

    ctypedef struct kvf_completion:
        uint64_t id
        int status
        uint64_t entry

    ctypedef struct kvf_ctx:
        kvf_region_table local
        int efd
        int64_t n_sockets
        int64_t n_slices_inflight
        int64_t n_threads
        uint64_t n_fenced
        uint64_t n_cut_off
        kvf_fence *fence
        uint64_t n_wakeups
        int64_t n_mrs
        int64_t n_qps
        uint32_t in_use

    int kvf_rt_init(kvf_region_table *t)
    void kvf_rt_destroy(kvf_region_table *t)
    int kvf_rt_add(kvf_region_table *t, uint64_t addr, uint64_t len, uint32_t access, uint32_t id)
    int kvf_rt_remove(kvf_region_table *t, uint32_t id)
    int kvf_rt_replace(kvf_region_table *t, const kvf_region *v, size_t n)
    int kvf_rt_set_keys(kvf_region_table *t, uint32_t id, const uint32_t *keys, size_t n)

    kvf_ctx *kvf_ctx_new(int local_workers)
    void kvf_ctx_free(kvf_ctx *c)
    int kvf_batch_cancel(kvf_ctx *c, uint64_t id)
    int kvf_batch_alloc(kvf_ctx *c, uint64_t nslices, uint64_t *id_out)
    void kvf_batch_release_guard(kvf_ctx *c, uint64_t id)
    void kvf_batch_set_qos(kvf_ctx *c, uint64_t id, const kvf_qos *qos)
    void kvf_slice_done(kvf_ctx *c, uint32_t slot, int status, uint64_t entry)
    int kvf_queue_init_sched(kvf_queue *q, kvf_ctx *ctx, int counted, void *guard)
    void kvf_queue_destroy(kvf_queue *q)
    void kvf_queue_detach(kvf_queue *q)
    int kvf_queue_push(kvf_queue *q, const kvf_slice *s)
    size_t kvf_queue_pop(kvf_queue *q, kvf_slice *out, size_t max)
    ctypedef struct kvf_pop_budget:
        uint64_t bytes
        uint32_t op
        uint64_t blocked
    size_t kvf_queue_pop_fit(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes,
                             kvf_pop_budget *budget)
    size_t kvf_drain(kvf_ctx *c, kvf_completion *out, size_t cap)
    int kvf_take(kvf_ctx *c, uint64_t id, int *status, uint64_t *entry)
    int kvf_batch_finished(kvf_ctx *c, uint64_t id)
    int kvf_batch_wait(kvf_ctx *c, uint64_t id, uint64_t spin_ns, uint64_t timeout_ns, int *status,
                       uint64_t *entry)

    ctypedef struct kvf_local_channel:
        pass
    kvf_local_channel *kvf_local_channel_new(kvf_ctx *c, kvf_region_table *remote, int pid,
                                             uint64_t inline_limit, kvf_fence *fence)
    void kvf_local_channel_close(kvf_local_channel *lc)
    void kvf_local_channel_free(kvf_local_channel *lc)
    int kvf_local_channel_hold(kvf_local_channel *lc, uint64_t addr, uint64_t len, int op)
    void kvf_local_channel_release(kvf_local_channel *lc)
    int kvf_local_probe(int pid, uint64_t addr, void *out, size_t len)

    ctypedef struct kvf_tcp_channel:
        pass
    kvf_tcp_channel *kvf_tcp_channel_new(kvf_ctx *c, kvf_region_table *remote, const int *fds, int nfds,
                                         int ack_fd, uint64_t slice_size, int express, uint64_t window)
    int kvf_tcp_poll_acks(kvf_tcp_channel *ch)
    void kvf_set_loop_thread(kvf_ctx *c, int on)
    int kvf_tcp_channel_alive(kvf_tcp_channel *ch)
    int kvf_tcp_channel_idle(kvf_tcp_channel *ch)
    int kvf_tcp_channel_conn_dead(kvf_tcp_channel *ch, int i)
    int kvf_tcp_channel_conn_stats(kvf_tcp_channel *ch, int i, uint64_t *sent_bytes, uint64_t *moved,
                                   uint64_t *failures, uint64_t *fences)
    int kvf_tcp_channel_conn_queue(kvf_tcp_channel *ch, int i, uint64_t out[3])
    int kvf_tcp_channel_credit_stats(kvf_tcp_channel *ch, int i, uint64_t *out)
    int kvf_tcp_channel_replace(kvf_tcp_channel *ch, int i, int fd)
    int kvf_tcp_channel_abort_batch(kvf_tcp_channel *ch, uint64_t id)
    int kvf_tcp_channel_check_reach(kvf_tcp_channel *ch, uint32_t grace_ms)
    void kvf_tcp_channel_free(kvf_tcp_channel *ch)

    void kvf_sched_set_age(kvf_ctx *c, uint64_t age_ns)
    void kvf_sched_set_fifo(kvf_ctx *c, int on)
    size_t kvf_sched_cancel(kvf_ctx *c, uint32_t slot)
    int kvf_srv_add_token(kvf_ctx *c, const uint8_t *token)
    void kvf_srv_remove_token(kvf_ctx *c, const uint8_t *token)
    int kvf_srv_serve(kvf_ctx *c, int fd)
    void kvf_srv_shutdown(kvf_ctx *c)
    int kvf_srv_quiesce_region(kvf_ctx *c, uint32_t rid)
    int kvf_srv_set_window(kvf_ctx *c, uint64_t window)
    void kvf_srv_set_spin(kvf_ctx *c, uint64_t ns)
    void kvf_srv_set_grace(kvf_ctx *c, uint32_t ms)

cdef extern from "_native/sockio.h" nogil:
    int sk_unanswered(int fd, uint32_t grace_ms)

cdef extern from "_native/credit.h" nogil:
    ctypedef struct kvf_credit_stats:
        uint64_t window, free, held, max_held
        uint64_t grants, granted_bytes, recalls, returned_bytes, asks
        uint64_t violations
        uint64_t holders, waiting
    int kvf_srv_window_stats(kvf_ctx *c, kvf_credit_stats *out)


cdef extern from "_native/kvf.h" nogil:
    enum:
        KVF_LAT_BUCKETS
        KVF_NSTATUS
    ctypedef struct kvf_chan_stats:
        uint64_t batches[2]
        uint64_t bytes[2]
        uint64_t failed[2]
        uint64_t by_status[16]
        uint64_t lat[2][28]
        uint64_t lat_sum_ns[2]
        int64_t inflight_batches[2]
        int64_t inflight_bytes[2]

cdef extern from "_native/provider.h" nogil:
    ctypedef struct kvf_channel:
        kvf_chan_stats *stats
    int kvf_submit_poll(kvf_channel *ch, int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
                        size_t n, const kvf_qos *qos, uint64_t budget_ns, uint64_t *id_out, size_t *bad,
                        int *finished)
    int kvf_channel_abort_batch(kvf_channel *ch, uint64_t id)
    void kvf_channel_close(kvf_channel *ch)
    void kvf_channel_free(kvf_channel *ch)
