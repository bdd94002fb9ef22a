/* The local provider's region fence (fence.h says what and why).
 *
 * The record, in shared memory, is read and written by several processes
 * with C11 atomics: they are lock-free for 32 and 64 bits here (asserted
 * below), and lock-free atomics are address-free, so two mappings of one
 * page order their accesses as one mapping would. Nothing in the record
 * is a pointer; a peer trusts nothing in it beyond the bounds it checks.
 *
 * The pairings, in one place (each access says which it is):
 *  (D) Dekker, all four seq_cst: the target's store of an odd `seq` (a
 *      deregister's update begins) and then its loads of the slots, against
 *      a copier's claim of a slot and then its load of `seq`. In the single
 *      total order of seq_cst operations, either the copier's load comes
 *      after the odd store (it sees `seq` moved and looks again, finding
 *      the region gone), or it comes before it, and then the claim is
 *      before the target's slot loads, which see the claim (or the copier's
 *      later store of 0, after its copy: (R)).
 *  (S) Seqlock: the target's odd store, a release fence, the entries'
 *      relaxed stores, and the even store (release); a copier's acquire
 *      load of `seq`, relaxed loads of the entries, an acquire fence and a
 *      relaxed load of `seq` again. If the copier read any entry the
 *      update wrote, its acquire fence synchronises with the target's
 *      release fence, so it sees `seq` odd or moved, and looks again.
 *  (R) Release of a slot: the copier's release store of 0 after its copy
 *      (memcpy, or process_vm_writev/readv on the copier's own thread: the
 *      kernel's accesses to the target's pages come before the system call
 *      returns), and the target's seq_cst (so acquire) load that reads it:
 *      every byte the copy wrote or read happens before whatever the target
 *      does after its wait (refilling the memory: a copy never sees, nor
 *      overwrites, what the target writes there next).
 */
#define _GNU_SOURCE
#include "fence.h"
#include "kvf.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the fence record is shared between processes: its atomics must be lock-free");

#define FENCE_MAGIC 0x3165636e6566766bull   /* "kvfence1" */
#define FENCE_NAME "kvflow-fence"
/* A slot's word: the region id above PID_BITS, the copier's process id
 * below (pid_max is at most 2^22 on Linux), 0 when free. */
#define PID_BITS 22
#define PID_MASK ((1ull << PID_BITS) - 1)
/* How long a copier waits for the target's record to leave an update (or
 * for a free slot) before it fails its slice: an update takes microseconds,
 * so only a target stopped or killed in the middle of one gets here. */
#define COPIER_WAIT_NS 1000000000ull

typedef struct {
    _Atomic uint64_t word;
    char pad[56];            /* one cache line per slot: copiers on different cores do not share */
} fence_slot;

typedef struct {
    _Atomic uint64_t addr, len;
    _Atomic uint32_t access, rid;
} fence_entry;

typedef struct {
    uint64_t magic;
    uint32_t nslots, nregions;
    _Atomic uint64_t incarnation;
    char pad0[40];
    _Atomic uint64_t seq;    /* odd while the target updates the entries (S) */
    _Atomic uint64_t n;      /* live entries */
    char pad1[48];
    fence_slot slots[KVF_FENCE_SLOTS];
    fence_entry entries[KVF_FENCE_REGIONS];
} fence_shm;

struct kvf_fence {
    _Atomic int64_t refs;
    fence_shm *m;
    int fd;                  /* the owner's memfd (-1: attached, or private memory) */
    pthread_mutex_t mu;      /* the owner's updates (one at a time: only it writes seq and entries) */
};

/* ------------------------------------------------------------- processes */

/* This process's id, for slot words: getpid() is a system call, and a
 * copy may be 4 KiB. Reset in a forked child (pthread_atfork). Relaxed:
 * every thread computes the same value. */
static _Atomic int self_pid_cache;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void forget_pid(void) { atomic_store_explicit(&self_pid_cache, 0, memory_order_relaxed); }
static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_pid); }

