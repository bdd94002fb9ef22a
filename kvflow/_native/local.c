/* The local provider: same process (memcpy) and same host
 * (process_vm_writev/readv, cross-memory attach).
 *
 * Small batches run inline in the caller's thread (no thread hop, no
 * wake-up: a same-host 4 KiB write costs one system call) when nothing is
 * queued; larger ones, and any behind queued work, are cut into slices that
 * a small pool of workers drains in the scheduler's order, so the event
 * loop is never blocked by a big copy.
 *
 * Every copy goes through the target engine's region fence (fence.h): a
 * run of slices copies only while a slot of the target's record names the
 * region it lies in, found live in the record at that moment, so that
 * deregister() on the target returns only once nothing copies into or out
 * of the region any more, whatever this side's copy of its table says and
 * whatever is still queued here. */
#define _GNU_SOURCE
#include "fence.h"
#include "kvf.h"
#include "provider.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define LOCAL_SLICE (1u << 20)
/* The slice's provider words: the target pid (0 = this process), and the
 * target's fence (words 1-2), which a queued slice holds a reference to
 * (taken at the enqueue, given back once it ran or a cancel dropped it). */
#define S_PID(s) ((s).word[0])

static inline void set_fence(kvf_slice *s, kvf_fence *f) {
    uint64_t v = (uint64_t)(uintptr_t)f;
    s->word[1] = (uint32_t)v;
    s->word[2] = (uint32_t)(v >> 32);
}

static inline kvf_fence *slice_fence(const kvf_slice *s) {
    return (kvf_fence *)(uintptr_t)((uint64_t)s->word[2] << 32 | s->word[1]);
}
#define LOCAL_POP 64
#define LOCAL_IOV 512
/* One worker takes at most this many bytes per wake-up, so a big batch is
 * shared between the workers instead of drained by the first one. */
#define LOCAL_POP_BYTES (1u << 20)

int kvf_ctx_init_common(kvf_ctx *c);
void kvf_ctx_free_common(kvf_ctx *c);

typedef struct kvf_local_pool {
    kvf_queue q;
    pthread_t *threads;
    int nthreads;
    kvf_ctx *ctx;
} kvf_local_pool;

static int errno_status(int e) {
    switch (e) {
    case ESRCH: return KVF_ELOST;      /* the peer process is gone */
    case EFAULT: return KVF_EREMOTE;   /* remote range not mapped any more */
    case ENOMEM: return KVF_ENOMEM;
    default: return KVF_EIO;
    }
}

/* Moves one run of slices with the same pid and op. Returns KVF_OK or the
 * error of the first slice that failed; *failed is its index in s. */
static int xfer_run(const kvf_slice *s, size_t n, size_t *failed) {
    if (S_PID(s[0]) == 0) {
        for (size_t i = 0; i < n; i++) {
            if (s[i].op == KVF_OP_WRITE)
                memcpy((void *)(uintptr_t)s[i].remote, (const void *)(uintptr_t)s[i].local, s[i].len);
            else
                memcpy((void *)(uintptr_t)s[i].local, (const void *)(uintptr_t)s[i].remote, s[i].len);
        }
        return KVF_OK;
    }
    struct iovec lv[LOCAL_IOV], rv[LOCAL_IOV];
    size_t i = 0;
    while (i < n) {
        size_t k = 0;
        uint64_t want = 0;
        for (; k < LOCAL_IOV && i + k < n; k++) {
            lv[k].iov_base = (void *)(uintptr_t)s[i + k].local;
            lv[k].iov_len = s[i + k].len;
            rv[k] = lv[k];
            rv[k].iov_base = (void *)(uintptr_t)s[i + k].remote;
            want += s[i + k].len;
        }
        ssize_t got = s[0].op == KVF_OP_WRITE
                          ? process_vm_writev((pid_t)S_PID(s[0]), lv, k, rv, k, 0)
                          : process_vm_readv((pid_t)S_PID(s[0]), lv, k, rv, k, 0);
        if (got == (ssize_t)want) { i += k; continue; }
        /* Partial or failed: the kernel stops at the first bad iovec. Find
         * it, and retry the rest one slice at a time to attribute errors. */
        int e = got < 0 ? errno : EFAULT;
        uint64_t done = got < 0 ? 0 : (uint64_t)got;
        size_t j = 0;
        while (j < k && done >= s[i + j].len) done -= s[i + j].len, j++;
        if (j < k && done > 0) {
            /* the kernel moved part of this slice: finish it alone */
            kvf_slice rest = s[i + j];
            rest.local += done; rest.remote += done; rest.len -= done;
            size_t f;
            if (xfer_run(&rest, 1, &f) != KVF_OK) { *failed = i + j; return errno_status(e); }
            j++;
        } else if (j < k) {
            if (got < 0 && e != EFAULT) { *failed = i + j; return errno_status(e); }
            /* retry this slice alone: if it fails alone, it is the culprit */
            struct iovec a = {(void *)(uintptr_t)s[i + j].local, s[i + j].len};
            struct iovec b = {(void *)(uintptr_t)s[i + j].remote, s[i + j].len};
            ssize_t g = s[0].op == KVF_OP_WRITE ? process_vm_writev((pid_t)S_PID(s[0]), &a, 1, &b, 1, 0)
                                                : process_vm_readv((pid_t)S_PID(s[0]), &a, 1, &b, 1, 0);
            if (g != (ssize_t)s[i + j].len) {
                *failed = i + j;
                return errno_status(g < 0 ? errno : EFAULT);
            }
            j++;
        }
        i += j;
    }
    return KVF_OK;
}

