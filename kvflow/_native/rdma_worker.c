/* The rdma provider's completion side: a device's completions mapped back
 * to their slices (retired, retried or failed), notifications received,
 * the device's worker thread, and the device itself. See rdma.h for the
 * design. */
#define _GNU_SOURCE
#include "rdma_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ------------------------------------------------------------- completions */

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
 * the device (index + 1) for the error message (kvflow/status.py). */
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

/* Retires posted slice `seq` with `status`. Caller holds q->mu. */
static void retire(rqp *q, uint64_t seq, int status) {
    kvf_slice *s = &q->ring[seq % q->depth];
    q->inflight -= s->len;
    if (s->op == KVF_OP_WRITE) q->landed += s->len;    /* reported to the target's window (credits) */
    atomic_fetch_sub_explicit(&q->dev->posted, 1, memory_order_relaxed);
    slice_finish(q->ch->base.ctx, s, status);
}

static void post_recv(kvf_rdma_dev *d, int i) {
    struct ibv_sge sge = {(uint64_t)(uintptr_t)(d->recv_buf + (size_t)i * KVF_RDMA_RECV_BYTES),
                          KVF_RDMA_RECV_BYTES, d->recv_mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = RECV_FLAG | (uint64_t)i, .sg_list = &sge, .num_sge = 1}, *bad;
    ibv_post_srq_recv(d->srq, &wr, &bad);
}

static void qp_post_unlock(rqp *q, kvf_queue *retry, size_t max_wrs);

static void on_recv(kvf_rdma_dev *d, const struct ibv_wc *wc) {
    int i = (int)(wc->wr_id & 0xffffffffu);
    if (i < 0 || i >= d->recv_bufs) return;
    rqp *q = NULL;
    if (wc->status == IBV_WC_SUCCESS && wc->opcode == IBV_WC_RECV &&
        rdma_credit_recv(d, wc, d->recv_buf + (size_t)i * KVF_RDMA_RECV_BYTES, &q)) {
        /* a credit message; a grant or recall left its QP locked, to post */
        post_recv(d, i);
        if (q) {
            kvf_queue retry;
            kvf_queue_init(&retry);
            qp_post_unlock(q, &retry, d->worker_posts ? WORKER_CHAIN : POST_ALL);
        }
        return;
    }
    if (wc->status == IBV_WC_SUCCESS && wc->opcode == IBV_WC_RECV) {
        uint32_t len = wc->byte_len <= KVF_RDMA_RECV_BYTES ? wc->byte_len : KVF_RDMA_RECV_BYTES;
        uint8_t *data = malloc(len ? len : 1);
        if (data) {
            memcpy(data, d->recv_buf + (size_t)i * KVF_RDMA_RECV_BYTES, len);
            kvf_rdma_event e = {KVF_RDMA_EV_NOTIFY, d->index, wc->qp_num, 0, 0, 0, len, data};
            rdma_events_push(d->ev, &e);
        }
    }
    post_recv(d, i);
}

/* rdma_qp_post_locked, then releases q->mu and sends what *retry holds
 * (slices of a QP that broke) to the channel's other QPs; *retry is
 * destroyed. */
static void qp_post_unlock(rqp *q, kvf_queue *retry, size_t max_wrs) {
    rdma_qp_post_locked(q, retry, max_wrs);
    kvf_rdma_chan *ch = q->ch;
    if (retry->count) rdma_chan_ref(ch);      /* the channel outlives its QP's lock */
    pthread_mutex_unlock(&q->mu);
    if (retry->count) {
        rdma_dispatch_queue(ch, retry);
        rdma_chan_unref(ch);
    }
    kvf_queue_destroy(retry);
}

static void on_send(kvf_rdma_dev *d, const struct ibv_wc *wc) {
    if ((wc->wr_id & (CTL_FLAG | TGT_FLAG)) == (CTL_FLAG | TGT_FLAG)) {
        rdma_credit_target_sent(d, (uint32_t)wc->wr_id);
        return;
    }
    uint32_t slot = (uint32_t)(wc->wr_id >> 48) & (MAX_SLOTS - 1);
    uint32_t gen = (uint32_t)(wc->wr_id >> 32) & 0xffff;
    uint32_t seq32 = (uint32_t)wc->wr_id;
    pthread_mutex_lock(&d->mu);
    rqp *q = d->slots[slot];
    if (!q) { pthread_mutex_unlock(&d->mu); return; }
    pthread_mutex_lock(&q->mu);
    pthread_mutex_unlock(&d->mu);
    if (!qp_live(q->state) || q->gen != gen) { pthread_mutex_unlock(&q->mu); return; }
    if (wc->wr_id & CTL_FLAG) {
        /* an initiator's credit message: its entry is free; a failed one
         * breaks the QP (its credit could not be asked for or reported) */
        q->ctl_out--;
        atomic_fetch_sub_explicit(&q->dev->posted, 1, memory_order_relaxed);
        kvf_queue retry;
        kvf_queue_init(&retry);
        if (wc->status != IBV_WC_SUCCESS) rdma_qp_break_locked(q, wc->status, &retry);
        qp_post_unlock(q, &retry, d->worker_posts ? WORKER_CHAIN : POST_ALL);
        return;
    }
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
        if (failed.op == KVF_OP_WRITE) q->landed += failed.len;    /* no longer in flight either */
        atomic_fetch_sub_explicit(&q->dev->posted, 1, memory_order_relaxed);
        q->tail = seq + 1;
        if (retryable(wc->status) && failed.op <= KVF_OP_READ && failed.attempts < MAX_ATTEMPTS)
            kvf_queue_push_locked(&retry, &failed);
        else
            slice_finish(c, &failed, verbs_status(wc->status, d));
        rdma_qp_break_locked(q, wc->status, &retry);
    }
    qp_post_unlock(q, &retry, d->worker_posts ? WORKER_CHAIN : POST_ALL);
}

void rdma_handle(kvf_rdma_dev *d, struct ibv_wc *wc, int n) {
    for (int i = 0; i < n; i++) {
        if (wc[i].wr_id & RECV_FLAG) on_recv(d, &wc[i]);
        else on_send(d, &wc[i]);
    }
}

/* ------------------------------------------------------------------ worker */

/* A worker polls its CQs while work requests of its device are on the wire
 * (for at most the device's spin_ns since the last completion or wake-up), and sleeps on
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
    if (n > 0) rdma_handle(d, wc, n);
    int m = ibv_poll_cq(d->rcq, POLL_BATCH, wc);
    if (m > 0) rdma_handle(d, wc, m);
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
    kvf_thread_name("kvf-rdma");
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
    /* one entry per receive buffer (the SRQ's: every QP receives through
     * it, notifications and credit messages) */
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
