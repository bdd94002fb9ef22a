/* IBGDA endpoints, the host half: see rdma_ibgda.h. */
#include "rdma_ibgda.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifndef KVF_NO_MLX5DV
#include <infiniband/mlx5dv.h>
#endif

#include "rdma.h"

struct kvf_ibgda_ep {
    kvf_ctx *c;
    struct ibv_context *ctx;
    struct ibv_td *td;          /* NULL where the device has no thread domains */
    struct ibv_pd *parent;      /* the parent domain (pd + td), or NULL */
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint64_t seq;               /* host writes: wr_id of the last one posted */
    int device_owned;           /* the view was taken: the device posts and polls */
};

static int fail(char *why, size_t n, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return rc;
}

int kvf_ibgda_supported(struct ibv_context *ctx) {
#ifdef KVF_NO_MLX5DV
    (void)ctx;
    return 0;
#else
    return mlx5dv_is_supported(ctx->device) ? 1 : 0;
#endif
}

int kvf_ibgda_ep_new(kvf_ctx *c, struct ibv_context *ctx, struct ibv_pd *pd, uint32_t depth,
                     kvf_ibgda_ep **out, char *why, size_t n) {
    *out = NULL;
    if (depth < 2 || depth > (1u << 15) || (depth & (depth - 1)))
        return fail(why, n, KVF_EINVAL, "an IBGDA queue depth is a power of two from 2 to 32768");
    kvf_ibgda_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return fail(why, n, KVF_ENOMEM, "no memory for an IBGDA endpoint");
    ep->c = c;
    ep->ctx = ctx;
    /* A thread domain gets the QP a UAR of its own on mlx5 (the GPU rings
     * it with no lock); elsewhere it may not exist, and nothing needs it. */
    struct ibv_td_init_attr ta = {0};
    ep->td = ibv_alloc_td(ctx, &ta);
    if (ep->td) {
        struct ibv_parent_domain_init_attr pa = {.pd = pd, .td = ep->td};
        ep->parent = ibv_alloc_parent_domain(ctx, &pa);
        if (!ep->parent) {
            ibv_dealloc_td(ep->td);
            ep->td = NULL;
        }
    }
    /* one entry per WQE: every write the device posts is signalled */
    ep->cq = ibv_create_cq(ctx, (int)depth, NULL, NULL, 0);
    if (!ep->cq) {
        int e = errno;             /* before the frees below can change it */
        kvf_ibgda_ep_free(ep);
        return fail(why, n, KVF_EIO, "cannot create an IBGDA completion queue (%s)", strerror(e));
    }
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = ep->cq;
    ia.recv_cq = ep->cq;           /* nothing is ever received on it */
    ia.cap.max_send_wr = depth;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    ep->qp = ibv_create_qp(ep->parent ? ep->parent : pd, &ia);
    if (!ep->qp) {
        int e = errno;             /* before the frees below can change it */
        kvf_ibgda_ep_free(ep);
        return fail(why, n, KVF_EIO, "cannot create an IBGDA queue pair (%s)", strerror(e));
    }
    kvf_rdma_count(c, 0, 1);
    *out = ep;
    return KVF_OK;
}

struct ibv_qp *kvf_ibgda_ep_qp(kvf_ibgda_ep *ep) { return ep->qp; }

