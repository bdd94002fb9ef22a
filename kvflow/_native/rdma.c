/* The rdma provider's data path (see rdma.h for the design). */
#define _GNU_SOURCE
#include "rdma.h"
#include "provider.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* The slice's provider words: its memory keys on its QP's device pair (resolve_keys_locked). */
#define S_LKEY(s) ((s).word[0])
#define S_RKEY(s) ((s).word[1])

#define SIGNAL_EVERY 16      /* one signalled work request per this many */
#define CHAIN 64             /* work requests per ibv_post_send */
#define MAX_SLOTS 4096       /* QPs per device (slot is 12 bits of wr_id) */
#define MAX_QPS 64           /* QPs per channel */
#define MAX_ATTEMPTS 3       /* posts of one slice before its batch fails */
#define POLL_BATCH 64
/* On a device whose worker posts (worker_posts), it posts at most this many
 * work requests of one QP before it polls and turns to the next QP: on
 * Soft-RoCE the post does the whole round trip inside the system call, so
 * a finished batch is reported (and its caller submits the next) while the
 * worker goes on with the rest, instead of after everything queued. */
#define WORKER_CHAIN 16
#define POST_ALL ((size_t)-1)
#define RECV_FLAG (1ull << 63)
/* Bytes posted and not yet completed, per QP. Enough to keep a NIC busy
 * (4 MiB is ~160 us at 200 Gb/s, and several QPs run at once), small enough
 * that a cancelled or timed-out batch stops quickly: only what is posted
 * must still complete, the rest is dropped from the backlog. */
#define MAX_INFLIGHT_BYTES (4u << 20)
/* A signalled work request at least every this many bytes as well: a QP's
 * posted bytes then retire a quarter of the cap at a time and the backlog
 * refills it while the rest is on the wire (one signal per cap drained the
 * QP completely before anything new was posted). */
#define SIGNAL_BYTES (MAX_INFLIGHT_BYTES / 4)

/* PROBING: reconnected, carrying only its probe until kvf_rdma_chan_qp_up.
 * GONE: its device was removed; the verbs QP is destroyed and q->dev must
 * not be touched any more (it is freed). Only kvf_rdma_chan_replace_qp
 * leaves GONE, with a QP of the device reopened under the same index, on
 * the control thread, holding ch->mu and q->mu. */
enum { QP_UP = 1, QP_BROKEN = 0, QP_CLOSED = -1, QP_PROBING = 2, QP_GONE = -2 };

static inline int qp_live(int state) { return state == QP_UP || state == QP_PROBING; }


/* ---------------------------------------------------------------- counters */

/* Relaxed: the counters are read for a balance once things are quiet, and
 * order nothing. */
void kvf_rdma_count(kvf_ctx *c, int64_t mrs, int64_t qps) {
    if (!c) return;          /* a device already closed (its engine may be gone) */
    if (mrs) atomic_fetch_add_explicit(&c->n_mrs, mrs, memory_order_relaxed);
    if (qps) atomic_fetch_add_explicit(&c->n_qps, qps, memory_order_relaxed);
}

int kvf_rdma_destroy_qp(kvf_ctx *c, struct ibv_qp *qp) {
    int rc = ibv_destroy_qp(qp);
    /* a QP the kernel would not destroy is still there: it stays counted */
    if (rc == 0) kvf_rdma_count(c, 0, -1);
    return rc;
}

/* ------------------------------------------------------------------ events */

struct kvf_rdma_events {
    pthread_mutex_t mu;
    kvf_rdma_event *v;
    size_t n, cap;
    int efd;
    int signaled;
};

kvf_rdma_events *kvf_rdma_events_new(void) {
    kvf_rdma_events *q = calloc(1, sizeof(*q));
    if (!q) return NULL;
    q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->efd < 0) { free(q); return NULL; }
    pthread_mutex_init(&q->mu, NULL);
    return q;
}

int kvf_rdma_events_fd(kvf_rdma_events *q) { return q->efd; }

static void events_push(kvf_rdma_events *q, const kvf_rdma_event *e) {
    pthread_mutex_lock(&q->mu);
    if (q->n == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 64;
        kvf_rdma_event *v = realloc(q->v, cap * sizeof(*v));
        if (!v) {            /* drop it: a notification is lost, never memory */
            pthread_mutex_unlock(&q->mu);
            free(e->data);
            return;
        }
        q->v = v;
        q->cap = cap;
    }
    q->v[q->n++] = *e;
    int wake = !q->signaled;
    q->signaled = 1;
    pthread_mutex_unlock(&q->mu);
    if (wake) {
        uint64_t one = 1;
        ssize_t r = write(q->efd, &one, sizeof(one));
        (void)r;
    }
}

size_t kvf_rdma_events_take(kvf_rdma_events *q, kvf_rdma_event *out, size_t cap) {
    uint64_t v;
    ssize_t r = read(q->efd, &v, sizeof(v));
    (void)r;
    pthread_mutex_lock(&q->mu);
    size_t n = q->n < cap ? q->n : cap;
    memcpy(out, q->v, n * sizeof(*out));
    memmove(q->v, q->v + n, (q->n - n) * sizeof(*out));
    q->n -= n;
    if (q->n == 0) q->signaled = 0;
    else {
        uint64_t one = 1;
        r = write(q->efd, &one, sizeof(one));
    }
    pthread_mutex_unlock(&q->mu);
    return n;
}

