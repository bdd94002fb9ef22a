/* kvflow native core: shared declarations.
 *
 * The hot path lives here, in plain C, so that it runs with the GIL released:
 * region tables, the batch pool, the completion ring (eventfd to asyncio),
 * slice queues, and the providers' worker threads (tcp, local).
 * Python (Cython, kvflow/_core.pyx) only submits batches and drains completions.
 */
#ifndef KVF_H
#define KVF_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Status codes: mapped to exceptions in one place (kvflow/status.py). */
enum {
    KVF_OK = 0,
    KVF_EINVAL = 1,          /* bad argument (zero length, overflow, ...) */
    KVF_EUNREG = 2,          /* local range not inside a registered region */
    KVF_EREMOTE = 3,         /* remote range outside the peer's regions / no access */
    KVF_ELOST = 4,           /* connection to the peer lost */
    KVF_ECANCELLED = 5,      /* cancelled (or timed out) by the user */
    KVF_EPROTO = 6,          /* malformed frame */
    KVF_ENOMEM = 7,          /* out of batch slots or memory */
    KVF_EIO = 8,             /* system call failed (errno in the detail) */
    KVF_ECLOSED = 9,         /* engine or channel closed */
};
/* A batch status is one of the codes above in its low byte; an rdma
 * completion error adds the verbs status (ibv_wc_status) in bits 8-15 and
 * the device (index + 1, 0: none) in bits 16-22 (kvflow/status.py reads
 * them for the error message). */
#define KVF_STATUS_CODE_MASK 0xff
#define KVF_STATUS_WC_SHIFT 8
#define KVF_STATUS_WC_MASK 0xff
#define KVF_STATUS_DEV_SHIFT 16
#define KVF_STATUS_DEV_MASK 0x7f

enum { KVF_OP_WRITE = 0, KVF_OP_READ = 1 };
/* READ/WRITE: what peers may do to a region. LOCAL_WRITE (local table
 * only): the memory itself is writable, so reads may land in it. */
enum { KVF_ACCESS_READ = 1, KVF_ACCESS_WRITE = 2, KVF_ACCESS_LOCAL_WRITE = 4 };

/* ---------------------------------------------------------------- regions */

/* RDMA devices an engine may use at once (memory keys per region). */
#define KVF_MAX_DEVS 8

typedef struct {
    uint64_t addr;
    uint64_t len;
    uint32_t access;
    uint32_t id;
    uint32_t keys[KVF_MAX_DEVS];  /* rdma: lkey (local table) or rkey (peer's) per device */
} kvf_region;

/* Sorted by addr, non-overlapping; lookups are binary searches under a read
 * lock. The lock prefers writers so that deregister() is not starved by a
 * stream of receivers. Every reader holds it only for lookups, never while
 * bytes move: a tcp receiver publishes the id of the region it lands in
 * (or sends from) before it lets the lock go, and deregister() waits for
 * those (kvf_srv_quiesce_region), so it returns only once nobody writes
 * into the region, and register() never waits for a payload. */
typedef struct {
    pthread_rwlock_t lock;
    kvf_region *v;
    size_t n, cap;
    uint64_t generation;
} kvf_region_table;

int kvf_rt_init(kvf_region_table *t);
void kvf_rt_destroy(kvf_region_table *t);
int kvf_rt_add(kvf_region_table *t, uint64_t addr, uint64_t len, uint32_t access, uint32_t id);
int kvf_rt_remove(kvf_region_table *t, uint32_t id);
int kvf_rt_replace(kvf_region_table *t, const kvf_region *v, size_t n);
int kvf_rt_set_keys(kvf_region_table *t, uint32_t id, const uint32_t *keys, size_t n);
/* Caller holds the read lock. Returns the region holding [addr, addr+len) or NULL. */
const kvf_region *kvf_rt_find_locked(const kvf_region_table *t, uint64_t addr, uint64_t len);

/* ------------------------------------------------------------------- qos */

/* Priority classes (kvflow.Priority): a batch's slices are taken from a
 * scheduled queue by class, then deadline, then fewest bytes left (sched.c). */
