/* Region tables, the batch pool, the completion ring, batch planning and
 * slice queues: everything the providers share. */
#define _GNU_SOURCE
#include "kvf.h"
#include "provider.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- regions */

int kvf_rt_init(kvf_region_table *t) {
    pthread_rwlockattr_t a;
    pthread_rwlockattr_init(&a);
    /* Writer preference: see kvf.h. Readers never take the lock recursively. */
    pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int rc = pthread_rwlock_init(&t->lock, &a);
    pthread_rwlockattr_destroy(&a);
    t->v = NULL;
    t->n = t->cap = 0;
    t->generation = 0;
    return rc ? KVF_ENOMEM : KVF_OK;
}

void kvf_rt_destroy(kvf_region_table *t) {
    free(t->v);
    t->v = NULL;
    t->n = t->cap = 0;
    pthread_rwlock_destroy(&t->lock);
}

/* Index of the first region whose addr > a (upper bound). */
static size_t rt_upper(const kvf_region_table *t, uint64_t a) {
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->v[mid].addr <= a) lo = mid + 1; else hi = mid;
    }
    return lo;
}

const kvf_region *kvf_rt_find_locked(const kvf_region_table *t, uint64_t addr, uint64_t len) {
    size_t i = rt_upper(t, addr);
    if (i == 0) return NULL;
    const kvf_region *r = &t->v[i - 1];
    /* addr >= r->addr here; compare lengths, not end addresses, so that a
     * region ending at 2^64 cannot overflow. */
    uint64_t off = addr - r->addr;
    if (off >= r->len || len > r->len - off) return NULL;
    return r;
}

int kvf_rt_add(kvf_region_table *t, uint64_t addr, uint64_t len, uint32_t access, uint32_t id) {
    if (len == 0 || addr + len < addr) return KVF_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    size_t i = rt_upper(t, addr);
    int overlap = (i > 0 && t->v[i - 1].addr + t->v[i - 1].len > addr) ||
                  (i < t->n && t->v[i].addr < addr + len);
    if (overlap) { pthread_rwlock_unlock(&t->lock); return KVF_EINVAL; }
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        kvf_region *v = realloc(t->v, cap * sizeof(*v));
        if (!v) { pthread_rwlock_unlock(&t->lock); return KVF_ENOMEM; }
        t->v = v;
        t->cap = cap;
    }
    memmove(&t->v[i + 1], &t->v[i], (t->n - i) * sizeof(kvf_region));
    t->v[i] = (kvf_region){addr, len, access, id, {0}};
    t->n++;
    t->generation++;
    pthread_rwlock_unlock(&t->lock);
    return KVF_OK;
}

