/* The rdma provider's internals, shared by its data-path files (rdma.h is
 * the public face, and says the design):
 *
 *   rdma_events.c  the event queue for the event loop; device async events
 *   rdma_post.c    posting: a QP's backlog to its send queue, striping a
 *                  batch over a channel's QPs, breaking a QP
 *   rdma_worker.c  completions, the per-device worker thread, the device
 *   rdma_chan.c    channels and their QPs' lifecycle, the provider ops
 *   rdma_credit.c  receiver credits: the receive window over RC QPs
 *
 * Like those files, built only where libibverbs is (setup.py, have_verbs). */
#ifndef KVF_RDMA_INT_H
#define KVF_RDMA_INT_H

#include <time.h>

#include "credit.h"
#include "rdma.h"
#include "provider.h"

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
/* wr_id of a credit message (rdma_credit.c), not a slice: an initiator's
 * QP slot and generation as a slice's would be, or with TGT_FLAG too, a
 * target QP's id in the low 32 bits. */
#define CTL_FLAG (1ull << 62)
#define TGT_FLAG (1ull << 61)
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
    /* Receiver credits, when the target has a receive window (ch->window;
     * under mu): its wallet (credit.h), as a tcp connection's; completed
     * write bytes to report; whether it said that it waits for cr.need;
     * credit messages posted and not completed (they take send-queue
     * entries outside the ring). */
    kvf_credit_wallet cr;
    uint64_t landed;
    int need_told;
    uint32_t ctl_out;
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
    /* Target QPs holding receiver credits (rdma_credit.c), under mu. */
    struct kvf_rdma_target *targets;
    uint32_t next_target;
};

struct kvf_rdma_chan {
    kvf_channel base;        /* ops, the context, the peer's regions (provider.h) */
    uint64_t slice_size;
    uint64_t token;
    pthread_mutex_t mu;      /* guards qps, nqps, parked, rr, closed */
    rqp *qps[MAX_QPS];
    int nqps;
    kvf_queue parked;        /* slices waiting for any QP to come back */
    uint64_t window;         /* the target's receive window: credits on (0: off) */
    uint32_t rr;
    int closed;
    _Atomic int refs;        /* the owner's + workers' re-dispatching */
};

static inline void slice_finish(kvf_ctx *c, const kvf_slice *s, int status) {
    atomic_fetch_sub_explicit(&c->n_slices_inflight, 1, memory_order_relaxed);
    kvf_slice_done(c, s->slot, status, s->entry);
}

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* --------------------------------------------- shared between the files */

/* rdma_events.c: queues e for the event loop and wakes it once per burst;
 * e->data is the queue's from then on (freed if it cannot be queued). */
void rdma_events_push(kvf_rdma_events *q, const kvf_rdma_event *e);

/* rdma_post.c (each commented where it is defined) */
void rdma_dev_posted(kvf_rdma_dev *d, int64_t n);
void rdma_take_incoming_locked(rqp *q, kvf_queue *to);
void rdma_qp_post_locked(rqp *q, kvf_queue *retry, size_t max_wrs);
void rdma_set_state_locked(rqp *q, int state);
int rdma_qp_take_down_locked(rqp *q, kvf_queue *retry);
void rdma_qp_break_locked(rqp *q, int wc_status, kvf_queue *retry);
int rdma_chan_all_gone_locked(const kvf_rdma_chan *ch);
void rdma_chan_dispatch(kvf_rdma_chan *ch, kvf_slice *s, size_t n, int inline_post);
void rdma_dispatch_queue(kvf_rdma_chan *ch, kvf_queue *retry);

/* rdma_worker.c: handles n completions of device d (send or receive), as
 * its worker does; also called by a polling caller (rdma_poll). */
void rdma_handle(kvf_rdma_dev *d, struct ibv_wc *wc, int n);

/* rdma_credit.c: receiver credits over the data path (see there). The
 * initiator's side, under q->mu: what a QP may post (strict budget for
 * pop_fit), its asks and reports, a grant or recall that arrived; the
 * target's: a credit message received, and a target QP's message sent. */
uint32_t rdma_credit_depth(const rqp *q);
void rdma_credit_spent_locked(rqp *q, uint64_t spent, uint64_t blocked);
void rdma_credit_ask_locked(rqp *q);
void rdma_credit_reset_locked(rqp *q);
/* A received message with the credit immediate: 1 when it was one (on the
 * initiator: *q_out is the QP it was for, locked, for the caller to post
 * and unlock; NULL when nothing is to be done). */
int rdma_credit_recv(kvf_rdma_dev *d, const struct ibv_wc *wc, const uint8_t *buf, rqp **q_out);
void rdma_credit_target_sent(kvf_rdma_dev *d, uint32_t id);

/* rdma_chan.c: the channel's references (the owner's, and a worker's while
 * it re-dispatches); the last one frees it. */
void rdma_chan_ref(kvf_rdma_chan *ch);
void rdma_chan_unref(kvf_rdma_chan *ch);

#endif