enum { KVF_PRIO_HIGH = 0, KVF_PRIO_NORMAL = 1, KVF_PRIO_LOW = 2, KVF_NPRIO = 3 };
/* Default starvation bound: a class with queued slices is served at least this often. */
#define KVF_SCHED_AGE_NS (20u * 1000u * 1000u)

/* A submission's options, set on its batch before its slices are queued
 * (kvf_batch_set_qos). */
typedef struct {
    int32_t prio;            /* KVF_PRIO_* */
    uint64_t deadline_ns;    /* urgency, ns from submission; 0: none */
    /* 1: a detached batch, for a thread that submits and then blocks in
     * kvf_batch_wait (the event loop takes no part): never pushed to the
     * completion ring. A field of the submission rather than a thread-local
     * flag: core.c is compiled into _core and _verbs, and a thread-local
     * there would exist twice (STYLE rule 16). */
    int32_t detached;
} kvf_qos;

/* ------------------------------------------------------------ batch pool */

#define KVF_MAX_BATCHES (1u << 16)

/* A channel's batch numbers (engine.metrics()): counted once per batch, as
 * it finishes, with relaxed atomics. Latency bucket i holds batches that
 * took less than 2^(i+1) us (bucket 0: under 2 us), the last one the rest. */
#define KVF_LAT_BUCKETS 28
#define KVF_NSTATUS 16
typedef struct kvf_chan_stats {
    _Atomic uint64_t batches[2], bytes[2], failed[2];   /* by op: write, read */
    _Atomic uint64_t by_status[KVF_NSTATUS];            /* failed batches by KVF_E* status */
    _Atomic uint64_t lat[2][KVF_LAT_BUCKETS];
    _Atomic uint64_t lat_sum_ns[2];
    /* Submitted through kvf_submit and not finished yet (queued or on the
     * wire), by op: up at submission, down as the batch finishes. Relaxed:
     * a gauge read from another thread, never a synchronisation point. */
    _Atomic int64_t inflight_batches[2], inflight_bytes[2];
    struct kvf_chan_stats *next;                        /* the engine's list (freed with it) */
} kvf_chan_stats;
void kvf_chan_stats_record(kvf_chan_stats *st, int op, uint64_t bytes, int status, uint64_t ns);

typedef struct {
    _Atomic uint64_t remaining;  /* slices not yet finished (+1 held by the submitter) */
    _Atomic int32_t status;      /* first error wins (CAS from KVF_OK) */
    _Atomic int32_t cancelled;   /* set by cancel(); workers drop queued slices */
    _Atomic uint64_t err_entry;  /* entry index of the first failed slice */
    uint32_t gen;
    uint32_t next_free;
    int32_t detached;            /* waited for by its submitting thread, never drained */
    int32_t prio;                /* KVF_PRIO_*, set before its slices are queued */
    uint64_t deadline_ns;        /* absolute (CLOCK_MONOTONIC); 0: none */
    kvf_chan_stats *stats;       /* where it is counted when it finishes (NULL: nowhere) */
    uint64_t t0_ns, bytes;
    int32_t op;
} kvf_batch;

typedef struct {
    uint64_t id;
    int32_t status;
    int32_t pad;
    uint64_t entry;
} kvf_completion;

