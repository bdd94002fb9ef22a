// The CUDA driver stand-in (cuda_standin.h): streams (a worker thread each), events, copies and other stream work.

#include "cuda_standin.h"

/* ------------------------------------------------------------ streams and events */

static void start_worker(struct obj *s);

void enqueue(struct obj *s, struct op *o)
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

CUresult stream_sync(struct obj *s)
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
