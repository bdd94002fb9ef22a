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


# The rest of the module. Included rather than cimported as modules of their
# own: kvflow._verbs stays one extension, linked once against the rdma C
# files, whose static state (devices' workers, the event queue) exists once.
include "_verbs_qp.pxi"
include "_verbs_channel.pxi"
