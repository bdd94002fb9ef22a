/* The tcp provider, initiator side: one connection's sending and
 * receiving. What a round claims from the connection's queue (its credit
 * and the fences owed for failed connections), the sender thread, and the
 * submitter's inline send on an idle connection; the receiver thread,
 * which lands read payloads and completes what the target answered; and
 * the connection's failure, which hands what it owned to the live ones
 * (tcp_client.c says when that is sent again).
 *
 * The channel these connections belong to (placement, acks, the provider
 * ops, rebuilding) is tcp_client.c; framing and moving bytes into a socket
 * is tcp_send.c; what the three share is in tcp_int.h. */
#define _GNU_SOURCE
#include "tcp_int.h"
#include "sockio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

static void requeue(kvf_tcp_channel *ch, kvf_slice *s, size_t k, int status, const uint64_t fences[4]);
static void conn_reset(tcp_conn *c);
static void tag_free_locked(tcp_conn *c, uint32_t tag);

/* Some connection is up (computed, not cached: connections fail and are
 * rebuilt on different threads). */
int tcp_any_alive(kvf_tcp_channel *ch) {
    if (atomic_load(&ch->closing)) return 0;
    for (int i = 0; i < ch->n; i++) if (!atomic_load(&ch->conns[i].dead)) return 1;
    return 0;
}

/* Marks the connection dead. What it still owns (queued, or sent and not
 * answered) moves to the live connections after a socket error, and fails
 * with `status` otherwise (protocol error, close) or when none is left. */
void tcp_conn_fail(tcp_conn *c, int status) {
    kvf_ctx *ctx = c->ch->base.ctx;
    pthread_mutex_lock(&c->q.mu);
    if (c->dead) { pthread_mutex_unlock(&c->q.mu); return; }
    /* before dead is set and the lock dropped: kvf_tcp_channel_replace
     * (which closes this fd, and a new socket may take its number) waits
     * for dead, and tcp_conn_fail may run on a submitter's or an ack poller's
     * thread while the loop replaces the connection. The socket is
     * non-blocking: tcp_disconnect holds its lock only briefly. */
    conn_reset(c);
    c->dead = 1;
    c->fail_status = status;
    c->failures++;
    /* its credits end with it: the target takes back what the connection
     * held once it sees it close (resent slices spend credit again) */
    kvf_wallet_reset(&c->cr);
    c->ctl_n = 0;
    /* Whoever takes its work fences it at the target first, and the
     * connections it was to fence (or fenced, in frames that may be lost
     * with it). The byte its hello carried: index, epoch. */
    uint64_t fences[4];
    unsigned byte = (unsigned)(c - c->ch->conns) |
                    ((atomic_load(&c->epoch) & KVF_CONN_EPOCH_MAX) << KVF_CONN_EPOCH_SHIFT);
    for (int w = 0; w < 4; w++) {
        fences[w] = c->fence_pend[w] | c->fence_sent[w];
        c->fence_pend[w] = c->fence_sent[w] = 0;
    }
    fences[byte / 64] |= 1ull << (byte % 64);
    size_t nq = c->q.count, k = 0;
    kvf_slice *fail = malloc((nq + TCP_WINDOW) * sizeof(kvf_slice));
    if (fail) {
        k = kvf_queue_pop_locked(&c->q, fail, nq);
        for (uint32_t t = 0; t < TCP_WINDOW; t++) {
            if (c->state[t] == 1) {
                fail[k++] = c->inflight[t];
                tag_free_locked(c, t);
            }
        }
    }
    pthread_cond_broadcast(&c->q.cv);
    pthread_mutex_unlock(&c->q.mu);
    if (status == KVF_ELOST && tcp_any_alive(c->ch)) {
        c->moved += k;
        requeue(c->ch, fail, k, status, fences);
    } else {
        for (size_t i = 0; i < k; i++) kvf_slice_done(ctx, fail[i].slot, status, fail[i].entry);
        atomic_fetch_sub(&ctx->n_slices_inflight, (int64_t)k);
    }
    free(fail);
}

