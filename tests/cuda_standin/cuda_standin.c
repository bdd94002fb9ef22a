// A CUDA driver stand-in for kvflow's tests: a libcuda.so.1 that
// cuda-bindings loads on machines without a GPU. It is a test double, never
// a GPU result: tools/gpu_check.sh on a real GPU is the acceptance.
//
// What it keeps:
// - "Device memory" is host memory the CPU cannot touch at the device
//   address: cuMemAlloc reserves the address range PROT_NONE (a CPU path
//   handed a device address faults or gets EFAULT, as with a real GPU) and
//   keeps the bytes in a memfd mapped elsewhere, which only the stand-in's
//   copies and kernels reach. A freed range stays reserved, so a stale
//   device pointer never aliases later host memory.
// - CUDA IPC across processes: a handle names the exporter's pid, its memfd
//   and the allocation's serial; cuIpcOpenMemHandle maps /proc/PID/fd/FD.
//   A handle opened again by the same context is reference counted (as
//   cuda.h says); a process cannot open its own handles.
// - Contexts (primary and created), a thread-local stack of current ones;
//   streams and events belonging to a context. Each stream runs its work in
//   order on a thread of its own, so copies, event records and host
//   functions are asynchronous as on a GPU. An async fault is sticky: every
//   later call in that context returns it.
// - Misuse fails with the driver's code: CUDA_ERROR_NOT_INITIALIZED before
//   cuInit; CUDA_ERROR_INVALID_CONTEXT for a call that needs a current
//   context without one (CONTEXT_IS_DESTROYED when the current one was
//   destroyed); CUDA_ERROR_INVALID_HANDLE for a destroyed (or wrong kind of)
//   stream, event, module or function, and for work queued on a stream of
//   another context than the current one. The last is stricter than the
//   driver for copies (it lets a copy go onto another context's stream),
//   exact for kernel launches and for cuEventRecord (event and stream must
//   share a context). kvfstandin_last_error() says why a call failed.
// - kvflow's kernels, by name, as C written here (labelled: the device code
//   itself never runs): kvf_flag_write, kvf_doorbells, kvf_layer_put (its
//   puts through putring.cuh compiled for the host; blocks one after the
//   other, where a GPU runs them at once). kvf_ibgda_write has none (it
//   drives an mlx5 NIC): cuModuleGetFunction returns NOT_SUPPORTED for it.
//   The fatbin must hold sm_90 code or PTX for the stand-in's 9.0 devices.
//
// Not modelled: the legacy NULL stream's implicit synchronization with
// other streams (kvflow's streams are non-blocking), peer access, memory
// limits, stream priorities, graphs, anything about speed.
//
// Entry points: cuGetProcAddress_v2 (how cuda-bindings finds everything),
// cuDriverGetVersion (dlsym'd by cuda-bindings' version check), and the
// calls below under their ABI names; every one is checked against cuda.h's
// prototype by the compiler, and the table against cudaTypedefs.h's PFN
// types. Test hooks: kvfstandin_*.
#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "putring.cuh"

#define MAX_DEVICES 8
#define MAX_OBJS (1 << 20)
#define MAX_MEMS 4096
#define MAX_CTX_DEPTH 32
#define IPC_MAGIC 0x316275747366766bULL     /* "kvfstub1", little-endian */

enum { K_CTX = 1, K_STREAM, K_EVENT, K_MODULE, K_FUNC };
enum { KERN_NONE, KERN_FLAG_WRITE, KERN_DOORBELLS, KERN_LAYER_PUT, KERN_UNSUPPORTED };

struct op;

struct obj {
    int kind, alive;
    CUdeviceptr handle;
    struct obj *ctx;                /* what it belongs to (a context: itself) */
    /* context */
    int dev, primary, refs;
    CUresult sticky;
    struct obj *null_stream;
    /* stream */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    uint64_t enq, done;             /* ops queued, ops run */
    int worker;
    /* event */
    struct obj *rec_stream;
    uint64_t rec_seq;
    /* module / function */
    unsigned kernels;               /* module: the KERN_ bits its image holds */
    int kernel;
};

struct mem {
    int live, kind;                 /* M_DEVICE, M_PINNED, M_REGISTERED */
    uint64_t addr, size;
    char *shadow;                   /* device memory: where its bytes are */
    int fd, dev;
    uint64_t serial;
    struct obj *ctx;                /* device: the allocating (or importing) context */
    int imported, refs;             /* an IPC mapping: opened how many times */
    int ipc_pid; uint64_t ipc_serial;
};
enum { M_DEVICE = 1, M_PINNED, M_REGISTERED };

struct op {
    struct op *next;
    int type;
    uint64_t a, b, n;               /* copy: dst, src, n; write64: addr, value */
    void (*fn)(void *);
    void *data;
    struct obj *wait_stream;
    uint64_t wait_seq;
    int kernel;
    unsigned grid, block;
    uint64_t params[16];
};
enum { OP_COPY = 1, OP_WAIT, OP_WRITE64, OP_HOSTFN, OP_KERNEL, OP_SLEEP };

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct obj *g_objs[MAX_OBJS];
static int g_nobjs;
static struct mem g_mems[MAX_MEMS];
static int g_nmems;
static uint64_t g_serial;
static int g_init, g_ndev, g_phys[MAX_DEVICES];
static struct obj *g_primary[MAX_DEVICES];
static __thread struct obj *t_stack[MAX_CTX_DEPTH];
static __thread int t_depth;
static __thread char t_err[512];
static char g_last_err[512];
static long g_copy_delay_us;
static uint64_t g_stats[8];          /* copies, bytes, kernels, host functions, ipc opens */

/* ------------------------------------------------------------ errors */

static CUresult fail(CUresult code, const char *fmt, ...)
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

#define NEED_INIT() do { if (!g_init) return fail(CUDA_ERROR_NOT_INITIALIZED, "%s before cuInit", __func__); } while (0)

/* ------------------------------------------------------------ handles */

static struct obj *new_obj(int kind, struct obj *ctx)
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

static struct obj *lookup(uint64_t h, int kind)
{
    if ((h & 0xffffff0000000000ULL) != 0x00c0da0000000000ULL || ((h >> 32) & 0xff) != (uint64_t)kind)
        return NULL;
    uint64_t idx = (h & 0xffffffffULL) - 1;
    pthread_mutex_lock(&g_mu);
    struct obj *o = idx < (uint64_t)g_nobjs ? g_objs[idx] : NULL;
    pthread_mutex_unlock(&g_mu);
    return o;
}

