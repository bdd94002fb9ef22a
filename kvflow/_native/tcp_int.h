/* The tcp provider's initiator internals, shared by its files:
 *
 *   tcp_client.c  channels: placement, acks, the provider ops, rebuilding
 *                 and closing connections
 *   tcp_conn.c    one connection: claiming from its queue, the sender and
 *                 receiver threads, the inline send, failover
 *   tcp_send.c    framing slices and moving them into a socket (sendmsg
 *                 from registered memory; vmsplice + splice for large
 *                 payloads; the non-blocking form for the inline path)
 */
#ifndef KVF_TCP_INT_H
#define KVF_TCP_INT_H

#include <stdatomic.h>
#include <sys/uio.h>

#include "credit.h"
#include "kvf.h"
#include "provider.h"
#include "wire.h"

/* The slice's provider word: its in-flight tag on the connection (the ack names it). */
#define S_TAG(s) ((s).word[0])

#define TCP_WINDOW 1024      /* in-flight slices per connection (tag space) */
#define TCP_POP 64           /* slices per sendmsg */
/* Bytes a sender claims per round (at least one slice): what the scheduler
 * can no longer reorder once claimed, so a HIGH slice queued meanwhile
 * waits for at most this much of this connection's earlier work (and what
 * the kernel holds), and what is already "on the wire" when a batch is
 * cancelled. */
#define TCP_POP_BYTES (1u << 20)
/* A submitter sends at most this much itself on an idle connection: copied
 * (small payloads), and in all (large payloads are spliced: no copy). */
#define TCP_INLINE_BYTES (64u << 10)
#define TCP_INLINE_SPLICE_BYTES (1u << 20)
#define SPLICE_MIN (64u << 10)   /* write payloads from this size are spliced */
#define PIPE_BYTES (1u << 20)
#define KVF_OP_FLUSH 0x100u  /* slice flag (in op): ask the target for its acks now */
#define MAX_ATTEMPTS 3       /* sends of one slice (on any connection) before its batch fails */
/* Fence frames (KVF_F_FENCE) sent in front of one run of slices at most;
 * with more pending, a round sends fences only. Header frames in front of
 * a run: the fences and a credit ask. */
#define TCP_FENCE_MAX 16
#define TCP_CTL_MAX (TCP_FENCE_MAX + 1)

typedef struct tcp_conn {
    kvf_tcp_channel *ch;
    int fd;
    kvf_queue q;              /* q.mu also guards the in-flight table */
    kvf_slice inflight[TCP_WINDOW];
    /* 0 free; 1 posted (completable by an ack or by conn_fail); 2 owned by the
     * receiver while a read payload lands (only the receiver completes it) */
    uint8_t state[TCP_WINDOW];
    uint32_t free_tags[TCP_WINDOW];
    uint32_t nfree;
    uint8_t below_high[TCP_WINDOW];   /* the tag's slice is of a batch below HIGH */
    uint32_t n_below_high;    /* tags in use whose slice is below HIGH (a HIGH batch would wait behind
                               * their bytes in the kernel: express_for reads it without the lock) */
    _Atomic int dead;
    _Atomic unsigned epoch;   /* times it was rebuilt (acks carry it) */
    int fail_status;
    uint64_t sent_bytes;      /* payload bytes framed on this connection */
    uint64_t moved;           /* slices handed to other connections when it failed */
    uint64_t fences;          /* fence frames it sent (for failed connections whose work it took) */
    uint64_t failures;
    int unheard;              /* the last reach check found it unanswered (sk_heard; under q.mu) */
    uint32_t cancel_seen;     /* ctx->cancel_epoch at its last claim */
    kvf_credit_wallet cr;     /* receiver credits (when the channel has a window; under q.mu) */
    kvf_hdr ctl;              /* a credit ask to send before the next frames */
    int ctl_n;
    /* Failed connections of the channel (their hello byte: index and epoch,
     * a bit each) whose work moved here: a fence for each goes before the
     * next slices, so that the target applies nothing more from them once
     * it reads what was sent again (wire.h). Pending, and framed by this
     * incarnation (carried on if it fails too: its frames may not have
     * reached the target). Under q.mu. */
    uint64_t fence_pend[4], fence_sent[4];
    /* fence_sent is dropped once the target has read the last fences:
     * when a slice framed after them is answered (it reads a connection's
     * frames in order). claims counts claim rounds, tag_claim the round of
     * each in-flight tag, fence_mark the round of the last fences. */
    uint32_t claims, fence_mark;
    uint32_t tag_claim[TCP_WINDOW];
    int sending;              /* a thread is writing frames to fd (tx or an inline submitter) */
    /* What an inline submitter could not send without blocking: the tx
     * thread sends it before anything else (frames must not interleave). */
    kvf_hdr pend_h[TCP_POP + TCP_CTL_MAX];          /* + fences and a credit frame */
    struct iovec pend_iov[2 * TCP_POP + TCP_CTL_MAX];
    struct iovec *pend;
    int pend_n;
    /* A pipe for vmsplice()+splice(): large write payloads go to the socket
     * by page reference instead of being copied into it (the target's ack,
     * which completes the slice, proves the pages were read). -1: none. */
    int pipe_r, pipe_w;
    size_t pipe_cap;
    size_t pipe_pending;      /* bytes an inline submitter left in the pipe */
    pthread_t tx, rx;
    int tx_started, rx_started;
} tcp_conn;

struct kvf_tcp_channel {
    kvf_channel base;         /* ops, the context, the peer's regions (provider.h) */
    int n;
    tcp_conn *conns;
    uint64_t slice_size;
    _Atomic int closing;      /* close() or ack connection lost: fail, never move or rebuild */
    int ack_fd;               /* -1: acks come back on each data connection */
    int express;              /* the connection kept for HIGH batches; -1: none */
    uint64_t window;          /* the target's receive window: credits on (0: off) */
    char *ack_buf;            /* partial ack frames between polls */
    size_t ack_len;
    pthread_mutex_t ack_mu;   /* one reader of ack_fd at a time (the loop, or a thread polling its batches) */
};

/* Waiting for credit: the next write slice costs more than it holds. */
static inline int tcp_credit_blocked(const tcp_conn *c) { return c->cr.need && c->cr.credit < c->cr.need; }

/* tcp_conn.c */
int tcp_any_alive(kvf_tcp_channel *ch);
void tcp_conn_fail(tcp_conn *c, int status);
int tcp_take_tag(tcp_conn *c, uint32_t tag, kvf_slice *out, int keep, int epoch);
void tcp_send_inline_unlock(tcp_conn *c);
void *tcp_tx(void *arg);
void *tcp_rx(void *arg);

/* tcp_send.c */
int tcp_frame_slices(const kvf_hdr *ctl, int nctl, const kvf_slice *s, size_t k, kvf_hdr *h, struct iovec *iov);
int tcp_send_frames(tcp_conn *c, struct iovec *iov, int niov);
int tcp_send_frames_nb(tcp_conn *c, struct iovec *iov, int niov, size_t *in_pipe);
int tcp_drain_pipe(tcp_conn *c, size_t n, int more);
void tcp_conn_open_pipe(tcp_conn *c);
void tcp_conn_close_pipe(tcp_conn *c);

#endif