/* Frees an in-flight tag (under q.mu). */
static void tag_free_locked(tcp_conn *c, uint32_t tag) {
    c->state[tag] = 0;
    c->free_tags[c->nfree++] = tag;
    __atomic_store_n(&c->n_below_high, c->n_below_high - c->below_high[tag], __ATOMIC_RELAXED);
    c->below_high[tag] = 0;
}

/* Ends a connection at once, before its slices are reported: what its
 * socket still holds is dropped and a reset is sent. A shutdown would send
 * the queue first, and the queue holds payloads by page reference
 * (vmsplice): they would go out after the write was reported failed, with
 * whatever the caller has put in its buffer since (measured: 2 MiB of such
 * bytes landed on a target that had stopped reading, 8 MiB written,
 * tests/test_backpressure.py). connect(AF_UNSPEC) is tcp_disconnect(): the
 * write queue purged, RST sent, and the other threads using the socket
 * woken with an error; the shutdown after it only covers a failure of it. */
static void conn_reset(tcp_conn *c) {
    struct sockaddr sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_family = AF_UNSPEC;
    (void)connect(c->fd, &sa, sizeof(sa));
    shutdown(c->fd, SHUT_RDWR);
}

/* Hands slices of a failed connection to the least-loaded live ones, each
 * of which fences `fences` (tcp_conn_fail) before it sends them. */
static void requeue(kvf_tcp_channel *ch, kvf_slice *s, size_t k, int status, const uint64_t fences[4]) {
    kvf_ctx *ctx = ch->base.ctx;
    for (size_t i = 0; i < k; i++) {
        int placed = 0;
        if (s[i].attempts + 1 < MAX_ATTEMPTS) {
            s[i].attempts++;
            s[i].op |= KVF_OP_FLUSH;       /* its ack must not wait for slices elsewhere */
            tcp_conn *best = NULL;
            for (int j = 0; j < ch->n; j++) {
                tcp_conn *c = &ch->conns[j];
                if (!atomic_load(&c->dead) &&
                    (!best || __atomic_load_n(&c->q.bytes, __ATOMIC_RELAXED) <
                                  __atomic_load_n(&best->q.bytes, __ATOMIC_RELAXED)))
                    best = c;
            }
            if (best) {
                pthread_mutex_lock(&best->q.mu);
                placed = !best->dead && kvf_queue_push_locked(&best->q, &s[i]) == KVF_OK;
                /* under the lock its claims take slices under: no claim
                 * can take this slice without the fences */
                if (placed) for (int w = 0; w < 4; w++) best->fence_pend[w] |= fences[w];
                pthread_mutex_unlock(&best->q.mu);
                if (placed) pthread_cond_signal(&best->q.cv);
            }
        }
        if (!placed) {
            kvf_slice_done(ctx, s[i].slot, status, s[i].entry);
            atomic_fetch_sub(&ctx->n_slices_inflight, 1);
        }
    }
}

/* After a claim with credits on: the credit frame to send first, if one is
 * due (c->ctl). `blocked`: the next slice's length when it did not fit in
 * the credit held. A connection that stops for credit hands back what it
 * did not spend (so a waiter never sits on credit), and every connection
 * asks ahead for what its queue holds, up to the window. */
static void credit_ask_locked(tcp_conn *c, uint64_t blocked) {
    uint64_t window = c->ch->window;
    uint64_t goal = c->q.bytes < window ? c->q.bytes : window;
    uint64_t unit = c->ch->slice_size;
    uint64_t returned = c->cr.ret_pending;
    if (blocked) {
        returned += c->cr.credit;
        c->cr.need = blocked;
        if (goal < unit) goal = unit;
    }
    uint64_t want = kvf_wallet_want(&c->cr, goal, blocked != 0);
    kvf_wallet_asked(&c->cr, want, blocked != 0);
    if (!returned && !want && !blocked) return;
    c->ctl = (kvf_hdr){KVF_MAGIC, KVF_F_CREDIT_ASK, blocked ? KVF_ASK_BLOCKED : 0, (uint32_t)unit,
                       returned, 0, want};
    c->ctl_n = 1;
}