static const char *kind_name(int kind)
{
    static const char *names[] = {"?", "context", "stream", "event", "module", "function"};
    return kind >= 0 && kind <= K_FUNC ? names[kind] : "?";
}

static CUresult get(uint64_t h, int kind, struct obj **out, const char *fn)
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
static CUresult current(struct obj **out, const char *fn)
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

static void start_worker(struct obj *s);

/* A stream for work queued now: `h` in the current context (the NULL
   stream's aliases name the current context's own). */
static CUresult work_stream(CUstream h, struct obj **cur, struct obj **out, const char *fn)
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

static struct mem *find_mem(uint64_t addr, int live_only)
{
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if ((m->live || !live_only) && addr >= m->addr && addr < m->addr + m->size)
            return m;
    }
    return NULL;
}

static struct mem *new_mem(void)
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
static char *reach(uint64_t addr, uint64_t n, int pageable, CUresult *why)
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
static int copy_bytes(char *dst, const char *src, uint64_t n)
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

static void *reserve(int dev, uint64_t len)
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

/* ------------------------------------------------------------ init, devices */

CUresult CUDAAPI cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuInit(unsigned int flags)
{
    if (flags)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuInit: flags must be 0");
    pthread_mutex_lock(&g_mu);
    if (!g_init) {
        const char *n = getenv("KVFLOW_CUDA_STANDIN_DEVICES");
        int total = n ? atoi(n) : 2;
        if (total < 0 || total > MAX_DEVICES)
            total = 2;
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        g_ndev = 0;
        if (vis) {          /* ordinals are positions in this list, as with the driver */
            char buf[128];
            snprintf(buf, sizeof buf, "%s", vis);
            for (char *s = strtok(buf, ","); s && g_ndev < MAX_DEVICES; s = strtok(NULL, ",")) {
                int d = atoi(s);
                if (d < 0 || d >= total)
                    break;
                g_phys[g_ndev++] = d;
            }
        } else {
            for (int i = 0; i < total; i++)
                g_phys[g_ndev++] = i;
        }
        const char *delay = getenv("KVFLOW_CUDA_STANDIN_COPY_DELAY_US");
        g_copy_delay_us = delay ? atol(delay) : 0;
        g_init = 1;
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int *count)
{
    NEED_INIT();
    *count = g_ndev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal)
{
    NEED_INIT();
    if (ordinal < 0 || ordinal >= g_ndev)
        return fail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet(%d): %d devices", ordinal, g_ndev);
    *device = ordinal;
    return CUDA_SUCCESS;
}

#define NEED_DEV(d) do { NEED_INIT(); if ((d) < 0 || (d) >= g_ndev) return fail(CUDA_ERROR_INVALID_DEVICE, "%s: no device %d", __func__, (int)(d)); } while (0)

CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    NEED_DEV(dev);
    char b[16] = "kvfStandInGpu-";
    b[14] = (char)('0' + g_phys[dev]);
    b[15] = 0;
    memcpy(uuid->bytes, b, 16);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev)
{
    NEED_DEV(dev);
    snprintf(name, (size_t)len, "kvflow CUDA stand-in %d (not a GPU)", g_phys[dev]);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev)
{
    NEED_DEV(dev);
    *bytes = (size_t)16 << 30;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    NEED_DEV(dev);
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 4; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *pi = g_phys[dev]; break;
    default: *pi = 0;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ contexts */

static struct obj *new_ctx(int dev, int primary)
{
    struct obj *c = new_obj(K_CTX, NULL);
    if (c) {
        c->dev = dev;
        c->primary = primary;
        c->refs = 1;
    }
    return c;
}

/* Everything of a destroyed context dies with it; its memory stays
   reserved (and unreachable). */
static void destroy_ctx(struct obj *c)
{
    pthread_mutex_lock(&g_mu);
    c->alive = 0;
    for (int i = 0; i < g_nobjs; i++)
        if (g_objs[i]->ctx == c)
            g_objs[i]->alive = 0;
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if (m->live && m->ctx == c) {
            m->live = 0;
            if (m->shadow)
                munmap(m->shadow, m->size);
            if (m->kind == M_PINNED)
                munmap((void *)(uintptr_t)m->addr, m->size);
            if (m->fd >= 0 && !m->imported)
                close(m->fd);
            m->shadow = NULL;
            if (m->kind != M_DEVICE)
                m->addr = 0;            /* host memory: the range may be reused */
        }
    }
    pthread_mutex_unlock(&g_mu);
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    NEED_DEV(dev);
    pthread_mutex_lock(&g_mu);
    struct obj *c = g_primary[dev];
    if (c && c->alive)
        c->refs++;
    pthread_mutex_unlock(&g_mu);
    if (!c || !c->alive) {
        c = new_ctx(dev, 1);
        if (!c)
            return CUDA_ERROR_OUT_OF_MEMORY;
        pthread_mutex_lock(&g_mu);
        g_primary[dev] = c;
        pthread_mutex_unlock(&g_mu);
    }
    *pctx = (CUcontext)(uintptr_t)c->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev)
{
    NEED_DEV(dev);
    pthread_mutex_lock(&g_mu);
    struct obj *c = g_primary[dev];
    int last = c && c->alive && --c->refs == 0;
    int none = !c || !c->alive;
    pthread_mutex_unlock(&g_mu);
    if (none)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease(%d): not retained", (int)dev);
    if (last)                   /* "destroyed regardless of how many threads it is current to" */
        destroy_ctx(c);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxCreate(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    (void)params, (void)flags;
    NEED_DEV(dev);
    struct obj *c = new_ctx((int)dev, 0);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (t_depth < MAX_CTX_DEPTH)
        t_stack[t_depth++] = c;     /* created contexts are pushed */
    *pctx = (CUcontext)(uintptr_t)c->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxDestroy(CUcontext ctx)
{
    NEED_INIT();
    struct obj *c;
    CUresult r = get((uint64_t)(uintptr_t)ctx, K_CTX, &c, "cuCtxDestroy");
    if (r)
        return r;
    if (c->primary)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxDestroy: a primary context (release it instead)");
    destroy_ctx(c);
    if (t_depth && t_stack[t_depth - 1] == c)
        t_depth--;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx)
{
    NEED_INIT();
    struct obj *c = NULL;
    if (ctx) {
        CUresult r = get((uint64_t)(uintptr_t)ctx, K_CTX, &c, "cuCtxSetCurrent");
        if (r)
            return r;
    }
    if (!c) {
        if (t_depth)
            t_depth--;
    } else if (t_depth) {
        t_stack[t_depth - 1] = c;
    } else {
        t_stack[t_depth++] = c;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx)
{
    NEED_INIT();
    struct obj *c = t_depth ? t_stack[t_depth - 1] : NULL;
    *pctx = c ? (CUcontext)(uintptr_t)c->handle : NULL;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx)
{
    NEED_INIT();
    struct obj *c;
    CUresult r = get((uint64_t)(uintptr_t)ctx, K_CTX, &c, "cuCtxPushCurrent");
    if (r)
        return r;
    if (t_depth >= MAX_CTX_DEPTH)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuCtxPushCurrent: the stack is full");
    t_stack[t_depth++] = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx)
{
    NEED_INIT();
    if (!t_depth)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxPopCurrent: no current context");
    struct obj *c = t_stack[--t_depth];
    if (pctx)
        *pctx = (CUcontext)(uintptr_t)c->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device)
{
    struct obj *c;
    CUresult r = current(&c, "cuCtxGetDevice");
    if (r)
        return r;
    *device = c->dev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    if (!ctx)
        return cuCtxGetDevice(device);
    NEED_INIT();
    struct obj *c;
    CUresult r = get((uint64_t)(uintptr_t)ctx, K_CTX, &c, "cuCtxGetDevice_v2");
    if (r)
        return r;
    *device = c->dev;
    return CUDA_SUCCESS;
}

static CUresult stream_sync(struct obj *s);

CUresult CUDAAPI cuCtxSynchronize(void)
{
    struct obj *c;
    CUresult r = current(&c, "cuCtxSynchronize");
    if (r)
        return r;
    for (int i = 0;; i++) {
        pthread_mutex_lock(&g_mu);
        struct obj *o = i < g_nobjs ? g_objs[i] : NULL;
        pthread_mutex_unlock(&g_mu);
        if (!o)
            break;
        if (o->kind == K_STREAM && o->ctx == c && (r = stream_sync(o)))
            return r;
    }
    return c->sticky;
}

/* ------------------------------------------------------------ memory calls */

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t size)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemAlloc");
    if (r)
        return r;
    if (!size)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc(0)");
    size_t len = (size + 4095) & ~(size_t)4095;
    pthread_mutex_lock(&g_mu);
    uint64_t serial = ++g_serial;
    pthread_mutex_unlock(&g_mu);
    char name[64];
    snprintf(name, sizeof name, "kvfstandin-%llu", (unsigned long long)serial);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)len) < 0) {
        if (fd >= 0)
            close(fd);
        return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(%zu): %s", size, strerror(errno));
    }
    /* the device address: reserved, never accessible to the CPU */
    void *dev = reserve(c->dev, len);
    void *shadow = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (dev == MAP_FAILED || shadow == MAP_FAILED) {
        close(fd);
        return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(%zu): mmap: %s", size, strerror(errno));
    }
    pthread_mutex_lock(&g_mu);
    struct mem *m = new_mem();
    if (m)
        *m = (struct mem){.live = 1, .kind = M_DEVICE, .addr = (uint64_t)(uintptr_t)dev, .size = len,
                          .shadow = shadow, .fd = fd, .dev = c->dev, .serial = serial, .ctx = c};
    pthread_mutex_unlock(&g_mu);
    if (!m)
        return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc: too many allocations");
    *dptr = (CUdeviceptr)(uintptr_t)dev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemFree");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(dptr, 1);
    if (!m || m->kind != M_DEVICE || m->addr != dptr || m->imported) {
        pthread_mutex_unlock(&g_mu);
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemFree(%#llx): not the base of a live cuMemAlloc allocation",
                    (unsigned long long)dptr);
    }
    m->live = 0;                        /* the address range stays reserved */
    munmap(m->shadow, m->size);
    m->shadow = NULL;
    close(m->fd);
    m->fd = -1;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemGetAddressRange");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(dptr, 1);
    int ok = m && m->kind == M_DEVICE;
    if (ok) {
        if (pbase)
            *pbase = m->addr;
        if (psize)
            *psize = m->size;
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : fail(CUDA_ERROR_NOT_FOUND, "cuMemGetAddressRange(%#llx): not device memory",
                                    (unsigned long long)dptr);
}

CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
    (void)flags;
    struct obj *c;
    CUresult r = current(&c, "cuMemHostAlloc");
    if (r)
        return r;
    if (!size)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc(0)");
    size_t len = (size + 4095) & ~(size_t)4095;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemHostAlloc(%zu)", size);
    pthread_mutex_lock(&g_mu);
    struct mem *m = new_mem();
    if (m)
        *m = (struct mem){.live = 1, .kind = M_PINNED, .addr = (uint64_t)(uintptr_t)p, .size = len, .fd = -1,
                          .dev = c->dev, .ctx = c};
    pthread_mutex_unlock(&g_mu);
    *pp = p;
    return m ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuMemFreeHost(void *p)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemFreeHost");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem((uint64_t)(uintptr_t)p, 1);
    int ok = m && m->kind == M_PINNED && m->addr == (uint64_t)(uintptr_t)p;
    if (ok) {
        m->live = 0;
        munmap(p, m->size);
        m->addr = 0;                    /* host memory: the range may be reused */
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : fail(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost(%p): not from cuMemHostAlloc", p);
}

CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int flags)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemHostGetDevicePointer");
    if (r)
        return r;
    if (flags)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostGetDevicePointer: flags must be 0");
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem((uint64_t)(uintptr_t)p, 1);
    int ok = m && m->kind != M_DEVICE;
    pthread_mutex_unlock(&g_mu);
    if (!ok)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostGetDevicePointer(%p): not pinned or registered", p);
    *pdptr = (CUdeviceptr)(uintptr_t)p;   /* unified addressing: the same number */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostRegister(void *p, size_t size, unsigned int flags)
{
    (void)flags;
    struct obj *c;
    CUresult r = current(&c, "cuMemHostRegister");
    if (r)
        return r;
    uint64_t a = (uint64_t)(uintptr_t)p;
    if (!p || !size)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister(%p, %zu)", p, size);
    /* the driver pins the pages: they must be mapped */
    for (uint64_t q = a & ~4095ULL; q < a + size; q += 4096) {
        unsigned char v;
        if (mincore((void *)(uintptr_t)q, 1, &v) < 0)
            return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister(%p, %zu): not mapped", p, size);
    }
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if (m->live && a < m->addr + m->size && m->addr < a + size) {
            pthread_mutex_unlock(&g_mu);
            return fail(m->kind == M_DEVICE ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                        "cuMemHostRegister(%p, %zu): overlaps a registered range", p, size);
        }
    }
    struct mem *m = new_mem();
    if (m)
        *m = (struct mem){.live = 1, .kind = M_REGISTERED, .addr = a, .size = size, .fd = -1, .dev = c->dev, .ctx = c};
    pthread_mutex_unlock(&g_mu);
    return m ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuMemHostUnregister(void *p)
{
    struct obj *c;
    CUresult r = current(&c, "cuMemHostUnregister");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem((uint64_t)(uintptr_t)p, 1);
    int ok = m && m->kind == M_REGISTERED && m->addr == (uint64_t)(uintptr_t)p;
    if (ok) {
        m->live = 0;
        m->addr = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS
              : fail(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "cuMemHostUnregister(%p): not registered", p);
}

CUresult CUDAAPI cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attrs, void **data, CUdeviceptr ptr)
{
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(ptr, 1);
    struct mem copy = m ? *m : (struct mem){0};
    pthread_mutex_unlock(&g_mu);
    for (unsigned i = 0; i < n; i++) {
        void *d = data[i];
        switch (attrs[i]) {
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            *(unsigned *)d = !m ? 0 : copy.kind == M_DEVICE ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
            break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)d = m ? copy.dev : -2; break;
        case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)d = 0; break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)d = m ? copy.addr : 0; break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)d = m ? copy.size : 0; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)d = m ? ptr : 0; break;
        case CU_POINTER_ATTRIBUTE_CONTEXT:
            *(CUcontext *)d = m ? (CUcontext)(uintptr_t)copy.ctx->handle : NULL;
            break;
        default:
            return fail(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttributes: attribute %d has no stand-in",
                        (int)attrs[i]);
        }
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ IPC */