void kvf_rdma_events_free(kvf_rdma_events *q) {
    if (!q) return;
    for (size_t i = 0; i < q->n; i++) free(q->v[i].data);
    free(q->v);
    close(q->efd);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

/* ---------------------------------------------------------------- structs */

typedef struct rqp {
    pthread_mutex_t mu;
    struct ibv_qp *qp;
    kvf_rdma_dev *dev;       /* not to be touched once QP_GONE */
    uint32_t dev_index;      /* dev->index, readable after the device is gone */
    kvf_rdma_chan *ch;
    uint32_t slot;
    uint32_t gen;            /* 16 bits: bumped when the QP breaks or is replaced */
    int index;
    uint32_t rdev;
    _Atomic int state;
    uint32_t depth;
    kvf_slice *ring;         /* posted slices, ring[seq % depth] */
    uint64_t head, tail;     /* next sequence to post; oldest not retired */
    uint64_t inflight;       /* bytes posted, not retired */
    uint32_t unsig;          /* work requests posted since the last signalled one */
    uint64_t unsig_bytes;    /* and their bytes */
    kvf_queue backlog;       /* waiting for send-queue room (guarded by mu) */
    uint64_t wrs, bytes;
    /* Slices a submitter queued for the worker to post (worker_posts): under
     * in_mu, not mu, so that a submitter never waits for a post, which on
     * Soft-RoCE holds mu for the whole transfer. Moved to the backlog by
     * whoever posts next. Lock order: mu, in_mu, dev->ready_mu; in_mu also
     * guards the moves of dev/slot/state to and from GONE. */
    pthread_mutex_t in_mu;
    kvf_queue incoming;
    _Atomic uint32_t nincoming;
    int worker_posts;        /* dev->worker_posts (read without a lock) */
    int ready;               /* in the device's ready list (guarded by dev->ready_mu) */
} rqp;

struct kvf_rdma_dev {
    kvf_ctx *c;
    kvf_rdma_events *ev;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *chan;   /* both CQs report on it */
    struct ibv_cq *cq;       /* send completions of every QP on the device */
    struct ibv_cq *rcq;      /* receive completions (notifications, from the SRQ) */
    int cq_armed, rcq_armed; /* an event was requested and not yet taken (worker only) */
    struct ibv_srq *srq;
    struct ibv_mr *recv_mr;
    uint8_t *recv_buf;
    int recv_bufs;
    uint32_t index;
    pthread_mutex_t mu;      /* guards slots */
    rqp *slots[MAX_SLOTS];
    pthread_t worker;
    int wake_fd;             /* eventfd: work was posted, or stop */
    _Atomic int stop;
    _Atomic int sleeping;    /* the worker waits in poll() */
    _Atomic int polling;     /* callers polling the send CQ (kvf_submit_poll: rdma_poll_begin) */
    _Atomic int64_t posted;  /* WRs posted on this device and not retired */
    int started;
    /* Worker posts: the submitting thread only queues a batch's slices and
     * the worker posts them (see kvf_rdma_dev_new). The ready list holds the
     * slots of QPs with a backlog to post; ready_mu is a leaf lock (taken
     * under q->mu, nothing taken under it). */
    int worker_posts;
    uint64_t spin_ns;        /* how long the worker spins for work on the wire before it arms and sleeps */
    pthread_mutex_t ready_mu;
    uint32_t *ready;         /* ring of MAX_SLOTS slots */
    uint32_t ready_head;
    _Atomic uint32_t nready;
};

struct kvf_rdma_chan {
    kvf_channel base;        /* ops, the context, the peer's regions (provider.h) */
    uint64_t slice_size;
    uint64_t token;
    pthread_mutex_t mu;      /* guards qps, nqps, parked, rr, closed */
    rqp *qps[MAX_QPS];
    int nqps;
    kvf_queue parked;        /* slices waiting for any QP to come back */
    uint32_t rr;
    int closed;
    _Atomic int refs;        /* the owner's + workers' re-dispatching */
};

static const kvf_provider_ops rdma_ops;

static inline uint64_t wr_id(const rqp *q, uint64_t seq) {
    return ((uint64_t)q->slot << 48) | ((uint64_t)(q->gen & 0xffff) << 32) | (uint32_t)seq;
}

/* verbs work-completion status → kvflow status */
static int wc_kvf_status(int s) {
    switch (s) {
    case IBV_WC_SUCCESS: return KVF_OK;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR: return KVF_EREMOTE;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
    case IBV_WC_MW_BIND_ERR: return KVF_EUNREG;
    case IBV_WC_LOC_LEN_ERR: return KVF_EINVAL;
    default: return KVF_ELOST;   /* retry exceeded, flush, fatal, ... */
    }
}

/* The status a batch fails with: kvflow's code, plus the verbs status and
 * the device (index + 1) for the error message (kvflow/errors.py). */
static int verbs_status(int wc_status, const kvf_rdma_dev *d) {
    return wc_kvf_status(wc_status) | ((wc_status & KVF_STATUS_WC_MASK) << KVF_STATUS_WC_SHIFT) |
           ((int)((d->index + 1) & KVF_STATUS_DEV_MASK) << KVF_STATUS_DEV_SHIFT);
}

/* Failures of the path, not of the request: another QP (device) may work.
 * LOC_QP_OP_ERR is what Soft-RoCE reports when its netdev went down. */
static int retryable(int s) {
    return s == IBV_WC_WR_FLUSH_ERR || s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_RNR_RETRY_EXC_ERR ||
           s == IBV_WC_LOC_QP_OP_ERR ||
           s == IBV_WC_GENERAL_ERR || s == IBV_WC_FATAL_ERR || s == IBV_WC_REM_OP_ERR ||
           s == IBV_WC_RESP_TIMEOUT_ERR || s == IBV_WC_BAD_RESP_ERR;
}

static void slice_finish(kvf_ctx *c, const kvf_slice *s, int status) {
    atomic_fetch_sub_explicit(&c->n_slices_inflight, 1, memory_order_relaxed);
    kvf_slice_done(c, s->slot, status, s->entry);
}

static void chan_ref(kvf_rdma_chan *ch) { atomic_fetch_add(&ch->refs, 1); }
static void chan_destroy(kvf_rdma_chan *ch);
static void chan_unref(kvf_rdma_chan *ch) {
    if (atomic_fetch_sub(&ch->refs, 1) == 1) chan_destroy(ch);
}

/* ------------------------------------------------------------------ posting */

/* Wakes the worker if it sleeps (whoever polls: e.g. it has posting to do). */
static void dev_wake(kvf_rdma_dev *d) {
    if (atomic_load(&d->sleeping) && atomic_exchange(&d->sleeping, 0)) {
        uint64_t one = 1;
        ssize_t r = write(d->wake_fd, &one, sizeof(one));
        (void)r;
    }
}

/* Work was posted on the device (n WRs; 0: a poller hands its work over):
 * if its worker sleeps and no caller polls the device, wake it now, so that
 * it is up and polling while the work requests are on the wire (the wake-up
 * overlaps the round trip instead of following it). While a caller polls
 * (kvf_submit_poll: rdma_poll_begin), that caller handles every completion of the
 * device and wakes the worker when it stops, if work is left.
 *
 * seq_cst throughout, paired with the worker's store to `sleeping` and its
 * loads of `polling` and `posted`: either the worker sees the work before
 * it sleeps, or the poster sees it asleep and wakes it. */
static void dev_posted(kvf_rdma_dev *d, int64_t n) {
    if (n) atomic_fetch_add(&d->posted, n);
    if (!atomic_load(&d->polling)) dev_wake(d);
}

/* Puts q in its device's ready list (once) and wakes the worker. Caller
 * holds q->mu or q->in_mu (q->dev stays). seq_cst on nready, paired with
 * the worker's check of it after announcing its sleep. */
static void ready_push_locked(rqp *q) {
    kvf_rdma_dev *d = q->dev;
    pthread_mutex_lock(&d->ready_mu);
    if (!q->ready) {
        q->ready = 1;
        uint32_t n = atomic_load(&d->nready);
        d->ready[(d->ready_head + n) % MAX_SLOTS] = q->slot;
        atomic_fetch_add(&d->nready, 1);
    }
    pthread_mutex_unlock(&d->ready_mu);
    dev_wake(d);
}

/* Moves what submitters queued for the worker into the backlog (or into
 * *to, e.g. a retry queue). Caller holds q->mu. */
static void take_incoming_locked(rqp *q, kvf_queue *to) {
    if (!atomic_load(&q->nincoming)) return;
    pthread_mutex_lock(&q->in_mu);
    kvf_slice tmp[64];
    size_t k;
    while ((k = kvf_queue_pop_locked(&q->incoming, tmp, 64)) > 0)
        for (size_t i = 0; i < k; i++)
            if (kvf_queue_push_locked(to, &tmp[i])) slice_finish(q->ch->base.ctx, &tmp[i], KVF_ENOMEM);
    atomic_store(&q->nincoming, 0);
    pthread_mutex_unlock(&q->in_mu);
}

/* Posts backlog slices while the send queue has room, at most max_wrs work
 * requests. Caller holds q->mu. A backlog left for want of max_wrs puts the
 * QP in the worker's ready list; one left for want of room is posted as
 * completions free it. On a post failure the QP is broken: *retry gets
 * what must go elsewhere. */
static void qp_break_locked(rqp *q, int wc_status, kvf_queue *retry);

static void qp_post_locked(rqp *q, kvf_queue *retry, size_t max_wrs) {
    kvf_ctx *c = q->ch->base.ctx;
    if (qp_live(q->state)) take_incoming_locked(q, &q->backlog);
    while (max_wrs && qp_live(q->state) && q->backlog.count && q->head - q->tail < q->depth &&
           (q->inflight < MAX_INFLIGHT_BYTES || q->head == q->tail)) {
        size_t room = q->depth - (size_t)(q->head - q->tail);
        if (room > CHAIN) room = CHAIN;
        if (room > max_wrs) room = max_wrs;
        /* take slices while the byte budget lasts (at least one) */
        size_t want = 0;
        uint64_t budget = q->inflight < MAX_INFLIGHT_BYTES ? MAX_INFLIGHT_BYTES - q->inflight : 0;
        for (size_t i = 0; i < room && i < q->backlog.count; i++) {
            uint64_t l = q->backlog.ring[(q->backlog.head + i) % q->backlog.cap].len;
            if (want && l > budget) break;
            budget = l > budget ? 0 : budget - l;
            want++;
        }
        kvf_slice tmp[CHAIN];
        size_t k = kvf_queue_pop_locked(&q->backlog, tmp, want);
        struct ibv_send_wr wr[CHAIN];
        struct ibv_sge sge[CHAIN];
        size_t m = 0;
        for (size_t i = 0; i < k; i++) {
            kvf_slice *s = &tmp[i];
            if (s->op <= KVF_OP_READ && kvf_batch_cancelled(c, s->slot)) {
                slice_finish(c, s, KVF_ECANCELLED);
                continue;
            }
            s->attempts++;
            sge[m] = (struct ibv_sge){s->local, (uint32_t)s->len, S_LKEY(*s)};
            memset(&wr[m], 0, sizeof(wr[m]));
            wr[m].wr_id = wr_id(q, q->head + m);
            wr[m].sg_list = &sge[m];
            wr[m].num_sge = 1;
            if (s->op == KVF_OP_SEND) {
                wr[m].opcode = IBV_WR_SEND;
            } else {
                wr[m].opcode = s->op == KVF_OP_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
                wr[m].wr.rdma.remote_addr = s->remote;
                wr[m].wr.rdma.rkey = S_RKEY(*s);
            }
            q->ring[(q->head + m) % q->depth] = *s;
            m++;
        }
        if (m == 0) continue;
        max_wrs -= m;
        for (size_t j = 0; j < m; j++) {
            wr[j].next = j + 1 < m ? &wr[j + 1] : NULL;
            /* signalled: every SIGNAL_EVERY-th or SIGNAL_BYTES, and the
             * chain's last, so that the oldest posted slice always has a
             * signalled one after it */
            q->unsig++;
            q->unsig_bytes += sge[j].length;
            if (q->unsig >= SIGNAL_EVERY || q->unsig_bytes >= SIGNAL_BYTES || j + 1 == m) {
                wr[j].send_flags = IBV_SEND_SIGNALED;
                q->unsig = 0;
                q->unsig_bytes = 0;
            }
        }
        struct ibv_send_wr *bad = NULL;
        int rc = ibv_post_send(q->qp, wr, &bad);
        size_t posted = rc ? (size_t)(bad - wr) : m;
        for (size_t j = 0; j < posted; j++) {
            q->bytes += sge[j].length;
            q->inflight += sge[j].length;
        }
        dev_posted(q->dev, (int64_t)posted);
        q->wrs += posted;
        if (rc) {
            /* Unposted slices go back to the backlog; the QP cannot be
             * trusted (a posted but unsignalled tail would never retire). */
            q->head += posted;
            for (size_t j = posted; j < m; j++) {
                kvf_slice s = q->ring[(q->head + j - posted) % q->depth];
                s.attempts--;
                kvf_queue_push_locked(&q->backlog, &s);
            }
            qp_break_locked(q, IBV_WC_GENERAL_ERR, retry);
            return;
        }
        q->head += m;
    }
    if (!max_wrs && qp_live(q->state) && q->backlog.count) ready_push_locked(q);
}

/* Retires posted slice `seq` with `status`. Caller holds q->mu. */
static void retire(rqp *q, uint64_t seq, int status) {
    kvf_slice *s = &q->ring[seq % q->depth];
    q->inflight -= s->len;
    atomic_fetch_sub_explicit(&q->dev->posted, 1, memory_order_relaxed);
    slice_finish(q->ch->base.ctx, s, status);
}

static void events_broken(rqp *q, int wc_status) {
    kvf_rdma_event e = {KVF_RDMA_EV_BROKEN, q->dev->index, 0, (uint32_t)q->index, q->ch->token,
                        wc_status, 0, NULL};
    events_push(q->dev->ev, &e);
}

/* The QP failed: everything posted and queued on it moves to *retry, the
 * QP goes to the error state (no more memory access), and the event loop is
 * told to connect a new one. Caller holds q->mu. */
/* Takes a live QP out of service: error state, completions still in the CQ
 * stale, what it carried (posted and backlog) to *retry. Caller holds q->mu.
 * Returns 0 if it was not live. */
/* A QP leaves UP under in_mu too: a submitter queues for the worker only
 * while it sees the QP UP under in_mu, so whatever it queued before is in
 * `incoming` when the state changes, for the caller to move on. */
static void set_state_locked(rqp *q, int state) {
    pthread_mutex_lock(&q->in_mu);
    q->state = state;
    pthread_mutex_unlock(&q->in_mu);
}

static int qp_take_down_locked(rqp *q, kvf_queue *retry) {
    if (!qp_live(q->state)) return 0;
    set_state_locked(q, QP_BROKEN);
    q->gen = (q->gen + 1) & 0xffff;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
    for (uint64_t s = q->tail; s < q->head; s++) kvf_queue_push_locked(retry, &q->ring[s % q->depth]);
    atomic_fetch_sub_explicit(&q->dev->posted, (int64_t)(q->head - q->tail), memory_order_relaxed);
    q->tail = q->head;
    q->inflight = 0;
    kvf_slice tmp[64];
    size_t k;
    while ((k = kvf_queue_pop_locked(&q->backlog, tmp, 64)) > 0)
        for (size_t i = 0; i < k; i++) kvf_queue_push_locked(retry, &tmp[i]);
    take_incoming_locked(q, retry);
    return 1;
}

static void qp_break_locked(rqp *q, int wc_status, kvf_queue *retry) {
    if (qp_take_down_locked(q, retry)) events_broken(q, wc_status);
}

/* Keys for slices bound to (local device dev, remote device rdev): looked
 * up again each time a slice is placed, so a region deregistered meanwhile
 * fails the slice instead of being written with a stale key. The caller
 * holds both tables' read locks (taken once per group of slices). */
static int resolve_keys_locked(kvf_rdma_chan *ch, kvf_slice *s, uint32_t dev, uint32_t rdev) {
    if (s->op > KVF_OP_READ) return KVF_OK;     /* SEND/PROBE carry their keys */
    const kvf_region *r = kvf_rt_find_locked(&ch->base.ctx->local, s->local, s->len);
    if (!r || !r->keys[dev]) return KVF_EUNREG;
    S_LKEY(*s) = r->keys[dev];
    r = kvf_rt_find_locked(ch->base.remote, s->remote, s->len);
    if (!r || rdev >= KVF_MAX_DEVS || !r->keys[rdev]) return KVF_EREMOTE;
    S_RKEY(*s) = r->keys[rdev];
    return KVF_OK;
}

/* Every QP of the channel destroyed with its device (none comes back
 * unless its device does, and the control path closes such a channel):
 * a slice waiting for one would wait for ever. Caller holds ch->mu.
 * q->state is read without q->mu: CLOSED is final, and GONE is set under
 * q->mu and left only under ch->mu as well (held here), so a stale read can
 * only miss a QP that is becoming GONE this instant (kvf_rdma_chan_drop_dev
 * then fails what was parked meanwhile). */
static int chan_all_gone_locked(const kvf_rdma_chan *ch) {
    if (ch->nqps == 0) return 0;          /* still being connected */
    for (int i = 0; i < ch->nqps; i++)
        if (ch->qps[i]->state != QP_GONE && ch->qps[i]->state != QP_CLOSED) return 0;
    return 1;
}

static void fail_parked_locked(kvf_rdma_chan *ch) {
    kvf_slice tmp[64];
    size_t k;
    while ((k = kvf_queue_pop_locked(&ch->parked, tmp, 64)) > 0)
        for (size_t j = 0; j < k; j++) slice_finish(ch->base.ctx, &tmp[j], KVF_ELOST);
}

static void dispatch_queue(kvf_rdma_chan *ch, kvf_queue *retry);

/* Resolves the keys of QP q's share of s (every step-th slice from first)
 * and queues them on `to`, which the caller's lock guards (q->mu or
 * q->in_mu, either of which keeps q's state UP); a QP no longer UP sends
 * them to `bounced`. The number queued. */
static size_t stripe_locked(kvf_rdma_chan *ch, rqp *q, kvf_slice *s, size_t n, size_t first,
                            size_t step, kvf_queue *to, kvf_queue *bounced) {
    kvf_ctx *c = ch->base.ctx;
    size_t queued = 0;
    pthread_rwlock_rdlock(&c->local.lock);
    pthread_rwlock_rdlock(&ch->base.remote->lock);
    for (size_t i = first; i < n; i += step) {
        if (q->state != QP_UP) { kvf_queue_push_locked(bounced, &s[i]); continue; }
        int rc = resolve_keys_locked(ch, &s[i], q->dev_index, q->rdev);
        if (rc) { slice_finish(c, &s[i], rc); continue; }
        if (kvf_queue_push_locked(to, &s[i])) slice_finish(c, &s[i], KVF_ENOMEM);
        else queued++;
    }
    pthread_rwlock_unlock(&ch->base.remote->lock);
    pthread_rwlock_unlock(&c->local.lock);
    return queued;
}

/* Places slices on the channel's live QPs, round-robin (striping them over
 * devices), and posts what fits: on the calling thread, unless the QP's
 * device has its worker post (worker_posts) and the caller did not ask to
 * post inline. With no live QP they wait in `parked`. */
static void chan_dispatch(kvf_rdma_chan *ch, kvf_slice *s, size_t n, int inline_post) {
    kvf_ctx *c = ch->base.ctx;
    if (n) {
        rqp *up[MAX_QPS];
        int nup = 0;
        pthread_mutex_lock(&ch->mu);
        if (ch->closed) {
            pthread_mutex_unlock(&ch->mu);
            for (size_t i = 0; i < n; i++) slice_finish(c, &s[i], KVF_ELOST);
            return;
        }
        for (int i = 0; i < ch->nqps; i++)
            if (ch->qps[i]->state == QP_UP) up[nup++] = ch->qps[i];
        if (nup == 0) {
            /* wait for a QP to come back (a repair), unless none can: every
             * one went with its device, and the peer is lost to this channel */
            int lost = chan_all_gone_locked(ch);
            for (size_t i = 0; i < n; i++) {
                if (lost) slice_finish(c, &s[i], KVF_ELOST);
                else kvf_queue_push_locked(&ch->parked, &s[i]);
            }
            pthread_mutex_unlock(&ch->mu);
            return;
        }
        uint32_t rr = ch->rr;
        ch->rr += (uint32_t)n;
        pthread_mutex_unlock(&ch->mu);

        kvf_queue bounced;
        kvf_queue_init(&bounced);
        for (int qi = 0; qi < nup; qi++) {
            rqp *q = up[qi];
            size_t first = (size_t)((qi - (int)(rr % (uint32_t)nup) + nup) % nup);
            if (!inline_post && q->worker_posts) {
                /* for the worker to post: queued under in_mu, never waiting
                 * for a post in progress (which holds q->mu) */
                pthread_mutex_lock(&q->in_mu);
                size_t queued = stripe_locked(ch, q, s, n, first, (size_t)nup, &q->incoming, &bounced);
                if (queued) {
                    atomic_fetch_add(&q->nincoming, (uint32_t)queued);
                    ready_push_locked(q);
                }
                pthread_mutex_unlock(&q->in_mu);
                continue;
            }
            kvf_queue retry;
            kvf_queue_init(&retry);
            pthread_mutex_lock(&q->mu);
            stripe_locked(ch, q, s, n, first, (size_t)nup, &q->backlog, &bounced);
            qp_post_locked(q, &retry, POST_ALL);
            pthread_mutex_unlock(&q->mu);
            kvf_slice tmp[64];
            size_t k;
            while ((k = kvf_queue_pop_locked(&retry, tmp, 64)) > 0)
                for (size_t i = 0; i < k; i++) kvf_queue_push_locked(&bounced, &tmp[i]);
            kvf_queue_destroy(&retry);
        }
        /* what bounced off a QP that broke meanwhile goes round again */
        dispatch_queue(ch, &bounced);
        kvf_queue_destroy(&bounced);
        return;
    }
}

static void dispatch_queue(kvf_rdma_chan *ch, kvf_queue *retry) {
    if (!retry->count) return;
    size_t n = retry->count;
    kvf_slice *v = malloc(n * sizeof(*v));
    if (!v) {
        kvf_slice tmp[64];
        size_t k;
        while ((k = kvf_queue_pop_locked(retry, tmp, 64)) > 0)
            for (size_t i = 0; i < k; i++) slice_finish(ch->base.ctx, &tmp[i], KVF_ENOMEM);
        return;
    }
    n = kvf_queue_pop_locked(retry, v, n);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i].attempts >= MAX_ATTEMPTS || v[i].op > KVF_OP_READ) slice_finish(ch->base.ctx, &v[i], KVF_ELOST);
        else v[k++] = v[i];
    }
    chan_dispatch(ch, v, k, 0);
    free(v);
}