/* Pops up to TCP_POP slices / TCP_POP_BYTES (and, with credits, write
 * payloads up to the credit held) and gives each an in-flight tag;
 * slices of cancelled batches go to `cancelled` instead. Caller holds q.mu
 * and owns c->sending. Returns the number of slices to send; a credit
 * frame to send before them may be left in c->ctl. */
static size_t claim_locked(tcp_conn *c, kvf_slice *s, kvf_slice *cancelled, size_t *ncancel) {
    kvf_ctx *ctx = c->ch->base.ctx;
    size_t max = c->nfree < TCP_POP ? c->nfree : TCP_POP;
    size_t k = 0;
    uint64_t bytes = 0, spent = 0;
    *ncancel = 0;
    uint32_t epoch = atomic_load_explicit(&ctx->cancel_epoch, memory_order_relaxed);
    kvf_slice run[TCP_POP];
    kvf_pop_budget budget = {c->cr.credit, KVF_OP_WRITE, 0};
    int credits = c->ch->window != 0;
    int nfence = 0;
    for (int w = 0; w < 4; w++) nfence += __builtin_popcountll(c->fence_pend[w]);
    if (nfence > TCP_FENCE_MAX) max = 0;    /* this round sends fences only: they go first */
    c->claims++;
    /* one run in the scheduler's order (max <= TCP_POP, so cancelled fits too) */
    size_t got = kvf_queue_pop_fit_locked(&c->q, run, max, TCP_POP_BYTES, credits ? &budget : NULL);
    for (size_t i = 0; i < got; i++) {
        kvf_slice x = run[i];
        if (kvf_batch_cancelled(ctx, x.slot)) { cancelled[(*ncancel)++] = x; continue; }
        uint32_t tag = c->free_tags[--c->nfree];
        S_TAG(x) = tag;
        c->inflight[tag] = x;
        c->tag_claim[tag] = c->claims;
        c->state[tag] = 1;
        c->below_high[tag] = ctx->batches[x.slot].prio != KVF_PRIO_HIGH;
        __atomic_store_n(&c->n_below_high, c->n_below_high + c->below_high[tag], __ATOMIC_RELAXED);
        s[k++] = x;
        bytes += x.len;
        if ((x.op & 0xff) == KVF_OP_WRITE) spent += x.len;
    }
    if (credits) {
        c->cr.credit -= spent;
        if (got) c->cr.need = 0;
        credit_ask_locked(c, got ? 0 : budget.blocked);
    }
    if (k && epoch != c->cancel_seen) {
        /* a batch was cancelled: the target sends the acks it holds back
         * (those of the cancelled batch's slices on the wire too) now */
        c->cancel_seen = epoch;
        s[k - 1].op |= KVF_OP_FLUSH;
        c->inflight[S_TAG(s[k - 1])].op |= KVF_OP_FLUSH;
    }
    c->sent_bytes += bytes;
    return k;
}

/* Finishes the slices of cancelled batches that were popped instead of sent. */
static void finish_cancelled(kvf_ctx *ctx, const kvf_slice *cancelled, size_t ncancel) {
    for (size_t i = 0; i < ncancel; i++) {
        kvf_slice_done(ctx, cancelled[i].slot, KVF_ECANCELLED, cancelled[i].entry);
        atomic_fetch_sub(&ctx->n_slices_inflight, 1);
    }
}

/* Fences wait to be framed: they go even while slices wait for credit or
 * tags (the target may count credit as held by the connection they stop). */
