# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The rdma provider's control path, in Cython over libibverbs: devices and
ports, GID choice, protection domains, memory registration on every device,
queue pairs and their RESET→INIT→RTR→RTS moves. The data path (posting,
polling, completions) is C: kvflow/_native/rdma_*.c (rdma_int.h says which file does what).

Nothing here is on the hot path except RdmaChannel._post, which hands a
batch to C with the GIL released.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset
from libc.errno cimport errno
import os
import weakref
from kvflow.errors import VerbsError

from kvflow._core cimport Core, RemoteTable, Channel

# Small awaited batches: the caller polls the CQ itself for about this many
# times the recent completion time (bounds below), instead of sleeping until
# the worker wakes the event loop: no thread hop on the latency path.
POLL_MAX_BYTES = 64 << 10
POLL_MIN_NS = 20_000
POLL_MAX_NS = 2_000_000
from kvflow._native cimport kvf_ctx, kvf_channel, kvf_channel_free, KVF_OK, KVF_ECLOSED

RECV_BYTES = KVF_RDMA_RECV_BYTES
OP_SEND = KVF_OP_SEND
OP_PROBE = KVF_OP_PROBE
EV_NOTIFY = KVF_RDMA_EV_NOTIFY
EV_BROKEN = KVF_RDMA_EV_BROKEN
EVENT_QP_FATAL = IBV_EVENT_QP_FATAL
EVENT_QP_REQ_ERR = IBV_EVENT_QP_REQ_ERR
EVENT_QP_ACCESS_ERR = IBV_EVENT_QP_ACCESS_ERR
EVENT_PORT_ACTIVE = IBV_EVENT_PORT_ACTIVE
EVENT_PORT_ERR = IBV_EVENT_PORT_ERR
EVENT_DEVICE_FATAL = IBV_EVENT_DEVICE_FATAL
EVENT_CQ_ERR = IBV_EVENT_CQ_ERR
ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ

SYSFS = "/sys/class/infiniband"
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}

# RC transport: 4.096 us * 2^14 = 67 ms ack timeout, 6 retries (a dead
# path fails a work request in about half a second); receiver-not-ready
# retries are infinite (7), so a notification waits for a receive buffer.
# Not 7 retries: Soft-RoCE reads retry_cnt 7 as infinite too (rxe_comp.c
# never counts it down), so a QP whose remote QP went with its device
# (the peer's device removed) retried for ever and its slices never moved:
# measured in the VM, a write to such a peer never finished (60 s timeout).
# The ack timeout is per device (Device(ack_timeout=), chosen by
# kvflow.providers.rdma.provider.choose_ack_timeout): this default for hardware NICs, 17
# (537 ms) for software devices (rxe, siw), whose emulated ACKs can take
# longer than 67 ms under load: measured in the Soft-RoCE VM, 4 KiB x64
# batches ran at 10-11 MB/s with 28-46 spurious retransmits per 4 s at 14,
# and at 19-20 MB/s with 5-8 at 17.
ACK_TIMEOUT = 14
# How long a device's worker spins (sched_yield) for work on the wire that
# no caller polls for, before it arms the CQ and sleeps (rdma_worker.c,
# worker_owns_work); Device(spin_ns=), from env KVFLOW_RDMA_SPIN_NS.
SPIN_NS = 200_000
RETRY_COUNT = 6
RNR_RETRY = 7
MIN_RNR_TIMER = 12
RD_ATOMIC = 16



def device_names():
    """Names of the RDMA devices this host has (empty when none)."""
    cdef int n = 0, i
    cdef ibv_device **lst = ibv_get_device_list(&n)
    out = []
    if lst == NULL:
        return out
    for i in range(n):
        out.append(ibv_get_device_name(lst[i]).decode())
    ibv_free_device_list(lst)
    return out