static int self_pid(void) {
    int p = atomic_load_explicit(&self_pid_cache, memory_order_relaxed);
    if (!p) {
        p = (int)getpid();
        atomic_store_explicit(&self_pid_cache, p, memory_order_relaxed);
    }
    return p;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* 1 once process pid can copy nothing any more: it does not exist, or it
 * is a zombie whose every thread has exited (its memory is gone). A pid
 * reused by another process reads as alive: the wait is bounded anyway,
 * and a wrong "gone" would let a live copier write into reused memory. */
static int process_gone(int pid) {
    if (pid == self_pid()) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    ssize_t k = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (k <= 0) return 0;
    buf[k] = 0;
    const char *rp = strrchr(buf, ')');      /* the command name may hold anything */
    if (!rp || (rp[1] != ' ') || (rp[2] != 'Z' && rp[2] != 'X')) return 0;
    /* a zombie leader whose other threads still run lists them here */
    snprintf(path, sizeof(path), "/proc/%d/task", pid);
    DIR *d = opendir(path);
    if (!d) return 1;
    int tasks = 0;
    for (struct dirent *de; (de = readdir(d));) tasks += de->d_name[0] != '.';
    closedir(d);
    return tasks <= 1;
}

/* --------------------------------------------------------------- records */

static kvf_fence *wrap(fence_shm *m, int fd) {
    kvf_fence *f = calloc(1, sizeof(*f));
    if (!f) return NULL;
    atomic_init(&f->refs, 1);
    f->m = m;
    f->fd = fd;
    pthread_mutex_init(&f->mu, NULL);
    return f;
}

kvf_fence *kvf_fence_create(void) {
    pthread_once(&fork_once, watch_forks);
    int fd = memfd_create(FENCE_NAME, MFD_CLOEXEC);
    void *p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, sizeof(fence_shm)) == 0)
        p = mmap(NULL, sizeof(fence_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        /* no memfd: peers of this process are fenced all the same; those
         * of other processes cannot attach (the provider says so) */
        if (fd >= 0) close(fd);
        fd = -1;
        p = mmap(NULL, sizeof(fence_shm), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
    }
    fence_shm *m = p;    /* zero-filled: no slot claimed, no entry */
    m->magic = FENCE_MAGIC;
    m->nslots = KVF_FENCE_SLOTS;
    m->nregions = KVF_FENCE_REGIONS;
    kvf_fence *f = wrap(m, fd);
    if (!f) {
        munmap(p, sizeof(fence_shm));
        if (fd >= 0) close(fd);
    }
    return f;
}

void kvf_fence_set_incarnation(kvf_fence *f, uint64_t incarnation) {
    /* release: pairs with the acquire load of an attaching peer (the
     * header above it is written before, though only once) */
    atomic_store_explicit(&f->m->incarnation, incarnation, memory_order_release);
}

int kvf_fence_fd(const kvf_fence *f) { return f->fd; }

kvf_fence *kvf_fence_attach(int pid, uint64_t incarnation, int *err) {
    pthread_once(&fork_once, watch_forks);
    char dir[48];
    snprintf(dir, sizeof(dir), "/proc/%d/fd", pid);
    DIR *d = opendir(dir);
    if (!d) {
        *err = errno;
        return NULL;
    }
    int e = ENOENT;
    const char want[] = "/memfd:" FENCE_NAME " ";
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        char path[320], link[128];
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        ssize_t k = readlink(path, link, sizeof(link) - 1);
        if (k < (ssize_t)sizeof(want) - 1) continue;
        link[k] = 0;
        if (memcmp(link, want, sizeof(want) - 1) != 0) continue;
        /* the same permission as process_vm_writev's, a little looser
         * (ptrace read mode): a peer that may write the memory may map this */
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            e = errno;
            continue;
        }
        struct stat st;
        void *p = MAP_FAILED;
        if (fstat(fd, &st) == 0 && st.st_size == (off_t)sizeof(fence_shm))
            p = mmap(NULL, sizeof(fence_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) continue;
        fence_shm *m = p;
        /* acquire: pairs with kvf_fence_set_incarnation's release */
        if (m->magic == FENCE_MAGIC && m->nslots == KVF_FENCE_SLOTS && m->nregions == KVF_FENCE_REGIONS &&
            atomic_load_explicit(&m->incarnation, memory_order_acquire) == incarnation) {
            closedir(d);
            kvf_fence *f = wrap(m, -1);
            if (!f) {
                munmap(p, sizeof(fence_shm));
                *err = ENOMEM;
            }
            return f;
        }
        munmap(p, sizeof(fence_shm));
    }
    closedir(d);
    *err = e;
    return NULL;
}

