/* The provider contract, C side: what the one shared submission path
 * (kvf_submit, core.c) needs of a provider's channel.
 *
 * Every provider's channel struct starts with a kvf_channel: its ops
 * table, the engine's native context and the peer's region table. A batch
 * goes through the same steps whatever the provider:
 *
 *   kvf_submit: open? -> validate + coalesce + slice (kvf_prepare, with the
 *   provider's slice size) -> alive? -> run inline (small local batches) or
 *   allocate the batch (kvf_batch_alloc, its guard held) -> [the seam] ->
 *   ops->enqueue -> release the guard
 *
 * The seam between allocation and enqueue is where a scheduler (QoS:
 * priority classes, deadlines, fair share, receiver credits) and a relay
 * (cross-rail slices to a lane of a peer rank) plug in, so that every
 * provider gets them at once. Providers keep their per-slice state in the
 * slice's provider words (kvf_slice.word), never in the shared fields. */
#ifndef KVF_PROVIDER_H
#define KVF_PROVIDER_H
#include "kvf.h"

typedef struct kvf_channel kvf_channel;

/* What a provider keeps for one poll (kvf_submit_poll): its devices. */
typedef struct {
    void *dev[16];
    int n;
} kvf_poll_state;

/* kvf_submit flags */
enum {
    KVF_SUBMIT_POLLED = 1,   /* the caller polls for this batch itself: post on its thread, wake no worker */
};

typedef struct kvf_provider_ops {
    const char *name;
    /* 0 once the channel was closed: the batch fails with KVF_ECLOSED
     * before anything is looked at. NULL: always open. */
    int (*open)(kvf_channel *ch);
    /* 0 when nothing could carry the batch (every connection down): it
     * fails with KVF_ELOST, after validation. NULL: always alive. */
    int (*alive)(kvf_channel *ch);
    /* The largest slice for a batch of `total` bytes. */
    uint64_t (*slice_size)(kvf_channel *ch, uint64_t total);
    /* Optional: runs a small batch in the caller's thread, with no batch
     * slot (the batch id stays 0): KVF_OK, or the status of slice *failed.
     * -1: not small enough (or it must wait behind queued work), allocate
     * and enqueue it. prio: the batch's class (KVF_PRIO_*). */
    int (*run_inline)(kvf_channel *ch, kvf_slice *s, size_t n, uint64_t total, int prio, size_t *failed);
    /* Takes the n slices of one allocated batch (their slot set); every
     * slice is finished exactly once (kvf_slice_done), now or later. The
     * array stays the caller's: copy what is kept. */
    void (*enqueue)(kvf_channel *ch, kvf_slice *s, size_t n, int flags);
    /* Optional, polling for a small batch on the caller's thread:
     * poll_begin readies the channel before the batch is enqueued (rdma:
     * its devices count one more poller, so posts wake no worker), poll
     * waits for batch `id` at most budget_ns and returns 1 once it
     * finished, poll_end undoes poll_begin. */
    void (*poll_begin)(kvf_channel *ch, kvf_poll_state *st);
    int (*poll)(kvf_channel *ch, kvf_poll_state *st, uint64_t id, uint64_t budget_ns);
    void (*poll_end)(kvf_channel *ch, kvf_poll_state *st);
    /* Optional: a cancelled batch still on the wire after its drain grace;
     * make sure none of its bytes lands later (tcp resets the connections
     * holding it). Returns how many were reset; NULL: slices finish or
     * fail in bounded time anyway. */
    int (*abort_batch)(kvf_channel *ch, uint64_t id);
    /* Refuses new batches and fails what is queued or in flight; nothing
     * touches registered memory once it returns. Idempotent. */
    void (*close)(kvf_channel *ch);
    /* close(), then releases the channel's memory. */
    void (*free)(kvf_channel *ch);
} kvf_provider_ops;

struct kvf_channel {
    const kvf_provider_ops *ops;
    kvf_ctx *ctx;                 /* the engine's native context */
    kvf_region_table *remote;     /* the peer's regions, as its descriptor says */
    kvf_chan_stats *stats;        /* its batches' numbers (owned by ctx: they outlive the channel) */
};

/* Sets a provider's channel base: ops, context, the peer's table, and its
 * stats block. KVF_ENOMEM when the block cannot be allocated. */
int kvf_channel_init(kvf_channel *ch, const kvf_provider_ops *ops, kvf_ctx *ctx, kvf_region_table *remote);

/* Submits one batch on any provider's channel, with its class and deadline
 * (qos; NULL: NORMAL, none). KVF_OK with *id_out the
 * batch id (0: it already completed inline); otherwise nothing was posted
 * and *bad is the first bad entry (for the validation errors). */
int kvf_submit(kvf_channel *ch, int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
               size_t n, int flags, const kvf_qos *qos, uint64_t *id_out, size_t *bad);
/* kvf_submit, then (budget_ns > 0 and the provider polls) waits on this
 * thread for the batch at most budget_ns: *finished 1 when it completed
 * here, as the loop thread's (no eventfd; the caller takes it with
 * kvf_take). */
int kvf_submit_poll(kvf_channel *ch, int op, const uint64_t *la, const uint64_t *ra, const uint64_t *len,
                    size_t n, const kvf_qos *qos, uint64_t budget_ns, uint64_t *id_out, size_t *bad,
                    int *finished);
/* The lifecycle of any provider's channel (ops->abort_batch, close, free). */
int kvf_channel_abort_batch(kvf_channel *ch, uint64_t id);
void kvf_channel_close(kvf_channel *ch);
void kvf_channel_free(kvf_channel *ch);

#endif