static inline int fences_pending(const tcp_conn *c) {
    return (c->fence_pend[0] | c->fence_pend[1] | c->fence_pend[2] | c->fence_pend[3]) != 0;
}

/* Takes the header-only frames to send before the slices claim_locked took
 * into out (room for TCP_CTL_MAX): pending fences (up to TCP_FENCE_MAX:
 * with more, claim_locked took no slice), then the credit frame it left.
 * Returns how many. */
static int take_ctl_locked(tcp_conn *c, kvf_hdr *out) {
    int n = 0;
    for (int w = 0; w < 4; w++) {
        while (c->fence_pend[w] && n < TCP_FENCE_MAX) {
            int b = __builtin_ctzll(c->fence_pend[w]);
            c->fence_pend[w] &= c->fence_pend[w] - 1;
            c->fence_sent[w] |= 1ull << b;
            c->fences++;
            out[n++] = (kvf_hdr){KVF_MAGIC, KVF_F_FENCE, (uint8_t)(w * 64 + b), 0, 0, 0, 0};
        }
    }
    if (n) c->fence_mark = c->claims;   /* the slices of this round come after them */
    if (c->ctl_n) {
        c->ctl_n = 0;
        out[n++] = c->ctl;
    }
    return n;
}

void *tcp_tx(void *arg) {
    kvf_thread_name("kvf-tcp-tx");
    tcp_conn *c = arg;
    kvf_slice s[TCP_POP], cancelled[TCP_POP];
    kvf_hdr h[TCP_POP + TCP_CTL_MAX], ctl[TCP_CTL_MAX];
    struct iovec iov[2 * TCP_POP + TCP_CTL_MAX];
    for (;;) {
        pthread_mutex_lock(&c->q.mu);
        while (!c->dead && !c->pend_n && !c->pipe_pending && !(c->cr.ret_pending && !c->sending) &&
               !(fences_pending(c) && !c->sending) &&
               (c->q.count == 0 || c->nfree == 0 || c->sending || tcp_credit_blocked(c)))
            pthread_cond_wait(&c->q.cv, &c->q.mu);
        if (c->dead) { pthread_mutex_unlock(&c->q.mu); break; }
        c->sending = 1;
        int bad = 0;
        if (c->pend_n || c->pipe_pending) {
            /* the rest of an inline submitter's frames goes first */
            int n = c->pend_n;
            size_t in_pipe = c->pipe_pending;
            pthread_mutex_unlock(&c->q.mu);
            bad = tcp_drain_pipe(c, in_pipe, n > 0) || (n && tcp_send_frames(c, c->pend, n));
            pthread_mutex_lock(&c->q.mu);
            c->pend_n = 0;
            c->pipe_pending = 0;
            c->sending = 0;
            pthread_mutex_unlock(&c->q.mu);
            if (bad) { tcp_conn_fail(c, KVF_ELOST); break; }
            continue;
        }
        size_t ncancel;
        size_t k = claim_locked(c, s, cancelled, &ncancel);
        int nctl = take_ctl_locked(c, ctl);
        pthread_mutex_unlock(&c->q.mu);
        finish_cancelled(c->ch->base.ctx, cancelled, ncancel);
        int niov = tcp_frame_slices(ctl, nctl, s, k, h, iov);
        bad = niov ? tcp_send_frames(c, iov, niov) : 0;
        pthread_mutex_lock(&c->q.mu);
        c->sending = 0;
        pthread_mutex_unlock(&c->q.mu);
        if (bad) { tcp_conn_fail(c, KVF_ELOST); break; }
    }
    return NULL;
}

/* Takes a tag's slice (keep: rx owns it while a read payload lands, else
 * the tag is freed; epoch >= 0: only from the connection's incarnation
 * `epoch`). 1: taken; 0: no such slice (a protocol error); -1: the
 * connection failed, and what it owned has moved, or was replaced since
 * (a late answer). */
