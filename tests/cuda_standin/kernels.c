// The CUDA driver stand-in (cuda_standin.h): modules, functions, launches, and kvflow's kernels as C.

#include "cuda_standin.h"
#include "putring.cuh"          /* the put ring's device side, compiled for the host: kvf_layer_put */

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
void run_kernel(struct obj *s, struct op *o)
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
