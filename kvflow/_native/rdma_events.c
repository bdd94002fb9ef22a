/* The rdma provider's events: the queue of notifications and broken QPs
 * that the event loop reads through an eventfd (kvf_rdma_events), and the
 * devices' own asynchronous events (see rdma.h). */
#define _GNU_SOURCE
#include "rdma_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ------------------------------------------------------------------ events */

struct kvf_rdma_events {
    pthread_mutex_t mu;
    kvf_rdma_event *v;
    size_t n, cap;
    int efd;
    int signaled;
};

kvf_rdma_events *kvf_rdma_events_new(void) {
    kvf_rdma_events *q = calloc(1, sizeof(*q));
    if (!q) return NULL;
    q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->efd < 0) { free(q); return NULL; }
    pthread_mutex_init(&q->mu, NULL);
    return q;
}

int kvf_rdma_events_fd(kvf_rdma_events *q) { return q->efd; }

void rdma_events_push(kvf_rdma_events *q, const kvf_rdma_event *e) {
    pthread_mutex_lock(&q->mu);
    if (q->n == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 64;
        kvf_rdma_event *v = realloc(q->v, cap * sizeof(*v));
        if (!v) {            /* drop it: a notification is lost, never memory */
            pthread_mutex_unlock(&q->mu);
            free(e->data);
            return;
        }
        q->v = v;
        q->cap = cap;
    }
    q->v[q->n++] = *e;
    int wake = !q->signaled;
    q->signaled = 1;
    pthread_mutex_unlock(&q->mu);
    if (wake) {
        uint64_t one = 1;
        ssize_t r = write(q->efd, &one, sizeof(one));
        (void)r;
    }
}

size_t kvf_rdma_events_take(kvf_rdma_events *q, kvf_rdma_event *out, size_t cap) {
    uint64_t v;
    ssize_t r = read(q->efd, &v, sizeof(v));
    (void)r;
    pthread_mutex_lock(&q->mu);
    size_t n = q->n < cap ? q->n : cap;
    memcpy(out, q->v, n * sizeof(*out));
    memmove(q->v, q->v + n, (q->n - n) * sizeof(*out));
    q->n -= n;
    if (q->n == 0) q->signaled = 0;
    else {
        uint64_t one = 1;
        r = write(q->efd, &one, sizeof(one));
    }
    pthread_mutex_unlock(&q->mu);
    return n;
}

void kvf_rdma_events_free(kvf_rdma_events *q) {
    if (!q) return;
    for (size_t i = 0; i < q->n; i++) free(q->v[i].data);
    free(q->v);
    close(q->efd);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

/* ----------------------------------------------------------- device events */

int kvf_rdma_async_fd(struct ibv_context *ctx) {
    int fl = fcntl(ctx->async_fd, F_GETFL);
    if (fl < 0 || fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
    return ctx->async_fd;
}

int kvf_rdma_async_event(struct ibv_context *ctx, int *type, uint32_t *qpn, int *port) {
    struct ibv_async_event e;
    if (ibv_get_async_event(ctx, &e)) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    *type = (int)e.event_type;
    *qpn = 0;
    *port = 0;
    switch (e.event_type) {
    case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST: case IBV_EVENT_SQ_DRAINED: case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR: case IBV_EVENT_QP_LAST_WQE_REACHED:
        *qpn = e.element.qp ? e.element.qp->qp_num : 0;
        break;
    case IBV_EVENT_PORT_ACTIVE: case IBV_EVENT_PORT_ERR: case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE: case IBV_EVENT_SM_CHANGE: case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        *port = e.element.port_num;
        break;
    default:
        break;
    }
    ibv_ack_async_event(&e);
    return 1;
}

const char *kvf_rdma_dev_path(struct ibv_context *ctx) { return ctx->device->dev_path; }
