/* The rdma provider's data path: per-device workers over libibverbs.
 *
 * The control path (devices, GIDs, PDs, MRs, QP creation and the
 * RESET→INIT→RTR→RTS moves) is Cython (kvflow/_verbs.pyx); it hands the
 * objects it made to this file, which posts and polls with no Python and
 * no GIL:
 *
 *   - one worker thread per device owns that device's CQs (every QP of the
 *     engine on that device, initiator and target side, completes there:
 *     sends on one CQ, notifications received on another) and sleeps on
 *     its completion channel when idle;
 *   - the submitting thread posts directly while a QP has send-queue room
 *     (a 4 KiB write costs no thread hop); the rest waits in the QP's
 *     backlog, which the worker posts as completions free room (on a
 *     device with worker_posts the worker posts everything but polled
 *     batches);
 *   - work requests go out in chains (one ibv_post_send per chain), only
 *     every SIGNAL_EVERY-th and the last of a chain signalled; an RC send
 *     queue completes in order, so one signalled completion retires every
 *     slice posted before it;
 *   - wr_id = QP slot | QP generation | sequence: a completion is mapped to
 *     its slice with no lookup structure and no Python object, and stale
 *     completions of a QP that was reset are recognised and dropped.
 */
#ifndef KVF_RDMA_H
#define KVF_RDMA_H

#include <infiniband/verbs.h>

#include "kvf.h"

/* Ops beyond KVF_OP_WRITE/READ that only the rdma provider posts. */
enum { KVF_OP_SEND = 2, KVF_OP_PROBE = 3 };

/* Events for the event loop (kvf_rdma_events): notifications that arrived
 * over the data path, and QPs that need a new connection. */
enum { KVF_RDMA_EV_NOTIFY = 1, KVF_RDMA_EV_BROKEN = 2 };

typedef struct {
    uint32_t kind;
    uint32_t dev;          /* device index */
    uint32_t qpn;          /* NOTIFY: the target QP it arrived on */
    uint32_t qp_index;     /* BROKEN: index of the QP in its channel */
    uint64_t chan;         /* BROKEN: the channel's token */
    int32_t wc_status;     /* BROKEN: the verbs status that broke it */
    uint32_t len;          /* NOTIFY: payload length */
    uint8_t *data;         /* NOTIFY: payload (freed by kvf_rdma_events_free) */
} kvf_rdma_event;

typedef struct kvf_rdma_dev kvf_rdma_dev;
typedef struct kvf_rdma_chan kvf_rdma_chan;
typedef struct kvf_rdma_events kvf_rdma_events;

/* The engine's MR and QP counters (kvf_ctx n_mrs, n_qps): the control
 * path counts what it registers and creates; QPs are destroyed through
 * kvf_rdma_destroy_qp wherever they die (here or there), so the count
 * follows them. */
void kvf_rdma_count(kvf_ctx *c, int64_t mrs, int64_t qps);
int kvf_rdma_destroy_qp(kvf_ctx *c, struct ibv_qp *qp);

/* Events: one queue per engine, readable through an eventfd. */
kvf_rdma_events *kvf_rdma_events_new(void);
int kvf_rdma_events_fd(kvf_rdma_events *q);
size_t kvf_rdma_events_take(kvf_rdma_events *q, kvf_rdma_event *out, size_t cap);
void kvf_rdma_events_free(kvf_rdma_events *q);

/* A device: creates its completion channel, send CQ (cq_size entries),
 * receive CQ (recv_bufs + 1), a shared
 * receive queue with `recv_bufs` buffers of KVF_RDMA_RECV_BYTES for
 * notifications, and starts its worker. NULL on failure (errno set).
 *
 * worker_posts: submitting (kvf_submit) only queues the slices and the
 * worker posts them, WORKER_CHAIN at a time per QP with a poll in between
 * (polled batches, kvf_submit_poll, still post on the caller's thread). For
 * software devices (Soft-RoCE), whose ibv_post_send does the transfer
 * itself inside the system call: the submitting thread (the event loop's)
 * then runs no packet work, and a finished batch is reported while the
 * rest is still being sent. A NIC's post is a doorbell write, which the
 * submitting thread does best itself. */
#define KVF_RDMA_RECV_BYTES 4096
kvf_rdma_dev *kvf_rdma_dev_new(kvf_ctx *c, kvf_rdma_events *ev, struct ibv_context *ctx,
                               struct ibv_pd *pd, uint32_t index, int cq_size, int recv_bufs,
                               int worker_posts, uint64_t spin_ns);
struct ibv_cq *kvf_rdma_dev_cq(kvf_rdma_dev *d);     /* send completions */
struct ibv_cq *kvf_rdma_dev_rcq(kvf_rdma_dev *d);    /* receive completions */
struct ibv_srq *kvf_rdma_dev_srq(kvf_rdma_dev *d);
/* Stops the worker and frees the device's CQ, SRQ and buffers (the QPs on it
 * must be gone). */
void kvf_rdma_dev_free(kvf_rdma_dev *d);

/* Device events (port up/down, fatal errors): the context's async fd, made
 * non-blocking, for the event loop to watch; kvf_rdma_async_event takes one
 * event and acknowledges it at once (an unacknowledged event would make the
 * destruction of its QP or CQ, or the context's close, wait forever):
 * 1 with *type (enum ibv_event_type), *qpn (QP events) and *port (port
 * events) set, 0 when none is pending, -1 on error (errno). */