int kvf_ibgda_ep_view(kvf_ibgda_ep *ep, kvf_ibgda_view *out, char *why, size_t n) {
    memset(out, 0, sizeof *out);
#ifdef KVF_NO_MLX5DV
    return fail(why, n, KVF_EINVAL, "kvflow was built without infiniband/mlx5dv.h: no IBGDA on %s",
                ibv_get_device_name(ep->ctx->device));
#else
    /* the device starts from a fresh queue (producer and consumer index
     * 0): after a host write the provider's indexes have moved on */
    if (ep->seq)
        return fail(why, n, KVF_EINVAL, "the host has written through this queue pair (write_from_host): a "
                    "device cannot take it over");
    if (!kvf_ibgda_supported(ep->ctx))
        return fail(why, n, KVF_EINVAL, "%s is not an mlx5 device: IBGDA needs mlx5 direct verbs "
                    "(ConnectX-5 or later)", ibv_get_device_name(ep->ctx->device));
    struct mlx5dv_qp dq;
    struct mlx5dv_cq dc;
    struct mlx5dv_obj obj;
    memset(&dq, 0, sizeof dq);
    memset(&dc, 0, sizeof dc);
    memset(&obj, 0, sizeof obj);
    obj.qp.in = ep->qp;
    obj.qp.out = &dq;
    obj.cq.in = ep->cq;
    obj.cq.out = &dc;
    int rc = mlx5dv_init_obj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ);
    if (rc)
        return fail(why, n, KVF_EIO, "mlx5dv_init_obj failed (%s)", strerror(rc));
    /* what ibgda.cuh assumes: 64-byte basic blocks and CQEs, rings of a
     * power of two (it masks the index) */
    if (dq.sq.stride != 64 || dc.cqe_size != 64)
        return fail(why, n, KVF_EINVAL, "unexpected mlx5 layout: send stride or CQE size is not 64 bytes "
                    "(MLX5_CQE_SIZE set?)");
    if (!dq.sq.wqe_cnt || (dq.sq.wqe_cnt & (dq.sq.wqe_cnt - 1)) || !dc.cqe_cnt || (dc.cqe_cnt & (dc.cqe_cnt - 1)))
        return fail(why, n, KVF_EINVAL, "unexpected mlx5 layout: a ring size is not a power of two");
    if (!dq.bf.reg || !dq.dbrec || !dc.dbrec)
        return fail(why, n, KVF_EINVAL, "mlx5dv_init_obj gave no doorbell register or record");
    out->sq_buf = (uint64_t)(uintptr_t)dq.sq.buf;
    out->dbrec = (uint64_t)(uintptr_t)dq.dbrec;
    out->bf_reg = (uint64_t)(uintptr_t)dq.bf.reg;
    out->cq_buf = (uint64_t)(uintptr_t)dc.buf;
    out->cq_dbrec = (uint64_t)(uintptr_t)dc.dbrec;
    out->wqe_cnt = dq.sq.wqe_cnt;
    out->qpn = ep->qp->qp_num;
    out->cqe_cnt = dc.cqe_cnt;
    out->bf_size = dq.bf.size;
    out->dedicated_uar = ep->td != NULL;
    ep->device_owned = 1;
    return KVF_OK;
#endif
}

int kvf_ibgda_host_write(kvf_ibgda_ep *ep, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                         uint32_t len, uint64_t timeout_ns) {
    if (ep->device_owned) return -EBUSY;
    struct ibv_sge sge = {.addr = laddr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = ++ep->seq;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    int rc = ibv_post_send(ep->qp, &wr, &bad);
    if (rc) return -rc;
    uint64_t end = kvf_now_ns() + timeout_ns;
    for (;;) {
        struct ibv_wc wc;
        int got = ibv_poll_cq(ep->cq, 1, &wc);
        if (got < 0) return -EIO;
        /* an earlier write that timed out may complete now: skip it */
        if (got == 1 && wc.wr_id == ep->seq) return (int)wc.status;
        if (got == 0 && kvf_now_ns() > end) return -ETIMEDOUT;
    }
}

void kvf_ibgda_ep_free(kvf_ibgda_ep *ep) {
    if (!ep) return;
    if (ep->qp) kvf_rdma_destroy_qp(ep->c, ep->qp);
    if (ep->cq) ibv_destroy_cq(ep->cq);
    if (ep->parent) ibv_dealloc_pd(ep->parent);
    if (ep->td) ibv_dealloc_td(ep->td);
    free(ep);
}
