// GPU-initiated puts without a CPU: IBGDA (InfiniBand GPUDirect Async,
// seed 001), the device side. A kernel builds an mlx5 send WQE for an RDMA
// write in the QP's send queue, updates the QP's doorbell record, and rings
// the UAR's BlueFlame register with the WQE's first 8 bytes; it polls the
// CQ's entries for the completion. No CPU thread is involved once the QP
// exists.
//
// NEVER RUN ON HARDWARE: it needs an mlx5 NIC (ConnectX-5 or later) with
// GPUDirect RDMA, the QP's buffers and doorbell record reachable from the
// GPU and the UAR page mapped into it; no machine of this project has one.
// What is tested (tests/test_ibgda.py, on the host): the WQE, doorbell and
// CQE layouts byte for byte against rdma-core's own mlx5dv.h definitions
// and helpers (mlx5dv_set_ctrl_seg, mlx5dv_set_data_seg, struct
// mlx5_cqe64), the ring/poll sequences on host memory, and the memory-region
// lookup against a linear scan. kernels.cu builds kvf_ibgda_write with it,
// so the device code compiles for sm_80/sm_90.
//
// Layouts (all big-endian on the wire, as the NIC reads them):
//   WQE for an RDMA write, 48 bytes in one 64-byte basic block (ds = 3):
//     ctrl  0: opmod_idx_opcode = (pi << 8) | 0x08     4: qpn_ds = (qpn << 8) | 3
//           8: signature  9: dci_stream_channel_id (2)  11: fm_ce_se (0x08: CQ update)  12: imm
//     raddr 16: remote address (8)  24: rkey  28: reserved
//     data  32: byte count  36: lkey  40: local address (8)
//   doorbell record: dbrec[1] (MLX5_SND_DBR) = the SQ's producer index + 1, 16 bits
//   BlueFlame: the WQE's first 8 bytes stored into the UAR register (64 bits)
//   CQE (64 bytes): 60: wqe_counter (2), 63: op_own = (opcode << 4) | owner bit
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define KVF_IB_DEV __device__ __forceinline__
#define KVF_IB_FENCE() __threadfence_system()
#else
#define KVF_IB_DEV static inline
#define KVF_IB_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

#define KVF_MLX5_OPCODE_RDMA_WRITE 0x08
#define KVF_MLX5_OPCODE_RDMA_READ 0x10
#define KVF_MLX5_WQE_CTRL_CQ_UPDATE 0x08
#define KVF_MLX5_SEND_WQE_BB 64
#define KVF_MLX5_SND_DBR 1
#define KVF_MLX5_CQE_REQ 0
#define KVF_MLX5_CQE_REQ_ERR 13
#define KVF_MLX5_CQE_INVALID 15
#define KVF_IBGDA_WRITE_DS 3            /* ctrl + raddr + data: 3 x 16 bytes */