int kvf_rdma_async_fd(struct ibv_context *ctx);
int kvf_rdma_async_event(struct ibv_context *ctx, int *type, uint32_t *qpn, int *port);
/* The device's uverbs node in sysfs (e.g. /sys/class/infiniband_verbs/uverbs1):
 * the kernel removes it first when the device is being removed. */
const char *kvf_rdma_dev_path(struct ibv_context *ctx);

/* An initiator channel toward one peer (a kvf_channel: batches go through
 * kvf_submit; kvf_submit_poll polls the CQs of the channel's devices on the
 * calling thread until a small awaited batch finished or the budget passed,
 * so that its completion needs no thread wake-up at all; completions found
 * meanwhile are handled as the worker would). `remote` is the peer's
 * region table (with its rkeys per device); QPs are added by the control
 * path. */
kvf_rdma_chan *kvf_rdma_chan_new(kvf_ctx *c, kvf_region_table *remote, uint64_t slice_size,
                                 uint64_t token);
/* Adds a connected (RTS) QP on local device `dev` toward the peer's device
 * `rdev`, with `depth` send-queue entries; up = 0: it carries only
 * post_one() work (its probe) until kvf_rdma_chan_qp_up. Returns its index
 * or -1. */
int kvf_rdma_chan_add_qp(kvf_rdma_chan *ch, kvf_rdma_dev *dev, uint32_t rdev, struct ibv_qp *qp,
                         uint32_t depth, int up);
/* Swaps a broken QP's verbs QP for a newly connected one on `dev` (the old
 * one is destroyed); up = 1: in service at once, and what waited is posted.
 * `dev` is the QP's device, or, for a QP destroyed with its device
 * (QP_GONE), the device reopened under the same index: the QP moves to it. */
int kvf_rdma_chan_replace_qp(kvf_rdma_chan *ch, int index, kvf_rdma_dev *dev, struct ibv_qp *qp, int up);
/* A replaced QP that was not put up at once (up = 0) carries only
 * kvf_rdma_post_one work (its probe) until this puts it up and posts what
 * waited. */
int kvf_rdma_chan_qp_up(kvf_rdma_chan *ch, int index);
/* Takes a live QP out of service (error state; what it carried goes to the
 * others), e.g. after its probe timed out. No BROKEN event follows. */
int kvf_rdma_chan_break_qp(kvf_rdma_chan *ch, int index);
/* One work request with explicit keys on QP `index` (KVF_OP_SEND for a
 * notification, KVF_OP_PROBE for a reachability read); a batch of one. */
int kvf_rdma_post_one(kvf_rdma_chan *ch, int index, int op, uint64_t laddr, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, uint32_t len, uint64_t *id_out);
/* Per-QP counters: device, remote device, state, work requests and bytes
 * posted, and the verbs QP number (0 once destroyed: maps an async QP
 * event to its channel slot). */
int kvf_rdma_chan_qp_stats(kvf_rdma_chan *ch, int index, uint32_t *dev, uint32_t *rdev,
                           uint64_t *wrs, uint64_t *bytes, uint32_t *qpn);
int kvf_rdma_chan_qp_queue(kvf_rdma_chan *ch, int index, uint64_t out[4]);
int kvf_rdma_chan_nqps(kvf_rdma_chan *ch);
/* Device `d` is gone (removed or fatal): destroys the channel's QPs on it
 * at once (what they carried goes to the other devices' QPs) and leaves
 * them QP_GONE: repaired only if the device is reopened (replace_qp).
 * Returns how many there were. */
int kvf_rdma_chan_drop_dev(kvf_rdma_chan *ch, kvf_rdma_dev *d);
/* Receiver credits (rdma_credit.c). The target's window (its accept says
 * it) for this channel: write slices are then posted only against credit
 * its pool granted, and cut to a quarter of the window at most. Before the
 * channel is used. */
void kvf_rdma_chan_set_window(kvf_rdma_chan *ch, uint64_t window);
/* QP `index`'s credits: held, asked for, waits for credit, grants,
 * recalls, the slice length it waits to afford (0: none). */
int kvf_rdma_chan_credit_stats(kvf_rdma_chan *ch, int index, uint64_t out[6]);
/* A target QP (made by the control path, with at least KVF_RDMA_TARGET_DEPTH
 * send-queue entries and KVF_RDMA_CREDIT_INLINE inline bytes) joins the
 * engine's receive window as one holder: its initiator's asks arrive on it
 * and its grants leave on it. *out NULL: the engine has no window. Freed
 * (leaving the window, giving back what it held) before its QP is
 * destroyed. */
typedef struct kvf_rdma_target kvf_rdma_target;
#define KVF_RDMA_TARGET_DEPTH 8
#define KVF_RDMA_CREDIT_INLINE 64
int kvf_rdma_target_new(kvf_rdma_dev *d, struct ibv_qp *qp, kvf_rdma_target **out);
void kvf_rdma_target_free(kvf_rdma_target *t);

/* Fails everything queued or in flight (KVF_ELOST) after destroying the QPs,
 * so nothing more touches memory. Idempotent. */
void kvf_rdma_chan_close(kvf_rdma_chan *ch);
void kvf_rdma_chan_free(kvf_rdma_chan *ch);

#endif