typedef struct kvf_ctx {
    kvf_region_table local;        /* this engine's registered memory */
    kvf_batch *batches;
    pthread_mutex_t pool_mu;
    uint32_t free_head;
    uint32_t in_use;

    /* Completion ring: workers append under a mutex; the first append after
     * the loop drained writes the eventfd, so asyncio wakes once per burst of
     * completions, never once per slice. A mutex (not a lock-free ring) is
     * enough: it is taken once per finished batch, not per slice. */
    pthread_mutex_t comp_mu;
    kvf_completion *comp;
    size_t comp_n, comp_cap;
    pthread_cond_t detached_cv;   /* (with comp_mu) a detached batch finished */
    int comp_signaled;
    int efd;

    /* tcp server side: authenticated session tokens and served connections */
    pthread_mutex_t srv_mu;
    pthread_cond_t srv_cv;     /* signalled when a connection thread leaves */
    struct kvf_session *sessions;   /* guarded by srv_mu */
    struct kvf_srv_conn *srv_conns;
    _Atomic int closing;
    _Atomic int n_pre_auth;    /* server connections still before their hello */
    _Atomic uint64_t n_fenced; /* server connections fenced (KVF_F_FENCE): their work moved */
    _Atomic uint64_t n_cut_off; /* server connections cut off by a deregister() (kvf_srv_quiesce_region) */
    _Atomic uint64_t n_wakeups; /* eventfd writes that woke the loop for completions (completion_push) */
    _Atomic unsigned long poll_thread;  /* pthread_self() of the thread draining its own completions, or 0
                                         * (kvf_set_loop_thread) */
    struct kvf_credit_pool *credit;   /* the receive window (credit.h); NULL: none */
    _Atomic uint64_t srv_spin_ns;     /* a served connection's thread looks again this long before it sleeps */
    _Atomic uint32_t srv_grace_ms;    /* 0, or how long a served peer's kernel may leave a frame unanswered
                                       * before the frame's deadline ends it (kvf_srv_set_grace) */
    kvf_chan_stats *chan_stats;       /* every channel's stats block (guarded by pool_mu) */

    struct kvf_local_pool *local_pool;
    /* This engine's region fence (fence.h): same-host peers announce their
     * copies into and out of its regions there, and deregister() waits for
     * them. NULL only if it could not be made (no local peer then). */
    struct kvf_fence *fence;

    /* Scheduled queues of every channel (sched.c), walked by a cancel to
     * drop the batch's queued slices at once. sched_mu before any q->mu. */
    pthread_mutex_t sched_mu;
    struct kvf_sched *scheds;
    _Atomic uint64_t sched_age_ns;   /* the starvation bound (kvf_sched_set_age) */
    _Atomic int sched_fifo;          /* batches in arrival order (kvf_sched_set_fifo) */
    /* Counts cancels: a provider whose peers hold back completions (tcp's
     * batched acks) asks for them at once after one, so that a cancelled
     * batch's slices already on the wire finish without waiting for later
     * work. */
    _Atomic uint32_t cancel_epoch;

    /* Resource counters (the balance the tests check). Always on: relaxed
     * atomics touched once per socket, thread, MR or QP made or freed (and
     * per slice), far off the cost of what they count, so no debug build. */
    _Atomic int64_t n_sockets;
    _Atomic int64_t n_slices_inflight;
    _Atomic int64_t n_threads;
    _Atomic int64_t n_mrs;     /* ibv_mr registered (regions on every device, internal buffers) */
    _Atomic int64_t n_qps;     /* ibv_qp created, initiator and target side */
} kvf_ctx;

kvf_ctx *kvf_ctx_new(int local_workers);
void kvf_ctx_free(kvf_ctx *c);
int kvf_batch_alloc(kvf_ctx *c, uint64_t nslices, uint64_t *id_out);
void kvf_batch_release_guard(kvf_ctx *c, uint64_t id);
/* Its class and deadline (NULL: NORMAL, none): before its slices are queued. */
void kvf_batch_set_qos(kvf_ctx *c, uint64_t id, const kvf_qos *qos);
int kvf_batch_cancel(kvf_ctx *c, uint64_t id);
int kvf_batch_cancelled(kvf_ctx *c, uint32_t slot);
/* 1 once every slice of batch `id` finished (until the loop drains it). */
int kvf_batch_finished(kvf_ctx *c, uint64_t id);
/* A slice finished (status KVF_OK or an error); may complete its batch. */
void kvf_slice_done(kvf_ctx *c, uint32_t slot, int status, uint64_t entry);
/* Drain finished batches into out (at most cap); frees their slots. */
size_t kvf_drain(kvf_ctx *c, kvf_completion *out, size_t cap);
/* After a thread polled for batch `id` itself (kvf_set_loop_thread): takes
 * its completion out of the ring if it is there (1, with its status and
 * failed entry; its slot is freed), and makes sure the loop wakes for any
 * other completion that the polling left in the ring. 0: not there yet
 * (it comes through the eventfd like any other). */
