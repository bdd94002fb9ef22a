# Included by _verbs.pyx (one module, one native image): queue pairs, the
# RC state moves that connect them, and IBGDA endpoints.

cdef _rc_init(Device dev, ibv_qp *qp):
    """RESET → INIT on the device's port, remote reads and writes allowed
    (only registered regions' keys open them)."""
    cdef ibv_qp_attr a
    memset(&a, 0, sizeof(a))
    a.qp_state = IBV_QPS_INIT
    a.pkey_index = 0
    a.port_num = <uint8_t>dev.port
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)


cdef _rc_connect(Device dev, ibv_qp *qp, uint32_t sq_psn, uint32_t qpn, uint32_t psn, bytes gid, int lid,
                 int mtu):
    """INIT → RTR → RTS toward the remote QP `qpn` (its first PSN `psn`)."""
    cdef ibv_qp_attr a
    if len(gid) != 16:
        raise ValueError("a GID is 16 bytes")
    memset(&a, 0, sizeof(a))
    a.qp_state = IBV_QPS_RTR
    a.path_mtu = <ibv_mtu>min(mtu, dev.mtu)
    a.dest_qp_num = qpn
    a.rq_psn = psn
    a.max_dest_rd_atomic = <uint8_t>dev.max_rd_atom
    a.min_rnr_timer = MIN_RNR_TIMER
    a.ah_attr.port_num = <uint8_t>dev.port
    a.ah_attr.dlid = <uint16_t>lid
    if any(gid):
        a.ah_attr.is_global = 1
        memcpy(a.ah_attr.grh.dgid.raw, <const char *>gid, 16)
        a.ah_attr.grh.sgid_index = <uint8_t>dev.gid_index
        a.ah_attr.grh.hop_limit = 64
    if ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER):
        raise VerbsError(f"{dev.name}: cannot move QP {qp.qp_num} to RTR toward QP {qpn}")
    memset(&a, 0, sizeof(a))
    a.qp_state = IBV_QPS_RTS
    a.timeout = <uint8_t>dev.ack_timeout
    a.retry_cnt = RETRY_COUNT
    a.rnr_retry = RNR_RETRY
    a.sq_psn = sq_psn
    a.max_rd_atomic = <uint8_t>dev.max_init_rd_atom
    if ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC):
        raise VerbsError(f"{dev.name}: cannot move QP {qp.qp_num} to RTS")


cdef class Qp:
    """A queue pair made by Device.create_qp, until a channel takes it over
    (then the native side owns and destroys it)."""

    @property
    def qpn(self):
        return self.qp.qp_num if self.qp != NULL else 0

    def connect(self, uint32_t qpn, uint32_t psn, bytes gid, int lid, int mtu):
        """INIT → RTR → RTS toward the remote QP `qpn`."""
        if self.qp == NULL:
            raise VerbsError(f"{self.dev.name}: queue pair destroyed, handed over, or its device closed")
        _rc_connect(self.dev, self.qp, self.psn, qpn, psn, gid, lid, mtu)

    cdef ibv_qp *take(self) except NULL:
        if self.qp == NULL or not self.dev.open:
            raise VerbsError(f"{self.dev.name}: queue pair destroyed, handed over, or its device closed")
        cdef ibv_qp *qp = self.qp
        self.qp = NULL
        self.dev.qps.discard(self)
        return qp

    def destroy(self):
        """Destroys the verbs QP (counted) unless it was handed over or
        destroyed already; its device's close() calls this first, so the
        context is still there. Idempotent."""
        self._leave_window()
        if self.qp != NULL:
            kvf_rdma_destroy_qp(self.dev.kc, self.qp)
            self.qp = NULL
        if self.dev is not None and self.dev.qps is not None:
            self.dev.qps.discard(self)

    cdef _leave_window(self):
        # before the QP goes: the window no longer sends grants on it, and
        # what it held returns to the pool
        if self.tgt != NULL:
            with nogil:
                kvf_rdma_target_free(self.tgt)
            self.tgt = NULL
        if self.reserved and self.dev is not None:
            self.dev.release(self.reserved)
            self.reserved = 0

    def __dealloc__(self):
        # not destroy(): no new weak reference to an object being freed (its
        # WeakSet entry went with it)
        if self.tgt != NULL and self.dev is not None:
            kvf_rdma_target_free(self.tgt)
            self.tgt = NULL
        if self.qp != NULL and self.dev is not None:
            kvf_rdma_destroy_qp(self.dev.kc, self.qp)
            self.qp = NULL


cdef class IbgdaQp:
    """An IBGDA endpoint (Device.create_ibgda): its QP is connected like a
    channel's, then either driven by a GPU (view() gives what the device
    needs: kvflow/gpu/ibgda.py) or written through from the host
    (host_write: what checks the connection where no mlx5 NIC is). Never
    handed to a channel; destroyed with its device at the latest."""

    @property
    def qpn(self):
        return kvf_ibgda_ep_qp(self.ep).qp_num if self.ep != NULL else 0

    cdef _check(self):
        if self.ep == NULL or not self.dev.open:
            raise VerbsError(f"{self.dev.name}: IBGDA queue pair destroyed or its device closed")

    def connect(self, uint32_t qpn, uint32_t psn, bytes gid, int lid, int mtu):
        """INIT → RTR → RTS toward the remote QP `qpn`."""
        self._check()
        _rc_connect(self.dev, kvf_ibgda_ep_qp(self.ep), self.psn, qpn, psn, gid, lid, mtu)
        self.connected = True

    def view(self):
        """The mlx5 layout a GPU drives: a dict of host addresses (sq_buf,
        dbrec, bf_reg, cq_buf, cq_dbrec) and sizes (wqe_cnt, cqe_cnt,
        bf_size, qpn, dedicated_uar). Raises VerbsError where the device is
        not mlx5. Once taken, host_write is refused: the device owns the
        queue."""
        cdef kvf_ibgda_view v
        cdef char why[256]
        self._check()
        if kvf_ibgda_ep_view(self.ep, &v, why, sizeof(why)) != KVF_OK:
            raise VerbsError(f"{self.dev.name}: {why.decode()}")
        return {"sq_buf": v.sq_buf, "dbrec": v.dbrec, "bf_reg": v.bf_reg, "cq_buf": v.cq_buf,
                "cq_dbrec": v.cq_dbrec, "wqe_cnt": v.wqe_cnt, "qpn": v.qpn, "cqe_cnt": v.cqe_cnt,
                "bf_size": v.bf_size, "dedicated_uar": bool(v.dedicated_uar)}

    def host_write(self, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t length,
                   double timeout):
        """One RDMA write from the host on this QP, waited for (GIL
        released): the ibv_wc_status (0: landed), or -errno (-ETIMEDOUT,
        -EBUSY once view() was taken). The caller serialises calls."""
        cdef int rc
        cdef uint64_t ns = <uint64_t>(max(timeout, 0.0) * 1e9)
        self._check()
        if not self.connected:
            raise VerbsError(f"{self.dev.name}: IBGDA queue pair {self.qpn} is not connected")
        with nogil:
            rc = kvf_ibgda_host_write(self.ep, laddr, lkey, raddr, rkey, length, ns)
        return rc

    def destroy(self):
        """Destroys the QP and its CQ (counted). Idempotent."""
        if self.ep != NULL:
            kvf_ibgda_ep_free(self.ep)
            self.ep = NULL
        if self.dev is not None and self.dev.qps is not None:
            self.dev.qps.discard(self)

    def __dealloc__(self):
        if self.ep != NULL and self.dev is not None:
            kvf_ibgda_ep_free(self.ep)
            self.ep = NULL