int tcp_take_tag(tcp_conn *c, uint32_t tag, kvf_slice *out, int keep, int epoch) {
    int ok = 0;
    pthread_mutex_lock(&c->q.mu);
    if (c->dead) ok = -1;
    /* an ack read on the session's ack connection names the connection's
     * epoch: checked here, under the lock replace() bumps it under, or a
     * late ack of the connection replaced could take the tag of a slice
     * the new one has just sent (reported done before it landed) */
    else if (epoch >= 0 && (unsigned)epoch != (atomic_load(&c->epoch) & KVF_CONN_EPOCH_MAX)) ok = -1;
    else if (tag < TCP_WINDOW && c->state[tag] == 1) {
        *out = c->inflight[tag];
        ok = 1;
        /* an answer to a slice framed after the last fences: the target has
         * read them, they need not be handed on if this connection fails
         * (kept, a byte could come to name a later incarnation of its
         * connection: epochs wrap) */
        if ((c->fence_sent[0] | c->fence_sent[1] | c->fence_sent[2] | c->fence_sent[3]) &&
            (int32_t)(c->tag_claim[tag] - c->fence_mark) >= 0)
            memset(c->fence_sent, 0, sizeof(c->fence_sent));
        if (keep) c->state[tag] = 2;
        else {
            if (c->nfree == 0) pthread_cond_signal(&c->q.cv);
            tag_free_locked(c, tag);
        }
    }
    pthread_mutex_unlock(&c->q.mu);
    return ok;
}

static void release_tag(tcp_conn *c, uint32_t tag) {
    pthread_mutex_lock(&c->q.mu);
    if (c->nfree == 0) pthread_cond_signal(&c->q.cv);
    tag_free_locked(c, tag);
    pthread_mutex_unlock(&c->q.mu);
}

/* A grant adds to what the connection may send; a recall hands back what
 * it has not spent (in its next credit frame). */
static void credit_frame(tcp_conn *c, const kvf_hdr *h) {
    pthread_mutex_lock(&c->q.mu);
    int wake = h->type == KVF_F_CREDIT_GRANT ? kvf_wallet_grant(&c->cr, h->addr) : kvf_wallet_recall(&c->cr);
    pthread_mutex_unlock(&c->q.mu);
    if (wake) pthread_cond_signal(&c->q.cv);
}

