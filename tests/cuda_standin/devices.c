// The CUDA driver stand-in (cuda_standin.h): cuInit, devices and contexts.

#include "cuda_standin.h"

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