int kvf_take(kvf_ctx *c, uint64_t id, int *status, uint64_t *entry);
/* Names the calling (engine-owned) thread, as top -H, perf and gdb show it. */
void kvf_thread_name(const char *name);
/* Waits (spinning for spin_ns, then sleeping) until detached batch `id`
 * finished or timeout_ns passed (0: forever). KVF_OK: finished, its status
 * in *status (and *entry), its slot freed; KVF_ECANCELLED: timed out, the
 * batch still runs (cancel it, then wait again). */
int kvf_batch_wait(kvf_ctx *c, uint64_t id, uint64_t spin_ns, uint64_t timeout_ns, int *status,
                   uint64_t *entry);

/* ------------------------------------------------------------------ plan */

typedef struct {
    uint64_t local;
    uint64_t remote;
    uint64_t len;
    uint64_t entry;      /* index of the first batch entry in this slice */
    uint32_t slot;       /* batch slot */
    uint32_t op;
    uint32_t attempts;   /* times it was handed to a connection or QP (failover gives up after a few) */
    /* The provider's own words: the shared code never reads them, and each
     * provider names the ones it uses in its own .c (local: the target pid;
     * tcp: the in-flight tag; rdma: the memory keys on the device pair). */
    uint32_t word[5];
} kvf_slice;

_Static_assert(sizeof(kvf_slice) == 64, "a slice is one cache line");

/* Validates a batch against the local table and the peer's table (the
 * first bad entry's index goes to *bad), then coalesces and slices it into
 * *out (malloc'd, caller frees; *nslices entries). */
int kvf_prepare(kvf_ctx *c, kvf_region_table *remote, int op, const uint64_t *la,
                const uint64_t *ra, const uint64_t *len, size_t n, uint64_t slice_size,
                kvf_slice **out, size_t *nslices, size_t *bad);

/* ----------------------------------------------------------------- queue */

typedef struct kvf_sched kvf_sched;

/* A slice queue: FIFO (kvf_queue_init), or scheduled by priority class,
 * deadline and fair share (kvf_queue_init_sched: the queues senders take
 * their work from). count and bytes hold for both. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvf_slice *ring;
    size_t head, count, cap;
    uint64_t bytes;      /* queued bytes, for least-loaded placement */
    int closed;
    kvf_sched *sched;    /* NULL: FIFO */
} kvf_queue;

int kvf_queue_init(kvf_queue *q);
/* A scheduled queue of engine ctx; counted: its slices count in
 * ctx->n_slices_inflight (a cancel that drops them takes them off); guard:
 * the mutex its users hold around push and pop (NULL: q->mu), which a
 * cancel takes too. Lock order: ctx->sched_mu before guard, so nobody may
 * init, detach or destroy a scheduled queue while holding a guard. */
int kvf_queue_init_sched(kvf_queue *q, kvf_ctx *ctx, int counted, pthread_mutex_t *guard);
void kvf_queue_destroy(kvf_queue *q);
/* A scheduled queue whose channel closed leaves the engine's list (cancels
 * stop looking at it; the engine may be freed first). Idempotent. */
void kvf_queue_detach(kvf_queue *q);
/* Caller holds q->mu. */
int kvf_queue_push_locked(kvf_queue *q, const kvf_slice *s);
size_t kvf_queue_pop_locked(kvf_queue *q, kvf_slice *out, size_t max);
/* Pops up to max slices, stopping once max_bytes were taken (at least one
 * slice when any is queued). Caller holds q->mu. */
size_t kvf_queue_pop_bytes_locked(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes);
/* A strict budget for pop_fit: slices of op `op` (0xff bits) take at most
 * `bytes` in all. When the next slice does not fit, the pop stops there
 * (nothing behind it passes it) and `blocked` gets its length. */
typedef struct {
    uint64_t bytes;
    uint32_t op;
    uint64_t blocked;
} kvf_pop_budget;
/* pop_bytes with a budget (NULL: none). Caller holds q->mu. */
size_t kvf_queue_pop_fit_locked(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes,
                                kvf_pop_budget *budget);
