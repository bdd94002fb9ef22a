/* The transfer scheduler: the order in which a provider's queue hands out
 * its slices (kvf_queue in scheduled mode, kvf_queue_init_sched).
 *
 * A FIFO queue makes a short request wait behind every byte queued before
 * it. A scheduled queue keeps one flow per batch (the batch's slices in
 * this queue, in order) and takes the next slice by
 *
 *   1. class: HIGH before NORMAL before LOW (the batch's priority), except
 *      that a class passed over for `age_ns` (another class was served
 *      while it had work, and it has not been served since) is served
 *      first: every class with queued slices gets a slice at least once per
 *      age_ns, whatever runs above it (the starvation bound). The clock
 *      starts when it is first passed over, not when it was last served: a
 *      queue that waits for credit (a strict budget) serves nothing for a
 *      while, and counting that wait made LOW overdue at every grant, so
 *      the LOW slice took each grant and a HIGH slice behind it waited for
 *      the whole LOW backlog (issue 18's rdma bug: grants of one slice on
 *      4 QPs, one grant per QP every 20 ms or more);
 *   2. within a class, batches with a deadline first, earliest deadline
 *      first;
 *   3. then the batches without one, the one with the fewest bytes left in
 *      this queue first (shortest remaining first: a small request queued
 *      behind a huge one goes ahead of it, and of two equal ones the one
 *      nearer its end finishes first, so completions stay staggered and a
 *      submitter keeping a few batches in flight never sees them all end
 *      together); ties by arrival;
 *   4. except that the class's oldest batch, once it has waited age_ns
 *      since it was last served, is served first: no batch starves behind
 *      a stream of smaller ones (the same bound as between classes).
 *
 * One binary heap per class orders its flows by (deadline, bytes left,
 * arrival); an arrival-ordered ring finds the oldest. Costs: a push is
 * O(log n) at most (a hash lookup of the batch's flow, and the flow moving
 * down the heap as it grows; usually not at all), a pop O(log n) at most
 * (the served flow moving up). No allocation per slice: a flow's slices
 * live in one array that doubles; flows are recycled. Everything runs under
 * the queue's own lock, held by the caller (a push or pop never sends or
 * posts).
 *
 * In FIFO mode (kvf_sched_set_fifo: a baseline, and for users who want
 * arrival order) every batch is NORMAL without a deadline and ordered by
 * arrival alone: batches go whole, in the order they came.
 *
 * Cancelling a batch removes its flows from every scheduled queue of the
 * engine at once (kvf_sched_cancel): queued slices never wait for a sender
 * to reach them; only slices already handed to a socket or a NIC are left
 * to finish. */
#include "kvf.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct kvf_flow {
    uint32_t slot;          /* the batch's slot */
    uint32_t cls;
    uint64_t deadline;      /* absolute, CLOCK_MONOTONIC ns; UINT64_MAX: none */
    uint64_t seq;           /* arrival order in this queue */
    uint64_t left;          /* bytes queued here (the heap's second key; 0 in FIFO mode) */
    kvf_slice *v;           /* its slices: v[head .. head+n) */
    uint32_t head, n, cap;
    int32_t heap_i;         /* index in its class's heap */
    int32_t fifo;           /* opened in FIFO mode: ordered by arrival only */
    struct kvf_flow *next, *prev;   /* the class's ring, in arrival order */
    struct kvf_flow *chain;         /* hash bucket chain; free list */
} kvf_flow;

typedef struct {
    kvf_flow **heap;        /* its flows, min-heap by (deadline, left, seq) */
    size_t nheap, capheap;
    kvf_flow *oldest;       /* the ring's first flow (NULL: none) */
    uint64_t oldest_ns;     /* when the oldest was last served, or became the oldest */
    size_t count;           /* queued slices of this class */
    uint64_t last_ns;       /* last served, or when it got work */
    uint64_t passed_ns;     /* since when a higher class was served past its work (0: not passed) */
} sched_class;