/* ------------------------------------------------------------------ worker */

static void post_recv(kvf_rdma_dev *d, int i) {
    struct ibv_sge sge = {(uint64_t)(uintptr_t)(d->recv_buf + (size_t)i * KVF_RDMA_RECV_BYTES),
                          KVF_RDMA_RECV_BYTES, d->recv_mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = RECV_FLAG | (uint64_t)i, .sg_list = &sge, .num_sge = 1}, *bad;
    ibv_post_srq_recv(d->srq, &wr, &bad);
}

static void on_recv(kvf_rdma_dev *d, const struct ibv_wc *wc) {
    int i = (int)(wc->wr_id & 0xffffffffu);
    if (i < 0 || i >= d->recv_bufs) return;
    if (wc->status == IBV_WC_SUCCESS && wc->opcode == IBV_WC_RECV) {
        uint32_t len = wc->byte_len <= KVF_RDMA_RECV_BYTES ? wc->byte_len : KVF_RDMA_RECV_BYTES;
        uint8_t *data = malloc(len ? len : 1);
        if (data) {
            memcpy(data, d->recv_buf + (size_t)i * KVF_RDMA_RECV_BYTES, len);
            kvf_rdma_event e = {KVF_RDMA_EV_NOTIFY, d->index, wc->qp_num, 0, 0, 0, len, data};
            events_push(d->ev, &e);
        }
    }
    post_recv(d, i);
}