int kvf_rt_remove(kvf_region_table *t, uint32_t id) {
    int rc = KVF_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    for (size_t i = 0; i < t->n; i++) {
        if (t->v[i].id == id) {
            memmove(&t->v[i], &t->v[i + 1], (t->n - i - 1) * sizeof(kvf_region));
            t->n--;
            t->generation++;
            rc = KVF_OK;
            break;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

int kvf_rt_set_keys(kvf_region_table *t, uint32_t id, const uint32_t *keys, size_t n) {
    if (n > KVF_MAX_DEVS) return KVF_EINVAL;
    int rc = KVF_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    for (size_t i = 0; i < t->n; i++) {
        if (t->v[i].id == id) {
            memcpy(t->v[i].keys, keys, n * sizeof(*keys));
            rc = KVF_OK;
            break;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

static int region_cmp(const void *a, const void *b) {
    uint64_t x = ((const kvf_region *)a)->addr, y = ((const kvf_region *)b)->addr;
    return x < y ? -1 : x > y;
}

int kvf_rt_replace(kvf_region_table *t, const kvf_region *v, size_t n) {
    kvf_region *copy = malloc((n ? n : 1) * sizeof(*copy));
    if (!copy) return KVF_ENOMEM;
    memcpy(copy, v, n * sizeof(*copy));
    qsort(copy, n, sizeof(*copy), region_cmp);
    for (size_t i = 0; i < n; i++) {
        if (copy[i].len == 0 || copy[i].addr + copy[i].len < copy[i].addr ||
            (i && copy[i - 1].addr + copy[i - 1].len > copy[i].addr)) {
            free(copy);
            return KVF_EINVAL;   /* a peer sent overlapping or empty regions */
        }
    }
    pthread_rwlock_wrlock(&t->lock);
    free(t->v);
    t->v = copy;
    t->n = t->cap = n;
    t->generation++;
    pthread_rwlock_unlock(&t->lock);
    return KVF_OK;
}

/* ------------------------------------------------------------ batch pool */

kvf_ctx *kvf_ctx_new(int local_workers);   /* defined in local.c (needs the pool) */

int kvf_ctx_init_common(kvf_ctx *c) {
    if (kvf_rt_init(&c->local)) return KVF_ENOMEM;
    c->batches = calloc(KVF_MAX_BATCHES, sizeof(kvf_batch));
    if (!c->batches) return KVF_ENOMEM;
    for (uint32_t i = 0; i < KVF_MAX_BATCHES; i++) c->batches[i].next_free = i + 1;
    c->free_head = 0;
    pthread_mutex_init(&c->pool_mu, NULL);
    pthread_mutex_init(&c->comp_mu, NULL);
    pthread_cond_init(&c->detached_cv, NULL);
    pthread_mutex_init(&c->srv_mu, NULL);
    pthread_cond_init(&c->srv_cv, NULL);
    pthread_mutex_init(&c->sched_mu, NULL);
    c->scheds = NULL;
    atomic_store(&c->sched_age_ns, KVF_SCHED_AGE_NS);
    c->comp_cap = 256;
    c->comp = malloc(c->comp_cap * sizeof(kvf_completion));
    if (!c->comp) return KVF_ENOMEM;
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) return KVF_EIO;
    return KVF_OK;
}

void kvf_ctx_free_common(kvf_ctx *c) {
    if (c->efd >= 0) close(c->efd);
    free(c->comp);
    free(c->batches);
    kvf_rt_destroy(&c->local);
    pthread_mutex_destroy(&c->pool_mu);
    pthread_mutex_destroy(&c->comp_mu);
    pthread_cond_destroy(&c->detached_cv);
    pthread_mutex_destroy(&c->srv_mu);
    pthread_cond_destroy(&c->srv_cv);
    kvf_sched_orphan_all(c);
    pthread_mutex_destroy(&c->sched_mu);
    while (c->chan_stats) {
        kvf_chan_stats *st = c->chan_stats;
        c->chan_stats = st->next;
        free(st);
    }
}

void kvf_thread_name(const char *name) { pthread_setname_np(pthread_self(), name); }

static inline uint32_t id_slot(uint64_t id) { return (uint32_t)id; }
static inline uint32_t id_gen(uint64_t id) { return (uint32_t)(id >> 32); }

int kvf_batch_alloc(kvf_ctx *c, uint64_t nslices, uint64_t *id_out) {
    pthread_mutex_lock(&c->pool_mu);
    if (c->free_head >= KVF_MAX_BATCHES) {
        pthread_mutex_unlock(&c->pool_mu);
        return KVF_ENOMEM;
    }
    uint32_t slot = c->free_head;
    kvf_batch *b = &c->batches[slot];
    c->free_head = b->next_free;
    c->in_use++;
    /* id 0 means "completed inline": never hand it out, even after the
     * generation wraps */
    if (++b->gen == 0) b->gen = 1;
    pthread_mutex_unlock(&c->pool_mu);
    /* +1: the submitter's guard, dropped once every slice is queued, so that
     * workers cannot complete the batch while it is still being queued. */
    atomic_store_explicit(&b->remaining, nslices + 1, memory_order_relaxed);
    atomic_store_explicit(&b->status, KVF_OK, memory_order_relaxed);
    atomic_store_explicit(&b->cancelled, 0, memory_order_relaxed);
    atomic_store_explicit(&b->err_entry, 0, memory_order_relaxed);
    b->stats = NULL;                 /* kvf_submit names it; a provider's own batches are not counted */
    b->detached = 0;                 /* kvf_batch_set_qos: the submission says */
    b->prio = KVF_PRIO_NORMAL;
    b->deadline_ns = 0;
    /* The release in the queue's mutex publishes these stores to workers. */
    *id_out = ((uint64_t)b->gen << 32) | slot;
    return KVF_OK;
}

void kvf_batch_release_guard(kvf_ctx *c, uint64_t id) {
    kvf_slice_done(c, id_slot(id), KVF_OK, 0);
}

int kvf_batch_cancel(kvf_ctx *c, uint64_t id) {
    uint32_t slot = id_slot(id);
    if (slot >= KVF_MAX_BATCHES) return KVF_EINVAL;
    kvf_batch *b = &c->batches[slot];
    if (b->gen != id_gen(id)) return KVF_EINVAL;   /* already drained */
    atomic_store_explicit(&b->cancelled, 1, memory_order_relaxed);
    int expected = KVF_OK;
    atomic_compare_exchange_strong(&b->status, &expected, KVF_ECANCELLED);
    /* its queued slices go now; only those on the wire are waited for */
    kvf_sched_cancel(c, slot);
    atomic_fetch_add_explicit(&c->cancel_epoch, 1, memory_order_relaxed);
    return KVF_OK;
}

int kvf_batch_cancelled(kvf_ctx *c, uint32_t slot) {
    return atomic_load_explicit(&c->batches[slot].cancelled, memory_order_relaxed);
}

int kvf_batch_finished(kvf_ctx *c, uint64_t id) {
    if (id_slot(id) >= KVF_MAX_BATCHES) return 0;
    kvf_batch *b = &c->batches[id_slot(id)];
    return b->gen == id_gen(id) && atomic_load_explicit(&b->remaining, memory_order_acquire) == 0;
}

/* Which thread is draining its own completions right after polling for
 * them (kvf_submit_poll, the loop reading acks): completions pushed on that
 * thread need no eventfd write. Kept in the context, not in a thread-local:
 * this file is compiled into both extensions (_core and _verbs), so a
 * thread-local existed twice, and an rdma poll, which completes slices
 * through _verbs's copy of completion_push, read the copy nobody set and
 * woke the loop to drain nothing. One thread holds the mark at a time (a
 * compare-and-swap from 0); another that polls meanwhile just keeps its
 * wake-ups, which is always correct. pthread_self() is libc's, the same in
 * both images. Relaxed: only the thread that set the mark ever finds its
 * own id there, and its own earlier store is visible to it. */
void kvf_set_loop_thread(kvf_ctx *c, int on) {
    unsigned long me = (unsigned long)pthread_self(), expect = on ? 0 : me;
    atomic_compare_exchange_strong_explicit(&c->poll_thread, &expect, on ? me : 0,
                                            memory_order_relaxed, memory_order_relaxed);
}

static int polling_here(kvf_ctx *c) {
    return atomic_load_explicit(&c->poll_thread, memory_order_relaxed) == (unsigned long)pthread_self();
}

static void completion_push(kvf_ctx *c, uint32_t slot) {
    kvf_batch *b = &c->batches[slot];
    if (b->detached) {
        /* its thread waits for it: wake it (it may sleep on the condvar) */
        pthread_mutex_lock(&c->comp_mu);
        pthread_cond_broadcast(&c->detached_cv);
        pthread_mutex_unlock(&c->comp_mu);
        return;
    }
    kvf_completion e = {
        ((uint64_t)b->gen << 32) | slot,
        atomic_load_explicit(&b->status, memory_order_acquire), 0,
        atomic_load_explicit(&b->err_entry, memory_order_relaxed)};
    pthread_mutex_lock(&c->comp_mu);
    if (c->comp_n == c->comp_cap) {
        size_t cap = c->comp_cap * 2;
        kvf_completion *v = realloc(c->comp, cap * sizeof(*v));
        if (v) { c->comp = v; c->comp_cap = cap; }
        /* On ENOMEM we cannot drop a completion (its future would hang), so
         * spin on the allocation; this is effectively unreachable. */
        while (c->comp_n == c->comp_cap) {
            pthread_mutex_unlock(&c->comp_mu);
            usleep(1000);
            pthread_mutex_lock(&c->comp_mu);
            v = realloc(c->comp, c->comp_cap * 2 * sizeof(*v));
            if (v) { c->comp = v; c->comp_cap *= 2; }
        }
    }
    c->comp[c->comp_n++] = e;
    /* The loop thread drains right after polling: it needs no wake-up, and
     * leaving comp_signaled set makes other threads skip theirs until then. */
    int wake = !c->comp_signaled && !polling_here(c);
    c->comp_signaled = 1;
    pthread_mutex_unlock(&c->comp_mu);
    if (wake) {
        atomic_fetch_add_explicit(&c->n_wakeups, 1, memory_order_relaxed);
        uint64_t one = 1;
        ssize_t r = write(c->efd, &one, sizeof(one));
        (void)r;   /* EAGAIN only if the counter is saturated: already readable */
    }
}

void kvf_chan_stats_record(kvf_chan_stats *st, int op, uint64_t bytes, int status, uint64_t ns) {
    int o = op == KVF_OP_READ;
    atomic_fetch_add_explicit(&st->batches[o], 1, memory_order_relaxed);
    if (status != KVF_OK) {
        atomic_fetch_add_explicit(&st->failed[o], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&st->by_status[status > 0 && status < KVF_NSTATUS ? status : 0], 1,
                                  memory_order_relaxed);
        return;
    }
    atomic_fetch_add_explicit(&st->bytes[o], bytes, memory_order_relaxed);
    uint64_t us = ns / 1000;
    int i = us < 2 ? 0 : 63 - __builtin_clzll(us);     /* floor(log2(us)) */
    atomic_fetch_add_explicit(&st->lat[o][i < KVF_LAT_BUCKETS ? i : KVF_LAT_BUCKETS - 1], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&st->lat_sum_ns[o], ns, memory_order_relaxed);
}

void kvf_slice_done(kvf_ctx *c, uint32_t slot, int status, uint64_t entry) {
    kvf_batch *b = &c->batches[slot];
    if (status != KVF_OK) {
        int expected = KVF_OK;
        if (atomic_compare_exchange_strong(&b->status, &expected, status))
            atomic_store_explicit(&b->err_entry, entry, memory_order_relaxed);
    }
    /* acq_rel: the last decrementer sees every other slice's status store. */
    if (atomic_fetch_sub_explicit(&b->remaining, 1, memory_order_acq_rel) == 1) {
        if (b->stats) {
            kvf_chan_stats *st = b->stats;
            int o = b->op == KVF_OP_READ;
            atomic_fetch_sub_explicit(&st->inflight_batches[o], 1, memory_order_relaxed);
            atomic_fetch_sub_explicit(&st->inflight_bytes[o], (int64_t)b->bytes, memory_order_relaxed);
            kvf_chan_stats_record(st, b->op, b->bytes, atomic_load_explicit(&b->status, memory_order_relaxed),
                                  kvf_now_ns() - b->t0_ns);
        }
        completion_push(c, slot);
    }
}

int kvf_channel_init(kvf_channel *ch, const kvf_provider_ops *ops, kvf_ctx *ctx, kvf_region_table *remote) {
    kvf_chan_stats *st = calloc(1, sizeof(*st));
    *ch = (kvf_channel){ops, ctx, remote, st};
    if (!st) return KVF_ENOMEM;
    pthread_mutex_lock(&ctx->pool_mu);
    st->next = ctx->chan_stats;
    ctx->chan_stats = st;
    pthread_mutex_unlock(&ctx->pool_mu);
    return KVF_OK;
}

static void batch_free(kvf_ctx *c, uint32_t slot) {
    pthread_mutex_lock(&c->pool_mu);
    c->batches[slot].next_free = c->free_head;
    c->free_head = slot;
    c->in_use--;
    pthread_mutex_unlock(&c->pool_mu);
}

int kvf_batch_wait(kvf_ctx *c, uint64_t id, uint64_t spin_ns, uint64_t timeout_ns, int *status,
                   uint64_t *entry) {
    uint32_t slot = id_slot(id);
    if (slot >= KVF_MAX_BATCHES) return KVF_EINVAL;
    kvf_batch *b = &c->batches[slot];
    if (b->gen != id_gen(id) || !b->detached) return KVF_EINVAL;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t start = (uint64_t)t0.tv_sec * 1000000000ull + (uint64_t)t0.tv_nsec, now = start;
    while (atomic_load_explicit(&b->remaining, memory_order_acquire) != 0) {
        if (now - start < spin_ns) {
            sched_yield();
        } else {
            if (timeout_ns && now - start >= timeout_ns) return KVF_ECANCELLED;
            /* sleep until a detached batch finishes (or 1 ms: a bound, not
             * a poll; never past the timeout) */
            uint64_t nap = 1000000;
            if (timeout_ns && timeout_ns - (now - start) < nap) nap = timeout_ns - (now - start);
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += (long)nap;
            if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
            pthread_mutex_lock(&c->comp_mu);
            if (atomic_load_explicit(&b->remaining, memory_order_acquire) != 0)
                pthread_cond_timedwait(&c->detached_cv, &c->comp_mu, &until);
            pthread_mutex_unlock(&c->comp_mu);
        }
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        now = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
    }
    *status = atomic_load_explicit(&b->status, memory_order_acquire);
    *entry = atomic_load_explicit(&b->err_entry, memory_order_relaxed);
    batch_free(c, slot);
    return KVF_OK;
}

size_t kvf_drain(kvf_ctx *c, kvf_completion *out, size_t cap) {
    /* Reset the eventfd before taking the list: a completion pushed after we
     * take the list sees comp_signaled == 0 and writes the eventfd again;
     * one pushed between the read and the take is taken now (no lost wake-up). */
    uint64_t v;
    ssize_t r = read(c->efd, &v, sizeof(v));
    (void)r;
    pthread_mutex_lock(&c->comp_mu);
    size_t n = c->comp_n < cap ? c->comp_n : cap;
    memcpy(out, c->comp, n * sizeof(*out));
    memmove(c->comp, c->comp + n, (c->comp_n - n) * sizeof(*out));
    c->comp_n -= n;
    if (c->comp_n == 0) c->comp_signaled = 0;
    else {
        /* more than cap were waiting: keep the eventfd readable */
        uint64_t one = 1;
        r = write(c->efd, &one, sizeof(one));
    }
    pthread_mutex_unlock(&c->comp_mu);
    pthread_mutex_lock(&c->pool_mu);
    for (size_t i = 0; i < n; i++) {
        uint32_t slot = id_slot(out[i].id);
        c->batches[slot].next_free = c->free_head;
        c->free_head = slot;
        c->in_use--;
    }
    pthread_mutex_unlock(&c->pool_mu);
    return n;
}

int kvf_take(kvf_ctx *c, uint64_t id, int *status, uint64_t *entry) {
    int taken = 0, kick = 0;
    pthread_mutex_lock(&c->comp_mu);
    for (size_t i = c->comp_n; i-- > 0;) {      /* its own completion is usually the last */
        if (c->comp[i].id != id) continue;
        *status = c->comp[i].status;
        *entry = c->comp[i].entry;
        memmove(c->comp + i, c->comp + i + 1, (c->comp_n - i - 1) * sizeof(*c->comp));
        c->comp_n--;
        taken = 1;
        break;
    }
    /* What is left may have been pushed by this (polling) thread, which
     * writes no eventfd: make sure the loop wakes for it. An empty ring
     * needs no wake-up; the next push writes the eventfd again. */
    if (c->comp_n) kick = c->comp_signaled = 1;
    else c->comp_signaled = 0;
    pthread_mutex_unlock(&c->comp_mu);
    if (taken) batch_free(c, id_slot(id));
    if (kick) {
        uint64_t one = 1;
        ssize_t r = write(c->efd, &one, sizeof(one));
        (void)r;
    }
    return taken;
}

/* ------------------------------------------------------------------ plan */

/* Checks every entry (one lock per table for the whole batch) and records
 * the pair of regions it lies in, as key[i]. Local ranges must be
 * registered, and writable by us when a read lands in them; remote ranges
 * must lie in one region of the peer with the access the op needs. */
static int validate(kvf_ctx *c, kvf_region_table *remote, int op, const uint64_t *la,
                    const uint64_t *ra, const uint64_t *len, size_t n, uint64_t *key, size_t *bad) {
    for (size_t i = 0; i < n; i++) {
        if (len[i] == 0 || la[i] + len[i] < la[i] || ra[i] + len[i] < ra[i]) {
            *bad = i;
            return KVF_EINVAL;
        }
    }
    int rc = KVF_OK;
    uint32_t need_local = op == KVF_OP_READ ? KVF_ACCESS_LOCAL_WRITE : 0;
    pthread_rwlock_rdlock(&c->local.lock);
    for (size_t i = 0; i < n; i++) {
        const kvf_region *r = kvf_rt_find_locked(&c->local, la[i], len[i]);
        if (!r || (r->access & need_local) != need_local) { *bad = i; rc = KVF_EUNREG; break; }
        key[i] = (uint64_t)r->id << 32;
    }
    pthread_rwlock_unlock(&c->local.lock);
    if (rc) return rc;
    uint32_t need = op == KVF_OP_WRITE ? KVF_ACCESS_WRITE : KVF_ACCESS_READ;
    pthread_rwlock_rdlock(&remote->lock);
    for (size_t i = 0; i < n; i++) {
        const kvf_region *r = kvf_rt_find_locked(remote, ra[i], len[i]);
        if (!r || !(r->access & need)) { *bad = i; rc = KVF_EREMOTE; break; }
        key[i] |= r->id;
    }
    pthread_rwlock_unlock(&remote->lock);
    return rc;
}

/* Coalesces entries adjacent on both sides and inside the same pair of
 * regions (a frame must land in one region), then cuts runs into slices of
 * at most slice_size. */
static size_t plan(int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
                   const uint64_t *key, size_t n, uint64_t slice_size, kvf_slice **out) {
    /* Upper bound on the slice count, so one allocation serves the batch. */
    size_t cap = 0;
    for (size_t i = 0; i < n; i++) cap += (len[i] + slice_size - 1) / slice_size;
    kvf_slice *s = malloc((cap ? cap : 1) * sizeof(*s));
    if (!s) { *out = NULL; return 0; }
    size_t k = 0;
    size_t i = 0;
    while (i < n) {
        uint64_t l0 = la[i], r0 = ra[i], total = len[i], k0 = key[i];
        size_t first = i++;
        while (i < n && key[i] == k0 && la[i] == l0 + total && ra[i] == r0 + total &&
               total + len[i] <= slice_size) {
            total += len[i];
            i++;
        }
        for (uint64_t off = 0; off < total; off += slice_size) {
            uint64_t l = total - off < slice_size ? total - off : slice_size;
            s[k++] = (kvf_slice){.local = l0 + off, .remote = r0 + off, .len = l, .entry = first, .op = (uint32_t)op};
        }
    }
    *out = s;
    return k;
}

int kvf_prepare(kvf_ctx *c, kvf_region_table *remote, int op, const uint64_t *la,
                const uint64_t *ra, const uint64_t *len, size_t n, uint64_t slice_size,
                kvf_slice **out, size_t *nslices, size_t *bad) {
    *out = NULL;
    *nslices = 0;
    uint64_t *key = malloc((n ? n : 1) * sizeof(*key));
    if (!key) return KVF_ENOMEM;
    int rc = validate(c, remote, op, la, ra, len, n, key, bad);
    if (rc == KVF_OK) {
        *nslices = plan(op, la, ra, len, key, n, slice_size, out);
        if (!*out) rc = KVF_ENOMEM;
    }
    free(key);
    return rc;
}

/* ---------------------------------------------------------------- submit */

void kvf_batch_set_qos(kvf_ctx *c, uint64_t id, const kvf_qos *qos) {
    kvf_batch *b = &c->batches[id_slot(id)];
    b->prio = qos && qos->prio >= 0 && qos->prio < KVF_NPRIO ? qos->prio : KVF_PRIO_NORMAL;
    b->deadline_ns = qos && qos->deadline_ns ? kvf_now_ns() + qos->deadline_ns : 0;
    b->detached = qos ? qos->detached : 0;
}

int kvf_submit(kvf_channel *ch, int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
               size_t n, int flags, const kvf_qos *qos, uint64_t *id_out, size_t *bad) {
    const kvf_provider_ops *ops = ch->ops;
    *id_out = 0;
    if (ops->open && !ops->open(ch)) return KVF_ECLOSED;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += len[i];      /* wraps only for batches validate() refuses */
    kvf_slice *s;
    size_t k;
    int rc = kvf_prepare(ch->ctx, ch->remote, op, la, ra, len, n, ops->slice_size(ch, total), &s, &k, bad);
    if (rc) return rc;
    if (ops->alive && !ops->alive(ch)) {
        free(s);
        *bad = 0;
        return KVF_ELOST;
    }
    uint64_t t0 = ch->stats ? kvf_now_ns() : 0;
    if (ops->run_inline) {
        size_t failed = 0;
        int prio = qos && qos->prio >= 0 && qos->prio < KVF_NPRIO ? qos->prio : KVF_PRIO_NORMAL;
        rc = ops->run_inline(ch, s, k, total, prio, &failed);
        if (rc >= 0) {
            if (rc) *bad = s[failed].entry;
            free(s);
            if (ch->stats) kvf_chan_stats_record(ch->stats, op, total, rc, kvf_now_ns() - t0);
            return rc;
        }
    }
    uint64_t id;
    rc = kvf_batch_alloc(ch->ctx, k, &id);
    if (rc) {
        free(s);
        return rc;
    }
    kvf_batch *b = &ch->ctx->batches[(uint32_t)id];
    b->stats = ch->stats;
    b->t0_ns = t0;
    b->bytes = total;
    b->op = op;
    if (b->stats) {
        /* before the enqueue: its last slice may finish (and take these
         * back off) as soon as it is handed over */
        int o = op == KVF_OP_READ;
        atomic_fetch_add_explicit(&b->stats->inflight_batches[o], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->stats->inflight_bytes[o], (int64_t)total, memory_order_relaxed);
    }
    for (size_t i = 0; i < k; i++) s[i].slot = (uint32_t)id;
    /* The seam (provider.h): the batch's class and deadline, which the
     * providers' scheduled queues order it by (sched.c); a relay takes the
     * slices here. */
    kvf_batch_set_qos(ch->ctx, id, qos);
    ops->enqueue(ch, s, k, flags);
    free(s);
    /* after the enqueue: the batch cannot complete (and its slot be
     * reused) before every slice is handed over */
    kvf_batch_release_guard(ch->ctx, id);
    *id_out = id;
    return KVF_OK;
}

int kvf_submit_poll(kvf_channel *ch, int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
                    size_t n, const kvf_qos *qos, uint64_t budget_ns, uint64_t *id_out, size_t *bad,
                    int *finished) {
    const kvf_provider_ops *ops = ch->ops;
    *finished = 0;
    if (!budget_ns || !ops->poll) return kvf_submit(ch, op, la, ra, len, n, 0, qos, id_out, bad);
    if (ops->open && !ops->open(ch)) {
        *id_out = 0;
        return KVF_ECLOSED;
    }
    kvf_poll_state st = {{0}, 0};
    /* polling before posting: the posts below do not wake the workers */
    ops->poll_begin(ch, &st);
    int rc = kvf_submit(ch, op, la, ra, len, n, KVF_SUBMIT_POLLED, qos, id_out, bad);
    if (rc == KVF_OK && *id_out) {
        /* completions found here need no eventfd: the caller takes its own
         * next (kvf_take), which also wakes the loop for any others */
        kvf_set_loop_thread(ch->ctx, 1);
        *finished = ops->poll(ch, &st, *id_out, budget_ns);
        kvf_set_loop_thread(ch->ctx, 0);
    }
    ops->poll_end(ch, &st);
    return rc;
}

int kvf_channel_abort_batch(kvf_channel *ch, uint64_t id) {
    return ch->ops->abort_batch ? ch->ops->abort_batch(ch, id) : 0;
}

void kvf_channel_close(kvf_channel *ch) { ch->ops->close(ch); }

void kvf_channel_free(kvf_channel *ch) { ch->ops->free(ch); }

/* ----------------------------------------------------------------- queue */

int kvf_queue_init(kvf_queue *q) {
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->cap = 256;
    q->ring = malloc(q->cap * sizeof(kvf_slice));
    q->head = q->count = 0;
    q->bytes = 0;
    q->closed = 0;
    q->sched = NULL;
    return q->ring ? KVF_OK : KVF_ENOMEM;
}

void kvf_queue_destroy(kvf_queue *q) {
    if (q->sched) kvf_sched_free(q->sched);
    q->sched = NULL;
    free(q->ring);
    q->ring = NULL;
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
}

int kvf_queue_push_locked(kvf_queue *q, const kvf_slice *s) {
    if (q->sched) {
        int rc = kvf_sched_push_locked(q->sched, s);
        if (rc == KVF_OK) {
            q->count++;
            q->bytes += s->len;
        }
        return rc;
    }
    if (q->count == q->cap) {
        size_t cap = q->cap * 2;
        kvf_slice *v = malloc(cap * sizeof(*v));
        if (!v) return KVF_ENOMEM;
        for (size_t i = 0; i < q->count; i++) v[i] = q->ring[(q->head + i) % q->cap];
        free(q->ring);
        q->ring = v;
        q->cap = cap;
        q->head = 0;
    }
    q->ring[(q->head + q->count) % q->cap] = *s;
    q->count++;
    q->bytes += s->len;
    return KVF_OK;
}

size_t kvf_queue_pop_fit_locked(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes,
                                kvf_pop_budget *budget) {
    size_t k = 0;
    if (budget) budget->blocked = 0;
    if (q->sched) {
        k = kvf_sched_pop_locked(q->sched, out, max, max_bytes, budget);
        for (size_t i = 0; i < k; i++) q->bytes -= out[i].len;
        q->count -= k;
        return k;
    }
    uint64_t bytes = 0, counted = 0;
    while (k < max && q->count && (!max_bytes || bytes < max_bytes)) {
        const kvf_slice *next = &q->ring[q->head];
        if (budget && (next->op & 0xff) == budget->op) {
            if (next->len > budget->bytes - counted) { budget->blocked = next->len; break; }
            counted += next->len;
        }
        kvf_queue_pop_locked(q, &out[k], 1);
        bytes += out[k++].len;
    }
    return k;
}

size_t kvf_queue_pop_bytes_locked(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes) {
    return kvf_queue_pop_fit_locked(q, out, max, max_bytes, NULL);
}

size_t kvf_queue_pop_locked(kvf_queue *q, kvf_slice *out, size_t max) {
    if (q->sched) return kvf_queue_pop_bytes_locked(q, out, max, 0);
    size_t n = q->count < max ? q->count : max;
    for (size_t i = 0; i < n; i++) {
        out[i] = q->ring[q->head];
        q->head = (q->head + 1) % q->cap;
        q->bytes -= out[i].len;
    }
    q->count -= n;
    return n;
}

int kvf_queue_push(kvf_queue *q, const kvf_slice *s) {
    pthread_mutex_lock(&q->mu);
    int rc = kvf_queue_push_locked(q, s);
    pthread_mutex_unlock(&q->mu);
    return rc;
}

size_t kvf_queue_pop_fit(kvf_queue *q, kvf_slice *out, size_t max, uint64_t max_bytes,
                         kvf_pop_budget *budget) {
    pthread_mutex_lock(&q->mu);
    size_t n = kvf_queue_pop_fit_locked(q, out, max, max_bytes, budget);
    pthread_mutex_unlock(&q->mu);
    return n;
}

size_t kvf_queue_pop(kvf_queue *q, kvf_slice *out, size_t max) {
    pthread_mutex_lock(&q->mu);
    size_t n = kvf_queue_pop_locked(q, out, max);
    pthread_mutex_unlock(&q->mu);
    return n;
}