struct kvf_sched {
    kvf_ctx *ctx;
    kvf_queue *q;
    pthread_mutex_t *guard; /* the lock its users hold around push and pop */
    int counted;            /* its slices count in ctx->n_slices_inflight */
    int registered;         /* in ctx->scheds (cancels find it) */
    /* Told of the slices a cancel drops (their provider words may hold
     * references: the local provider's fence); NULL: nobody. */
    void (*on_drop)(const kvf_slice *v, size_t n);
    sched_class cls[KVF_NPRIO];
    kvf_flow **buckets;     /* by slot, chained */
    size_t nbuckets, nflows;
    kvf_flow *free;
    kvf_flow *last;         /* the flow of the last push (a batch's slices come in runs) */
    uint64_t seq;
    struct kvf_sched *next_in_ctx;
};

size_t kvf_sched_queued_locked(const kvf_sched *s, int prio) {
    return prio >= 0 && prio < KVF_NPRIO ? s->cls[prio].count : 0;
}

static uint64_t mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* The aging clock: the coarse monotonic clock (a few ns from the vDSO,
 * ticks of 1-4 ms), read once per push of a new flow and once per pop
 * call; plenty for a bound of tens of ms. Deadlines use mono_ns (they are
 * only compared with each other). */
static uint64_t coarse_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

uint64_t kvf_now_ns(void) { return mono_ns(); }

void kvf_sched_set_age(kvf_ctx *c, uint64_t age_ns) {
    atomic_store_explicit(&c->sched_age_ns, age_ns, memory_order_relaxed);
}

void kvf_sched_set_fifo(kvf_ctx *c, int on) {
    atomic_store_explicit(&c->sched_fifo, on ? 1 : 0, memory_order_relaxed);
}

/* ------------------------------------------------------------ flow index */

static size_t bucket_of(const kvf_sched *s, uint32_t slot) {
    return (slot * 2654435761u) & (s->nbuckets - 1);
}

static kvf_flow *flow_find(const kvf_sched *s, uint32_t slot) {
    for (kvf_flow *f = s->buckets[bucket_of(s, slot)]; f; f = f->chain)
        if (f->slot == slot) return f;
    return NULL;
}

static int index_grow(kvf_sched *s) {
    size_t nb = s->nbuckets * 2;
    kvf_flow **b = calloc(nb, sizeof(*b));
    if (!b) return -1;
    kvf_flow **old = s->buckets;
    size_t on = s->nbuckets;
    s->buckets = b;
    s->nbuckets = nb;
    for (size_t i = 0; i < on; i++) {
        for (kvf_flow *f = old[i], *nx; f; f = nx) {
            nx = f->chain;
            size_t k = bucket_of(s, f->slot);
            f->chain = b[k];
            b[k] = f;
        }
    }
    free(old);
    return 0;
}

static void index_remove(kvf_sched *s, kvf_flow *f) {
    kvf_flow **p = &s->buckets[bucket_of(s, f->slot)];
    while (*p != f) p = &(*p)->chain;
    *p = f->chain;
    s->nflows--;
}

/* ------------------------------------------------------- deadline heaps */

static int heap_less(const kvf_flow *a, const kvf_flow *b) {
    if (a->deadline != b->deadline) return a->deadline < b->deadline;
    if (a->left != b->left) return a->left < b->left;
    return a->seq < b->seq;
}

static void heap_set(sched_class *c, size_t i, kvf_flow *f) {
    c->heap[i] = f;
    f->heap_i = (int32_t)i;
}

