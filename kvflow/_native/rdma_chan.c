/* The rdma provider's channels: creating one, adding, replacing, breaking
 * and dropping its QPs, their stats, the provider ops (kvf_provider_ops)
 * and the close; and the engine's MR and QP counters. See rdma.h for the
 * design. */
#define _GNU_SOURCE
#include "rdma_int.h"

#include <stdlib.h>

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

/* ----------------------------------------------------------------- channel */

static const kvf_provider_ops rdma_ops;

void rdma_chan_ref(kvf_rdma_chan *ch) { atomic_fetch_add(&ch->refs, 1); }
static void chan_destroy(kvf_rdma_chan *ch);
void rdma_chan_unref(kvf_rdma_chan *ch) {
    if (atomic_fetch_sub(&ch->refs, 1) == 1) chan_destroy(ch);
}

kvf_rdma_chan *kvf_rdma_chan_new(kvf_ctx *c, kvf_region_table *remote, uint64_t slice_size,
                                 uint64_t token) {
    kvf_rdma_chan *ch = calloc(1, sizeof(*ch));
    if (!ch) return NULL;
    if (kvf_channel_init(&ch->base, &rdma_ops, c, remote) != KVF_OK) { free(ch); return NULL; }
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

/* Frees a QP record whose verbs QP is gone (or was never made). */
static void rqp_free(rqp *q) {
    kvf_queue_destroy(&q->backlog);
    kvf_queue_destroy(&q->incoming);
    free(q->ring);
    pthread_mutex_destroy(&q->mu);
    pthread_mutex_destroy(&q->in_mu);
    free(q);
}

int kvf_rdma_chan_add_qp(kvf_rdma_chan *ch, kvf_rdma_dev *dev, uint32_t rdev, struct ibv_qp *qp,
                         uint32_t depth, int up) {
    /* a device already closed (freed: nothing to index) or no QP */
    if (!dev || !qp || !depth) return -1;
    rqp *q = calloc(1, sizeof(*q));
    if (!q) return -1;
    q->ring = calloc(depth, sizeof(kvf_slice));
    /* both scheduled (sched.c): slices go to the send queue by class,
     * deadline and fair share, and a cancel drops them from either */
    kvf_ctx *c = ch->base.ctx;
    if (!q->ring || kvf_queue_init_sched(&q->backlog, c, 1, &q->mu)) { free(q->ring); free(q); return -1; }
    if (kvf_queue_init_sched(&q->incoming, c, 1, &q->in_mu)) {
        kvf_queue_destroy(&q->backlog);
        free(q->ring);
        free(q);
        return -1;
    }
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
    rqp_free(q);
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
    /* ch->mu too: submit_poll and rdma_chan_all_gone_locked read a GONE QP's
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
    rdma_credit_reset_locked(q);
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
        rdma_dispatch_queue(ch, &parked);
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
    int was_live = rdma_qp_take_down_locked(q, &retry);   /* no BROKEN event: the caller asked for it */
    pthread_mutex_unlock(&q->mu);
    rdma_dispatch_queue(ch, &retry);
    kvf_queue_destroy(&retry);
    return was_live ? KVF_OK : KVF_EINVAL;
}

static void fail_parked_locked(kvf_rdma_chan *ch) {
    kvf_slice tmp[64];
    size_t k;
    while ((k = kvf_queue_pop_locked(&ch->parked, tmp, 64)) > 0)
        for (size_t j = 0; j < k; j++) slice_finish(ch->base.ctx, &tmp[j], KVF_ELOST);
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
        rdma_qp_take_down_locked(q, &retry);
        if (q->qp) {
            /* destroyed, not only broken: the kernel removes the device
             * only once every object of the context is gone */
            kvf_rdma_destroy_qp(ch->base.ctx, q->qp);
            q->qp = NULL;
        }
        if (q->state != QP_CLOSED) rdma_set_state_locked(q, QP_GONE);
        pthread_mutex_unlock(&q->mu);
        rdma_dispatch_queue(ch, &retry);
        kvf_queue_destroy(&retry);
        n++;
    }
    /* what was parked waiting for a QP of this channel waits in vain now */
    pthread_mutex_lock(&ch->mu);
    if (rdma_chan_all_gone_locked(ch)) fail_parked_locked(ch);
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

/* QP `index`'s queue: work requests posted and not retired, their bytes,
 * and the slices (and bytes) waiting to be posted (its backlog and what
 * submitters handed its worker). */
int kvf_rdma_chan_qp_queue(kvf_rdma_chan *ch, int index, uint64_t out[4]) {
    rqp *q = chan_qp(ch, index);
    if (!q) return -1;
    pthread_mutex_lock(&q->mu);
    out[0] = q->head - q->tail;
    out[1] = q->inflight;
    out[2] = q->backlog.count;
    out[3] = q->backlog.bytes;
    pthread_mutex_lock(&q->in_mu);
    out[2] += q->incoming.count;
    out[3] += q->incoming.bytes;
    pthread_mutex_unlock(&q->in_mu);
    pthread_mutex_unlock(&q->mu);
    return 0;
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
    rdma_chan_dispatch((kvf_rdma_chan *)ch, s, n, flags & KVF_SUBMIT_POLLED);
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
            if (k > 0) { rdma_handle(d, wc, k); got = 1; }
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
        if (atomic_load(&d->posted) > 0) rdma_dev_posted(d, 0);
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
        rdma_qp_post_locked(q, &retry, POST_ALL);
        pthread_mutex_unlock(&q->mu);
    }
    rdma_dispatch_queue(ch, &retry);
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
        /* off the engine's list of scheduled queues first (takes its lock,
         * which no cancel holds while waiting for q->mu: sched_mu first) */
        kvf_queue_detach(&q->backlog);
        kvf_queue_detach(&q->incoming);
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
        rdma_set_state_locked(q, QP_CLOSED);
        rdma_take_incoming_locked(q, &q->backlog);
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
    for (int i = 0; i < ch->nqps; i++) rqp_free(ch->qps[i]);
    kvf_queue_destroy(&ch->parked);
    pthread_mutex_destroy(&ch->mu);
    free(ch);
}

void kvf_rdma_chan_free(kvf_rdma_chan *ch) {
    if (!ch) return;
    kvf_rdma_chan_close(ch);
    rdma_chan_unref(ch);
}