KVF_IB_DEV uint32_t kvf_be32(uint32_t x)
{
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

KVF_IB_DEV uint64_t kvf_be64(uint64_t x)
{
    return ((uint64_t)kvf_be32((uint32_t)x) << 32) | kvf_be32((uint32_t)(x >> 32));
}

KVF_IB_DEV uint16_t kvf_be16(uint16_t x)
{
    return (uint16_t)((x >> 8) | (x << 8));
}

// One RC QP as the device drives it: what mlx5dv_init_obj (or the DEVX
// objects' creation) reports, with addresses the device can reach.
struct kvf_ibgda_qp {
    uint8_t *sq_buf;                /* wqe_cnt basic blocks of 64 bytes */
    volatile uint32_t *dbrec;       /* [0] receive, [1] send */
    volatile uint64_t *bf_reg;      /* the UAR's BlueFlame register */
    uint8_t *cq_buf;                /* cqe_cnt entries of 64 bytes */
    volatile uint32_t *cq_dbrec;    /* [0]: the consumer index */
    uint32_t wqe_cnt, qpn, cqe_cnt, pad;
    uint32_t sq_pi;                 /* producer index (the device's state) */
    uint32_t cq_ci;                 /* consumer index (the device's state) */
};

// A registered memory region, for the lookup by address: the table is
// sorted by addr, regions do not overlap.
struct kvf_mr {
    uint64_t addr, length;
    uint32_t lkey, rkey;
};

// Writes the 48 bytes of an RDMA write WQE at `wqe`: producer index pi,
// local [laddr, +len) under lkey, to raddr under rkey; signalled: a CQE
// when it completes.
KVF_IB_DEV void kvf_ibgda_write_wqe(uint8_t *wqe, uint16_t pi, uint32_t qpn, uint64_t laddr, uint32_t lkey,
                                    uint64_t raddr, uint32_t rkey, uint32_t len, int signalled)
{
    uint32_t *w = (uint32_t *)wqe;
    w[0] = kvf_be32(((uint32_t)pi << 8) | KVF_MLX5_OPCODE_RDMA_WRITE);
    w[1] = kvf_be32((qpn << 8) | KVF_IBGDA_WRITE_DS);
    w[2] = (uint32_t)(signalled ? KVF_MLX5_WQE_CTRL_CQ_UPDATE : 0) << 24;   /* signature, stream id 0; fm_ce_se */
    w[3] = 0;                                                               /* imm */
    *(uint64_t *)(wqe + 16) = kvf_be64(raddr);
    w[6] = kvf_be32(rkey);
    w[7] = 0;
    w[8] = kvf_be32(len);
    w[9] = kvf_be32(lkey);
    *(uint64_t *)(wqe + 40) = kvf_be64(laddr);
}

// Posts one RDMA write on qp (one thread; the caller serialises posts on a
// QP): the WQE into the next basic block, the doorbell record, then the
// BlueFlame register. Returns the WQE's producer index.
KVF_IB_DEV uint32_t kvf_ibgda_post_write(struct kvf_ibgda_qp *qp, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                                         uint32_t rkey, uint32_t len)
{
    uint32_t pi = qp->sq_pi;
    uint8_t *wqe = qp->sq_buf + (size_t)(pi & (qp->wqe_cnt - 1)) * KVF_MLX5_SEND_WQE_BB;
    kvf_ibgda_write_wqe(wqe, (uint16_t)pi, qp->qpn, laddr, lkey, raddr, rkey, len, 1);
    qp->sq_pi = pi + 1;
    KVF_IB_FENCE();                                  /* the WQE before the doorbell record */
    qp->dbrec[KVF_MLX5_SND_DBR] = kvf_be32((pi + 1) & 0xffff);
    KVF_IB_FENCE();                                  /* the record before the register */
    *qp->bf_reg = *(volatile uint64_t *)wqe;         /* BlueFlame: the ctrl segment's first 8 bytes */
    KVF_IB_FENCE();
    return pi;
}

// Looks at the CQ's next entry: -1 if the NIC has not written it yet; else
// its opcode (KVF_MLX5_CQE_REQ: done, KVF_MLX5_CQE_REQ_ERR: failed), with
// *wqe_counter the WQE it completes, the consumer index advanced and the
// CQ's doorbell record updated.
KVF_IB_DEV int kvf_ibgda_poll_cq(struct kvf_ibgda_qp *qp, uint16_t *wqe_counter)
{
    uint32_t ci = qp->cq_ci;
    volatile uint8_t *cqe = qp->cq_buf + (size_t)(ci & (qp->cqe_cnt - 1)) * 64;
    uint8_t op_own = cqe[63];
    int opcode = op_own >> 4;
    int owner = op_own & 1;
    if (opcode == KVF_MLX5_CQE_INVALID || owner != (int)((ci / qp->cqe_cnt) & 1))
        return -1;
    KVF_IB_FENCE();                                  /* the entry's other fields after its owner bit */
    *wqe_counter = kvf_be16(*(volatile uint16_t *)(cqe + 60));
    qp->cq_ci = ci + 1;
    qp->cq_dbrec[0] = kvf_be32((ci + 1) & 0xffffff);
    return opcode;
}

// The region holding [addr, +len): its index, or -1. O(log n) (the seed
// notes a linear scan in the engine it studied).
KVF_IB_DEV int kvf_mr_lookup(const struct kvf_mr *table, int n, uint64_t addr, uint64_t len)
{
    int lo = 0, hi = n - 1, found = -1;
    while (lo <= hi) {                               /* the last region starting at or below addr */
        int mid = lo + (hi - lo) / 2;
        if (table[mid].addr <= addr) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    if (found < 0 || addr - table[found].addr > table[found].length ||
        len > table[found].length - (addr - table[found].addr))
        return -1;
    return found;
}
