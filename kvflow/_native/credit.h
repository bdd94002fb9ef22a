/* Receiver credits (the target side): one pool of `window` bytes per engine
 * that caps what all initiators together may have in flight toward it.
 *
 * Credits are counted per data connection (a holder: a tcp connection,
 * or an rdma target QP, rdma_credit.c). An initiator spends
 * credit for every write payload it frames on a connection and asks for
 * more on it; the target takes the bytes back when the payload has landed
 * (or was dropped), so
 *
 *     held = granted - landed - returned,   sum(held) <= window
 *
 * and every payload byte between an initiator's socket and this engine's
 * memory is covered by a grant. A holder whose connection ends gives back
 * everything it held: what it had in flight can no longer land from it
 * (a resent slice spends credit again on its new connection).
 *
 * Grants go to waiting holders in arrival order (round robin: one share
 * each, then to the back), a share being the window divided among the
 * holders in use, and never less than the holder's stated need (its next
 * slice), so a slice never waits on a grant too small for it. An
 * initiator that blocks on credit hands back what it did not spend, in
 * its ask; when the head waiter cannot be served, holders that are not
 * waiting are asked to hand back theirs (a recall). With window >= the
 * largest slice, someone can always go: no deadlock. */
#ifndef KVF_CREDIT_H
#define KVF_CREDIT_H
#include <pthread.h>
#include <stdint.h>

#include "wire.h"

typedef struct kvf_credit_holder kvf_credit_holder;
struct kvf_credit_holder {
    uint64_t held;            /* granted, not landed or returned */
    uint64_t want;            /* asked for, not granted yet */
    uint64_t need;            /* it stopped for credit: the smallest grant it can use; 0: not stopped */
    uint64_t unit;            /* its slice size: grants come in whole ones where they can */
    int waiting;              /* in the pool's wait queue */
    int recalled;             /* asked to hand back what it holds; cleared by its next ask */
    int joined;
    kvf_credit_holder *wnext; /* wait queue */
    kvf_credit_holder *prev, *next;  /* every holder of the pool */
    /* Sends a target -> initiator credit frame on the holder's
     * connection (called with the pool's lock held; it takes only the
     * connection's write lock). Nonzero: the connection failed. */
    int (*send)(kvf_credit_holder *h, const kvf_hdr *frame);
};

typedef struct kvf_credit_stats {
    uint64_t window, free, held, max_held;
    uint64_t grants, granted_bytes, recalls, returned_bytes, asks;
    uint64_t violations;      /* payload bytes that landed without a grant covering them */
    uint64_t holders, waiting;
} kvf_credit_stats;

typedef struct kvf_credit_pool {
    pthread_mutex_t mu;
    uint64_t window, free;
    kvf_credit_holder *all;
    kvf_credit_holder *whead, *wtail;
    kvf_credit_stats st;
} kvf_credit_pool;

kvf_credit_pool *kvf_credit_pool_new(uint64_t window);
void kvf_credit_pool_free(kvf_credit_pool *p);
void kvf_credit_join(kvf_credit_pool *p, kvf_credit_holder *h);
/* The holder's connection ended: what it held returns to the pool. */
void kvf_credit_leave(kvf_credit_pool *p, kvf_credit_holder *h);
/* A write payload of len bytes landed (or was dropped) from h. */
void kvf_credit_landed(kvf_credit_pool *p, kvf_credit_holder *h, uint64_t len);
/* An ask frame: `returned` unspent bytes back, `want` more wanted, in
 * slices of `unit` bytes; `blocked`: it stopped for credit (and handed
 * back all it held unspent), so it needs one unit at least, now. */
void kvf_credit_ask(kvf_credit_pool *p, kvf_credit_holder *h, uint64_t returned, uint64_t want,
                    uint64_t unit, int blocked);
/* An ask that also reports `landed` payload bytes: the rdma provider's,
 * whose target does not see one-sided writes land (its initiator reports
 * its completions). */
void kvf_credit_report(kvf_credit_pool *p, kvf_credit_holder *h, uint64_t landed, uint64_t returned,
                       uint64_t want, uint64_t unit, int blocked);
void kvf_credit_stats_get(kvf_credit_pool *p, kvf_credit_stats *out);

/* ------------------------------------------------------- the initiator's side
 *
 * What one data connection (tcp) or QP (rdma) holds of a target's window,
 * under that connection's or QP's own lock; both providers ask, spend and
 * take grants and recalls through these. */

/* Ask ahead once the queue exceeds what is held and asked for by this much. */
#define KVF_CREDIT_ASK_AHEAD (256u << 10)

typedef struct {
    uint64_t credit;         /* write payload bytes it may still send */
    uint64_t asked;          /* asked for, not granted yet */
    uint64_t ret_pending;    /* unspent, to hand back in the next ask (a recall's) */
    uint64_t need;           /* the slice it waits to afford (0: not waiting) */
    uint64_t waits, grants, recalls;
} kvf_credit_wallet;

/* Its connection or QP ended: its credit went with the target's holder. */
static inline void kvf_wallet_reset(kvf_credit_wallet *w) {
    w->credit = w->asked = w->ret_pending = w->need = 0;
}

/* How much to ask for, `goal` being what its queue holds (up to the
 * window; at least one slice when blocked): when blocked (it stopped for
 * credit and hands back all it holds), what it has not asked for yet;
 * else only once the goal exceeds what it holds and asked for by
 * KVF_CREDIT_ASK_AHEAD. */
static inline uint64_t kvf_wallet_want(const kvf_credit_wallet *w, uint64_t goal, int blocked) {
    if (blocked) return goal > w->asked ? goal - w->asked : 0;
    return goal > w->credit + w->asked + KVF_CREDIT_ASK_AHEAD ? goal - w->credit - w->asked : 0;
}

/* The ask went out: `want` more asked for, what was pending handed back,
 * and, blocked, all it held (the caller put it in the ask). */
static inline void kvf_wallet_asked(kvf_credit_wallet *w, uint64_t want, int blocked) {
    w->ret_pending = 0;
    w->asked += want;
    if (blocked) {
        w->credit = 0;
        w->waits++;
    }
}

/* A grant of `bytes`: 1 when it now affords the slice it waited for. */
static inline int kvf_wallet_grant(kvf_credit_wallet *w, uint64_t bytes) {
    w->credit += bytes;
    w->asked = w->asked > bytes ? w->asked - bytes : 0;
    w->grants++;
    return w->need && w->credit >= w->need;
}

/* A recall: what it has not spent is handed back with its next ask; 1
 * when there was some. */
static inline int kvf_wallet_recall(kvf_credit_wallet *w) {
    if (!w->credit) return 0;
    w->ret_pending += w->credit;
    w->credit = 0;
    w->recalls++;
    return 1;
}

/* held, asked for, waits, grants, recalls, need (the stats calls' order) */
static inline void kvf_wallet_stats(const kvf_credit_wallet *w, uint64_t out[6]) {
    out[0] = w->credit;
    out[1] = w->asked;
    out[2] = w->waits;
    out[3] = w->grants;
    out[4] = w->recalls;
    out[5] = w->need;
}

#endif