/* qp_post_locked, then releases q->mu and sends what *retry holds (slices
 * of a QP that broke) to the channel's other QPs; *retry is destroyed. */
static void qp_post_unlock(rqp *q, kvf_queue *retry, size_t max_wrs) {
    qp_post_locked(q, retry, max_wrs);
    kvf_rdma_chan *ch = q->ch;
    if (retry->count) chan_ref(ch);      /* the channel outlives its QP's lock */
    pthread_mutex_unlock(&q->mu);
    if (retry->count) {
        dispatch_queue(ch, retry);
        chan_unref(ch);
    }
    kvf_queue_destroy(retry);
}

static void on_send(kvf_rdma_dev *d, const struct ibv_wc *wc) {
    uint32_t slot = (uint32_t)(wc->wr_id >> 48) & (MAX_SLOTS - 1);
    uint32_t gen = (uint32_t)(wc->wr_id >> 32) & 0xffff;
    uint32_t seq32 = (uint32_t)wc->wr_id;
    pthread_mutex_lock(&d->mu);
    rqp *q = d->slots[slot];
    if (!q) { pthread_mutex_unlock(&d->mu); return; }
    pthread_mutex_lock(&q->mu);
    pthread_mutex_unlock(&d->mu);
    if (!qp_live(q->state) || q->gen != gen) { pthread_mutex_unlock(&q->mu); return; }
    uint64_t seq = q->tail + (uint32_t)(seq32 - (uint32_t)q->tail);
    if (seq >= q->head) { pthread_mutex_unlock(&q->mu); return; }
    kvf_ctx *c = q->ch->base.ctx;
    /* RC completes in order: everything before seq succeeded */
    for (uint64_t x = q->tail; x < seq; x++) retire(q, x, KVF_OK);
    kvf_queue retry;
    kvf_queue_init(&retry);
    if (wc->status == IBV_WC_SUCCESS) {
        retire(q, seq, KVF_OK);
        q->tail = seq + 1;
    } else {
        kvf_slice failed = q->ring[seq % q->depth];
        q->inflight -= failed.len;
        atomic_fetch_sub_explicit(&q->dev->posted, 1, memory_order_relaxed);
        q->tail = seq + 1;
        if (retryable(wc->status) && failed.op <= KVF_OP_READ && failed.attempts < MAX_ATTEMPTS)
            kvf_queue_push_locked(&retry, &failed);
        else
            slice_finish(c, &failed, verbs_status(wc->status, d));
        qp_break_locked(q, wc->status, &retry);
    }
    qp_post_unlock(q, &retry, d->worker_posts ? WORKER_CHAIN : POST_ALL);
}

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void handle(kvf_rdma_dev *d, struct ibv_wc *wc, int n) {
    for (int i = 0; i < n; i++) {
        if (wc[i].wr_id & RECV_FLAG) on_recv(d, &wc[i]);
        else on_send(d, &wc[i]);
    }
}

