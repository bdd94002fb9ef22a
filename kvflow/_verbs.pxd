# libibverbs (infiniband/verbs.h): what kvflow's control path uses, and the
# native data path's face (kvflow/_native/rdma.h).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t

from kvflow._native cimport kvf_ctx, kvf_region_table
from kvflow._core cimport Channel

cdef extern from "infiniband/verbs.h" nogil:
    cdef struct ibv_device:
        pass

    cdef struct ibv_context:
        ibv_device *device

    cdef struct ibv_pd:
        pass

    cdef struct ibv_mr:
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey

    cdef struct ibv_cq:
        pass

    cdef struct ibv_srq:
        pass

    cdef struct ibv_qp:
        uint32_t qp_num

    cdef union ibv_gid:
        uint8_t raw[16]

    cdef enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096

    cdef enum ibv_event_type:
        IBV_EVENT_QP_FATAL
        IBV_EVENT_QP_REQ_ERR
        IBV_EVENT_QP_ACCESS_ERR
        IBV_EVENT_PORT_ACTIVE
        IBV_EVENT_PORT_ERR
        IBV_EVENT_DEVICE_FATAL
        IBV_EVENT_CQ_ERR

    const char *ibv_event_type_str(ibv_event_type event)

    cdef enum ibv_port_state:
        IBV_PORT_ACTIVE

    cdef enum:
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    cdef struct ibv_device_attr:
        uint64_t max_mr_size
        int max_qp
        int max_qp_wr
        int max_sge
        int max_cq
        int max_cqe
        int max_mr
        int max_qp_rd_atom
        int max_qp_init_rd_atom
        int max_srq_wr
        uint8_t phys_port_cnt

    cdef struct ibv_port_attr:
        ibv_port_state state
        ibv_mtu max_mtu
        ibv_mtu active_mtu
        int gid_tbl_len
        uint16_t lid
        uint8_t link_layer

    cdef enum ibv_access_flags:
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ

    cdef enum ibv_qp_type:
        IBV_QPT_RC

    cdef enum ibv_qp_state:
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR

    cdef enum ibv_qp_attr_mask:
        IBV_QP_STATE
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_DEST_QPN

    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    cdef struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    cdef struct ibv_qp_attr:
        ibv_qp_state qp_state
        ibv_mtu path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **list)
    const char *ibv_get_device_name(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *device_attr)
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr)
    int ibv_query_gid(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid)
    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)
    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)
    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *qp_init_attr)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask)
    int ibv_destroy_qp(ibv_qp *qp)


cdef extern from "_native/rdma.h" nogil:
    enum:
        KVF_OP_SEND
        KVF_OP_PROBE
        KVF_RDMA_EV_NOTIFY
        KVF_RDMA_EV_BROKEN
        KVF_RDMA_RECV_BYTES
        KVF_RDMA_TARGET_DEPTH
        KVF_RDMA_CREDIT_INLINE

    ctypedef struct kvf_rdma_event:
        uint32_t kind
        uint32_t dev
        uint32_t qpn
        uint32_t qp_index
        uint64_t chan
        int32_t wc_status
        uint32_t len
        uint8_t *data

    ctypedef struct kvf_rdma_dev:
        pass
    ctypedef struct kvf_rdma_chan:
        pass
    ctypedef struct kvf_rdma_events:
        pass
    ctypedef struct kvf_rdma_target:
        pass

    void kvf_rdma_count(kvf_ctx *c, int64_t mrs, int64_t qps)
    int kvf_rdma_destroy_qp(kvf_ctx *c, ibv_qp *qp)

    kvf_rdma_events *kvf_rdma_events_new()
    int kvf_rdma_events_fd(kvf_rdma_events *q)
    size_t kvf_rdma_events_take(kvf_rdma_events *q, kvf_rdma_event *out, size_t cap)
    void kvf_rdma_events_free(kvf_rdma_events *q)

    kvf_rdma_dev *kvf_rdma_dev_new(kvf_ctx *c, kvf_rdma_events *ev, ibv_context *ctx, ibv_pd *pd,
                                   uint32_t index, int cq_size, int recv_bufs, int worker_posts,
                                   uint64_t spin_ns)
    ibv_cq *kvf_rdma_dev_cq(kvf_rdma_dev *d)
    ibv_cq *kvf_rdma_dev_rcq(kvf_rdma_dev *d)
    ibv_srq *kvf_rdma_dev_srq(kvf_rdma_dev *d)
    void kvf_rdma_dev_free(kvf_rdma_dev *d)
    int kvf_rdma_async_fd(ibv_context *ctx)
    int kvf_rdma_async_event(ibv_context *ctx, int *type, uint32_t *qpn, int *port)
    const char *kvf_rdma_dev_path(ibv_context *ctx)
    int kvf_rdma_chan_drop_dev(kvf_rdma_chan *ch, kvf_rdma_dev *d)

    kvf_rdma_chan *kvf_rdma_chan_new(kvf_ctx *c, kvf_region_table *remote, uint64_t slice_size,
                                     uint64_t token)
    int kvf_rdma_chan_add_qp(kvf_rdma_chan *ch, kvf_rdma_dev *dev, uint32_t rdev, ibv_qp *qp,
                             uint32_t depth, int up)
    int kvf_rdma_chan_replace_qp(kvf_rdma_chan *ch, int index, kvf_rdma_dev *dev, ibv_qp *qp, int up)
    int kvf_rdma_chan_qp_up(kvf_rdma_chan *ch, int index)
    int kvf_rdma_chan_break_qp(kvf_rdma_chan *ch, int index)
    int kvf_rdma_post_one(kvf_rdma_chan *ch, int index, int op, uint64_t laddr, uint32_t lkey,
                          uint64_t raddr, uint32_t rkey, uint32_t len, uint64_t *id_out)
    int kvf_rdma_chan_qp_stats(kvf_rdma_chan *ch, int index, uint32_t *dev, uint32_t *rdev,
                               uint64_t *wrs, uint64_t *bytes, uint32_t *qpn)
    int kvf_rdma_chan_qp_queue(kvf_rdma_chan *ch, int index, uint64_t out[4])
    int kvf_rdma_chan_nqps(kvf_rdma_chan *ch)
    void kvf_rdma_chan_close(kvf_rdma_chan *ch)
    void kvf_rdma_chan_set_window(kvf_rdma_chan *ch, uint64_t window)
    int kvf_rdma_chan_credit_stats(kvf_rdma_chan *ch, int index, uint64_t out[6])
    int kvf_rdma_target_new(kvf_rdma_dev *d, ibv_qp *qp, kvf_rdma_target **out)
    void kvf_rdma_target_free(kvf_rdma_target *t)
    void kvf_rdma_chan_free(kvf_rdma_chan *ch)