/* Moves a run of slices toward one target (one pid, one op) through the
 * target's fence: each stretch of slices inside one region copies while a
 * slot names that region, and a slice whose region is gone (or lacks the
 * access) fails KVF_EREMOTE without touching memory. Returns KVF_OK or the
 * error of the first slice that failed; *failed is its index in s. */
static int fenced_run(kvf_fence *f, const kvf_slice *s, size_t n, size_t *failed) {
    size_t i = 0;
    while (i < n) {
        kvf_fence_pass p;
        int rc = kvf_fence_enter(f, s[i].remote, s[i].len, (int)s[i].op, &p);
        if (rc != KVF_OK) { *failed = i; return rc; }
        size_t j = i + 1;
        while (j < n && kvf_fence_covers(&p, s[j].remote, s[j].len)) j++;
        size_t at = SIZE_MAX;
        rc = xfer_run(&s[i], j - i, &at);
        kvf_fence_leave(&p);
        if (rc != KVF_OK) { *failed = i + at; return rc; }
        i = j;
    }
    return KVF_OK;
}

static void run_and_complete(kvf_ctx *c, kvf_slice *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        kvf_fence *f = slice_fence(&s[i]);
        /* skip slices of cancelled batches without touching memory */
        if (kvf_batch_cancelled(c, s[i].slot)) {
            kvf_slice_done(c, s[i].slot, KVF_ECANCELLED, s[i].entry);
            kvf_fence_unref(f, 1);
            i++;
            continue;
        }
        size_t j = i + 1;
        while (j < n && S_PID(s[j]) == S_PID(s[i]) && s[j].op == s[i].op && slice_fence(&s[j]) == f &&
               !kvf_batch_cancelled(c, s[j].slot)) j++;
        size_t failed = SIZE_MAX;
        int rc = fenced_run(f, &s[i], j - i, &failed);
        for (size_t k = i; k < j; k++) {
            int st = KVF_OK;
            if (rc != KVF_OK && k == i + failed) st = rc;
            else if (rc != KVF_OK && k > i + failed) {
                /* not attempted: retry alone so only the culprit fails */
                size_t at;
                st = fenced_run(f, &s[k], 1, &at);
            }
            kvf_slice_done(c, s[k].slot, st, s[k].entry);
        }
        kvf_fence_unref(f, (int64_t)(j - i));
        i = j;
    }
}

/* A cancel dropped these from the queue (kvf_sched_cancel). */
static void local_dropped(const kvf_slice *v, size_t n) {
    for (size_t i = 0; i < n; i++) kvf_fence_unref(slice_fence(&v[i]), 1);
}