/* A worker polls its CQs while work requests of its device are on the wire
 * (for at most SPIN_NS since the last completion or wake-up), and sleeps on
 * the completion channel otherwise: busy only while there is something to
 * wait for, never when idle.
 *
 * The receive CQ stays armed: a notification may arrive at any time. The
 * send CQ is armed only when the worker goes to sleep with work on the wire
 * that no caller polls for. A caller that polls for its own small batch
 * (kvf_submit_poll: rdma_poll_begin) neither wakes the worker nor keeps it spinning, so
 * its completion raises no event and wakes no thread: on Soft-RoCE that
 * wake-up cost as much as the write itself, and once the worker was awake
 * for one write it stayed engaged for all that followed. When the caller
 * stops polling with work left, it wakes the worker, which then arms. */

/* Work is on the wire and no caller polls for it: the worker waits for it
 * (spins, or arms the send CQ before it sleeps). */
static int worker_owns_work(kvf_rdma_dev *d) {
    return !atomic_load(&d->polling) && atomic_load(&d->posted) > 0;
}

/* Polls both CQs once; the number of completions handled. */
static int worker_poll(kvf_rdma_dev *d, struct ibv_wc *wc) {
    int n = ibv_poll_cq(d->cq, POLL_BATCH, wc);
    if (n > 0) handle(d, wc, n);
    int m = ibv_poll_cq(d->rcq, POLL_BATCH, wc);
    if (m > 0) handle(d, wc, m);
    return (n > 0 ? n : 0) + (m > 0 ? m : 0) + (n < 0 || m < 0 ? -1 : 0);
}

/* Takes every pending completion event (the channel fd is non-blocking);
 * a CQ whose event was taken is no longer armed. */
static void worker_take_events(kvf_rdma_dev *d) {
    struct ibv_cq *cq;
    void *cq_ctx;
    while (ibv_get_cq_event(d->chan, &cq, &cq_ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        if (cq == d->cq) d->cq_armed = 0;
        else d->rcq_armed = 0;
    }
}

/* Posts up to WORKER_CHAIN work requests of each QP in the ready list as
 * it stood on entry (a QP with more left goes back to its end); the number
 * of QPs served. */
static int worker_post_ready(kvf_rdma_dev *d) {
    uint32_t n = atomic_load(&d->nready);
    int served = 0;
    for (uint32_t i = 0; i < n; i++) {
        /* d->mu first, as on_send: the slot's QP cannot be freed meanwhile */
        pthread_mutex_lock(&d->mu);
        pthread_mutex_lock(&d->ready_mu);
        if (!atomic_load(&d->nready)) {
            pthread_mutex_unlock(&d->ready_mu);
            pthread_mutex_unlock(&d->mu);
            break;
        }
        uint32_t slot = d->ready[d->ready_head];
        d->ready_head = (d->ready_head + 1) % MAX_SLOTS;
        atomic_fetch_sub(&d->nready, 1);
        rqp *q = d->slots[slot];
        if (q) q->ready = 0;
        pthread_mutex_unlock(&d->ready_mu);
        if (!q) { pthread_mutex_unlock(&d->mu); continue; }
        pthread_mutex_lock(&q->mu);
        pthread_mutex_unlock(&d->mu);
        kvf_queue retry;
        kvf_queue_init(&retry);
        qp_post_unlock(q, &retry, WORKER_CHAIN);
        served++;
    }
    return served;
}

static void *dev_worker(void *arg) {
    kvf_rdma_dev *d = arg;
    struct ibv_wc wc[POLL_BATCH];
    uint64_t last = now_ns();
    while (!atomic_load_explicit(&d->stop, memory_order_relaxed)) {
        if (atomic_load(&d->nready) && worker_post_ready(d) > 0) last = now_ns();
        int n = worker_poll(d, wc);
        if (n > 0) {
            last = now_ns();
            continue;
        }
        if (n == 0 && worker_owns_work(d) && now_ns() - last < d->spin_ns) {
            sched_yield();
            continue;
        }
        /* Announce the sleep, then arm, then poll once more: work posted
         * after the announcement wakes us through wake_fd, and a completion
         * that raced the arming is seen now rather than after the next event. */
        atomic_store(&d->sleeping, 1);
        if (!d->rcq_armed) d->rcq_armed = ibv_req_notify_cq(d->rcq, 0) == 0;
        if (!d->cq_armed && worker_owns_work(d)) d->cq_armed = ibv_req_notify_cq(d->cq, 0) == 0;
        n = worker_poll(d, wc);
        if (n > 0 || atomic_load(&d->nready)) {
            atomic_store(&d->sleeping, 0);
            last = now_ns();
            continue;
        }
        if (n < 0) usleep(1000);     /* device trouble: do not spin */
        struct pollfd p[2] = {{d->chan->fd, POLLIN, 0}, {d->wake_fd, POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) usleep(1000);
        atomic_store(&d->sleeping, 0);
        if (p[1].revents) {
            uint64_t v;
            ssize_t r = read(d->wake_fd, &v, sizeof(v));
            (void)r;
        }
        if (p[0].revents) worker_take_events(d);
        last = now_ns();
    }
    atomic_fetch_sub(&d->c->n_threads, 1);
    return NULL;
}

/* ------------------------------------------------------------------ device */

kvf_rdma_dev *kvf_rdma_dev_new(kvf_ctx *c, kvf_rdma_events *ev, struct ibv_context *ctx,
                               struct ibv_pd *pd, uint32_t index, int cq_size, int recv_bufs,
                               int worker_posts, uint64_t spin_ns) {
    kvf_rdma_dev *d = calloc(1, sizeof(*d));
    if (!d) return NULL;
    d->ready = calloc(MAX_SLOTS, sizeof(*d->ready));
    if (!d->ready) { free(d); return NULL; }
    d->worker_posts = worker_posts;
    pthread_mutex_init(&d->ready_mu, NULL);
    d->spin_ns = spin_ns;
    d->c = c;
    d->ev = ev;
    d->ctx = ctx;
    d->pd = pd;
    d->index = index;
    d->wake_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    d->chan = ibv_create_comp_channel(ctx);
    if (!d->chan) goto fail;
    fcntl(d->chan->fd, F_SETFL, fcntl(d->chan->fd, F_GETFL) | O_NONBLOCK);
    d->cq = ibv_create_cq(ctx, cq_size, NULL, d->chan, 0);
    if (!d->cq) goto fail;
    /* one entry per receive buffer (the SRQ's), and the initiator QPs' single
     * receive WR each, which is never posted */
    d->rcq = ibv_create_cq(ctx, recv_bufs + 1, NULL, d->chan, 0);
    if (!d->rcq) goto fail;
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = (uint32_t)recv_bufs, .max_sge = 1}};
    d->srq = ibv_create_srq(pd, &sa);
    if (!d->srq) goto fail;
    d->recv_bufs = recv_bufs;
    d->recv_buf = aligned_alloc(4096, (size_t)recv_bufs * KVF_RDMA_RECV_BYTES);
    if (!d->recv_buf) goto fail;
    d->recv_mr = ibv_reg_mr(pd, d->recv_buf, (size_t)recv_bufs * KVF_RDMA_RECV_BYTES,
                            IBV_ACCESS_LOCAL_WRITE);
    if (!d->recv_mr) goto fail;
    kvf_rdma_count(c, 1, 0);
    for (int i = 0; i < recv_bufs; i++) post_recv(d, i);
    d->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (d->wake_fd < 0) goto fail;
    if (ibv_req_notify_cq(d->rcq, 0)) goto fail;
    d->rcq_armed = 1;
    atomic_fetch_add(&c->n_threads, 1);
    if (pthread_create(&d->worker, NULL, dev_worker, d)) {
        atomic_fetch_sub(&c->n_threads, 1);
        goto fail;
    }
    d->started = 1;
    return d;
fail: {
        int e = errno;
        kvf_rdma_dev_free(d);
        errno = e;
        return NULL;
    }
}

