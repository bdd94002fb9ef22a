// The CUDA driver stand-in (cuda_standin.h): the shared state (defined here once), errors, handles, the current context, and host/device memory bookkeeping.

#include "cuda_standin.h"

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
struct obj *g_objs[MAX_OBJS];
int g_nobjs;
struct mem g_mems[MAX_MEMS];
int g_nmems;
uint64_t g_serial;
int g_init, g_ndev, g_phys[MAX_DEVICES];
struct obj *g_primary[MAX_DEVICES];
__thread struct obj *t_stack[MAX_CTX_DEPTH];
__thread int t_depth;
static __thread char t_err[512];
static char g_last_err[512];
long g_copy_delay_us;
uint64_t g_stats[8];          /* copies, bytes, kernels, host functions, ipc opens */

/* ------------------------------------------------------------ errors */

CUresult fail(CUresult code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err, sizeof t_err, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_mu);
    snprintf(g_last_err, sizeof g_last_err, "%s", t_err);
    pthread_mutex_unlock(&g_mu);
    if (getenv("KVFLOW_CUDA_STANDIN_LOG"))
        fprintf(stderr, "cuda stand-in: error %d: %s\n", (int)code, t_err);
    return code;
}

/* The last refusal's reason (any thread): for the tests' messages. */
const char *kvfstandin_last_error(void) { return g_last_err; }

/* ------------------------------------------------------------ handles */

struct obj *new_obj(int kind, struct obj *ctx)
{
    struct obj *o = calloc(1, sizeof *o);
    if (!o)
        return NULL;
    o->kind = kind;
    o->alive = 1;
    o->ctx = ctx ? ctx : o;
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    pthread_mutex_lock(&g_mu);
    if (g_nobjs >= MAX_OBJS) {
        pthread_mutex_unlock(&g_mu);
        free(o);
        return NULL;
    }
    int idx = g_nobjs++;
    g_objs[idx] = o;
    pthread_mutex_unlock(&g_mu);
    /* never a valid host pointer, never reused: a destroyed handle stays known as destroyed */
    o->handle = 0x00c0da0000000000ULL | ((uint64_t)kind << 32) | (uint64_t)(idx + 1);
    return o;
}

struct obj *lookup(uint64_t h, int kind)
{
    if ((h & 0xffffff0000000000ULL) != 0x00c0da0000000000ULL || ((h >> 32) & 0xff) != (uint64_t)kind)
        return NULL;
    uint64_t idx = (h & 0xffffffffULL) - 1;
    pthread_mutex_lock(&g_mu);
    struct obj *o = idx < (uint64_t)g_nobjs ? g_objs[idx] : NULL;
    pthread_mutex_unlock(&g_mu);
    return o;
}

const char *kind_name(int kind)
{
    static const char *names[] = {"?", "context", "stream", "event", "module", "function"};
    return kind >= 0 && kind <= K_FUNC ? names[kind] : "?";
}

CUresult get(uint64_t h, int kind, struct obj **out, const char *fn)
{
    struct obj *o = lookup(h, kind);
    if (!o)
        return fail(kind == K_CTX ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_INVALID_HANDLE,
                    "%s: %#llx is not a %s", fn, (unsigned long long)h, kind_name(kind));
    if (!o->alive || !o->ctx->alive)
        return fail(kind == K_CTX ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_INVALID_HANDLE,
                    "%s: %s %#llx was destroyed", fn, kind_name(kind), (unsigned long long)h);
    *out = o;
    return CUDA_SUCCESS;
}

/* The calling thread's current context, for a call that needs one. */
CUresult current(struct obj **out, const char *fn)
{
    if (!g_init)
        return fail(CUDA_ERROR_NOT_INITIALIZED, "%s before cuInit", fn);
    struct obj *c = t_depth ? t_stack[t_depth - 1] : NULL;
    if (!c)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "%s without a current context", fn);
    if (!c->alive)
        return fail(CUDA_ERROR_CONTEXT_IS_DESTROYED, "%s: the current context was destroyed", fn);
    if (c->sticky)
        return fail(c->sticky, "%s: the context has had an earlier fault (sticky)", fn);
    *out = c;
    return CUDA_SUCCESS;
}


/* A stream for work queued now: `h` in the current context (the NULL
   stream's aliases name the current context's own). */