static void *local_worker(void *arg) {
    kvf_thread_name("kvf-local");
    kvf_local_pool *p = arg;
    kvf_slice buf[LOCAL_POP];
    for (;;) {
        pthread_mutex_lock(&p->q.mu);
        while (p->q.count == 0 && !p->q.closed) pthread_cond_wait(&p->q.cv, &p->q.mu);
        if (p->q.count == 0 && p->q.closed) { pthread_mutex_unlock(&p->q.mu); break; }
        size_t n = kvf_queue_pop_bytes_locked(&p->q, buf, LOCAL_POP, LOCAL_POP_BYTES);
        int more = p->q.count > 0;
        pthread_mutex_unlock(&p->q.mu);
        if (more) pthread_cond_signal(&p->q.cv);   /* let another worker share */
        run_and_complete(p->ctx, buf, n);
    }
    return NULL;
}

kvf_ctx *kvf_ctx_new(int local_workers) {
    kvf_ctx *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->efd = -1;
    if (kvf_ctx_init_common(c) != KVF_OK) { kvf_ctx_free_common(c); free(c); return NULL; }
    kvf_local_pool *p = calloc(1, sizeof(*p));
    if (!p || kvf_queue_init_sched(&p->q, c, 0, NULL) != KVF_OK) { kvf_ctx_free_common(c); free(p); free(c); return NULL; }
    kvf_sched_set_drop(p->q.sched, local_dropped);
    p->ctx = c;
    c->fence = kvf_fence_create();
    p->threads = calloc(local_workers > 0 ? local_workers : 1, sizeof(pthread_t));
    for (int i = 0; i < local_workers; i++) {
        if (pthread_create(&p->threads[i], NULL, local_worker, p) == 0) {
            p->nthreads++;
            atomic_fetch_add(&c->n_threads, 1);
        }
    }
    c->local_pool = p;
    return c;
}

void kvf_ctx_free(kvf_ctx *c) {
    if (!c) return;
    kvf_srv_shutdown(c);
    kvf_srv_free_sessions(c);
    kvf_local_pool *p = c->local_pool;
    if (p) {
        pthread_mutex_lock(&p->q.mu);
        p->q.closed = 1;
        pthread_cond_broadcast(&p->q.cv);
        pthread_mutex_unlock(&p->q.mu);
        for (int i = 0; i < p->nthreads; i++) {
            pthread_join(p->threads[i], NULL);
            atomic_fetch_sub(&c->n_threads, 1);
        }
        free(p->threads);
        kvf_queue_destroy(&p->q);
        free(p);
    }
    if (c->fence) {
        /* peers still holding the record (their channels, their queued
         * slices) find no region in it from now on */
        kvf_fence_clear(c->fence);
        kvf_fence_unref(c->fence, 1);
    }
    kvf_ctx_free_common(c);
    free(c);
}

/* ---------------------------------------------------------------- channel */

struct kvf_local_channel {
    kvf_channel base;
    int pid;                  /* the peer's process; 0: this one (memcpy) */
    uint64_t inline_limit;    /* batches up to this many bytes run in the caller's thread */
    kvf_fence *fence;         /* the target's region fence (a reference) */
    kvf_fence_pass hold;      /* kvf_local_channel_hold's pass (tests) */
    _Atomic int closed;
};

static int local_open(kvf_channel *ch) {
    return !atomic_load_explicit(&((kvf_local_channel *)ch)->closed, memory_order_relaxed);
}

static uint64_t local_slice_size(kvf_channel *ch, uint64_t total) {
    /* A batch that may run inline is one run per coalesced entry (no need
     * to cut it) while that keeps every run within a slice: behind queued
     * work it goes to the workers after all. */
    uint64_t limit = ((kvf_local_channel *)ch)->inline_limit;
    return total <= limit && limit <= LOCAL_SLICE ? UINT64_MAX / 2 : LOCAL_SLICE;
}

