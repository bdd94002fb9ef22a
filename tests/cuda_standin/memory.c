// The CUDA driver stand-in (cuda_standin.h): allocations, pinned and registered host memory, pointer attributes, and CUDA IPC.

#include "cuda_standin.h"

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