static void heap_up(sched_class *c, size_t i) {
    kvf_flow *f = c->heap[i];
    while (i > 0 && heap_less(f, c->heap[(i - 1) / 2])) {
        heap_set(c, i, c->heap[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    heap_set(c, i, f);
}

static void heap_down(sched_class *c, size_t i) {
    kvf_flow *f = c->heap[i];
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        kvf_flow *best = f;
        if (l < c->nheap && heap_less(c->heap[l], best)) { m = l; best = c->heap[l]; }
        if (l + 1 < c->nheap && heap_less(c->heap[l + 1], best)) { m = l + 1; best = c->heap[l + 1]; }
        if (m == i) break;
        heap_set(c, i, best);
        i = m;
    }
    heap_set(c, i, f);
}

static int heap_push(sched_class *c, kvf_flow *f) {
    if (c->nheap == c->capheap) {
        size_t cap = c->capheap ? c->capheap * 2 : 16;
        kvf_flow **h = realloc(c->heap, cap * sizeof(*h));
        if (!h) return -1;
        c->heap = h;
        c->capheap = cap;
    }
    heap_set(c, c->nheap++, f);
    heap_up(c, c->nheap - 1);
    return 0;
}

static void heap_remove(sched_class *c, kvf_flow *f) {
    size_t i = (size_t)f->heap_i;
    kvf_flow *last = c->heap[--c->nheap];
    f->heap_i = -1;
    if (last == f) return;
    heap_set(c, i, last);
    heap_up(c, i);
    heap_down(c, (size_t)last->heap_i);
}

/* ------------------------------------------------------------------ ring */

static void ring_insert(sched_class *c, kvf_flow *f, uint64_t now) {
    if (!c->oldest) {
        f->next = f->prev = f;
        c->oldest = f;
        c->oldest_ns = now;
        return;
    }
    /* at the tail: just before the oldest */
    f->next = c->oldest;
    f->prev = c->oldest->prev;
    f->prev->next = f;
    c->oldest->prev = f;
}

static void ring_remove(sched_class *c, kvf_flow *f, uint64_t now) {
    if (f->next == f) {
        c->oldest = NULL;
    } else {
        f->prev->next = f->next;
        f->next->prev = f->prev;
        if (c->oldest == f) {
            c->oldest = f->next;
            c->oldest_ns = now;     /* the next one's wait starts now */
        }
    }
    f->next = f->prev = NULL;
}

/* ----------------------------------------------------------------- flows */

static kvf_flow *flow_open(kvf_sched *s, uint32_t slot, uint64_t now) {
    if (s->nflows + 1 > s->nbuckets && index_grow(s)) return NULL;
    kvf_flow *f = s->free;
    if (f) {
        s->free = f->chain;
    } else {
        f = calloc(1, sizeof(*f));
        if (!f) return NULL;
    }
    kvf_batch *b = &s->ctx->batches[slot];
    int fifo = atomic_load_explicit(&s->ctx->sched_fifo, memory_order_relaxed);
    f->slot = slot;
    f->cls = fifo || b->prio < 0 || b->prio >= KVF_NPRIO ? KVF_PRIO_NORMAL : (uint32_t)b->prio;
    f->deadline = b->deadline_ns && !fifo ? b->deadline_ns : UINT64_MAX;
    f->fifo = fifo;
    f->seq = s->seq++;
    f->left = 0;
    f->head = f->n = 0;
    f->heap_i = -1;
    sched_class *c = &s->cls[f->cls];
    if (heap_push(c, f)) { f->chain = s->free; s->free = f; return NULL; }
    ring_insert(c, f, now);
    if (c->count == 0) { c->last_ns = now; c->passed_ns = 0; }
    size_t k = bucket_of(s, slot);
    f->chain = s->buckets[k];
    s->buckets[k] = f;
    s->nflows++;
    return f;
}

static void flow_close(kvf_sched *s, kvf_flow *f, uint64_t now) {
    sched_class *c = &s->cls[f->cls];
    if (s->last == f) s->last = NULL;
    heap_remove(c, f);
    ring_remove(c, f, now);
    index_remove(s, f);
    f->chain = s->free;
    s->free = f;
}

static int flow_append(kvf_flow *f, const kvf_slice *x) {
    if (f->head + f->n == f->cap) {
        if (f->head > 0 && f->n <= f->cap / 2) {
            memmove(f->v, f->v + f->head, f->n * sizeof(kvf_slice));
        } else {
            uint32_t cap = f->cap ? f->cap * 2 : 8;
            kvf_slice *v = malloc((size_t)cap * sizeof(kvf_slice));
            if (!v) return -1;
            if (f->n) memcpy(v, f->v + f->head, f->n * sizeof(kvf_slice));
            free(f->v);
            f->v = v;
            f->cap = cap;
        }
        f->head = 0;
    }
    f->v[f->head + f->n++] = *x;
    return 0;
}

/* ------------------------------------------------------------- the queue */

static void sched_register(kvf_sched *s) {
    kvf_ctx *c = s->ctx;
    pthread_mutex_lock(&c->sched_mu);
    s->next_in_ctx = c->scheds;
    c->scheds = s;
    s->registered = 1;
    pthread_mutex_unlock(&c->sched_mu);
}

/* Takes the queue off the engine's list (its channel closed: nothing is
 * queued any more, and the context may be freed before the channel). */
static void sched_unregister(kvf_sched *s) {
    if (!s->registered) return;
    kvf_ctx *c = s->ctx;
    pthread_mutex_lock(&c->sched_mu);
    kvf_sched **p = &c->scheds;
    while (*p && *p != s) p = &(*p)->next_in_ctx;
    if (*p) *p = s->next_in_ctx;
    s->registered = 0;
    pthread_mutex_unlock(&c->sched_mu);
}

void kvf_queue_detach(kvf_queue *q) {
    if (q->sched) sched_unregister(q->sched);
}

void kvf_sched_orphan_all(kvf_ctx *c) {
    pthread_mutex_lock(&c->sched_mu);
    for (kvf_sched *s = c->scheds; s; s = s->next_in_ctx) s->registered = 0;
    c->scheds = NULL;
    pthread_mutex_unlock(&c->sched_mu);
}

int kvf_queue_init_sched(kvf_queue *q, kvf_ctx *ctx, int counted, pthread_mutex_t *guard) {
    if (kvf_queue_init(q) != KVF_OK) return KVF_ENOMEM;
    kvf_sched *s = calloc(1, sizeof(*s));
    if (s) s->buckets = calloc(16, sizeof(*s->buckets));
    if (!s || !s->buckets) {
        free(s);
        kvf_queue_destroy(q);
        return KVF_ENOMEM;
    }
    s->nbuckets = 16;
    s->ctx = ctx;
    s->q = q;
    s->guard = guard ? guard : &q->mu;
    s->counted = counted;
    q->sched = s;
    sched_register(s);
    return KVF_OK;
}

void kvf_sched_set_drop(kvf_sched *s, void (*on_drop)(const kvf_slice *v, size_t n)) { s->on_drop = on_drop; }

static void free_flow(kvf_flow *f) {
    free(f->v);
    free(f);
}

void kvf_sched_free(kvf_sched *s) {
    sched_unregister(s);
    for (size_t i = 0; i < s->nbuckets; i++) {
        for (kvf_flow *f = s->buckets[i], *nx; f; f = nx) {
            nx = f->chain;
            free_flow(f);
        }
    }
    for (kvf_flow *f = s->free, *nx; f; f = nx) {
        nx = f->chain;
        free_flow(f);
    }
    for (int k = 0; k < KVF_NPRIO; k++) free(s->cls[k].heap);
    free(s->buckets);
    free(s);
}

int kvf_sched_push_locked(kvf_sched *s, const kvf_slice *x) {
    uint64_t now = 0;
    kvf_flow *f = s->last && s->last->slot == x->slot ? s->last : flow_find(s, x->slot);
    if (!f) {
        now = coarse_ns();
        f = flow_open(s, x->slot, now);
        if (!f) return KVF_ENOMEM;
    }
    s->last = f;
    if (flow_append(f, x)) {
        if (f->n == 0) flow_close(s, f, now ? now : coarse_ns());
        return KVF_ENOMEM;
    }
    sched_class *c = &s->cls[f->cls];
    c->count++;
    if (!f->fifo) {
        f->left += x->len;           /* its key grew: it may move down */
        heap_down(c, (size_t)f->heap_i);
    }
    return KVF_OK;
}

/* The class to serve now: the most overdue lower class (waited age_ns or
 * more since it was last served), else the highest class with work. */
static int pick_class(kvf_sched *s, uint64_t now, uint64_t age_ns) {
    int best = -1;
    uint64_t overdue = 0;
    for (int k = 1; k < KVF_NPRIO; k++) {
        sched_class *c = &s->cls[k];
        /* overdue: passed over by a higher class for age_ns; time in which
         * nothing was served (the queue waits for credit) does not count */
        if (!c->count || !c->passed_ns || now - c->passed_ns < age_ns) continue;
        if (best < 0 || now - c->passed_ns > overdue) { best = k; overdue = now - c->passed_ns; }
    }
    if (best >= 0) return best;
    for (int k = 0; k < KVF_NPRIO; k++) if (s->cls[k].count) return k;
    return -1;
}

/* The flow whose head slice goes next in class c: the heap's first
 * (earliest deadline, else fewest bytes left), unless the class's oldest
 * flow has waited age_ns since it was last served. */
static kvf_flow *pick_flow(sched_class *c, uint64_t now, uint64_t age_ns) {
    kvf_flow *f = c->heap[0];
    if (c->oldest != f && now - c->oldest_ns >= age_ns) f = c->oldest;
    return f;
}

static void take(kvf_sched *s, kvf_flow *f, kvf_slice *out, uint64_t now) {
    sched_class *c = &s->cls[f->cls];
    *out = f->v[f->head++];
    f->n--;
    c->count--;
    if (f == c->oldest) c->oldest_ns = now;
    if (f->n == 0) {
        flow_close(s, f, now);
        return;
    }
    if (!f->fifo) {
        f->left -= out->len;         /* its key shrank: it may move up */
        heap_up(c, (size_t)f->heap_i);
    }
}

size_t kvf_sched_pop_locked(kvf_sched *s, kvf_slice *out, size_t max, uint64_t max_bytes,
                            kvf_pop_budget *budget) {
    if (!max) return 0;
    uint64_t now = coarse_ns(), bytes = 0, counted = 0;
    uint64_t age_ns = atomic_load_explicit(&s->ctx->sched_age_ns, memory_order_relaxed);
    size_t n = 0;
    while (n < max && (!max_bytes || bytes < max_bytes)) {
        int k = pick_class(s, now, age_ns);
        if (k < 0) break;
        sched_class *c = &s->cls[k];
        kvf_flow *f = pick_flow(c, now, age_ns);
        const kvf_slice *next = &f->v[f->head];
        if (budget && (next->op & 0xff) == budget->op) {
            /* the budget is strict and the order too: the next slice
             * waits for budget rather than let a later one pass it */
            if (next->len > budget->bytes - counted) { budget->blocked = next->len; break; }
            counted += next->len;
        }
        take(s, f, &out[n], now);
        bytes += out[n++].len;
        c->last_ns = now;
        c->passed_ns = 0;
        for (int j = 1; j < KVF_NPRIO; j++)       /* the others with work were passed over */
            if (j != k && s->cls[j].count && !s->cls[j].passed_ns) s->cls[j].passed_ns = now;
    }
    return n;
}

/* Removes every queued slice of batch `slot` (into *out, malloc'd; the
 * caller finishes them). Returns how many. */
static size_t sched_remove_locked(kvf_sched *s, uint32_t slot, kvf_slice **out) {
    kvf_flow *f = flow_find(s, slot);
    *out = NULL;
    if (!f) return 0;
    size_t n = f->n;
    kvf_slice *v = malloc(n * sizeof(kvf_slice));
    if (!v) return 0;     /* left queued: the sender drops them (cancelled flag) */
    memcpy(v, f->v + f->head, n * sizeof(kvf_slice));
    for (size_t i = 0; i < n; i++) s->q->bytes -= v[i].len;
    s->q->count -= n;
    s->cls[f->cls].count -= n;
    f->n = 0;
    flow_close(s, f, coarse_ns());
    *out = v;
    return n;
}

size_t kvf_sched_cancel(kvf_ctx *c, uint32_t slot) {
    size_t total = 0;
    pthread_mutex_lock(&c->sched_mu);
    for (kvf_sched *s = c->scheds; s; s = s->next_in_ctx) {
        kvf_slice *v;
        pthread_mutex_lock(s->guard);
        size_t n = sched_remove_locked(s, slot, &v);
        pthread_mutex_unlock(s->guard);
        if (n && s->counted) atomic_fetch_sub_explicit(&c->n_slices_inflight, (int64_t)n, memory_order_relaxed);
        for (size_t i = 0; i < n; i++) kvf_slice_done(c, v[i].slot, KVF_ECANCELLED, v[i].entry);
        if (n && s->on_drop) s->on_drop(v, n);
        free(v);
        total += n;
    }
    pthread_mutex_unlock(&c->sched_mu);
    return total;
}