CUresult work_stream(CUstream h, struct obj **cur, struct obj **out, const char *fn)
{
    CUresult r = current(cur, fn);
    if (r)
        return r;
    uint64_t v = (uint64_t)(uintptr_t)h;
    if (v == 0 || v == (uint64_t)(uintptr_t)CU_STREAM_LEGACY || v == (uint64_t)(uintptr_t)CU_STREAM_PER_THREAD) {
        pthread_mutex_lock(&g_mu);
        struct obj *s = (*cur)->null_stream;
        pthread_mutex_unlock(&g_mu);
        if (!s) {
            s = new_obj(K_STREAM, *cur);
            if (!s)
                return fail(CUDA_ERROR_OUT_OF_MEMORY, "%s: no memory", fn);
            pthread_mutex_lock(&g_mu);
            if ((*cur)->null_stream) {
                s->alive = 0;
                s = (*cur)->null_stream;
            } else {
                (*cur)->null_stream = s;
            }
            pthread_mutex_unlock(&g_mu);
        }
        *out = s;
        return CUDA_SUCCESS;
    }
    struct obj *s;
    if ((r = get(v, K_STREAM, &s, fn)))
        return r;
    if (s->ctx != *cur)
        return fail(CUDA_ERROR_INVALID_HANDLE, "%s: stream %#llx belongs to context %#llx, the current one is %#llx",
                    fn, (unsigned long long)v, (unsigned long long)s->ctx->handle,
                    (unsigned long long)(*cur)->handle);
    *out = s;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ memory */

struct mem *find_mem(uint64_t addr, int live_only)
{
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if ((m->live || !live_only) && addr >= m->addr && addr < m->addr + m->size)
            return m;
    }
    return NULL;
}

struct mem *new_mem(void)
{
    for (int i = 0; i < g_nmems; i++)
        if (!g_mems[i].live && !g_mems[i].addr)
            return &g_mems[i];
    return g_nmems < MAX_MEMS ? &g_mems[g_nmems++] : NULL;
}

/* [addr, addr+n) as the stand-in reaches it: device memory at its shadow,
   pinned or registered host memory as it is. `pageable`: other host memory
   is allowed (a copy's host side; a kernel may not). Returns NULL and sets
   *why where it lies in freed device memory, or runs off an allocation. */
char *reach(uint64_t addr, uint64_t n, int pageable, CUresult *why)
{
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(addr, 0);
    char *p = NULL;
    if (m && m->live) {
        if (addr + n > m->addr + m->size || addr + n < addr)
            *why = CUDA_ERROR_INVALID_VALUE;
        else
            p = m->kind == M_DEVICE ? m->shadow + (addr - m->addr) : (char *)(uintptr_t)addr;
    } else if (m) {
        *why = CUDA_ERROR_INVALID_VALUE;         /* freed (device memory stays reserved) */
    } else if (pageable) {
        p = (char *)(uintptr_t)addr;
    } else {
        *why = CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    pthread_mutex_unlock(&g_mu);
    return p;
}

/* A copy by the kernel, not by the CPU: bytes it cannot reach (an unmapped
   or PROT_NONE page) are an error, not a crash. */
int copy_bytes(char *dst, const char *src, uint64_t n)
{
    while (n) {
        struct iovec l = {dst, n}, r = {(void *)src, n};
        ssize_t k = process_vm_readv(getpid(), &l, 1, &r, 1, 0);
        if (k <= 0)
            return -1;
        dst += k, src += k, n -= (uint64_t)k;
    }
    return 0;
}

/* A device address range: as a GPU's allocator, the same sequence of
   allocations gets the same addresses in every process (from a range per
   device, 2 MiB aligned), so a restarted peer's memory can sit where its
   predecessor's was. Imports and a taken range go wherever mmap puts them. */
static uint64_t g_next_va[MAX_DEVICES];

void *reserve(int dev, uint64_t len)
{
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (dev >= 0) {
        pthread_mutex_lock(&g_mu);
        uint64_t va = 0x600000000000ULL + ((uint64_t)g_phys[dev] << 38) + g_next_va[dev];
        g_next_va[dev] += (len + (2 << 20) - 1) & ~(uint64_t)((2 << 20) - 1);
        pthread_mutex_unlock(&g_mu);
        void *p = mmap((void *)(uintptr_t)va, len, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED)
            return p;
    }
    return mmap(NULL, len, PROT_NONE, flags, -1, 0);
}