cdef extern from "_native/rdma_ibgda.h" nogil:
    ctypedef struct kvf_ibgda_ep:
        pass

    ctypedef struct kvf_ibgda_view:
        uint64_t sq_buf
        uint64_t dbrec
        uint64_t bf_reg
        uint64_t cq_buf
        uint64_t cq_dbrec
        uint32_t wqe_cnt
        uint32_t qpn
        uint32_t cqe_cnt
        uint32_t bf_size
        uint32_t dedicated_uar

    int kvf_ibgda_ep_new(kvf_ctx *c, ibv_context *ctx, ibv_pd *pd, uint32_t depth, kvf_ibgda_ep **out,
                         char *why, size_t n)
    ibv_qp *kvf_ibgda_ep_qp(kvf_ibgda_ep *ep)
    int kvf_ibgda_supported(ibv_context *ctx)
    int kvf_ibgda_ep_view(kvf_ibgda_ep *ep, kvf_ibgda_view *out, char *why, size_t n)
    int kvf_ibgda_host_write(kvf_ibgda_ep *ep, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                             uint32_t len, uint64_t timeout_ns)
    void kvf_ibgda_ep_free(kvf_ibgda_ep *ep)


# The wrapper classes' fields (their code: _verbs.pyx and the _verbs_*.pxi it includes).


cdef class Device:                      # _verbs.pyx
    cdef ibv_context *ctx
    cdef ibv_pd *pd
    cdef kvf_rdma_dev *dev
    cdef kvf_ctx *kc               # the engine's counters (MRs, QPs); NULL once closed
    cdef ibv_gid sgid
    cdef readonly str name
    cdef readonly int index, port, gid_index, lid, mtu, link_layer
    cdef readonly int max_qp_wr, max_rd_atom, max_init_rd_atom, cq_size
    cdef readonly int ack_timeout  # RC local ACK timeout exponent: 4.096 us * 2^ack_timeout
    cdef readonly bint worker_posts  # the worker posts unpolled batches (kvf_rdma_dev_new)
    cdef readonly bytes gid
    cdef readonly str netdev
    cdef readonly str dev_path     # the uverbs node in sysfs: removed first when the device goes
    cdef object node_id            # _node_id(dev_path) at open; None: not visible here
    cdef public int qps_used
    # QPs made here and not (yet) handed to a channel: close() destroys
    # them before the PD and context they live in (a Qp object may outlive
    # its device, e.g. across an await of the connect that made it)
    cdef object qps


cdef class Qp:                          # _verbs_qp.pxi
    cdef ibv_qp *qp
    cdef kvf_rdma_target *tgt      # a target QP's place in the receive window (NULL: none)
    cdef int reserved              # CQ entries its device counts for it (a target QP with credits)
    cdef readonly Device dev
    cdef readonly uint32_t psn
    cdef readonly int depth
    cdef object __weakref__        # its device's WeakSet of QPs not handed over
    cdef ibv_qp *take(self) except NULL
    cdef _leave_window(self)


cdef class IbgdaQp:                     # _verbs_qp.pxi
    cdef kvf_ibgda_ep *ep
    cdef readonly Device dev
    cdef readonly uint32_t psn
    cdef readonly bint connected
    cdef object __weakref__
    cdef _check(self)


cdef class Events:                      # _verbs_channel.pxi
    cdef kvf_rdma_events *q


cdef class RdmaChannel(Channel):        # _verbs_channel.pxi
    cdef kvf_rdma_chan *ch
    cdef readonly uint64_t token
    cdef list devs                 # Device per QP index (keeps them alive)
    cdef list depths
    cdef public double poll_ewma_ns    # recent time to a polled completion
    cdef public uint64_t poll_max_ns   # 0: never poll on the caller's thread
    cdef uint64_t _poll_budget(self, uint64_t total)
    cdef _polled(self, uint64_t budget, uint64_t took)