struct ibv_cq *kvf_rdma_dev_cq(kvf_rdma_dev *d) { return d->cq; }
struct ibv_cq *kvf_rdma_dev_rcq(kvf_rdma_dev *d) { return d->rcq; }
struct ibv_srq *kvf_rdma_dev_srq(kvf_rdma_dev *d) { return d->srq; }

void kvf_rdma_dev_free(kvf_rdma_dev *d) {
    if (!d) return;
    if (d->started) {
        atomic_store(&d->stop, 1);
        uint64_t one = 1;
        ssize_t r = write(d->wake_fd, &one, sizeof(one));
        (void)r;
        pthread_join(d->worker, NULL);
    }
    if (d->wake_fd >= 0) close(d->wake_fd);
    if (d->srq) ibv_destroy_srq(d->srq);
    if (d->recv_mr && ibv_dereg_mr(d->recv_mr) == 0) kvf_rdma_count(d->c, -1, 0);
    free(d->recv_buf);
    if (d->cq) ibv_destroy_cq(d->cq);
    if (d->rcq) ibv_destroy_cq(d->rcq);
    if (d->chan) ibv_destroy_comp_channel(d->chan);
    pthread_mutex_destroy(&d->mu);
    pthread_mutex_destroy(&d->ready_mu);
    free(d->ready);
    free(d);
}

int kvf_rdma_async_fd(struct ibv_context *ctx) {
    int fl = fcntl(ctx->async_fd, F_GETFL);
    if (fl < 0 || fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
    return ctx->async_fd;
}

int kvf_rdma_async_event(struct ibv_context *ctx, int *type, uint32_t *qpn, int *port) {
    struct ibv_async_event e;
    if (ibv_get_async_event(ctx, &e)) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    *type = (int)e.event_type;
    *qpn = 0;
    *port = 0;
    switch (e.event_type) {
    case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST: case IBV_EVENT_SQ_DRAINED: case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR: case IBV_EVENT_QP_LAST_WQE_REACHED:
        *qpn = e.element.qp ? e.element.qp->qp_num : 0;
        break;
    case IBV_EVENT_PORT_ACTIVE: case IBV_EVENT_PORT_ERR: case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE: case IBV_EVENT_SM_CHANGE: case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        *port = e.element.port_num;
        break;
    default:
        break;
    }
    ibv_ack_async_event(&e);
    return 1;
}

const char *kvf_rdma_dev_path(struct ibv_context *ctx) { return ctx->device->dev_path; }

/* ----------------------------------------------------------------- channel */

kvf_rdma_chan *kvf_rdma_chan_new(kvf_ctx *c, kvf_region_table *remote, uint64_t slice_size,
                                 uint64_t token) {
    kvf_rdma_chan *ch = calloc(1, sizeof(*ch));
    if (!ch) return NULL;
    ch->base = (kvf_channel){&rdma_ops, c, remote};
    ch->slice_size = slice_size;
    ch->token = token;
    pthread_mutex_init(&ch->mu, NULL);
    if (kvf_queue_init(&ch->parked)) { free(ch); return NULL; }
    atomic_store(&ch->refs, 1);
    return ch;
}

/* Puts QP q in a free slot of device d's table, where its completions find
 * it (the slot is part of each wr_id); MAX_SLOTS when the table is full. */
static uint32_t dev_slot_take(kvf_rdma_dev *d, rqp *q) {
    pthread_mutex_lock(&d->mu);
    uint32_t slot = MAX_SLOTS;
    for (uint32_t i = 0; i < MAX_SLOTS; i++) if (!d->slots[i]) { slot = i; break; }
    if (slot < MAX_SLOTS) d->slots[slot] = q;
    pthread_mutex_unlock(&d->mu);
    return slot;
}

/* Takes QP q off device d's table: d's worker no longer finds it, and
 * taking q->mu afterwards waits for a worker that already did. */
static void dev_slot_drop(kvf_rdma_dev *d, uint32_t slot, rqp *q) {
    pthread_mutex_lock(&d->mu);
    if (d->slots[slot] == q) {
        d->slots[slot] = NULL;
        /* and out of the ready list: the slot may go to another QP */
        pthread_mutex_lock(&d->ready_mu);
        uint32_t n = atomic_load(&d->nready), k = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t v = d->ready[(d->ready_head + i) % MAX_SLOTS];
            if (v != slot) d->ready[(d->ready_head + k++) % MAX_SLOTS] = v;
        }
        atomic_store(&d->nready, k);
        q->ready = 0;
        pthread_mutex_unlock(&d->ready_mu);
    }
    pthread_mutex_unlock(&d->mu);
}