struct ipc_handle {             /* the 64 bytes of a CUipcMemHandle */
    uint64_t magic, serial, size;
    int32_t pid, fd, dev, pad;
    char rest[24];
};

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    struct obj *c;
    CUresult r = current(&c, "cuIpcGetMemHandle");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(dptr, 1);
    int ok = m && m->kind == M_DEVICE && !m->imported && m->addr == dptr;
    struct ipc_handle h = {0};
    if (ok)
        h = (struct ipc_handle){.magic = IPC_MAGIC, .serial = m->serial, .size = m->size, .pid = getpid(),
                                .fd = m->fd, .dev = g_phys[m->dev]};
    pthread_mutex_unlock(&g_mu);
    if (!ok)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcGetMemHandle(%#llx): not the base of a cuMemAlloc allocation",
                    (unsigned long long)dptr);
    memcpy(handle->reserved, &h, sizeof h);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    (void)flags;
    struct obj *c;
    CUresult r = current(&c, "cuIpcOpenMemHandle");
    if (r)
        return r;
    struct ipc_handle h;
    memcpy(&h, handle.reserved, sizeof h);
    if (h.magic != IPC_MAGIC)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenMemHandle: not an IPC handle");
    if (h.pid == getpid())
        return fail(CUDA_ERROR_INVALID_CONTEXT, "cuIpcOpenMemHandle: a handle does not open in the process that made it");
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if (m->live && m->imported && m->ipc_pid == h.pid && m->ipc_serial == h.serial && m->ctx == c) {
            m->refs++;              /* opened again by this context: the same pointer (cuda.h) */
            *pdptr = m->addr;
            pthread_mutex_unlock(&g_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    char path[64], link[128], want[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    ssize_t k = readlink(path, link, sizeof link - 1);
    snprintf(want, sizeof want, "/memfd:kvfstandin-%llu ", (unsigned long long)h.serial);
    if (k < 0 || (link[k] = 0, strncmp(link, want, strlen(want))))
        return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenMemHandle: the exporter (pid %d) or its allocation is gone",
                    h.pid);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || (uint64_t)st.st_size != h.size) {
        if (fd >= 0)
            close(fd);
        return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenMemHandle: cannot map pid %d's allocation", h.pid);
    }
    void *dev = reserve(-1, h.size);
    void *shadow = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (dev == MAP_FAILED || shadow == MAP_FAILED)
        return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuIpcOpenMemHandle: mmap");
    pthread_mutex_lock(&g_mu);
    struct mem *m = new_mem();
    if (m)
        *m = (struct mem){.live = 1, .kind = M_DEVICE, .addr = (uint64_t)(uintptr_t)dev, .size = h.size,
                          .shadow = shadow, .fd = -1, .dev = c->dev, .ctx = c, .imported = 1, .refs = 1,
                          .ipc_pid = h.pid, .ipc_serial = h.serial};
    g_stats[4]++;
    pthread_mutex_unlock(&g_mu);
    *pdptr = (CUdeviceptr)(uintptr_t)dev;
    return m ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    struct obj *c;
    CUresult r = current(&c, "cuIpcCloseMemHandle");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(dptr, 1);
    int ok = m && m->imported && m->addr == dptr;
    if (ok && --m->refs == 0) {
        m->live = 0;
        munmap(m->shadow, m->size);
        m->shadow = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : fail(CUDA_ERROR_INVALID_VALUE, "cuIpcCloseMemHandle(%#llx): not an opened IPC mapping",
                                    (unsigned long long)dptr);
}

/* ------------------------------------------------------------ streams and events */

static void enqueue(struct obj *s, struct op *o)
{
    pthread_mutex_lock(&s->mu);
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    s->enq++;
    if (!s->worker)
        start_worker(s);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void run_kernel(struct obj *s, struct op *o);

static void *worker(void *arg)
{
    struct obj *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head)
            pthread_cond_wait(&s->cv, &s->mu);
        struct op *o = s->head;
        pthread_mutex_unlock(&s->mu);
        CUresult err = s->ctx->sticky;
        if (!err) {
            switch (o->type) {
            case OP_COPY:
                if (g_copy_delay_us)
                    usleep((useconds_t)g_copy_delay_us);
                if (copy_bytes((char *)(uintptr_t)o->a, (const char *)(uintptr_t)o->b, o->n) < 0)
                    err = fail(CUDA_ERROR_ILLEGAL_ADDRESS, "a copy of %llu bytes faulted (%#llx <- %#llx)",
                               (unsigned long long)o->n, (unsigned long long)o->a, (unsigned long long)o->b);
                pthread_mutex_lock(&g_mu);
                g_stats[0]++, g_stats[1] += o->n;
                pthread_mutex_unlock(&g_mu);
                break;
            case OP_WAIT:
                pthread_mutex_lock(&o->wait_stream->mu);
                while (o->wait_stream->done < o->wait_seq)
                    pthread_cond_wait(&o->wait_stream->cv, &o->wait_stream->mu);
                pthread_mutex_unlock(&o->wait_stream->mu);
                break;
            case OP_WRITE64: {
                CUresult why = 0;
                char *p = reach(o->a, 8, 0, &why);
                if (!p)
                    err = fail(why, "cuStreamWriteValue64 to %#llx: not device or mapped host memory",
                               (unsigned long long)o->a);
                else
                    __atomic_store_n((uint64_t *)p, o->b, __ATOMIC_SEQ_CST);   /* the system-wide fence, then the write */
                break;
            }
            case OP_HOSTFN:
                o->fn(o->data);
                pthread_mutex_lock(&g_mu);
                g_stats[3]++;
                pthread_mutex_unlock(&g_mu);
                break;
            case OP_KERNEL:
                run_kernel(s, o);
                err = s->ctx->sticky;
                break;
            case OP_SLEEP:
                usleep((useconds_t)o->n);
                break;
            }
        }
        if (err && !s->ctx->sticky)
            s->ctx->sticky = err;
        pthread_mutex_lock(&s->mu);
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->done++;
        int quit = !s->head && !s->alive;
        if (quit)
            s->worker = 0;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        free(o);
        if (quit)
            return NULL;
    }
}