void kvf_fence_ref(kvf_fence *f, int64_t n) {
    /* relaxed: taken by a holder, which keeps the record alive meanwhile */
    atomic_fetch_add_explicit(&f->refs, n, memory_order_relaxed);
}

void kvf_fence_unref(kvf_fence *f, int64_t n) {
    if (!f || n <= 0) return;
    /* acq_rel: each holder's use of the record comes before its release;
     * the last one's acquire sees them all before it unmaps */
    if (atomic_fetch_sub_explicit(&f->refs, n, memory_order_acq_rel) != n) return;
    munmap(f->m, sizeof(fence_shm));
    if (f->fd >= 0) close(f->fd);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

/* ------------------------------------------------------------ the target */

/* Caller holds f->mu (the only writer of seq). */
static uint64_t update_begin(fence_shm *m) {
    uint64_t s = atomic_load_explicit(&m->seq, memory_order_relaxed);
    /* seq_cst: the target's half of (D); the release fence after it is
     * the writer's side of (S): no entry store below is seen before it */
    atomic_store_explicit(&m->seq, s + 1, memory_order_seq_cst);
    atomic_thread_fence(memory_order_release);
    return s + 2;
}

static void update_end(fence_shm *m, uint64_t s) {
    /* release: (S), the entries are complete once it is seen */
    atomic_store_explicit(&m->seq, s, memory_order_release);
}

/* Entry moves inside the update (S): relaxed, as every entry access. */
static void entry_copy(fence_entry *to, fence_entry *from) {
    atomic_store_explicit(&to->addr, atomic_load_explicit(&from->addr, memory_order_relaxed), memory_order_relaxed);
    atomic_store_explicit(&to->len, atomic_load_explicit(&from->len, memory_order_relaxed), memory_order_relaxed);
    atomic_store_explicit(&to->access, atomic_load_explicit(&from->access, memory_order_relaxed), memory_order_relaxed);
    atomic_store_explicit(&to->rid, atomic_load_explicit(&from->rid, memory_order_relaxed), memory_order_relaxed);
}

int kvf_fence_add(kvf_fence *f, uint32_t rid, uint64_t addr, uint64_t len, uint32_t access) {
    if (!rid || len == 0) return KVF_EINVAL;
    fence_shm *m = f->m;
    pthread_mutex_lock(&f->mu);
    /* relaxed: only this thread (under mu) writes n and the entries */
    size_t n = atomic_load_explicit(&m->n, memory_order_relaxed);
    if (n >= KVF_FENCE_REGIONS) {
        pthread_mutex_unlock(&f->mu);
        return KVF_ENOMEM;
    }
    size_t pos = 0;
    while (pos < n && atomic_load_explicit(&m->entries[pos].addr, memory_order_relaxed) < addr) pos++;
    uint64_t s = update_begin(m);
    for (size_t j = n; j > pos; j--) entry_copy(&m->entries[j], &m->entries[j - 1]);
    fence_entry *e = &m->entries[pos];
    atomic_store_explicit(&e->addr, addr, memory_order_relaxed);
    atomic_store_explicit(&e->len, len, memory_order_relaxed);
    atomic_store_explicit(&e->access, access, memory_order_relaxed);
    atomic_store_explicit(&e->rid, rid, memory_order_relaxed);
    atomic_store_explicit(&m->n, n + 1, memory_order_relaxed);
    update_end(m, s);
    pthread_mutex_unlock(&f->mu);
    return KVF_OK;
}

int kvf_fence_remove(kvf_fence *f, uint32_t rid) {
    fence_shm *m = f->m;
    pthread_mutex_lock(&f->mu);
    size_t n = atomic_load_explicit(&m->n, memory_order_relaxed);
    size_t i = 0;
    while (i < n && atomic_load_explicit(&m->entries[i].rid, memory_order_relaxed) != rid) i++;
    if (i == n) {
        pthread_mutex_unlock(&f->mu);
        return 0;
    }
    uint64_t s = update_begin(m);
    for (; i + 1 < n; i++) entry_copy(&m->entries[i], &m->entries[i + 1]);
    atomic_store_explicit(&m->n, n - 1, memory_order_relaxed);
    update_end(m, s);
    pthread_mutex_unlock(&f->mu);
    return 1;
}

void kvf_fence_clear(kvf_fence *f) {
    fence_shm *m = f->m;
    pthread_mutex_lock(&f->mu);
    uint64_t s = update_begin(m);
    atomic_store_explicit(&m->n, 0, memory_order_relaxed);
    update_end(m, s);
    pthread_mutex_unlock(&f->mu);
}

int kvf_fence_quiesce(kvf_fence *f, uint32_t rid, uint64_t timeout_ns, int *pids, int max) {
    fence_shm *m = f->m;
    uint64_t deadline = now_ns() + timeout_ns;
    int stuck = 0;
    for (int i = 0; i < KVF_FENCE_SLOTS; i++) {
        _Atomic uint64_t *slot = &m->slots[i].word;
        unsigned looks = 0;
        for (;;) {
            /* seq_cst: the target's loads of (D), after update_begin's
             * store; as an acquire it also pairs with the copier's
             * release of the slot (R) */
            uint64_t w = atomic_load_explicit(slot, memory_order_seq_cst);
            if (w == 0 || (uint32_t)(w >> PID_BITS) != rid) break;
            int pid = (int)(w & PID_MASK);
            /* a copy takes microseconds: look for a dead process only
             * once it is late, then every few milliseconds */
            if ((looks & 255) == 64 && process_gone(pid)) {
                /* relaxed: a process that is gone stores nothing more; the
                 * slot goes back to the copiers' claims (seq_cst CAS) */
                atomic_compare_exchange_strong_explicit(slot, &w, 0, memory_order_relaxed, memory_order_relaxed);
                continue;
            }
            if (now_ns() >= deadline) {
                if (stuck < max) pids[stuck] = pid;
                stuck++;
                break;
            }
            if (++looks < 32) sched_yield();
            else {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            }
        }
    }
    return stuck;
}

int kvf_fence_busy_slots(const kvf_fence *f) {
    int n = 0;
    /* relaxed: a snapshot for a balance check, ordering nothing */
    for (int i = 0; i < KVF_FENCE_SLOTS; i++)
        n += atomic_load_explicit(&f->m->slots[i].word, memory_order_relaxed) != 0;
    return n;
}

/* ----------------------------------------------------------- the copier */

typedef struct {
    uint64_t addr, len;
    uint32_t access, rid;
} entry_view;

/* The entry holding [addr, addr+len), read consistently (S). KVF_OK and
 * *seq the even counter it was read under, KVF_EREMOTE none holds it,
 * KVF_ELOST the record stayed mid-update past COPIER_WAIT_NS. */
static int lookup(fence_shm *m, uint64_t addr, uint64_t len, uint64_t *seq, entry_view *e) {
    uint64_t since = 0;
    for (unsigned tries = 0;; tries++) {
        /* acquire: (S), the reader's first load */
        uint64_t s = atomic_load_explicit(&m->seq, memory_order_acquire);
        if (!(s & 1)) {
            uint64_t n = atomic_load_explicit(&m->n, memory_order_relaxed);
            if (n > KVF_FENCE_REGIONS) n = KVF_FENCE_REGIONS;   /* torn by an update: looked at again */
            size_t lo = 0, hi = n;
            while (lo < hi) {   /* the first entry starting above addr */
                size_t mid = lo + (hi - lo) / 2;
                if (atomic_load_explicit(&m->entries[mid].addr, memory_order_relaxed) <= addr) lo = mid + 1;
                else hi = mid;
            }
            int found = 0;
            if (lo > 0) {
                fence_entry *x = &m->entries[lo - 1];
                e->addr = atomic_load_explicit(&x->addr, memory_order_relaxed);
                e->len = atomic_load_explicit(&x->len, memory_order_relaxed);
                e->access = atomic_load_explicit(&x->access, memory_order_relaxed);
                e->rid = atomic_load_explicit(&x->rid, memory_order_relaxed);
                found = addr - e->addr < e->len && len <= e->len - (addr - e->addr);
            }
            /* acquire fence, then relaxed: (S), the reader's second look */
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&m->seq, memory_order_relaxed) == s) {
                *seq = s;
                return found ? KVF_OK : KVF_EREMOTE;
            }
        }
        if (tries < 64) continue;
        uint64_t t = now_ns();
        if (!since) since = t;
        else if (t - since > COPIER_WAIT_NS) return KVF_ELOST;
        sched_yield();
    }
}