/* The same, taking q->mu. */
size_t kvf_queue_pop_fit(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes,
                         kvf_pop_budget *budget);
int kvf_queue_push(kvf_queue *q, const kvf_slice *s);
size_t kvf_queue_pop(kvf_queue *q, kvf_slice *out, size_t max);

/* sched.c: the scheduled mode (caller holds the queue's mu). */
size_t kvf_sched_queued_locked(const kvf_sched *s, int prio);   /* queued slices of a class */
int kvf_sched_push_locked(kvf_sched *s, const kvf_slice *x);
size_t kvf_sched_pop_locked(kvf_sched *s, kvf_slice *out, size_t max, uint64_t max_bytes,
                            kvf_pop_budget *budget);
void kvf_sched_free(kvf_sched *s);
/* A function told of the slices a cancel drops from the queue (before it
 * is shared: set once, right after kvf_queue_init_sched). */
void kvf_sched_set_drop(kvf_sched *s, void (*on_drop)(const kvf_slice *v, size_t n));
/* The engine is being freed: its queues that were never detached forget it. */
void kvf_sched_orphan_all(kvf_ctx *c);
/* Drops every queued slice of batch `slot` from the engine's scheduled
 * queues, finishing them KVF_ECANCELLED. Returns how many. */
size_t kvf_sched_cancel(kvf_ctx *c, uint32_t slot);
uint64_t kvf_now_ns(void);
/* The starvation bound of every scheduled queue of the engine. */
void kvf_sched_set_age(kvf_ctx *c, uint64_t age_ns);
/* FIFO mode: classes, deadlines and fair share off for batches queued from now on. */
void kvf_sched_set_fifo(kvf_ctx *c, int on);

/* ----------------------------------------------------------------- local */

/* A local channel (a kvf_channel: submit with kvf_submit). pid 0: this
 * process (memcpy), else process_vm_writev/readv into process pid. */
typedef struct kvf_local_channel kvf_local_channel;
struct kvf_fence;
/* fence: the target engine's region fence (fence.h), which every copy
 * enters; the channel takes its own reference. */
kvf_local_channel *kvf_local_channel_new(kvf_ctx *c, kvf_region_table *remote, int pid,
                                         uint64_t inline_limit, struct kvf_fence *fence);
void kvf_local_channel_close(kvf_local_channel *lc);
void kvf_local_channel_free(kvf_local_channel *lc);
/* Tests: enters the target's fence for [addr, addr+len) as a copy would,
 * and stays inside (a copier stalled between its check and its copy)
 * until kvf_local_channel_release or the channel's free. KVF_OK or the
 * error a copy would get. */
int kvf_local_channel_hold(kvf_local_channel *lc, uint64_t addr, uint64_t len, int op);
void kvf_local_channel_release(kvf_local_channel *lc);
int kvf_local_probe(int pid, uint64_t addr, void *out, size_t len);

/* ------------------------------------------------------------------- tcp */

typedef struct kvf_tcp_channel kvf_tcp_channel;
/* A tcp channel (a kvf_channel: submit with kvf_submit) over nfds
 * connected data sockets (hello done), acks on ack_fd (-1: on each).
 * express: the index of the connection kept for HIGH batches (-1: none):
 * nothing else is placed on it while another connection is up, so a HIGH
 * slice never waits behind other batches' bytes in the kernel's buffers.
 * window: the target's receive window from its hello acks (0: none):
 * write payloads are then framed only against credit the target granted
 * (credit.h), and slices are at most a quarter of it. */
kvf_tcp_channel *kvf_tcp_channel_new(kvf_ctx *c, kvf_region_table *remote, const int *fds, int nfds,
                                     int ack_fd, uint64_t slice_size, int express, uint64_t window);
/* Reads the write acks waiting on the channel's ack connection (never
 * blocks; called by the event loop when that socket is readable, or by a
 * thread polling its own detached batches: one reader at a time, a second
 * caller returns at once). Returns -1 once the connection is gone (the
 * channel is failed then). */