void *tcp_rx(void *arg) {
    kvf_thread_name("kvf-tcp-rx");
    tcp_conn *c = arg;
    kvf_ctx *ctx = c->ch->base.ctx;
    sk_reader r = {c->fd, malloc(RD_BUF), 0, 0, NULL, NULL, 0, 0, 0, 1, 0, 0};
    int status = KVF_ELOST;
    if (!r.buf) { tcp_conn_fail(c, KVF_ENOMEM); return NULL; }
    for (;;) {
        kvf_hdr h;
        if (sk_read_header(&r, &h)) break;
        if (h.magic != KVF_MAGIC) { status = KVF_EPROTO; break; }
        /* a grant or recall is a bare header between the target's
         * answers: it leaves the guess about the next payload as it was
         * (see the target's credit asks, tcp_server.c) */
        if (h.type != KVF_F_CREDIT_GRANT && h.type != KVF_F_CREDIT_RECALL) r.big = h.len >= RD_BUF / 4;
        kvf_slice s;
        if (h.type == KVF_F_CREDIT_GRANT || h.type == KVF_F_CREDIT_RECALL) {
            if (!c->ch->window || h.len) { status = KVF_EPROTO; break; }
            credit_frame(c, &h);
        } else if (h.type == KVF_F_WRITE_ACK) {
            int t = tcp_take_tag(c, h.tag, &s, 0, -1);
            if (t <= 0) { status = t < 0 ? KVF_ELOST : KVF_EPROTO; break; }
            if ((s.op & 0xff) != KVF_OP_WRITE) {
                kvf_slice_done(ctx, s.slot, KVF_EPROTO, s.entry);
                atomic_fetch_sub(&ctx->n_slices_inflight, 1);
                status = KVF_EPROTO;
                break;
            }
            kvf_slice_done(ctx, s.slot, h.status, s.entry);
            atomic_fetch_sub(&ctx->n_slices_inflight, 1);
        } else if (h.type == KVF_F_READ_RESP) {
            int t = tcp_take_tag(c, h.tag, &s, 1, -1);
            if (t <= 0) { status = t < 0 ? KVF_ELOST : KVF_EPROTO; break; }
            int st = h.status;
            /* a response whose length disagrees with the request cannot be
             * placed safely: drop the connection */
            int fatal = h.len > KVF_MAX_PAYLOAD || (s.op & 0xff) != KVF_OP_READ ||
                        (st == KVF_OK && h.len != s.len);
            if (!fatal && h.len) {
                /* a cancelled read's bytes go nowhere: the caller may already
                 * have reused or released the destination */
                void *dst = (st == KVF_OK && !kvf_batch_cancelled(ctx, s.slot))
                                ? (void *)(uintptr_t)s.local : NULL;
                if (sk_read_exact(&r, dst, h.len)) {
                    /* the connection died mid-payload: the read goes again
                     * on another connection (what landed is rewritten) */
                    release_tag(c, h.tag);
                    tcp_conn_fail(c, KVF_ELOST);
                    static const uint64_t no_fence[4] = {0};   /* a read lands nothing on the target */
                    requeue(c->ch, &s, 1, KVF_ELOST, no_fence);
                    status = KVF_ELOST;
                    break;
                }
            } else if (fatal) status = KVF_EPROTO;
            release_tag(c, h.tag);
            kvf_slice_done(ctx, s.slot, fatal ? status : st, s.entry);
            atomic_fetch_sub(&ctx->n_slices_inflight, 1);
            if (fatal) break;
        } else {
            status = KVF_EPROTO;
            break;
        }
    }
    free(r.buf);
    tcp_conn_fail(c, status);
    return NULL;
}

/* Small work on an idle connection: sent from the submitting thread
 * instead of waking the sender (saves a thread hop per batch). Never
 * blocks: what the socket (or pipe) does not take now is left to the
 * sender thread, so a stalled peer cannot stall the loop. Called with
 * c->q.mu held; returns with it released. */
void tcp_send_inline_unlock(tcp_conn *c) {
    kvf_slice mine[TCP_POP], cancelled[TCP_POP];
    kvf_hdr ctl[TCP_CTL_MAX];
    size_t ncancel;
    c->sending = 1;
    size_t m = claim_locked(c, mine, cancelled, &ncancel);
    int nctl = take_ctl_locked(c, ctl);
    pthread_mutex_unlock(&c->q.mu);
    finish_cancelled(c->ch->base.ctx, cancelled, ncancel);
    int niov = tcp_frame_slices(ctl, nctl, mine, m, c->pend_h, c->pend_iov);
    size_t in_pipe = 0;
    int left = niov ? tcp_send_frames_nb(c, c->pend_iov, niov, &in_pipe) : 0;
    pthread_mutex_lock(&c->q.mu);
    c->sending = 0;
    if (c->dead) left = left < 0 ? left : 0;   /* failed meanwhile: its slices have moved; nothing is pending */
    if (left > 0) {
        /* the last `left` iovecs (the first one partly sent) */
        c->pend = c->pend_iov + (niov - left);
        c->pend_n = left;
    }
    if (left >= 0 && !c->dead) c->pipe_pending = in_pipe;
    int more = c->q.count > 0 || c->pend_n || c->pipe_pending || c->cr.ret_pending;
    pthread_mutex_unlock(&c->q.mu);
    if (left < 0) tcp_conn_fail(c, KVF_ELOST);
    else if (more) pthread_cond_signal(&c->q.cv);
}