int kvf_rdma_chan_add_qp(kvf_rdma_chan *ch, kvf_rdma_dev *dev, uint32_t rdev, struct ibv_qp *qp,
                         uint32_t depth, int up) {
    /* a device already closed (freed: nothing to index) or no QP */
    if (!dev || !qp || !depth) return -1;
    rqp *q = calloc(1, sizeof(*q));
    if (!q) return -1;
    q->ring = calloc(depth, sizeof(kvf_slice));
    if (!q->ring || kvf_queue_init(&q->backlog)) { free(q->ring); free(q); return -1; }
    if (kvf_queue_init(&q->incoming)) { kvf_queue_destroy(&q->backlog); free(q->ring); free(q); return -1; }
    pthread_mutex_init(&q->mu, NULL);
    pthread_mutex_init(&q->in_mu, NULL);
    q->worker_posts = dev->worker_posts;
    q->qp = qp;
    q->dev = dev;
    q->dev_index = dev->index;
    q->ch = ch;
    q->rdev = rdev;
    q->depth = depth;
    q->state = up ? QP_UP : QP_PROBING;
    uint32_t slot = dev_slot_take(dev, q);
    if (slot == MAX_SLOTS) goto fail;
    q->slot = slot;
    pthread_mutex_lock(&ch->mu);
    if (ch->closed || ch->nqps == MAX_QPS) {
        pthread_mutex_unlock(&ch->mu);
        dev_slot_drop(dev, slot, q);
        goto fail;
    }
    q->index = ch->nqps;
    ch->qps[ch->nqps++] = q;
    pthread_mutex_unlock(&ch->mu);
    return q->index;
fail:
    kvf_queue_destroy(&q->backlog);
    kvf_queue_destroy(&q->incoming);
    free(q->ring);
    pthread_mutex_destroy(&q->mu);
    pthread_mutex_destroy(&q->in_mu);
    free(q);
    return -1;
}

static rqp *chan_qp(kvf_rdma_chan *ch, int index) {
    pthread_mutex_lock(&ch->mu);
    rqp *q = index >= 0 && index < ch->nqps ? ch->qps[index] : NULL;
    pthread_mutex_unlock(&ch->mu);
    return q;
}

int kvf_rdma_chan_replace_qp(kvf_rdma_chan *ch, int index, kvf_rdma_dev *dev, struct ibv_qp *qp, int up) {
    rqp *q = chan_qp(ch, index);
    if (!q || !dev || dev->index != q->dev_index) return KVF_EINVAL;
    /* A QP destroyed with its device (GONE) moves to the device reopened
     * under its index: first a slot in the new device's table (nothing of
     * it completes there before it posts), then q->dev and q->slot. The
     * unlocked read is stable: GONE is set by kvf_rdma_chan_drop_dev and
     * left only here, both on the control thread (RdmaChannel's use_lock). */
    int gone = q->state == QP_GONE;
    uint32_t slot = gone ? dev_slot_take(dev, q) : q->slot;
    if (slot == MAX_SLOTS) return KVF_ENOMEM;
    /* ch->mu too: submit_poll and chan_all_gone_locked read a GONE QP's
     * state (and dev) under ch->mu alone */
    pthread_mutex_lock(&ch->mu);
    pthread_mutex_lock(&q->mu);
    int ok = gone ? q->state == QP_GONE && !ch->closed : q->state == QP_BROKEN && q->dev == dev;
    if (ok && gone) {
        pthread_mutex_lock(&q->in_mu);
        q->dev = dev;
        q->slot = slot;
        q->worker_posts = dev->worker_posts;
        q->state = QP_BROKEN;
        pthread_mutex_unlock(&q->in_mu);
    }
    pthread_mutex_unlock(&ch->mu);
    if (!ok) {
        pthread_mutex_unlock(&q->mu);
        if (gone) dev_slot_drop(dev, slot, q);
        return KVF_EINVAL;
    }
    if (q->qp) kvf_rdma_destroy_qp(ch->base.ctx, q->qp);
    q->qp = qp;
    q->gen = (q->gen + 1) & 0xffff;
    q->head = q->tail = 0;
    q->unsig = 0;
    q->unsig_bytes = 0;
    q->inflight = 0;
    q->state = up ? QP_UP : QP_PROBING;
    pthread_mutex_unlock(&q->mu);
    return up ? kvf_rdma_chan_qp_up(ch, index) : KVF_OK;
}

int kvf_rdma_chan_qp_up(kvf_rdma_chan *ch, int index) {
    rqp *q = chan_qp(ch, index);
    if (!q) return KVF_EINVAL;
    pthread_mutex_lock(&q->mu);
    int ok = q->state == QP_UP || q->state == QP_PROBING;
    if (ok) q->state = QP_UP;
    pthread_mutex_unlock(&q->mu);
    if (!ok) return KVF_EINVAL;
    /* what waited for a live QP goes out now */
    pthread_mutex_lock(&ch->mu);
    kvf_queue parked = ch->parked;
    int fresh = kvf_queue_init(&ch->parked) == KVF_OK;
    if (!fresh) ch->parked = parked;
    pthread_mutex_unlock(&ch->mu);
    if (fresh) {
        dispatch_queue(ch, &parked);
        kvf_queue_destroy(&parked);
    }
    return KVF_OK;
}

int kvf_rdma_chan_break_qp(kvf_rdma_chan *ch, int index) {
    rqp *q = chan_qp(ch, index);
    if (!q) return KVF_EINVAL;
    kvf_queue retry;
    kvf_queue_init(&retry);
    pthread_mutex_lock(&q->mu);
    int was_live = qp_take_down_locked(q, &retry);   /* no BROKEN event: the caller asked for it */
    pthread_mutex_unlock(&q->mu);
    dispatch_queue(ch, &retry);
    kvf_queue_destroy(&retry);
    return was_live ? KVF_OK : KVF_EINVAL;
}

int kvf_rdma_chan_drop_dev(kvf_rdma_chan *ch, kvf_rdma_dev *d) {
    int n = 0;
    for (int i = 0; i < kvf_rdma_chan_nqps(ch); i++) {
        rqp *q = chan_qp(ch, i);
        if (!q || q->dev != d || q->state == QP_GONE) continue;
        dev_slot_drop(d, q->slot, q);      /* off the device first, as in kvf_rdma_chan_close */
        kvf_queue retry;
        kvf_queue_init(&retry);
        pthread_mutex_lock(&q->mu);
        qp_take_down_locked(q, &retry);
        if (q->qp) {
            /* destroyed, not only broken: the kernel removes the device
             * only once every object of the context is gone */
            kvf_rdma_destroy_qp(ch->base.ctx, q->qp);
            q->qp = NULL;
        }
        if (q->state != QP_CLOSED) set_state_locked(q, QP_GONE);
        pthread_mutex_unlock(&q->mu);
        dispatch_queue(ch, &retry);
        kvf_queue_destroy(&retry);
        n++;
    }
    /* what was parked waiting for a QP of this channel waits in vain now */
    pthread_mutex_lock(&ch->mu);
    if (chan_all_gone_locked(ch)) fail_parked_locked(ch);
    pthread_mutex_unlock(&ch->mu);
    return n;
}

int kvf_rdma_chan_nqps(kvf_rdma_chan *ch) {
    pthread_mutex_lock(&ch->mu);
    int n = ch->nqps;
    pthread_mutex_unlock(&ch->mu);
    return n;
}

int kvf_rdma_chan_qp_stats(kvf_rdma_chan *ch, int index, uint32_t *dev, uint32_t *rdev,
                           uint64_t *wrs, uint64_t *bytes, uint32_t *qpn) {
    rqp *q = chan_qp(ch, index);
    if (!q) return -1;
    pthread_mutex_lock(&q->mu);
    *qpn = q->qp ? q->qp->qp_num : 0;
    *dev = q->dev_index;
    *rdev = q->rdev;
    *wrs = q->wrs;
    *bytes = q->bytes;
    int st = q->state;
    pthread_mutex_unlock(&q->mu);
    return st;
}

static int rdma_open(kvf_channel *ch) { return !((kvf_rdma_chan *)ch)->closed; }

static uint64_t rdma_slice_size(kvf_channel *ch, uint64_t total) {
    (void)total;
    uint64_t slice = ((kvf_rdma_chan *)ch)->slice_size;
    return slice < (1u << 30) ? slice : (1u << 30);    /* one work request's length is 32 bits */
}

