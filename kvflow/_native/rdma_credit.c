/* Receiver credits on rdma: the engine's receive window (credit.h, one pool
 * for tcp and rdma together) over RC queue pairs.
 *
 * A one-sided write lands without the target's CPU seeing it, so the
 * target cannot take bytes back as they land, as its tcp side does. The
 * initiator can: an RC completion means the write was placed in the
 * target's memory. So each target QP is a holder of the pool, and
 *
 *   - the initiator's QP posts write slices only against credit it holds
 *     (the scheduler's next slice waits for credit; nothing passes it), and
 *     asks for credit, hands back what it does not spend and reports the
 *     bytes of its completed writes as landed, in a credit message;
 *   - the target takes those bytes back and grants what is free, as it
 *     does for tcp connections, in credit messages the other way.
 *
 * Held credit therefore covers every write between the initiator's send
 * queue and the target's memory, and a little more: bytes that landed and
 * were not reported yet (at most a report's worth, REPORT below, or until
 * the QP is idle).
 *
 * A credit message is a SEND with immediate data KVF_RDMA_CREDIT_IMM (a
 * notification is a SEND without), inline (no memory registered for it),
 * signalled, its wr_id flagged CTL_FLAG: it takes a send-queue entry
 * outside the QP's ring of slices, and completes on its own. An initiator
 * QP keeps CTL_MAX entries of its send queue for them; a target QP, which
 * sends nothing else, has KVF_RDMA_TARGET_DEPTH; a grant that finds no room
 * waits in the target's pending bytes and goes with the next completion.
 * Both ends' QPs receive through their device's SRQ.
 *
 * Grants find their QP without a lookup: every ask carries the initiator
 * QP's slot and generation (echo), and the target puts them back in its
 * grants and recalls. Asks find their target QP by (device, QP number) in
 * the device's short list of target QPs holding credit.
 *
 * When a QP breaks, its credit goes with it: the initiator's QP starts
 * again with none (rdma_credit_reset_locked), and the target QP it was
 * paired with gives back all it held when the repair replaces it, or when
 * the peer's control session ends (kvf_rdma_target_free). */
#define _GNU_SOURCE
#include "rdma_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define KVF_RDMA_CREDIT_IMM 0x4b464331u   /* "KFC1" */
#define CTL_MAX 4                         /* credit messages in flight per initiator QP */

typedef struct {
    uint16_t magic;      /* KVF_MAGIC */
    uint8_t type;        /* KVF_F_CREDIT_ASK / _GRANT / _RECALL (wire.h) */
    uint8_t flags;       /* ask: KVF_ASK_BLOCKED */
    uint32_t echo;       /* the initiator QP's slot << 16 | generation */
    uint64_t bytes;      /* ask: unspent credit handed back; grant: granted; recall: held */
    uint64_t want;       /* ask: bytes more wanted */
    uint64_t landed;     /* ask: completed write bytes since the last report */
    uint64_t unit;       /* ask: its slice size */
} credit_msg;
_Static_assert(sizeof(credit_msg) <= KVF_RDMA_CREDIT_INLINE, "a credit message is sent inline");

struct kvf_rdma_target {
    kvf_credit_holder h;      /* first: the pool's send callback finds the target from it */
    kvf_rdma_dev *d;
    struct ibv_qp *qp;
    uint32_t id, qpn;
    _Atomic uint32_t echo;    /* from its initiator's last ask */
    /* under the pool's lock: messages posted and not completed, and what
     * waits for send-queue room (a grant's bytes; a recall's held, 0: none) */
    uint32_t out;
    uint64_t pend_grant, pend_recall;
    kvf_rdma_target *next;    /* the device's list (d->mu) */
};

/* Posts one credit message, inline and signalled. 0, or the post's errno. */
static int post_msg(struct ibv_qp *qp, uint64_t wr_id, const credit_msg *m) {
    struct ibv_sge sge = {(uint64_t)(uintptr_t)m, sizeof(*m), 0};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.imm_data = htonl(KVF_RDMA_CREDIT_IMM);
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    return ibv_post_send(qp, &wr, &bad);
}

/* ------------------------------------------------------------ initiator */

void kvf_rdma_chan_set_window(kvf_rdma_chan *ch, uint64_t window) {
    ch->window = window;
    /* every slice must fit a grant, and a few must fit the window at once */
    if (window && ch->slice_size > window / 4) ch->slice_size = window / 4 > 4096 ? window / 4 : 4096;
}

/* Send-queue entries the QP's slices may use: the rest is kept for credit
 * messages. */
uint32_t rdma_credit_depth(const rqp *q) {
    return q->ch->window && q->depth > 2 * CTL_MAX ? q->depth - CTL_MAX : q->depth;
}

/* After a pop with credits on: `spent` write bytes taken; `blocked`: the
 * next slice's length when it did not fit the credit held. */