static int local_run_inline(kvf_channel *ch, kvf_slice *s, size_t n, uint64_t total, int prio,
                            size_t *failed) {
    kvf_local_channel *lc = (kvf_local_channel *)ch;
    kvf_ctx *ctx = ch->ctx;
    if (total > lc->inline_limit) return -1;
    /* Behind queued work a batch waits its turn: the scheduler (or FIFO
     * order) places it, instead of it passing the queue on this thread.
     * Except a HIGH batch while no HIGH slice is queued (QoS mode): the
     * scheduler would take it first anyway, and here it waits neither for
     * a worker to finish its slice nor for the wake-up that completes it
     * (on 2 cores busy with a LOW stream, those made its p99). */
    kvf_queue *q = &ctx->local_pool->q;
    pthread_mutex_lock(&q->mu);
    size_t queued = q->count;
    int passes = queued && prio == KVF_PRIO_HIGH && q->sched &&
                 !atomic_load_explicit(&ctx->sched_fifo, memory_order_relaxed) &&
                 kvf_sched_queued_locked(q->sched, KVF_PRIO_HIGH) == 0;
    pthread_mutex_unlock(&q->mu);
    if (queued && !passes) return -1;
    for (size_t i = 0; i < n; i++) S_PID(s[i]) = (uint32_t)lc->pid;
    *failed = SIZE_MAX;
    /* the channel's reference keeps the fence while this thread submits */
    return fenced_run(lc->fence, s, n, failed);
}

static void local_enqueue(kvf_channel *ch, kvf_slice *s, size_t n, int flags) {
    (void)flags;
    kvf_local_channel *lc = (kvf_local_channel *)ch;
    kvf_ctx *c = ch->ctx;
    kvf_queue *q = &c->local_pool->q;
    /* each queued slice holds the fence: the channel may be freed first */
    kvf_fence_ref(lc->fence, (int64_t)n);
    pthread_mutex_lock(&q->mu);
    size_t pushed = 0;
    for (; pushed < n; pushed++) {
        S_PID(s[pushed]) = (uint32_t)lc->pid;
        set_fence(&s[pushed], lc->fence);
        if (kvf_queue_push_locked(q, &s[pushed]) != KVF_OK) break;
    }
    pthread_mutex_unlock(&q->mu);
    pthread_cond_broadcast(&q->cv);
    for (size_t i = pushed; i < n; i++) kvf_slice_done(c, s[i].slot, KVF_ENOMEM, s[i].entry);
    kvf_fence_unref(lc->fence, (int64_t)(n - pushed));
}

static void local_close(kvf_channel *ch) { kvf_local_channel_close((kvf_local_channel *)ch); }
static void local_free(kvf_channel *ch) { kvf_local_channel_free((kvf_local_channel *)ch); }

static const kvf_provider_ops local_ops = {
    .name = "local",
    .open = local_open,
    .slice_size = local_slice_size,
    .run_inline = local_run_inline,
    .enqueue = local_enqueue,
    .close = local_close,
    .free = local_free,
};

kvf_local_channel *kvf_local_channel_new(kvf_ctx *c, kvf_region_table *remote, int pid,
                                         uint64_t inline_limit, kvf_fence *fence) {
    if (!fence) return NULL;
    kvf_local_channel *lc = calloc(1, sizeof(*lc));
    if (!lc) return NULL;
    if (kvf_channel_init(&lc->base, &local_ops, c, remote) != KVF_OK) { free(lc); return NULL; }
    lc->pid = pid;
    lc->inline_limit = inline_limit;
    kvf_fence_ref(fence, 1);
    lc->fence = fence;
    return lc;
}

/* New batches fail with KVF_ECLOSED; those queued to the workers finish. */
void kvf_local_channel_close(kvf_local_channel *lc) { atomic_store(&lc->closed, 1); }

void kvf_local_channel_free(kvf_local_channel *lc) {
    if (!lc) return;
    kvf_fence_leave(&lc->hold);
    kvf_fence_unref(lc->fence, 1);
    free(lc);
}

int kvf_local_channel_hold(kvf_local_channel *lc, uint64_t addr, uint64_t len, int op) {
    kvf_fence_leave(&lc->hold);
    return kvf_fence_enter(lc->fence, addr, len, op, &lc->hold);
}

void kvf_local_channel_release(kvf_local_channel *lc) { kvf_fence_leave(&lc->hold); }

int kvf_local_probe(int pid, uint64_t addr, void *out, size_t len) {
    struct iovec l = {out, len}, r = {(void *)(uintptr_t)addr, len};
    ssize_t g = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (g == (ssize_t)len) return 0;
    return g < 0 ? errno : EFAULT;
}
