/* IBGDA endpoints, the host half (seed 001): one RC QP per (local device,
 * peer device) pair beside the channel's QPs, with a CQ of its own, that a
 * GPU drives itself once it is connected (kvflow/_cuda/ibgda.cuh builds the
 * WQEs, rings the doorbell and polls the CQ). The host makes the QP and CQ,
 * connects the QP in the same rdma_connect handshake as the channel's QPs
 * (kvflow/_verbs.pyx moves it RESET -> INIT -> RTR -> RTS), and reads the
 * mlx5 layout of its send queue, doorbell records, UAR register and CQ
 * (mlx5dv_init_obj) for the device to be given; no worker thread ever
 * posts on it or polls its CQ.
 *
 * On mlx5 the QP is made in a thread domain, so the provider gives it a
 * UAR of its own: the GPU rings that register with no lock shared with the
 * host's QPs. Devices with no thread domains (rxe, siw) get a plain QP;
 * its view is refused (not mlx5), and the host can still write through it
 * (kvf_ibgda_host_write), which is what proves on Soft-RoCE that the
 * handshake connected it to the right peer QP.
 *
 * NEVER RUN ON AN mlx5 NIC: no machine of this project has one. */
#ifndef KVF_RDMA_IBGDA_H
#define KVF_RDMA_IBGDA_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>

#include "kvf.h"

typedef struct kvf_ibgda_ep kvf_ibgda_ep;

/* What a GPU needs to drive the QP, as host addresses (the launcher maps
 * them into the device: kvflow/gpu/ibgda.py). */
typedef struct {
    uint64_t sq_buf;       /* wqe_cnt basic blocks of 64 bytes */
    uint64_t dbrec;        /* the QP's doorbell records: [0] receive, [1] send (32 bits each) */
    uint64_t bf_reg;       /* the UAR's doorbell (BlueFlame) register */
    uint64_t cq_buf;       /* cqe_cnt entries of 64 bytes */
    uint64_t cq_dbrec;     /* the CQ's doorbell record: [0] consumer index */
    uint32_t wqe_cnt, qpn, cqe_cnt, bf_size;
    uint32_t dedicated_uar; /* the QP was made in a thread domain (a UAR of its own) */
} kvf_ibgda_view;

/* A new endpoint on (ctx, pd): a CQ of `depth` entries and an RC QP in
 * RESET with `depth` send-queue entries (a power of two). Returns
 * KVF_OK, or an error with a reason in why[n]. */
int kvf_ibgda_ep_new(kvf_ctx *c, struct ibv_context *ctx, struct ibv_pd *pd, uint32_t depth,
                     kvf_ibgda_ep **out, char *why, size_t n);
struct ibv_qp *kvf_ibgda_ep_qp(kvf_ibgda_ep *ep);
/* Whether this device can be driven by IBGDA at all (mlx5 direct verbs). */
int kvf_ibgda_supported(struct ibv_context *ctx);
/* Fills *out from mlx5dv_init_obj; KVF_OK, or an error with why[n]
 * (also once the host has written through it: the device starts from a
 * fresh queue). After it, host writes are refused: the device owns the
 * send queue. */
int kvf_ibgda_ep_view(kvf_ibgda_ep *ep, kvf_ibgda_view *out, char *why, size_t n);
/* One signalled RDMA write posted from the host and its completion
 * polled, up to timeout_ns: the ibv_wc_status (0: landed), -ETIMEDOUT,
 * -EBUSY (the device owns the queue) or another -errno from the post. The
 * QP must be connected. Not thread-safe per endpoint (the caller holds its
 * lock); releases nothing, takes no GIL. */
int kvf_ibgda_host_write(kvf_ibgda_ep *ep, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                         uint32_t len, uint64_t timeout_ns);
void kvf_ibgda_ep_free(kvf_ibgda_ep *ep);

#endif