static __thread unsigned slot_hint;

/* Claims a free slot with word w (seq_cst: the copier's store of (D)).
 * NULL when none freed up for COPIER_WAIT_NS. */
static _Atomic uint64_t *claim(fence_shm *m, uint64_t w) {
    unsigned start = slot_hint;
    if (!start) start = (unsigned)(((uintptr_t)&slot_hint >> 6) * 2654435761u);   /* threads spread out */
    uint64_t since = 0;
    for (;;) {
        for (unsigned i = 0; i < KVF_FENCE_SLOTS; i++) {
            unsigned k = (start + i) % KVF_FENCE_SLOTS;
            _Atomic uint64_t *s = &m->slots[k].word;
            uint64_t zero = 0;
            /* the relaxed look spares a CAS on a slot in use */
            if (atomic_load_explicit(s, memory_order_relaxed) == 0 &&
                atomic_compare_exchange_strong_explicit(s, &zero, w, memory_order_seq_cst, memory_order_relaxed)) {
                slot_hint = k ? k : KVF_FENCE_SLOTS;   /* 0 means "not chosen yet" */
                return s;
            }
        }
        /* every slot held: take back those of processes that are gone
         * (relaxed, as in kvf_fence_quiesce: a process that is gone stores
         * nothing more, and the slot goes back to seq_cst claims) */
        for (unsigned k = 0; k < KVF_FENCE_SLOTS; k++) {
            _Atomic uint64_t *s = &m->slots[k].word;
            uint64_t x = atomic_load_explicit(s, memory_order_relaxed);
            if (x && process_gone((int)(x & PID_MASK)))
                atomic_compare_exchange_strong_explicit(s, &x, 0, memory_order_relaxed, memory_order_relaxed);
        }
        uint64_t t = now_ns();
        if (!since) since = t;
        else if (t - since > COPIER_WAIT_NS) return NULL;
        sched_yield();
    }
}