int kvf_tcp_poll_acks(kvf_tcp_channel *ch);
/* Set by the event-loop thread around work whose completions it drains
 * itself right after: those completions need no eventfd wake-up. */
void kvf_set_loop_thread(kvf_ctx *c, int on);
int kvf_tcp_channel_alive(kvf_tcp_channel *ch);
/* 1 when nothing is queued or in flight on any live connection and the
 * channel has an ack connection: an awaited small batch may be polled for
 * on the caller's thread (kvf_submit_poll) without holding up others. */
int kvf_tcp_channel_idle(kvf_tcp_channel *ch);
/* Connection i: 1 dead, 0 up, -1 no such connection. */
int kvf_tcp_channel_conn_dead(kvf_tcp_channel *ch, int i);
int kvf_tcp_channel_conn_stats(kvf_tcp_channel *ch, int i, uint64_t *sent_bytes, uint64_t *moved,
                               uint64_t *failures, uint64_t *fences);
int kvf_tcp_channel_conn_queue(kvf_tcp_channel *ch, int i, uint64_t out[3]);
/* A cancelled batch whose slices are still on the wire after the grace
 * period: resets the connections that hold them (their unsent bytes are
 * discarded, so nothing of the batch lands later; the other slices they
 * carried move on) and returns how many. */
int kvf_tcp_channel_abort_batch(kvf_tcp_channel *ch, uint64_t id);
/* Connection i's credits: held, asked for, waits, grants, recalls, need. */
int kvf_tcp_channel_credit_stats(kvf_tcp_channel *ch, int i, uint64_t out[6]);
/* Fails (moving their slices to the live ones) the connections whose
 * peer's kernel has answered nothing for grace_ms, on this look and the
 * one before (sockio.c, sk_unanswered): a rail or host that is gone. A
 * peer that is only slow (stopped, starved: its kernel still acknowledges)
 * is never failed here, so connections carry no TCP_USER_TIMEOUT, which
 * would also end one whose peer's window stayed closed that long. The
 * caller looks every fraction of grace_ms. Returns how many it failed. */
int kvf_tcp_channel_check_reach(kvf_tcp_channel *ch, uint32_t grace_ms);
/* Replaces dead connection i by the connected (hello done) socket fd. */
int kvf_tcp_channel_replace(kvf_tcp_channel *ch, int i, int fd);
void kvf_tcp_channel_close(kvf_tcp_channel *ch);
void kvf_tcp_channel_free(kvf_tcp_channel *ch);

int kvf_srv_add_token(kvf_ctx *c, const uint8_t *token);
void kvf_srv_remove_token(kvf_ctx *c, const uint8_t *token);
int kvf_srv_serve(kvf_ctx *c, int fd);
void kvf_srv_shutdown(kvf_ctx *c);
/* After region `rid` left the local table: returns once no served
 * connection moves a payload into or out of it, cutting off (shutting
 * down) those still at it after a short grace. The number cut. */
int kvf_srv_quiesce_region(kvf_ctx *c, uint32_t rid);
void kvf_srv_free_sessions(kvf_ctx *c);
/* Receiver credits: caps the write payload bytes in flight toward this
 * engine from all initiators together at `window` (0: no cap). Once,
 * before the first connection is served. */
int kvf_srv_set_window(kvf_ctx *c, uint64_t window);
/* How long a served data connection's thread, finding no frame, keeps
 * looking (yielding the CPU) before it sleeps in poll(): 0 never. For
 * connections served from now on. */
void kvf_srv_set_spin(kvf_ctx *c, uint64_t ns);
/* The engine's keepalive, for the connections it serves: a frame that
 * outlasts its deadline (FRAME_TIMEOUT_S) is dropped only once the peer's
 * kernel has answered nothing for ms as well (sockio.c, sk_heard), so a
 * stopped or starved initiator is waited for. 0: the deadline alone. */
void kvf_srv_set_grace(kvf_ctx *c, uint32_t ms);
struct kvf_credit_stats;
int kvf_srv_window_stats(kvf_ctx *c, struct kvf_credit_stats *out);

#endif