def _gid_type(str name, int port, int index):
    try:
        with open(f"{SYSFS}/{name}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


def _gid_netdev(str name, int port, int index):
    try:
        with open(f"{SYSFS}/{name}/ports/{port}/gid_attrs/ndevs/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


def choose_gid(str name, int port, list gids, int link_layer):
    """Picks the GID index to use: on RoCE, a RoCE v2 IPv4-mapped GID first,
    then another RoCE v2 global one; link-local (fe80::) and zero GIDs are
    skipped. On InfiniBand, index 0. Returns -1 when none is usable."""
    if link_layer != IBV_LINK_LAYER_ETHERNET:
        return 0 if gids and any(gids[0]) else -1
    best, best_rank = -1, 0
    for i, g in enumerate(gids):
        if not any(g) or g[:2] == b"\xfe\x80":
            continue
        v2 = _gid_type(name, port, i).lower() == "roce v2"
        mapped = g[:10] == bytes(10) and g[10:12] == b"\xff\xff"
        rank = (2 if v2 else 0) + (1 if mapped else 0) + 1
        if rank > best_rank:
            best, best_rank = i, rank
    return best


def _node_id(str path):
    """What identifies a uverbs node: the device it belongs to and its
    char device number ("rxe1 231:193"); None when it cannot be read."""
    try:
        with open(f"{path}/ibdev") as f:
            ibdev = f.read().strip()
        with open(f"{path}/dev") as f:
            return f"{ibdev} {f.read().strip()}"
    except OSError:
        return None


cdef class Device:
    """One opened RDMA device (port 1 unless told): context, PD, and the
    native half (CQ with completion channel, notification SRQ, worker)."""

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

    def __cinit__(self, Core core, object events, str name, int index, int port=1,
                  gid_index=None, int recv_bufs=256, int ack_timeout=ACK_TIMEOUT,
                  bint worker_posts=False, uint64_t spin_ns=SPIN_NS):
        cdef int n = 0, i
        cdef ibv_device **lst = ibv_get_device_list(&n)
        cdef ibv_device_attr da
        cdef ibv_port_attr pa
        cdef ibv_gid g
        cdef Events ev = <Events>events
        self.name = name
        self.index = index
        self.port = port
        self.qps = weakref.WeakSet()
        if not 1 <= ack_timeout <= 31:
            raise ValueError(f"{name}: ack timeout {ack_timeout} is not in 1..31")
        self.ack_timeout = ack_timeout
        if lst == NULL:
            raise VerbsError(f"{name}: cannot list RDMA devices")
        try:
            for i in range(n):
                if ibv_get_device_name(lst[i]).decode() == name:
                    self.ctx = ibv_open_device(lst[i])
                    break
        finally:
            ibv_free_device_list(lst)
        if self.ctx == NULL:
            raise VerbsError(f"{name}: no such RDMA device or cannot open it")
        memset(&da, 0, sizeof(da))
        memset(&pa, 0, sizeof(pa))
        if ibv_query_device(self.ctx, &da) or ibv_query_port(self.ctx, <uint8_t>port, &pa):
            raise VerbsError(f"{name}: cannot query the device or port {port}")
        if pa.state != IBV_PORT_ACTIVE:
            raise VerbsError(f"{name} port {port} is not active (state {pa.state})")
        self.lid = pa.lid
        self.mtu = pa.active_mtu
        self.link_layer = pa.link_layer
        self.max_qp_wr = da.max_qp_wr
        self.max_rd_atom = min(da.max_qp_rd_atom, RD_ATOMIC) or 1
        self.max_init_rd_atom = min(da.max_qp_init_rd_atom, RD_ATOMIC) or 1
        gids = []
        for i in range(min(pa.gid_tbl_len, 256)):
            if ibv_query_gid(self.ctx, <uint8_t>port, i, &g):
                break
            gids.append(bytes(g.raw[:16]))
        if gid_index is not None:
            if not 0 <= gid_index < len(gids) or not any(gids[gid_index]):
                raise VerbsError(f"{name}: GID index {gid_index} is not usable")
            self.gid_index = gid_index
        else:
            self.gid_index = choose_gid(name, port, gids, pa.link_layer)
            if self.gid_index < 0:
                raise VerbsError(f"{name}: no usable GID (no RoCE v2 address on its netdev?)")
        self.gid = gids[self.gid_index] if gids else bytes(16)
        memcpy(self.sgid.raw, <const char *>self.gid, 16)
        self.netdev = _gid_netdev(name, port, self.gid_index)
        self.dev_path = kvf_rdma_dev_path(self.ctx).decode()
        self.node_id = _node_id(self.dev_path) if self.dev_path else None
        self.pd = ibv_alloc_pd(self.ctx)
        if self.pd == NULL:
            raise VerbsError(f"{name}: cannot allocate a protection domain")
        self.cq_size = min(da.max_cqe, 32767)
        cdef kvf_ctx *kc = core._ctx()
        self.kc = kc
        cdef int cq_size = self.cq_size
        cdef int wp = worker_posts
        self.worker_posts = worker_posts
        with nogil:
            self.dev = kvf_rdma_dev_new(kc, ev.q, self.ctx, self.pd, <uint32_t>index,
                                        cq_size, recv_bufs, wp, spin_ns)
        if self.dev == NULL:
            raise VerbsError(errno, f"{name}: cannot create its completion queue or worker "
                             f"({os.strerror(errno)})")
        self.qps_used = 0

    def info(self):
        """What peers need to reach this device (goes into the descriptor)."""
        return {"name": self.name, "gid": self.gid, "lid": self.lid, "mtu": self.mtu,
                "link": self.link_layer, "port": self.port}

    @property
    def software(self):
        """A device with no parent in sysfs (Soft-RoCE, siw): no hardware NIC."""
        return not os.path.exists(f"{SYSFS}/{self.name}/device")

    def reserve(self, int depth):
        """Accounts `depth` completion-queue entries for a new QP; False when
        the CQ could overflow (a QP in error completes every posted WR)."""
        if self.qps_used + depth + 1 > self.cq_size:
            return False
        self.qps_used += depth + 1
        return True

    def release(self, int depth):
        self.qps_used -= depth + 1

    def create_qp(self, int depth, bint target=False, bint credits=False):
        """A new RC QP in INIT. Every QP receives through the device's SRQ
        (a target's: notifications and credit asks; an initiator's: credit
        grants). A target QP sends nothing but, with `credits` (the engine
        has a receive window), the grants of the window it joins as one
        holder: it gets KVF_RDMA_TARGET_DEPTH send-queue entries, counted
        against the CQ, instead of `depth`."""
        cdef ibv_qp_init_attr ia
        cdef kvf_rdma_target *tgt = NULL
        self._check_open()
        if target and credits:
            depth = KVF_RDMA_TARGET_DEPTH
            if not self.reserve(depth):
                raise VerbsError(f"{self.name}: completion queue full (too many QPs)")
        memset(&ia, 0, sizeof(ia))
        ia.send_cq = kvf_rdma_dev_cq(self.dev)
        ia.recv_cq = kvf_rdma_dev_rcq(self.dev)
        ia.srq = kvf_rdma_dev_srq(self.dev)
        ia.cap.max_send_wr = depth
        ia.cap.max_recv_wr = 0
        ia.cap.max_send_sge = 1
        ia.cap.max_recv_sge = 1
        ia.cap.max_inline_data = KVF_RDMA_CREDIT_INLINE
        ia.qp_type = IBV_QPT_RC
        ia.sq_sig_all = 0
        cdef ibv_qp *qp = ibv_create_qp(self.pd, &ia)
        if qp == NULL:
            if target and credits:
                self.release(depth)
            raise VerbsError(f"{self.name}: cannot create a queue pair (depth {depth})")
        kvf_rdma_count(self.kc, 0, 1)
        problem = None
        if _rc_init(self, qp):
            problem = "cannot move a queue pair to INIT"
        elif target and credits and kvf_rdma_target_new(self.dev, qp, &tgt) != KVF_OK:
            problem = "no memory for a target queue pair's place in the receive window"
        if problem is not None:
            kvf_rdma_destroy_qp(self.kc, qp)
            if target and credits:
                self.release(depth)
            raise VerbsError(f"{self.name}: {problem}")
        q = Qp()
        q.qp = qp
        q.dev = self
        q.depth = depth
        q.tgt = tgt
        q.reserved = depth if target and credits else 0
        q.psn = int.from_bytes(os.urandom(3), "little")
        self.qps.add(q)
        return q

    def create_ibgda(self, int depth):
        """A new IBGDA endpoint in INIT: an RC QP with `depth` send-queue
        entries (a power of two) and a CQ of its own, which no worker of
        this device posts on or polls (kvflow/_native/rdma_ibgda.h)."""
        cdef kvf_ibgda_ep *ep = NULL
        cdef char why[256]
        self._check_open()
        rc = kvf_ibgda_ep_new(self.kc, self.ctx, self.pd, depth, &ep, why, sizeof(why))
        if rc != KVF_OK:
            raise VerbsError(f"{self.name}: {why.decode()}")
        if _rc_init(self, kvf_ibgda_ep_qp(ep)):
            kvf_ibgda_ep_free(ep)
            raise VerbsError(f"{self.name}: cannot move an IBGDA queue pair to INIT")
        q = IbgdaQp()
        q.ep = ep
        q.dev = self
        q.psn = int.from_bytes(os.urandom(3), "little")
        self.qps.add(q)
        return q

    @property
    def ibgda_capable(self):
        """Whether a GPU can drive this device's QPs (mlx5 direct verbs)."""
        self._check_open()
        return bool(kvf_ibgda_supported(self.ctx))

    def register(self, uintptr_t addr, size_t length, int flags):
        """ibv_reg_mr; returns (handle, lkey, rkey)."""
        cdef ibv_mr *mr
        self._check_open()
        with nogil:
            mr = ibv_reg_mr(self.pd, <void *>addr, length, flags)
        if mr == NULL:
            raise VerbsError(errno, f"{self.name}: cannot register {length} bytes at {addr:#x} "
                                    f"({os.strerror(errno)})")
        kvf_rdma_count(self.kc, 1, 0)
        return <uintptr_t>mr, mr.lkey, mr.rkey

    def deregister(self, uintptr_t handle):
        cdef ibv_mr *mr = <ibv_mr *>handle
        cdef int rc
        if handle == 0 or self.pd == NULL:
            return                 # not registered there, or freed with its device
        with nogil:
            rc = ibv_dereg_mr(mr)
        if rc == 0:
            kvf_rdma_count(self.kc, -1, 0)

    @property
    def open(self):
        return self.dev != NULL

    @property
    def removal_known(self):
        """Whether removed() can tell (the uverbs node was visible at open)."""
        return self.node_id is not None

    def removed(self):
        """True when the device's uverbs node is gone, or is now another
        device's (a node number reused). False when that cannot be told: a
        node not visible at open (another mount or namespace) says nothing
        about the device, nor does one that exists but cannot be read."""
        if self.node_id is None:
            return False
        now = _node_id(self.dev_path)
        if now is None:
            return not os.path.exists(self.dev_path)
        return now != self.node_id

    def async_fileno(self):
        """The context's async event fd (non-blocking) for loop.add_reader."""
        self._check_open()
        fd = kvf_rdma_async_fd(self.ctx)
        if fd < 0:
            raise VerbsError(errno, f"{self.name}: cannot watch its async events")
        return fd

    def async_events(self):
        """The pending async events, each acknowledged: [(type, qpn, port)]
        ([] when none is pending). Raises VerbsError (errno) when the event
        fd is in error and nothing was read."""
        cdef int t = 0, port = 0, rc
        cdef uint32_t qpn = 0
        out = []
        while self.ctx != NULL:
            rc = kvf_rdma_async_event(self.ctx, &t, &qpn, &port)
            if rc < 0 and not out:
                e = errno
                raise VerbsError(e, f"{self.name}: reading its async events: {os.strerror(e)}")
            if rc <= 0:
                break
            out.append((t, qpn, port))
        return out

    def _check_open(self):
        if self.dev == NULL:
            raise VerbsError(f"{self.name}: device closed")

    def close(self):
        """Destroys the QPs made here that no channel took over (counted),
        then stops the worker and frees everything: children before
        parents. The QPs channels own must be gone (RdmaChannel.drop_device
        or close). Idempotent."""
        if self.qps is not None:
            for q in list(self.qps):
                q.destroy()                # Qp or IbgdaQp
            self.qps.clear()
        if self.dev != NULL:
            with nogil:
                kvf_rdma_dev_free(self.dev)
            self.dev = NULL
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL
        self.kc = NULL

    def __dealloc__(self):
        self.close()

    def __repr__(self):
        return (f"<kvflow rdma device {self.name} gid[{self.gid_index}] mtu {MTU_BYTES.get(self.mtu)} "
                f"ack timeout {self.ack_timeout} ({4.096e-6 * (1 << self.ack_timeout) * 1e3:.0f} ms)>")


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

    cdef ibv_qp *qp
    cdef kvf_rdma_target *tgt      # a target QP's place in the receive window (NULL: none)
    cdef int reserved              # CQ entries its device counts for it (a target QP with credits)
    cdef readonly Device dev
    cdef readonly uint32_t psn
    cdef readonly int depth
    cdef object __weakref__        # its device's WeakSet of QPs not handed over

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
    needs: kvflow/_cuda/ibgda.py) or written through from the host
    (host_write: what checks the connection where no mlx5 NIC is). Never
    handed to a channel; destroyed with its device at the latest."""

    cdef kvf_ibgda_ep *ep
    cdef readonly Device dev
    cdef readonly uint32_t psn
    cdef readonly bint connected
    cdef object __weakref__

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


cdef class Events:
    """Notifications that arrived over the data path and QPs that broke,
    readable through `fileno()` (an eventfd)."""

    cdef kvf_rdma_events *q

    def __cinit__(self):
        self.q = kvf_rdma_events_new()
        if self.q == NULL:
            raise MemoryError()

    def fileno(self):
        return kvf_rdma_events_fd(self.q)

    def take(self):
        """[(kind, dev, qpn, qp_index, chan_token, wc_status, data)]"""
        cdef kvf_rdma_event ev[64]
        cdef size_t n, i
        out = []
        if self.q == NULL:
            return out
        while True:
            n = kvf_rdma_events_take(self.q, ev, 64)
            for i in range(n):
                data = ev[i].data[:ev[i].len] if ev[i].data != NULL else b""
                free(ev[i].data)
                out.append((ev[i].kind, ev[i].dev, ev[i].qpn, ev[i].qp_index, ev[i].chan,
                            ev[i].wc_status, data))
            if n < 64:
                return out

    def close(self):
        if self.q != NULL:
            kvf_rdma_events_free(self.q)
            self.q = NULL

    def __dealloc__(self):
        self.close()


cdef class RdmaChannel(Channel):
    """The rdma provider toward one peer: its QPs (several per device pair)
    and the native channel that stripes slices over them."""

    cdef kvf_rdma_chan *ch
    cdef readonly uint64_t token
    cdef list devs                 # Device per QP index (keeps them alive)
    cdef list depths
    cdef public double poll_ewma_ns    # recent time to a polled completion
    cdef public uint64_t poll_max_ns   # 0: never poll on the caller's thread

    def __init__(self, Core core, RemoteTable table, str peer, uint64_t slice_size, uint64_t token):
        cdef kvf_ctx *c = core._ctx()
        self.ch = kvf_rdma_chan_new(c, &table.t, slice_size, token)
        if self.ch == NULL:
            raise MemoryError()
        self.cch = <kvf_channel *>self.ch
        self.token = token
        self.devs = []
        self.depths = []
        self.poll_ewma_ns = 100_000
        self.poll_max_ns = POLL_MAX_NS

    cdef uint64_t _poll_budget(self, uint64_t total):
        if total > POLL_MAX_BYTES or not self.poll_max_ns or self.ch == NULL:
            return 0
        return <uint64_t>min(max(3 * self.poll_ewma_ns, POLL_MIN_NS), self.poll_max_ns)

    cdef _polled(self, uint64_t budget, uint64_t took):
        # a miss counts as the whole budget, so a slow path widens it
        self.poll_ewma_ns = 0.8 * self.poll_ewma_ns + 0.2 * took

    def add_qp(self, Qp qp, int rdev, bint up=True):
        """Hands a connected QP to the native channel; returns its index.
        up=False: it carries only post_one() work (its probe) until qp_up()."""
        if self.ch == NULL:
            raise VerbsError("channel closed")
        cdef Device d = qp.dev
        cdef int depth = qp.depth
        if d.dev == NULL:
            raise VerbsError(f"{d.name}: device closed")
        cdef ibv_qp *q = qp.take()
        cdef int index = kvf_rdma_chan_add_qp(self.ch, d.dev, <uint32_t>rdev, q, <uint32_t>depth, up)
        if index < 0:
            kvf_rdma_destroy_qp(d.kc, q)
            raise VerbsError(f"{self.peer}: too many queue pairs")
        self.devs.append(d)
        self.depths.append(depth)
        return index

    def replace_qp(self, int index, Qp qp, bint up=True):
        """Puts a newly connected QP in place of broken QP `index`; with
        up=False it carries only post_one() work (its probe) until qp_up().
        A QP destroyed with its device (QP_GONE) takes a QP of the device
        reopened under the same index (another Device object): the slot
        moves to it, with its share of that device's completion queue."""
        if self.ch == NULL:
            raise VerbsError("channel closed")
        cdef Device d = qp.dev
        cdef Device old = self.qp_device(index)
        cdef int depth = self.depths[index]
        cdef int rc
        moved = d is not old
        if moved and not d.reserve(depth):
            return False               # `qp` stays the caller's to destroy
        cdef ibv_qp *q = qp.take()
        with self.use_lock:            # leaving QP_GONE: never at once with close() or drop_device()
            rc = KVF_ECLOSED
            if self.ch != NULL:
                rc = kvf_rdma_chan_replace_qp(self.ch, index, d.dev, q, up)
        if rc != KVF_OK:
            kvf_rdma_destroy_qp(d.kc, q)
            if moved:
                d.release(depth)
            return False
        if moved:
            self.devs[index] = d       # the closed one's share went with it
        return True

    def qp_up(self, int index):
        """Puts probed QP `index` in service; what waited is posted."""
        return self.ch != NULL and kvf_rdma_chan_qp_up(self.ch, index) == KVF_OK

    def break_qp(self, int index):
        """Takes live QP `index` out of service (its work moves to the others)."""
        cdef int rc = -1
        if self.ch != NULL:
            with nogil:
                rc = kvf_rdma_chan_break_qp(self.ch, index)
        return rc == KVF_OK

    def drop_device(self, Device d):
        """Destroys the QPs on device `d` (it is gone): their work moves to
        the other devices' QPs; they are never repaired. Returns how many."""
        cdef int n = 0
        with self.use_lock:                # never at once with close(): see kvf_rdma_chan_close
            if self.ch != NULL and d.dev != NULL:
                with nogil:
                    n = kvf_rdma_chan_drop_dev(self.ch, d.dev)
        return n

    def qp_device(self, int index):
        """The Device of QP `index`. VerbsError once the channel is closed
        (its lists are emptied then; this module does no bounds checks)."""
        if index < 0 or index >= len(self.devs):
            raise VerbsError(f"{self.peer}: no QP {index} (channel closed?)")
        return self.devs[index]

    def post_one(self, int index, int op, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                 uint32_t rkey, uint32_t length):
        """One work request with explicit keys (notify SEND, probe READ);
        returns (status, batch_id)."""
        cdef uint64_t bid = 0
        cdef int rc
        if self.ch == NULL:
            return KVF_ECLOSED, 0
        with nogil:
            rc = kvf_rdma_post_one(self.ch, index, op, laddr, lkey, raddr, rkey, length, &bid)
        return rc, bid

    def qp_stats(self):
        """Per QP: device index, remote device index, state, work requests
        and bytes posted, its verbs QP number (0 once destroyed), and its
        queue under the names tcp connections use: work requests posted and
        not retired (inflight_slices) and their bytes (inflight_bytes),
        slices and bytes waiting to be posted (queued_slices, queued_bytes).
        (Channel.stats() is the batch numbers every channel has.)"""
        cdef uint32_t dev, rdev, qpn
        cdef uint64_t wrs, nbytes
        cdef uint64_t q[4]
        cdef int i, st
        out = []
        if self.ch == NULL:
            return out
        for i in range(kvf_rdma_chan_nqps(self.ch)):
            st = kvf_rdma_chan_qp_stats(self.ch, i, &dev, &rdev, &wrs, &nbytes, &qpn)
            q[0] = q[1] = q[2] = q[3] = 0
            kvf_rdma_chan_qp_queue(self.ch, i, q)
            out.append({"dev": dev, "rdev": rdev, "state": st, "wrs": wrs, "bytes": nbytes, "qpn": qpn,
                        "inflight_slices": q[0], "inflight_bytes": q[1], "queued_slices": q[2],
                        "queued_bytes": q[3]})
        return out

    def set_window(self, uint64_t window):
        """The target's receive window (its accept says it; 0: none):
        write slices then go only against credit it granted, each at most a
        quarter of the window. Before the channel is used."""
        if self.ch != NULL and window:
            kvf_rdma_chan_set_window(self.ch, window)

    def credit_stats(self):
        """Per QP, its receiver credits (when the target has a receive
        window): credit held, asked for, waits for credit, grants, recalls,
        and the slice length it waits to afford (0: none)."""
        cdef uint64_t v[6]
        cdef int i
        out = []
        if self.ch == NULL:
            return out
        for i in range(kvf_rdma_chan_nqps(self.ch)):
            if kvf_rdma_chan_credit_stats(self.ch, i, v) == 0:
                out.append({"credit": v[0], "asked": v[1], "waits": v[2], "grants": v[3],
                            "recalls": v[4], "need": v[5]})
        return out

    @property
    def alive(self):
        return self.ch != NULL

    def close(self):
        """Destroys the QPs (nothing touches memory after this returns) and
        fails what was queued or in flight. Idempotent."""
        with self.use_lock:
            self._quiesce()
            if self.ch != NULL:
                self.cch = NULL
                with nogil:
                    kvf_channel_free(<kvf_channel *>self.ch)
                self.ch = NULL
                for d, depth in zip(self.devs, self.depths):
                    (<Device>d).release(depth)
                self.devs = []
                self.depths = []

    def __dealloc__(self):
        if self.ch != NULL:
            self.cch = NULL
            kvf_channel_free(<kvf_channel *>self.ch)
            self.ch = NULL



def event_name(int event_type):
    """ibv_event_type_str: e.g. "port error", "local catastrophic error"."""
    return ibv_event_type_str(<ibv_event_type>event_type).decode()