int kvf_fence_enter(kvf_fence *f, uint64_t addr, uint64_t len, int op, kvf_fence_pass *p) {
    fence_shm *m = f->m;
    uint32_t need = op == KVF_OP_WRITE ? KVF_ACCESS_WRITE : KVF_ACCESS_READ;
    _Atomic uint64_t *slot = NULL;
    p->slot = NULL;
    for (;;) {
        uint64_t seq;
        entry_view e;
        int rc = lookup(m, addr, len, &seq, &e);
        if (rc == KVF_OK && !(e.access & need)) rc = KVF_EREMOTE;
        if (rc != KVF_OK) {
            /* release, as any slot's release (R), though nothing was copied */
            if (slot) atomic_store_explicit(slot, 0, memory_order_release);
            return rc;
        }
        uint64_t w = (uint64_t)e.rid << PID_BITS | (uint64_t)self_pid();
        if (!slot) {
            slot = claim(m, w);
            if (!slot) return KVF_ELOST;
        } else {
            /* seq_cst: (D), as the claim (the slot named another region
             * of this target so far; no byte was copied under it) */
            atomic_store_explicit(slot, w, memory_order_seq_cst);
        }
        /* seq_cst: the copier's load of (D). Unchanged: no update began
         * since the lookup, so a deregister of this region that begins
         * from now on sees the slot and waits for it. */
        if (atomic_load_explicit(&m->seq, memory_order_seq_cst) == seq) {
            p->slot = (void *)slot;
            p->lo = e.addr;
            p->hi = e.addr + e.len;
            return KVF_OK;
        }
        /* a register or a deregister ran since the lookup: look again */
    }
}

void kvf_fence_leave(kvf_fence_pass *p) {
    if (!p->slot) return;
    /* release: (R), the copy's bytes before the target's wait ends */
    atomic_store_explicit((_Atomic uint64_t *)p->slot, 0, memory_order_release);
    p->slot = NULL;
}
