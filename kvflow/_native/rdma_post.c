/* The rdma provider's posting path: a QP's backlog onto its send queue
 * (chains, signalling, the byte cap), a batch striped over a channel's live
 * QPs, and a QP taken out of service with what it carried sent elsewhere.
 * See rdma.h for the design. */
#define _GNU_SOURCE
#include "rdma_int.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ posting */

static inline uint64_t wr_id(const rqp *q, uint64_t seq) {
    return ((uint64_t)q->slot << 48) | ((uint64_t)(q->gen & 0xffff) << 32) | (uint32_t)seq;
}

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
void rdma_dev_posted(kvf_rdma_dev *d, int64_t n) {
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
void rdma_take_incoming_locked(rqp *q, kvf_queue *to) {
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
void rdma_qp_post_locked(rqp *q, kvf_queue *retry, size_t max_wrs) {
    kvf_ctx *c = q->ch->base.ctx;
    if (qp_live(q->state)) rdma_take_incoming_locked(q, &q->backlog);
    int credits = q->ch->window != 0;
    uint32_t depth = rdma_credit_depth(q);
    while (max_wrs && qp_live(q->state) && q->backlog.count && q->head - q->tail < depth &&
           (q->inflight < MAX_INFLIGHT_BYTES || q->head == q->tail)) {
        size_t room = depth - (size_t)(q->head - q->tail);
        if (room > CHAIN) room = CHAIN;
        if (room > max_wrs) room = max_wrs;
        /* in the scheduler's order while the byte cap lasts (at least one
         * slice; the loop's test keeps inflight below the cap), and with
         * credits, write slices only against credit held */
        uint64_t cap = MAX_INFLIGHT_BYTES - q->inflight;
        kvf_pop_budget budget = {q->cr.credit, KVF_OP_WRITE, 0};
        kvf_slice tmp[CHAIN];
        size_t k = kvf_queue_pop_fit_locked(&q->backlog, tmp, room, cap, credits ? &budget : NULL);
        if (credits) {
            uint64_t spent = 0;
            for (size_t i = 0; i < k; i++) if (tmp[i].op == KVF_OP_WRITE) spent += tmp[i].len;
            rdma_credit_spent_locked(q, spent, k ? 0 : budget.blocked);
        }
        if (k == 0) break;                    /* waiting for credit */
        struct ibv_send_wr wr[CHAIN];
        struct ibv_sge sge[CHAIN];
        size_t m = 0;
        for (size_t i = 0; i < k; i++) {
            kvf_slice *s = &tmp[i];
            if (s->op <= KVF_OP_READ && kvf_batch_cancelled(c, s->slot)) {
                if (credits && s->op == KVF_OP_WRITE) q->cr.credit += s->len;   /* not spent after all */
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
        rdma_dev_posted(q->dev, (int64_t)posted);
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
            rdma_qp_break_locked(q, IBV_WC_GENERAL_ERR, retry);
            return;
        }
        q->head += m;
    }
    if (credits) rdma_credit_ask_locked(q);
    if (!max_wrs && qp_live(q->state) && q->backlog.count) ready_push_locked(q);
}

static void events_broken(rqp *q, int wc_status) {
    kvf_rdma_event e = {KVF_RDMA_EV_BROKEN, q->dev->index, 0, (uint32_t)q->index, q->ch->token,
                        wc_status, 0, NULL};
    rdma_events_push(q->dev->ev, &e);
}

/* A QP leaves UP under in_mu too: a submitter queues for the worker only
 * while it sees the QP UP under in_mu, so whatever it queued before is in
 * `incoming` when the state changes, for the caller to move on. */
void rdma_set_state_locked(rqp *q, int state) {
    pthread_mutex_lock(&q->in_mu);
    q->state = state;
    pthread_mutex_unlock(&q->in_mu);
}

/* Takes a live QP out of service: error state, completions still in the CQ
 * stale, what it carried (posted and backlog) to *retry. Caller holds q->mu.
 * Returns 0 if it was not live. */
int rdma_qp_take_down_locked(rqp *q, kvf_queue *retry) {
    if (!qp_live(q->state)) return 0;
    rdma_set_state_locked(q, QP_BROKEN);
    q->gen = (q->gen + 1) & 0xffff;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
    for (uint64_t s = q->tail; s < q->head; s++) kvf_queue_push_locked(retry, &q->ring[s % q->depth]);
    atomic_fetch_sub_explicit(&q->dev->posted, (int64_t)(q->head - q->tail), memory_order_relaxed);
    q->tail = q->head;
    q->inflight = 0;
    rdma_credit_reset_locked(q);
    kvf_slice tmp[64];
    size_t k;
    while ((k = kvf_queue_pop_locked(&q->backlog, tmp, 64)) > 0)
        for (size_t i = 0; i < k; i++) kvf_queue_push_locked(retry, &tmp[i]);
    rdma_take_incoming_locked(q, retry);
    return 1;
}

/* The QP failed: everything posted and queued on it moves to *retry, the
 * QP goes to the error state (no more memory access), and the event loop is
 * told to connect a new one. Caller holds q->mu. */
void rdma_qp_break_locked(rqp *q, int wc_status, kvf_queue *retry) {
    if (rdma_qp_take_down_locked(q, retry)) events_broken(q, wc_status);
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
int rdma_chan_all_gone_locked(const kvf_rdma_chan *ch) {
    if (ch->nqps == 0) return 0;          /* still being connected */
    for (int i = 0; i < ch->nqps; i++)
        if (ch->qps[i]->state != QP_GONE && ch->qps[i]->state != QP_CLOSED) return 0;
    return 1;
}

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
void rdma_chan_dispatch(kvf_rdma_chan *ch, kvf_slice *s, size_t n, int inline_post) {
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
            int lost = rdma_chan_all_gone_locked(ch);
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
            rdma_qp_post_locked(q, &retry, POST_ALL);
            pthread_mutex_unlock(&q->mu);
            kvf_slice tmp[64];
            size_t k;
            while ((k = kvf_queue_pop_locked(&retry, tmp, 64)) > 0)
                for (size_t i = 0; i < k; i++) kvf_queue_push_locked(&bounced, &tmp[i]);
            kvf_queue_destroy(&retry);
        }
        /* what bounced off a QP that broke meanwhile goes round again */
        rdma_dispatch_queue(ch, &bounced);
        kvf_queue_destroy(&bounced);
        return;
    }
}

void rdma_dispatch_queue(kvf_rdma_chan *ch, kvf_queue *retry) {
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
    rdma_chan_dispatch(ch, v, k, 0);
    free(v);
}