void rdma_credit_spent_locked(rqp *q, uint64_t spent, uint64_t blocked) {
    q->cr.credit -= spent;
    if (blocked) {
        if (q->cr.need != blocked) q->need_told = 0;
        q->cr.need = blocked;
    } else if (spent) {
        q->cr.need = 0;
        q->need_told = 0;
    }
}

/* Landed bytes are reported once they reach this much, or when the QP has
 * nothing in flight any more. */
static uint64_t report_bytes(const rqp *q) {
    uint64_t r = q->ch->window / 8;
    return r > q->ch->slice_size ? r : q->ch->slice_size;
}

/* Sends a credit message if one is due and the send queue has room: the
 * QP stopped for credit and has not said so (it hands back all it holds
 * and needs one slice now), its backlog exceeds what it holds and asked
 * for, a recall's hand-back, or landed bytes to report. */
void rdma_credit_ask_locked(rqp *q) {
    uint64_t window = q->ch->window;
    if (!window || q->state != QP_UP || q->ctl_out >= CTL_MAX) return;
    if (q->head - q->tail + q->ctl_out >= q->depth) return;
    kvf_credit_wallet *w = &q->cr;
    uint64_t unit = q->ch->slice_size;
    uint64_t goal = q->backlog.bytes < window ? q->backlog.bytes : window;
    int blocked = w->need && w->credit < w->need && !q->need_told;
    uint64_t returned = w->ret_pending;
    if (blocked) {
        returned += w->credit;
        if (goal < unit) goal = unit;
    }
    uint64_t want = kvf_wallet_want(w, goal, blocked);
    int report = q->landed && (q->landed >= report_bytes(q) || q->inflight == 0);
    if (!blocked && !want && !returned && !report) return;
    credit_msg m = {KVF_MAGIC, KVF_F_CREDIT_ASK, blocked ? KVF_ASK_BLOCKED : 0,
                    q->slot << 16 | (q->gen & 0xffff), returned, want, q->landed, unit};
    uint64_t id = CTL_FLAG | ((uint64_t)q->slot << 48) | ((uint64_t)(q->gen & 0xffff) << 32);
    if (post_msg(q->qp, id, &m)) return;      /* retried at the next post or completion */
    q->ctl_out++;
    rdma_dev_posted(q->dev, 1);
    kvf_wallet_asked(w, want, blocked);
    q->landed = 0;
    if (blocked) q->need_told = 1;
}

/* The QP broke or was replaced: its credit went with its target QP. */
void rdma_credit_reset_locked(rqp *q) {
    kvf_wallet_reset(&q->cr);
    q->landed = 0;
    q->need_told = 0;
    atomic_fetch_sub_explicit(&q->dev->posted, (int64_t)q->ctl_out, memory_order_relaxed);
    q->ctl_out = 0;
}