static void start_worker(struct obj *s)     /* s->mu held */
{
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &a, worker, s) == 0)
        s->worker = 1;
    pthread_attr_destroy(&a);
}

static CUresult stream_sync(struct obj *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t want = s->enq;
    while (s->done < want)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return s->ctx->sticky;
}

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    struct obj *c;
    CUresult r = current(&c, "cuStreamCreate");
    if (r)
        return r;
    if (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: flags %#x", flags);
    struct obj *s = new_obj(K_STREAM, c);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phStream = (CUstream)(uintptr_t)s->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    (void)priority;
    return cuStreamCreate(phStream, flags);
}

CUresult CUDAAPI cuStreamDestroy(CUstream h)
{
    NEED_INIT();
    struct obj *s;
    CUresult r = get((uint64_t)(uintptr_t)h, K_STREAM, &s, "cuStreamDestroy");
    if (r)
        return r;
    pthread_mutex_lock(&s->mu);
    s->alive = 0;                   /* its queued work still runs, then its thread ends */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

static CUresult any_stream(CUstream h, struct obj **out, const char *fn)
{
    uint64_t v = (uint64_t)(uintptr_t)h;
    if (v == 0 || v == (uint64_t)(uintptr_t)CU_STREAM_LEGACY || v == (uint64_t)(uintptr_t)CU_STREAM_PER_THREAD) {
        struct obj *c;
        return work_stream(h, &c, out, fn);
    }
    return get(v, K_STREAM, out, fn);
}

CUresult CUDAAPI cuStreamSynchronize(CUstream h)
{
    NEED_INIT();
    struct obj *s;
    CUresult r = any_stream(h, &s, "cuStreamSynchronize");
    return r ? r : stream_sync(s);
}

CUresult CUDAAPI cuStreamQuery(CUstream h)
{
    NEED_INIT();
    struct obj *s;
    CUresult r = any_stream(h, &s, "cuStreamQuery");
    if (r)
        return r;
    if (s->ctx->sticky)
        return s->ctx->sticky;
    pthread_mutex_lock(&s->mu);
    int idle = s->done == s->enq;
    pthread_mutex_unlock(&s->mu);
    return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuStreamGetDevice(CUstream h, CUdevice *device)
{
    NEED_INIT();
    struct obj *s;
    CUresult r = any_stream(h, &s, "cuStreamGetDevice");
    if (r)
        return r;
    *device = s->ctx->dev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetCtx(CUstream h, CUcontext *pctx)
{
    NEED_INIT();
    struct obj *s;
    CUresult r = any_stream(h, &s, "cuStreamGetCtx");
    if (r)
        return r;
    *pctx = (CUcontext)(uintptr_t)s->ctx->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int flags)
{
    (void)flags;
    struct obj *c;
    CUresult r = current(&c, "cuEventCreate");
    if (r)
        return r;
    struct obj *e = new_obj(K_EVENT, c);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phEvent = (CUevent)(uintptr_t)e->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent h)
{
    NEED_INIT();
    struct obj *e;
    CUresult r = get((uint64_t)(uintptr_t)h, K_EVENT, &e, "cuEventDestroy");
    if (r)
        return r;
    e->alive = 0;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecord(CUevent h, CUstream hs)
{
    struct obj *c, *s, *e;
    CUresult r = work_stream(hs, &c, &s, "cuEventRecord");
    if (r)
        return r;
    if ((r = get((uint64_t)(uintptr_t)h, K_EVENT, &e, "cuEventRecord")))
        return r;
    if (e->ctx != s->ctx)       /* cuda.h: "must be from the same context" */
        return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord: event of context %#llx, stream of context %#llx",
                    (unsigned long long)e->ctx->handle, (unsigned long long)s->ctx->handle);
    pthread_mutex_lock(&s->mu);
    uint64_t seq = s->enq;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&g_mu);
    e->rec_stream = s;
    e->rec_seq = seq;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecordWithFlags(CUevent h, CUstream hs, unsigned int flags)
{
    if (flags)
        return fail(CUDA_ERROR_NOT_SUPPORTED, "cuEventRecordWithFlags: flags %#x have no stand-in", flags);
    return cuEventRecord(h, hs);
}

static CUresult event_state(CUevent h, struct obj **s, uint64_t *seq, const char *fn)
{
    NEED_INIT();
    struct obj *e;
    CUresult r = get((uint64_t)(uintptr_t)h, K_EVENT, &e, fn);
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    *s = e->rec_stream;
    *seq = e->rec_seq;
    pthread_mutex_unlock(&g_mu);
    return e->ctx->sticky;
}

CUresult CUDAAPI cuEventQuery(CUevent h)
{
    struct obj *s;
    uint64_t seq;
    CUresult r = event_state(h, &s, &seq, "cuEventQuery");
    if (r || !s)
        return r;               /* never recorded: complete */
    pthread_mutex_lock(&s->mu);
    int done = s->done >= seq;
    pthread_mutex_unlock(&s->mu);
    return done ? s->ctx->sticky : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuEventSynchronize(CUevent h)
{
    struct obj *s;
    uint64_t seq;
    CUresult r = event_state(h, &s, &seq, "cuEventSynchronize");
    if (r || !s)
        return r;
    pthread_mutex_lock(&s->mu);
    while (s->done < seq)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return s->ctx->sticky;
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream hs, CUevent h, unsigned int flags)
{
    struct obj *c, *s, *e;
    CUresult r = work_stream(hs, &c, &s, "cuStreamWaitEvent");
    if (r)
        return r;
    if ((r = get((uint64_t)(uintptr_t)h, K_EVENT, &e, "cuStreamWaitEvent")))
        return r;               /* the event may be of another context (cuda.h) */
    if (flags)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamWaitEvent: flags %#x", flags);
    pthread_mutex_lock(&g_mu);
    struct obj *ws = e->rec_stream;
    uint64_t seq = e->rec_seq;
    pthread_mutex_unlock(&g_mu);
    if (!ws)
        return CUDA_SUCCESS;
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_WAIT;
    o->wait_stream = ws;
    o->wait_seq = seq;
    enqueue(s, o);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ copies and stream work */

static CUresult queue_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs, int sync, const char *fn)
{
    struct obj *c, *s;
    CUresult r = work_stream(hs, &c, &s, fn);
    if (r)
        return r;
    if (!n)
        return CUDA_SUCCESS;
    CUresult why = 0;
    char *d = reach(dst, n, 1, &why), *p = d ? reach(src, n, 1, &why) : NULL;
    if (!d || !p)
        return fail(why, "%s(%#llx <- %#llx, %zu): a range in freed device memory, or past its allocation's end", fn,
                    (unsigned long long)dst, (unsigned long long)src, n);
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_COPY;
    o->a = (uint64_t)(uintptr_t)d;
    o->b = (uint64_t)(uintptr_t)p;
    o->n = n;
    enqueue(s, o);
    return sync ? stream_sync(s) : CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs)
{
    return queue_copy(dst, src, n, hs, 0, "cuMemcpyAsync");
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n)
{
    return queue_copy(dst, (CUdeviceptr)(uintptr_t)src, n, NULL, 1, "cuMemcpyHtoD");
}

CUresult CUDAAPI cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n)
{
    return queue_copy((CUdeviceptr)(uintptr_t)dst, src, n, NULL, 1, "cuMemcpyDtoH");
}

CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream hs)
{
    return queue_copy(dst, (CUdeviceptr)(uintptr_t)src, n, hs, 0, "cuMemcpyHtoDAsync");
}

CUresult CUDAAPI cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream hs)
{
    return queue_copy((CUdeviceptr)(uintptr_t)dst, src, n, hs, 0, "cuMemcpyDtoHAsync");
}

CUresult CUDAAPI cuStreamWriteValue64(CUstream hs, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{
    struct obj *c, *s;
    CUresult r = work_stream(hs, &c, &s, "cuStreamWriteValue64");
    if (r)
        return r;
    if (flags & ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamWriteValue64: flags %#x", flags);
    if (addr % 8)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamWriteValue64: %#llx is not 8-byte aligned",
                    (unsigned long long)addr);
    CUresult why = 0;
    if (!reach(addr, 8, 0, &why))
        return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamWriteValue64 to %#llx: not device or mapped host memory",
                    (unsigned long long)addr);
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_WRITE64;
    o->a = addr;
    o->b = value;
    enqueue(s, o);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream hs, CUhostFn fn, void *data)
{
    struct obj *c, *s;
    CUresult r = work_stream(hs, &c, &s, "cuLaunchHostFunc");
    if (r)
        return r;
    if (!fn)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchHostFunc: no function");
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_HOSTFN;
    o->fn = fn;
    o->data = data;
    enqueue(s, o);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ modules and kernels */

static const struct { const char *name; int kernel; int nparams; int sizes[12]; } KERNELS[] = {
    {"kvf_flag_write", KERN_FLAG_WRITE, 2, {8, 8}},
    {"kvf_doorbells", KERN_DOORBELLS, 3, {8, 8, 4}},
    {"kvf_layer_put", KERN_LAYER_PUT, 11, {8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}},
    {"kvf_ibgda_write", KERN_UNSUPPORTED, 0, {0}},
};
#define NKERNELS (int)(sizeof KERNELS / sizeof KERNELS[0])

static int has_name(const char *img, uint64_t n, const char *name)
{
    size_t k = strlen(name) + 1;        /* with its NUL: a symbol, not a prefix */
    return k <= n && memmem(img, n, name, k) != NULL;
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image)
{
    struct obj *c;
    CUresult r = current(&c, "cuModuleLoadData");
    if (r)
        return r;
    const unsigned char *b = image;
    uint32_t magic;
    uint16_t hsize;
    uint64_t fsize;
    memcpy(&magic, b, 4);
    if (magic != 0xba55ed50u)
        return fail(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData: the stand-in takes fatbins only");
    memcpy(&hsize, b + 6, 2);
    memcpy(&fsize, b + 8, 8);
    /* entries: kind (1 PTX, 2 ELF), header size, payload size, arch; the
       stand-in's devices are 9.0: sm_90 code, or PTX it could JIT */
    const char *code = NULL;
    uint64_t code_n = 0;
    int ptx = 0;
    for (uint64_t off = hsize; off + 32 <= hsize + fsize;) {
        uint16_t kind;
        uint32_t eh, arch;
        uint64_t ep;
        memcpy(&kind, b + off, 2);
        memcpy(&eh, b + off + 4, 4);
        memcpy(&ep, b + off + 8, 8);
        memcpy(&arch, b + off + 28, 4);
        if (kind == 2 && arch == 90)
            code = (const char *)b + off + eh, code_n = ep;
        if (kind == 1 && arch <= 90)
            ptx = 1;
        if (!eh)
            break;
        off += eh + ep;
    }
    if (!code && !ptx)
        return fail(CUDA_ERROR_NO_BINARY_FOR_GPU, "cuModuleLoadData: no sm_90 code nor PTX in the fatbin");
    struct obj *m = new_obj(K_MODULE, c);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    const char *all = (const char *)b;
    for (int i = 0; i < NKERNELS; i++)
        if (code ? has_name(code, code_n, KERNELS[i].name) : has_name(all, hsize + fsize, KERNELS[i].name))
            m->kernels |= 1u << i;
    *module = (CUmodule)(uintptr_t)m->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule h)
{
    NEED_INIT();
    struct obj *m;
    CUresult r = get((uint64_t)(uintptr_t)h, K_MODULE, &m, "cuModuleUnload");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    m->alive = 0;
    for (int i = 0; i < g_nobjs; i++)
        if (g_objs[i]->kind == K_FUNC && (uint64_t)g_objs[i]->rec_seq == m->handle)
            g_objs[i]->alive = 0;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    struct obj *c, *m;
    CUresult r = current(&c, "cuModuleGetFunction");
    if (r)
        return r;
    if ((r = get((uint64_t)(uintptr_t)hmod, K_MODULE, &m, "cuModuleGetFunction")))
        return r;
    if (m->ctx != c)
        return fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleGetFunction: the module is another context's");
    for (int i = 0; i < NKERNELS; i++) {
        if (strcmp(KERNELS[i].name, name))
            continue;
        if (!(m->kernels & (1u << i)))
            break;
        if (KERNELS[i].kernel == KERN_UNSUPPORTED)
            return fail(CUDA_ERROR_NOT_SUPPORTED, "cuModuleGetFunction(%s): the stand-in has no version of it", name);
        struct obj *f = new_obj(K_FUNC, c);
        if (!f)
            return CUDA_ERROR_OUT_OF_MEMORY;
        f->kernel = i;
        f->rec_seq = m->handle;         /* its module */
        *hfunc = (CUfunction)(uintptr_t)f->handle;
        return CUDA_SUCCESS;
    }
    return fail(CUDA_ERROR_NOT_FOUND, "cuModuleGetFunction(%s): not in the module", name);
}

CUresult CUDAAPI cuLaunchKernel(CUfunction hf, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int shmem, CUstream hs, void **params,
                                void **extra)
{
    struct obj *c, *s, *f;
    CUresult r = work_stream(hs, &c, &s, "cuLaunchKernel");
    if (r)
        return r;
    if ((r = get((uint64_t)(uintptr_t)hf, K_FUNC, &f, "cuLaunchKernel")))
        return r;
    if (!lookup(f->rec_seq, K_MODULE)->alive)
        return fail(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel: its module was unloaded");
    if (f->ctx != c)
        return fail(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel: the function is another context's");
    if (!gx || !gy || !gz || !bx || !by || !bz || bx * by * bz > 1024 || shmem > 48 * 1024 || extra || !params)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel: grid %u,%u,%u block %u,%u,%u shmem %u", gx, gy, gz,
                    bx, by, bz, shmem);
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_KERNEL;
    o->kernel = f->kernel;
    o->grid = gx * gy * gz;
    o->block = bx * by * bz;
    for (int i = 0; i < KERNELS[f->kernel].nparams; i++)     /* copied now, as the driver does */
        memcpy(&o->params[i], params[i], (size_t)KERNELS[f->kernel].sizes[i]);
    enqueue(s, o);
    return CUDA_SUCCESS;
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

#define KREACH(var, type, addr, n) \
    type var = (type)reach((addr), (n), 0, &why); \
    if (!var) { fail(why ? why : CUDA_ERROR_ILLEGAL_ADDRESS, "%s: %#llx+%llu is not memory the device reaches", \
                     KERNELS[o->kernel].name, (unsigned long long)(addr), (unsigned long long)(n)); \
                s->ctx->sticky = CUDA_ERROR_ILLEGAL_ADDRESS; return; }

/* kvflow's kernels as C (kernels.cu says what each does): the stand-in's
   reading of them, not the device code. */
static void run_kernel(struct obj *s, struct op *o)
{
    CUresult why = 0;
    uint64_t *a = o->params;
    pthread_mutex_lock(&g_mu);
    g_stats[2]++;
    pthread_mutex_unlock(&g_mu);
    switch (KERNELS[o->kernel].kernel) {
    case KERN_FLAG_WRITE: {
        KREACH(flag, volatile uint64_t *, a[0], 8);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        *flag = a[1];
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        break;
    }
    case KERN_DOORBELLS: {
        uint32_t count = (uint32_t)a[2];
        if (!count)
            break;
        KREACH(bell, volatile uint64_t *, a[0], 8ULL * count);
        KREACH(vals, const uint64_t *, a[1], 8ULL * count);
        for (uint32_t i = 0; i < count; i++) {
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            bell[i] = vals[i];
        }
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        break;
    }
    case KERN_LAYER_PUT: {
        uint64_t rows = a[3], din = a[4], dout = a[5], rpb = a[6], peer = a[8], remote = a[9];
        KREACH(x, const float *, a[0], rows * din * 4);
        KREACH(w, const float *, a[1], din * dout * 4);
        KREACH(kv, float *, a[2], rows * dout * 4);
        KREACH(ring, char *, a[7], KVF_RING_HEADER);
        uint64_t ring_size = ((struct kvf_ring_header *)ring)->size;
        KREACH(ring_all, char *, a[7], ring_size);
        KREACH(out, int64_t *, a[10], 16ULL * o->grid);
        (void)ring_all;
        for (unsigned b = 0; b < o->grid; b++) {
            uint64_t first = (uint64_t)b * rpb, last = first + rpb < rows ? first + rpb : rows;
            for (uint64_t i = first * dout; i < last * dout; i++) {
                uint64_t r = i / dout, col = i % dout;
                float acc = 0.f;
                for (uint64_t k = 0; k < din; k++)
                    acc += x[r * din + k] * w[k * dout + col];
                kv[i] = acc;
            }
            if (first >= last)
                continue;
            uint64_t off = first * dout * 4, len = (last - first) * dout * 4, t0 = now_ns();
            unsigned long long t = kvf_put(ring, b, KVF_PUT, (unsigned)peer, a[2] + off, remote + off, len, b);
            long long status = kvf_put_wait(ring, b, t);
            out[2 * b] = status;
            out[2 * b + 1] = (int64_t)(now_ns() - t0);
        }
        break;
    }
    default:
        s->ctx->sticky = CUDA_ERROR_LAUNCH_FAILED;
    }
}

/* ------------------------------------------------------------ errors by name */

static const struct { CUresult code; const char *name; } NAMES[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
};

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (NAMES[i].code == error) {
            *pStr = NAMES[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    return cuGetErrorName(error, pStr);
}

/* ------------------------------------------------------------ test hooks */

/* Queues a pause of `usec` on a stream (work queued after it waits): what
   makes an after= dependency observable. */
int kvfstandin_delay(CUstream hs, unsigned usec)
{
    struct obj *c, *s;
    CUresult r = work_stream(hs, &c, &s, "kvfstandin_delay");
    if (r)
        return (int)r;
    struct op *o = calloc(1, sizeof *o);
    o->type = OP_SLEEP;
    o->n = usec;
    enqueue(s, o);
    return 0;
}

/* Every copy then takes at least `usec` more: widens the window in which
   reading a copy's destination before its event fired finds old bytes. */
void kvfstandin_copy_delay(long usec) { g_copy_delay_us = usec; }

/* Live objects of a kind ("stream", "event", "context", "module",
   "device", "pinned", "registered", "ipc"), for balance checks; and the
   tallies ("copies", "bytes", "kernels", "hostfns", "ipc_opens"). */
long kvfstandin_count(const char *what)
{
    long n = 0;
    pthread_mutex_lock(&g_mu);
    static const char *tallies[] = {"copies", "bytes", "kernels", "hostfns", "ipc_opens"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(what, tallies[i])) {
            n = (long)g_stats[i];
            goto out;
        }
    for (int k = K_CTX; k <= K_FUNC; k++)
        if (!strcmp(what, kind_name(k)))
            for (int i = 0; i < g_nobjs; i++)
                n += g_objs[i]->kind == k && g_objs[i]->alive && g_objs[i]->ctx->alive &&
                     !(k == K_STREAM && g_objs[i]->ctx->null_stream == g_objs[i]);
    for (int i = 0; i < g_nmems; i++) {
        struct mem *m = &g_mems[i];
        if (!m->live)
            continue;
        n += (!strcmp(what, "device") && m->kind == M_DEVICE && !m->imported) ||
             (!strcmp(what, "ipc") && m->imported) || (!strcmp(what, "pinned") && m->kind == M_PINNED) ||
             (!strcmp(what, "registered") && m->kind == M_REGISTERED);
    }
out:
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* Where the bytes of device memory at `dptr` are (NULL: not device
   memory): for tests that check what landed without a driver copy. */
void *kvfstandin_peek(CUdeviceptr dptr, size_t n)
{
    CUresult why = 0;
    pthread_mutex_lock(&g_mu);
    struct mem *m = find_mem(dptr, 1);
    int dev = m && m->kind == M_DEVICE;
    pthread_mutex_unlock(&g_mu);
    return dev ? reach(dptr, n, 0, &why) : NULL;
}

/* ------------------------------------------------------------ cuGetProcAddress */

/* (name, the version it has from, the function): a request gets the newest
   entry at or below its version. The conditional checks each function's
   type against cudaTypedefs.h's PFN type for that version. */
#define E(name, ver, fn) {#name, ver, (void *)(1 ? (fn) : (PFN_##name##_v##ver)0)}
static const struct { const char *name; int version; void *fn; } TABLE[] = {
    E(cuGetErrorName, 6000, cuGetErrorName),
    E(cuGetErrorString, 6000, cuGetErrorString),
    E(cuInit, 2000, cuInit),
    E(cuDriverGetVersion, 2020, cuDriverGetVersion),
    E(cuDeviceGet, 2000, cuDeviceGet),
    E(cuDeviceGetCount, 2000, cuDeviceGetCount),
    E(cuDeviceGetName, 2000, cuDeviceGetName),
    E(cuDeviceGetUuid, 11040, cuDeviceGetUuid),
    E(cuDeviceTotalMem, 3020, cuDeviceTotalMem),
    E(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    E(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    E(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease),
    E(cuCtxCreate, 12050, cuCtxCreate),
    E(cuCtxDestroy, 4000, cuCtxDestroy),
    E(cuCtxPushCurrent, 4000, cuCtxPushCurrent),
    E(cuCtxPopCurrent, 4000, cuCtxPopCurrent),
    E(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    E(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    E(cuCtxGetDevice, 2000, cuCtxGetDevice),
    E(cuCtxGetDevice, 13000, cuCtxGetDevice_v2),
    E(cuCtxSynchronize, 2000, cuCtxSynchronize),
    E(cuModuleLoadData, 2000, cuModuleLoadData),
    E(cuModuleUnload, 2000, cuModuleUnload),
    E(cuModuleGetFunction, 2000, cuModuleGetFunction),
    E(cuMemAlloc, 3020, cuMemAlloc),
    E(cuMemFree, 3020, cuMemFree),
    E(cuMemGetAddressRange, 3020, cuMemGetAddressRange),
    E(cuMemFreeHost, 2000, cuMemFreeHost),
    E(cuMemHostAlloc, 2020, cuMemHostAlloc),
    E(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer),
    E(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle),
    E(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle),
    E(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle),
    E(cuMemHostRegister, 6050, cuMemHostRegister),
    E(cuMemHostUnregister, 4000, cuMemHostUnregister),
    E(cuMemcpyHtoD, 3020, cuMemcpyHtoD),
    E(cuMemcpyDtoH, 3020, cuMemcpyDtoH),
    E(cuMemcpyAsync, 4000, cuMemcpyAsync),
    E(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync),
    E(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync),
    E(cuPointerGetAttributes, 7000, cuPointerGetAttributes),
    E(cuStreamCreate, 2000, cuStreamCreate),
    E(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority),
    E(cuStreamGetDevice, 12080, cuStreamGetDevice),
    E(cuStreamGetCtx, 9020, cuStreamGetCtx),
    E(cuStreamWaitEvent, 3020, cuStreamWaitEvent),
    E(cuStreamQuery, 2000, cuStreamQuery),
    E(cuStreamSynchronize, 2000, cuStreamSynchronize),
    E(cuStreamDestroy, 4000, cuStreamDestroy),
    E(cuEventCreate, 2000, cuEventCreate),
    E(cuEventRecord, 2000, cuEventRecord),
    E(cuEventRecordWithFlags, 11010, cuEventRecordWithFlags),
    E(cuEventQuery, 2000, cuEventQuery),
    E(cuEventSynchronize, 2000, cuEventSynchronize),
    E(cuEventDestroy, 4000, cuEventDestroy),
    E(cuStreamWriteValue64, 11070, cuStreamWriteValue64),
    E(cuLaunchKernel, 4000, cuLaunchKernel),
    E(cuLaunchHostFunc, 10000, cuLaunchHostFunc),
};

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *status)
{
    (void)flags;
    int best = -1;
    for (int i = 0; i < (int)(sizeof TABLE / sizeof TABLE[0]); i++)
        if (!strcmp(TABLE[i].name, symbol) && TABLE[i].version <= version &&
            (best < 0 || TABLE[i].version > TABLE[best].version))
            best = i;
    if (best < 0) {             /* not in the stand-in: cuda-bindings raises if it is ever called */
        *pfn = NULL;
        if (status)
            *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = TABLE[best].fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
