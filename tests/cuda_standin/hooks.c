// The CUDA driver stand-in (cuda_standin.h): the test hooks (kvfstandin_*).

#include "cuda_standin.h"

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