int kvf_rdma_chan_credit_stats(kvf_rdma_chan *ch, int index, uint64_t out[6]) {
    pthread_mutex_lock(&ch->mu);
    rqp *q = index >= 0 && index < ch->nqps ? ch->qps[index] : NULL;
    pthread_mutex_unlock(&ch->mu);
    if (!q) return -1;
    pthread_mutex_lock(&q->mu);
    kvf_wallet_stats(&q->cr, out);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

/* A grant or recall for the initiator QP its echo names. */
static rqp *initiator_msg(kvf_rdma_dev *d, const credit_msg *m) {
    uint32_t slot = m->echo >> 16, gen = m->echo & 0xffff;
    if (slot >= MAX_SLOTS) return NULL;
    pthread_mutex_lock(&d->mu);
    rqp *q = d->slots[slot];
    if (q) pthread_mutex_lock(&q->mu);
    pthread_mutex_unlock(&d->mu);
    if (!q) return NULL;
    if (!qp_live(q->state) || (q->gen & 0xffff) != gen || !q->ch->window) {
        pthread_mutex_unlock(&q->mu);
        return NULL;
    }
    if (m->type == KVF_F_CREDIT_GRANT) kvf_wallet_grant(&q->cr, m->bytes);
    else kvf_wallet_recall(&q->cr);      /* handed back in the next ask */
    return q;
}

/* --------------------------------------------------------------- target */

/* The device's target QP with QP number qpn (an ask's), or id (a sent
 * message's wr_id). Caller holds d->mu. */
static kvf_rdma_target *target_by_qpn_locked(kvf_rdma_dev *d, uint32_t qpn) {
    kvf_rdma_target *t = d->targets;
    while (t && t->qpn != qpn) t = t->next;
    return t;
}

static kvf_rdma_target *target_by_id_locked(kvf_rdma_dev *d, uint32_t id) {
    kvf_rdma_target *t = d->targets;
    while (t && t->id != id) t = t->next;
    return t;
}

/* Sends what waits, while the target QP's send queue has room. Caller holds
 * the pool's lock. Nonzero: the QP cannot send (it is going; it leaves the
 * pool when the control path frees it). */
static int target_flush_locked(kvf_rdma_target *t) {
    while (t->out < KVF_RDMA_TARGET_DEPTH && (t->pend_grant || t->pend_recall)) {
        credit_msg m = {KVF_MAGIC, KVF_F_CREDIT_GRANT, 0, atomic_load(&t->echo), t->pend_grant, 0, 0, 0};
        if (!t->pend_grant) {
            m.type = KVF_F_CREDIT_RECALL;
            m.bytes = t->pend_recall;
        }
        int rc = post_msg(t->qp, CTL_FLAG | TGT_FLAG | t->id, &m);
        if (rc) return rc == ENOMEM ? 0 : -1;
        t->out++;
        rdma_dev_posted(t->d, 1);
        if (m.type == KVF_F_CREDIT_GRANT) t->pend_grant = 0;
        else t->pend_recall = 0;
    }
    return 0;
}

/* The pool's way to this target QP's initiator (credit.h); with the pool's
 * lock held. Grants that find no room add up. */
static int target_send(kvf_credit_holder *h, const kvf_hdr *frame) {
    kvf_rdma_target *t = (kvf_rdma_target *)h;
    if (frame->type == KVF_F_CREDIT_GRANT) t->pend_grant += frame->addr;
    else t->pend_recall = frame->addr ? frame->addr : 1;
    return target_flush_locked(t);
}

int kvf_rdma_target_new(kvf_rdma_dev *d, struct ibv_qp *qp, kvf_rdma_target **out) {
    *out = NULL;
    kvf_credit_pool *p = d->c->credit;
    if (!p) return KVF_OK;
    kvf_rdma_target *t = calloc(1, sizeof(*t));
    if (!t) return KVF_ENOMEM;
    t->d = d;
    t->qp = qp;
    t->qpn = qp->qp_num;
    t->h.send = target_send;
    pthread_mutex_lock(&d->mu);
    t->id = d->next_target++;
    t->next = d->targets;
    d->targets = t;
    kvf_credit_join(p, &t->h);
    pthread_mutex_unlock(&d->mu);
    *out = t;
    return KVF_OK;
}

void kvf_rdma_target_free(kvf_rdma_target *t) {
    if (!t) return;
    kvf_rdma_dev *d = t->d;
    kvf_credit_pool *p = d->c->credit;
    /* off the device's list and out of the pool together (d->mu, then the
     * pool's lock, as everywhere): no ask finds it and no grant goes to it
     * after this; completions of what it sent are dropped */
    pthread_mutex_lock(&d->mu);
    for (kvf_rdma_target **x = &d->targets; *x; x = &(*x)->next)
        if (*x == t) { *x = t->next; break; }
    kvf_credit_leave(p, &t->h);
    /* stable now: sends (under the pool's lock) ended with the leave, and
     * completions take d->mu, held here */
    atomic_fetch_sub_explicit(&d->posted, (int64_t)t->out, memory_order_relaxed);
    pthread_mutex_unlock(&d->mu);
    free(t);
}

void rdma_credit_target_sent(kvf_rdma_dev *d, uint32_t id) {
    kvf_credit_pool *p = d->c->credit;
    if (!p) return;
    pthread_mutex_lock(&d->mu);
    kvf_rdma_target *t = target_by_id_locked(d, id);
    if (t) {
        pthread_mutex_lock(&p->mu);
        t->out--;
        atomic_fetch_sub_explicit(&d->posted, 1, memory_order_relaxed);
        (void)target_flush_locked(t);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&d->mu);
}

/* -------------------------------------------------------------- receive */

int rdma_credit_recv(kvf_rdma_dev *d, const struct ibv_wc *wc, const uint8_t *buf, rqp **q_out) {
    *q_out = NULL;
    if (!(wc->wc_flags & IBV_WC_WITH_IMM) || ntohl(wc->imm_data) != KVF_RDMA_CREDIT_IMM) return 0;
    credit_msg m;
    if (wc->byte_len < sizeof(m)) return 1;          /* malformed: dropped */
    memcpy(&m, buf, sizeof(m));
    if (m.magic != KVF_MAGIC) return 1;
    if (m.type == KVF_F_CREDIT_ASK) {
        kvf_credit_pool *p = d->c->credit;
        if (!p) return 1;                             /* no window here: nothing to grant */
        pthread_mutex_lock(&d->mu);
        kvf_rdma_target *t = target_by_qpn_locked(d, wc->qp_num);
        if (t) {
            atomic_store(&t->echo, m.echo);
            kvf_credit_report(p, &t->h, m.landed, m.bytes, m.want, m.unit, m.flags & KVF_ASK_BLOCKED);
        }
        pthread_mutex_unlock(&d->mu);
    } else if (m.type == KVF_F_CREDIT_GRANT || m.type == KVF_F_CREDIT_RECALL) {
        *q_out = initiator_msg(d, &m);
    }
    return 1;
}