static void rdma_enqueue(kvf_channel *ch, kvf_slice *s, size_t n, int flags) {
    atomic_fetch_add_explicit(&ch->ctx->n_slices_inflight, (int64_t)n, memory_order_relaxed);
    /* a polled batch is posted here, whatever the device: this thread waits for it anyway */
    chan_dispatch((kvf_rdma_chan *)ch, s, n, flags & KVF_SUBMIT_POLLED);
}

/* The devices this channel's QPs are on, each counted as polled. */
static void rdma_poll_begin(kvf_channel *base, kvf_poll_state *st) {
    kvf_rdma_chan *ch = (kvf_rdma_chan *)base;
    _Static_assert(sizeof(st->dev) / sizeof(st->dev[0]) >= 2 * KVF_MAX_DEVS,
                   "a poll covers every device (a reopened one and the one it replaces too)");
    st->n = 0;
    pthread_mutex_lock(&ch->mu);
    for (int i = 0; i < ch->nqps; i++) {
        /* Read without q->mu (ch->mu is held): GONE is final, and only
         * kvf_rdma_chan_drop_dev sets it, called on the event loop's thread
         * before the device is freed. Polling (budget_ns > 0) happens only
         * on that thread too (Channel.submit_poll with poll=True), as do
         * the QP additions, so neither the devices nor the QPs of this
         * channel change until the poll ends. */
        if (ch->qps[i]->state == QP_GONE) continue;     /* its device (and CQ) is freed */
        int seen = 0;
        for (int j = 0; j < st->n; j++) seen |= st->dev[j] == ch->qps[i]->dev;
        if (!seen && st->n < (int)(sizeof(st->dev) / sizeof(st->dev[0]))) st->dev[st->n++] = ch->qps[i]->dev;
    }
    pthread_mutex_unlock(&ch->mu);
    for (int j = 0; j < st->n; j++) atomic_fetch_add(&((kvf_rdma_dev *)st->dev[j])->polling, 1);
}

static int rdma_poll(kvf_channel *ch, kvf_poll_state *st, uint64_t id, uint64_t budget_ns) {
    struct ibv_wc wc[POLL_BATCH];
    uint64_t deadline = now_ns() + budget_ns;
    int finished;
    while (!(finished = kvf_batch_finished(ch->ctx, id))) {
        int got = 0;
        for (int j = 0; j < st->n; j++) {
            kvf_rdma_dev *d = st->dev[j];
            int k = ibv_poll_cq(d->cq, POLL_BATCH, wc);
            if (k > 0) { handle(d, wc, k); got = 1; }
        }
        if (!got && now_ns() > deadline) break;
    }
    return finished;
}

/* Work left on a device (this batch's, or others') goes to its worker. */
static void rdma_poll_end(kvf_channel *ch, kvf_poll_state *st) {
    (void)ch;
    for (int j = 0; j < st->n; j++) {
        kvf_rdma_dev *d = st->dev[j];
        atomic_fetch_sub(&d->polling, 1);
        if (atomic_load(&d->posted) > 0) dev_posted(d, 0);
    }
}

static void rdma_close(kvf_channel *ch) { kvf_rdma_chan_close((kvf_rdma_chan *)ch); }
static void rdma_free(kvf_channel *ch) { kvf_rdma_chan_free((kvf_rdma_chan *)ch); }

static const kvf_provider_ops rdma_ops = {
    .name = "rdma",
    .open = rdma_open,
    .slice_size = rdma_slice_size,
    .enqueue = rdma_enqueue,
    .poll_begin = rdma_poll_begin,
    .poll = rdma_poll,
    .poll_end = rdma_poll_end,
    .close = rdma_close,
    .free = rdma_free,
};

int kvf_rdma_post_one(kvf_rdma_chan *ch, int index, int op, uint64_t laddr, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, uint32_t len, uint64_t *id_out) {
    rqp *q = chan_qp(ch, index);
    if (!q || ch->closed) return KVF_ECLOSED;
    uint64_t id;
    int rc = kvf_batch_alloc(ch->base.ctx, 1, &id);
    if (rc) return rc;
    kvf_slice s = {.local = laddr, .remote = raddr, .len = len, .slot = (uint32_t)id, .op = (uint32_t)op};
    S_LKEY(s) = lkey;
    S_RKEY(s) = rkey;
    atomic_fetch_add_explicit(&ch->base.ctx->n_slices_inflight, 1, memory_order_relaxed);
    kvf_queue retry;
    kvf_queue_init(&retry);
    pthread_mutex_lock(&q->mu);
    if (!qp_live(q->state) || kvf_queue_push_locked(&q->backlog, &s)) {
        pthread_mutex_unlock(&q->mu);
        slice_finish(ch->base.ctx, &s, KVF_ELOST);
    } else {
        qp_post_locked(q, &retry, POST_ALL);
        pthread_mutex_unlock(&q->mu);
    }
    dispatch_queue(ch, &retry);
    kvf_queue_destroy(&retry);
    kvf_batch_release_guard(ch->base.ctx, id);
    *id_out = id;
    return KVF_OK;
}

void kvf_rdma_chan_close(kvf_rdma_chan *ch) {
    pthread_mutex_lock(&ch->mu);
    if (ch->closed) { pthread_mutex_unlock(&ch->mu); return; }
    ch->closed = 1;
    int nqps = ch->nqps;
    pthread_mutex_unlock(&ch->mu);
    kvf_ctx *c = ch->base.ctx;
    for (int i = 0; i < nqps; i++) {
        rqp *q = ch->qps[i];
        /* Without q->mu: only kvf_rdma_chan_drop_dev makes a QP GONE and
         * only kvf_rdma_chan_replace_qp takes it out of GONE; RdmaChannel
         * serialises both with close by its use_lock, so no QP enters or
         * leaves GONE while this loop runs. */
        if (q->state == QP_GONE) continue;     /* destroyed with its device, nothing left on it */
        dev_slot_drop(q->dev, q->slot, q);     /* off the device first */
        pthread_mutex_lock(&q->mu);
        if (q->qp) {
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
            ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
            kvf_rdma_destroy_qp(c, q->qp);     /* synchronous: no more memory access */
            q->qp = NULL;
        }
        set_state_locked(q, QP_CLOSED);
        take_incoming_locked(q, &q->backlog);
        for (uint64_t s = q->tail; s < q->head; s++) slice_finish(c, &q->ring[s % q->depth], KVF_ELOST);
        atomic_fetch_sub_explicit(&q->dev->posted, (int64_t)(q->head - q->tail), memory_order_relaxed);
        q->tail = q->head;
        kvf_slice tmp[64];
        size_t k;
        while ((k = kvf_queue_pop_locked(&q->backlog, tmp, 64)) > 0)
            for (size_t j = 0; j < k; j++) slice_finish(c, &tmp[j], KVF_ELOST);
        pthread_mutex_unlock(&q->mu);
    }
    pthread_mutex_lock(&ch->mu);
    fail_parked_locked(ch);
    pthread_mutex_unlock(&ch->mu);
}

static void chan_destroy(kvf_rdma_chan *ch) {
    for (int i = 0; i < ch->nqps; i++) {
        rqp *q = ch->qps[i];
        kvf_queue_destroy(&q->backlog);
        kvf_queue_destroy(&q->incoming);
        free(q->ring);
        pthread_mutex_destroy(&q->mu);
        pthread_mutex_destroy(&q->in_mu);
        free(q);
    }
    kvf_queue_destroy(&ch->parked);
    pthread_mutex_destroy(&ch->mu);
    free(ch);
}

void kvf_rdma_chan_free(kvf_rdma_chan *ch) {
    if (!ch) return;
    kvf_rdma_chan_close(ch);
    chan_unref(ch);
}
