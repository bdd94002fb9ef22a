/* The tcp provider, initiator side: several connections per peer, each
 * with one sender and one receiver thread. The sockets are non-blocking
 * (splice() honours only the socket's own O_NONBLOCK, and the event loop
 * splices small batches itself); the threads wait in poll().
 *
 * Slices are queued per connection (least queued bytes first); the sender
 * pops a run of them, gives each an in-flight tag and sends headers and
 * small payloads in one sendmsg() straight from registered memory, large
 * write payloads by page reference (vmsplice + splice). Write acks come back
 * on the session's ack connection, which the event loop reads
 * (kvf_tcp_poll_acks); read responses land through the receiver thread,
 * payload straight into the destination.
 *
 * Rails: the connections may run over several address pairs (one per NIC).
 * A connection that fails with a socket error (its rail went down, a
 * timeout) hands what it still owned to the live connections: a slice is
 * sent again up to MAX_ATTEMPTS times (a write or read of the same bytes
 * to the same place is idempotent), so a dying rail costs throughput, not
 * data. The event loop rebuilds a dead connection (kvf_tcp_channel_replace).
 *
 * This file is the channel: placement over the connections, acks, the
 * provider ops, rebuilding and closing connections. One connection's
 * sending and receiving (claims, the threads, the inline send, failover)
 * are in tcp_conn.c; framing and moving bytes into a socket in tcp_send.c;
 * what the three share is in tcp_int.h. */
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

static const kvf_provider_ops tcp_ops;

#define ACK_BUF (64u << 10)


kvf_tcp_channel *kvf_tcp_channel_new(kvf_ctx *ctx, kvf_region_table *remote, const int *fds, int nfds,
                                     int ack_fd, uint64_t slice_size, int express, uint64_t window) {
    if (nfds < 1 || nfds > KVF_CONN_INDEX_MASK + 1) return NULL;   /* the index's bits (wire.h) */
    kvf_tcp_channel *ch = calloc(1, sizeof(*ch));
    if (!ch) return NULL;
    ch->window = window;
    /* every slice must fit a grant, and a few must fit the window at once */
    if (window && slice_size > window / 4) slice_size = window / 4 > 4096 ? window / 4 : 4096;
    if (kvf_channel_init(&ch->base, &tcp_ops, ctx, remote) != KVF_OK) { free(ch); return NULL; }
    pthread_mutex_init(&ch->ack_mu, NULL);
    ch->ack_fd = ack_fd;
    ch->express = express >= 0 && express < nfds && nfds > 1 ? express : -1;
    if (ack_fd >= 0) {
        ch->ack_buf = malloc(ACK_BUF);
        if (!ch->ack_buf) { free(ch); return NULL; }
        sk_nodelay(ack_fd);
        atomic_fetch_add(&ctx->n_sockets, 1);
    }
    ch->slice_size = slice_size;
    ch->conns = calloc(nfds, sizeof(tcp_conn));
    if (!ch->conns) { free(ch); return NULL; }
    ch->n = nfds;
    for (int i = 0; i < nfds; i++) {
        tcp_conn *c = &ch->conns[i];
        c->ch = ch;
        c->fd = fds[i];
        kvf_queue_init_sched(&c->q, ctx, 1, NULL);
        for (uint32_t t = 0; t < TCP_WINDOW; t++) c->free_tags[t] = TCP_WINDOW - 1 - t;
        c->nfree = TCP_WINDOW;
        c->pipe_r = c->pipe_w = -1;
        tcp_conn_open_pipe(c);
        if (c->fd < 0) {       /* its rail was down at connect: rebuilt later */
            c->dead = 1;
            c->fail_status = KVF_ELOST;
            continue;
        }
        sk_nodelay(c->fd);
        atomic_fetch_add(&ctx->n_sockets, 1);
        c->tx_started = pthread_create(&c->tx, NULL, tcp_tx, c) == 0;
        c->rx_started = pthread_create(&c->rx, NULL, tcp_rx, c) == 0;
        atomic_fetch_add(&ctx->n_threads, c->tx_started + c->rx_started);
        if (!c->tx_started || !c->rx_started) tcp_conn_fail(c, KVF_ENOMEM);
    }
    return ch;
}

int kvf_tcp_channel_alive(kvf_tcp_channel *ch) { return tcp_any_alive(ch); }

static void channel_fail(kvf_tcp_channel *ch, int status) {
    for (int i = 0; i < ch->n; i++) tcp_conn_fail(&ch->conns[i], status);
}

/* Without its ack connection the channel cannot finish writes: it fails
 * as a whole (nothing moves, nothing is rebuilt; the peer reconnects). */
static void ack_lost(kvf_tcp_channel *ch, int status) {
    atomic_store(&ch->closing, 1);
    channel_fail(ch, status);
}

/* Finishes one write ack: `aux` names the data connection whose tag it is
 * (its index, and in the top bits the epoch of its hello). */
static int ack_one(kvf_tcp_channel *ch, const kvf_hdr *h) {
    uint64_t index = h->aux & KVF_CONN_INDEX_MASK, epoch = (h->aux & 0xff) >> KVF_CONN_EPOCH_SHIFT;
    if (h->magic != KVF_MAGIC || h->type != KVF_F_WRITE_ACK || h->aux > 0xff || index >= (uint64_t)ch->n)
        return -1;
    tcp_conn *c = &ch->conns[index];
    kvf_slice s;
    /* a late ack of a connection that failed (its slices moved) or of the
     * one it replaced */
    if (epoch != (atomic_load(&c->epoch) & KVF_CONN_EPOCH_MAX)) return 0;
    int t = tcp_take_tag(c, h->tag, &s, 0, (int)epoch);
    if (t < 0) return 0;
    if (t == 0) return -1;
    int bad = (s.op & 0xff) != KVF_OP_WRITE;   /* an ack for a read's tag */
    kvf_slice_done(ch->base.ctx, s.slot, bad ? KVF_EPROTO : h->status, s.entry);
    atomic_fetch_sub(&ch->base.ctx->n_slices_inflight, 1);
    return bad ? -1 : 0;
}

static int poll_acks_locked(kvf_tcp_channel *ch);

int kvf_tcp_poll_acks(kvf_tcp_channel *ch) {
    if (ch->ack_fd < 0) return -1;
    /* another thread is reading them: it finishes what is there */
    if (pthread_mutex_trylock(&ch->ack_mu)) return 0;
    int rc = poll_acks_locked(ch);
    pthread_mutex_unlock(&ch->ack_mu);
    return rc;
}

static int poll_acks_locked(kvf_tcp_channel *ch) {
    for (;;) {
        ssize_t g = recv(ch->ack_fd, ch->ack_buf + ch->ack_len, ACK_BUF - ch->ack_len, MSG_DONTWAIT);
        if (g < 0 && errno == EINTR) continue;
        if (g < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (g <= 0) { ack_lost(ch, KVF_ELOST); return -1; }
        ch->ack_len += g;
        size_t off = 0;
        for (; off + sizeof(kvf_hdr) <= ch->ack_len; off += sizeof(kvf_hdr)) {
            kvf_hdr h;
            memcpy(&h, ch->ack_buf + off, sizeof(h));
            if (ack_one(ch, &h)) { ack_lost(ch, KVF_EPROTO); return -1; }
        }
        memmove(ch->ack_buf, ch->ack_buf + off, ch->ack_len - off);
        ch->ack_len -= off;
        if ((size_t)g < ACK_BUF / 2) return 0;   /* drained what was there */
    }
}

static int tcp_alive(kvf_channel *ch) { return tcp_any_alive((kvf_tcp_channel *)ch); }

static uint64_t tcp_slice_size(kvf_channel *ch, uint64_t total) {
    (void)total;
    return ((kvf_tcp_channel *)ch)->slice_size;
}


/* Where a batch goes: EXPRESS_NONE, spread over the connections other than
 * the express lane (every batch below HIGH, and every batch in FIFO mode:
 * the plain baseline, or no lane); the express lane's index, whole on it (a
 * HIGH batch while another connection has slices of a lower class sent and
 * not acknowledged, n_below_high: it would wait behind their bytes in the
 * kernel's buffers; queued ones it passes in the scheduler); or
 * EXPRESS_ALL, spread over every live connection, the lane included (a
 * HIGH batch on an idle channel: nothing to pass, and the lane alone
 * would carry a stream of HIGH batches at one connection's rate: 7.3-7.9
 * against 9.1 GB/s for 16 MiB batches here). The loads are read without
 * the locks: a stale one only places this batch less well. */
#define EXPRESS_NONE (-1)
#define EXPRESS_ALL (-2)
static int express_for(kvf_tcp_channel *ch, uint32_t slot) {
    kvf_ctx *ctx = ch->base.ctx;
    int x = ch->express;
    if (x < 0 || atomic_load(&ch->conns[x].dead) || atomic_load_explicit(&ctx->sched_fifo, memory_order_relaxed) ||
        ctx->batches[slot].prio != KVF_PRIO_HIGH)
        return EXPRESS_NONE;
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        if (i == x || atomic_load(&c->dead)) continue;
        if (__atomic_load_n(&c->n_below_high, __ATOMIC_RELAXED)) return x;
    }
    return EXPRESS_ALL;
}

/* Spreads one batch's slices over the live connections (least queued
 * bytes first; a HIGH batch on the express lane) and sends small work on
 * an idle connection right here. */
static void tcp_enqueue(kvf_channel *base, kvf_slice *s, size_t k, int flags) {
    (void)flags;
    kvf_tcp_channel *ch = (kvf_tcp_channel *)base;
    kvf_ctx *ctx = base->ctx;
    uint32_t slot = s[0].slot;
    /* Least-queued-bytes placement. The loads are read without the locks: a
     * stale value only makes placement slightly less even. */
    uint64_t load[64];
    int nc = ch->n < 64 ? ch->n : 64;
    int lane = express_for(ch, slot);
    int others = 0;
    for (int i = 0; i < nc; i++) {
        load[i] = atomic_load(&ch->conns[i].dead) ? UINT64_MAX
                                                   : __atomic_load_n(&ch->conns[i].q.bytes, __ATOMIC_RELAXED);
        others += i != ch->express && load[i] != UINT64_MAX;
    }
    /* the express lane carries HIGH batches only, while any other is up */
    if (ch->express >= 0 && ch->express < nc && others && lane != EXPRESS_ALL) {
        for (int i = 0; i < nc; i++)
            if ((lane >= 0) != (i == ch->express)) load[i] = UINT64_MAX;
    }
    int *dest = malloc(k * sizeof(int));
    if (!dest) {
        for (size_t i = 0; i < k; i++) kvf_slice_done(ctx, slot, KVF_ENOMEM, s[i].entry);
        return;
    }
    for (size_t i = 0; i < k; i++) {
        int best = 0;
        for (int j = 1; j < nc; j++) if (load[j] < load[best]) best = j;
        dest[i] = best;
        if (load[best] != UINT64_MAX) load[best] += s[i].len + 4096;   /* per-slice cost, so tiny slices spread too */
        s[i].slot = slot;
    }
    atomic_fetch_add(&ctx->n_slices_inflight, (int64_t)k);
    /* The last slice of this batch on each connection asks the target to
     * send its acks now; the others' acks wait for it (or for the target's
     * connection to go idle, or a full ack buffer): one ack flush and one
     * event-loop wake-up per batch and connection instead of per slice. */
    uint8_t marked[64] = {0};
    for (size_t i = k; i-- > 0;) {
        if (!marked[dest[i]]) {
            s[i].op |= KVF_OP_FLUSH;
            marked[dest[i]] = 1;
        }
    }
    for (int j = 0; j < nc; j++) {
        tcp_conn *c = &ch->conns[j];
        int any = 0;
        uint64_t bytes = 0, copied = 0;
        pthread_mutex_lock(&c->q.mu);
        for (size_t i = 0; i < k; i++) {
            if (dest[i] != j) continue;
            if (c->dead || kvf_queue_push_locked(&c->q, &s[i]) != KVF_OK) {
                dest[i] = -1;   /* fail it below, outside the lock */
                continue;
            }
            any = 1;
            bytes += s[i].len;
            /* payloads below SPLICE_MIN would be copied by this thread */
            if ((s[i].op & 0xff) == KVF_OP_WRITE && (s[i].len < SPLICE_MIN || c->pipe_w < 0))
                copied += s[i].len;
        }
        int status = c->dead ? c->fail_status : KVF_ENOMEM;
        if (any && !c->sending && !c->pend_n && !c->pipe_pending && !tcp_credit_blocked(c) &&
            copied <= TCP_INLINE_BYTES &&
            bytes <= TCP_INLINE_SPLICE_BYTES && c->q.count <= TCP_POP && c->nfree >= c->q.count) {
            tcp_send_inline_unlock(c);
        } else {
            pthread_mutex_unlock(&c->q.mu);
            if (any) pthread_cond_signal(&c->q.cv);
        }
        for (size_t i = 0; i < k; i++) {
            if (dest[i] == -1) {
                kvf_slice_done(ctx, slot, status, s[i].entry);
                atomic_fetch_sub(&ctx->n_slices_inflight, 1);
                dest[i] = -2;
            }
        }
    }
    free(dest);
}

static int tcp_abort_batch(kvf_channel *ch, uint64_t id) {
    return kvf_tcp_channel_abort_batch((kvf_tcp_channel *)ch, id);
}
static void tcp_close(kvf_channel *ch) { kvf_tcp_channel_close((kvf_tcp_channel *)ch); }
static void tcp_free(kvf_channel *ch) { kvf_tcp_channel_free((kvf_tcp_channel *)ch); }

/* The polled path (kvf_submit_poll), for a small batch its caller awaits
 * at once on an idle channel with an ack connection: the caller (the event
 * loop's thread) sent it inline (tcp_enqueue), and now waits on the ack
 * socket itself and reads the acks (kvf_tcp_poll_acks), instead of going
 * back to the loop and being woken by the same socket a round trip later.
 * A batch finished here needs no Transfer, no future and no loop wake-up.
 * Other batches the acks finish are pushed as the loop thread's; kvf_take
 * wakes the loop for them. */
static void tcp_poll_begin(kvf_channel *ch, kvf_poll_state *st) {
    (void)ch;
    st->n = 0;
}

static int tcp_poll(kvf_channel *base, kvf_poll_state *st, uint64_t id, uint64_t budget_ns) {
    (void)st;
    kvf_tcp_channel *ch = (kvf_tcp_channel *)base;
    uint64_t deadline = sk_now_ns() + budget_ns;
    for (;;) {
        if (kvf_batch_finished(base->ctx, id)) return 1;
        uint64_t now = sk_now_ns();
        if (ch->ack_fd < 0 || now >= deadline) return 0;
        /* Look, yielding the CPU, rather than sleep in ppoll(): the ack
         * is a round trip away, and a wake-up from ppoll() costs a
         * cross-CPU interrupt, tens of microseconds in a VM. The budget
         * bounds it either way (the caller's thread would wait anyway). */
        sched_yield();
        if (kvf_tcp_poll_acks(ch) < 0) return kvf_batch_finished(base->ctx, id);
    }
}

static void tcp_poll_end(kvf_channel *ch, kvf_poll_state *st) {
    (void)ch;
    (void)st;
}

static const kvf_provider_ops tcp_ops = {
    .name = "tcp",
    .alive = tcp_alive,
    .slice_size = tcp_slice_size,
    .enqueue = tcp_enqueue,
    .poll_begin = tcp_poll_begin,
    .poll = tcp_poll,
    .poll_end = tcp_poll_end,
    .abort_batch = tcp_abort_batch,
    .close = tcp_close,
    .free = tcp_free,
};

int kvf_tcp_channel_idle(kvf_tcp_channel *ch) {
    /* Read without the locks: a stale value only makes the caller poll
     * when it should not have (bounded by its budget), or not poll. */
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        if (atomic_load(&c->dead)) continue;
        if (__atomic_load_n(&c->q.count, __ATOMIC_RELAXED) || __atomic_load_n(&c->nfree, __ATOMIC_RELAXED) != TCP_WINDOW ||
            __atomic_load_n(&c->sending, __ATOMIC_RELAXED))
            return 0;
    }
    return ch->ack_fd >= 0 && tcp_any_alive(ch);
}

int kvf_tcp_channel_abort_batch(kvf_tcp_channel *ch, uint64_t id) {
    uint32_t slot = (uint32_t)id;
    int aborted = 0;
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        int holds = 0;
        pthread_mutex_lock(&c->q.mu);
        for (uint32_t t = 0; !c->dead && t < TCP_WINDOW && !holds; t++)
            holds = c->state[t] && c->inflight[t].slot == slot;
        pthread_mutex_unlock(&c->q.mu);
        if (!holds) continue;
        /* the connection is reset (conn_reset): nothing it still holds can
         * reach the target later */
        tcp_conn_fail(c, KVF_ELOST);
        aborted++;
    }
    return aborted;
}

/* Joins a dead connection's threads and closes its socket. */
static void conn_reap(kvf_tcp_channel *ch, tcp_conn *c) {
    if (c->tx_started) { pthread_join(c->tx, NULL); c->tx_started = 0; atomic_fetch_sub(&ch->base.ctx->n_threads, 1); }
    if (c->rx_started) { pthread_join(c->rx, NULL); c->rx_started = 0; atomic_fetch_sub(&ch->base.ctx->n_threads, 1); }
    if (c->fd >= 0) { close(c->fd); c->fd = -1; atomic_fetch_sub(&ch->base.ctx->n_sockets, 1); }
}

int kvf_tcp_channel_conn_dead(kvf_tcp_channel *ch, int i) {
    return i >= 0 && i < ch->n ? atomic_load(&ch->conns[i].dead) : -1;
}

int kvf_tcp_channel_check_reach(kvf_tcp_channel *ch, uint32_t grace_ms) {
    int failed = 0;
    if (atomic_load(&ch->closing)) return 0;
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        /* under q.mu: replace() swaps fd under it once the connection is
         * dead, so the fd looked at is this connection's, never a reused
         * number; a dead one's look is reset for its successor */
        pthread_mutex_lock(&c->q.mu);
        int gone = 0;
        if (atomic_load(&c->dead)) c->unheard = 0;
        else if (!sk_heard(c->fd, grace_ms, &c->unheard)) {
            gone = 1;
            c->unheard = 0;
        }
        pthread_mutex_unlock(&c->q.mu);
        if (gone) {
            tcp_conn_fail(c, KVF_ELOST);
            failed++;
        }
    }
    return failed;
}

int kvf_tcp_channel_conn_stats(kvf_tcp_channel *ch, int i, uint64_t *sent_bytes, uint64_t *moved,
                               uint64_t *failures, uint64_t *fences) {
    if (i < 0 || i >= ch->n) return -1;
    tcp_conn *c = &ch->conns[i];
    pthread_mutex_lock(&c->q.mu);
    *sent_bytes = c->sent_bytes;
    *moved = c->moved;
    *failures = c->failures;
    *fences = c->fences;
    int dead = c->dead;
    pthread_mutex_unlock(&c->q.mu);
    return dead;
}

/* Data connection i's queue: slices and bytes waiting for it, and slices
 * framed and not acknowledged yet (in-flight tags). */
int kvf_tcp_channel_conn_queue(kvf_tcp_channel *ch, int i, uint64_t out[3]) {
    if (i < 0 || i >= ch->n) return -1;
    tcp_conn *c = &ch->conns[i];
    pthread_mutex_lock(&c->q.mu);
    out[0] = c->q.count;
    out[1] = c->q.bytes;
    out[2] = TCP_WINDOW - c->nfree;
    pthread_mutex_unlock(&c->q.mu);
    return 0;
}

int kvf_tcp_channel_credit_stats(kvf_tcp_channel *ch, int i, uint64_t out[6]) {
    if (i < 0 || i >= ch->n) return -1;
    tcp_conn *c = &ch->conns[i];
    pthread_mutex_lock(&c->q.mu);
    kvf_wallet_stats(&c->cr, out);
    pthread_mutex_unlock(&c->q.mu);
    return 0;
}

int kvf_tcp_channel_replace(kvf_tcp_channel *ch, int i, int fd) {
    if (i < 0 || i >= ch->n || atomic_load(&ch->closing)) return KVF_EINVAL;
    tcp_conn *c = &ch->conns[i];
    if (!atomic_load(&c->dead)) return KVF_EINVAL;
    /* an inline submitter may still be writing to the old socket (its
     * sends do not block, and fail once it is reset): it is done with it
     * before the socket is closed and its number can be reused */
    pthread_mutex_lock(&c->q.mu);
    while (c->sending) {
        pthread_mutex_unlock(&c->q.mu);
        usleep(100);
        pthread_mutex_lock(&c->q.mu);
    }
    pthread_mutex_unlock(&c->q.mu);
    conn_reap(ch, c);
    /* a payload half-spliced when the connection died may sit in the pipe */
    tcp_conn_close_pipe(c);
    tcp_conn_open_pipe(c);
    pthread_mutex_lock(&c->q.mu);
    for (uint32_t t = 0; t < TCP_WINDOW; t++) {
        c->state[t] = 0;
        c->below_high[t] = 0;
        c->free_tags[t] = TCP_WINDOW - 1 - t;
    }
    c->nfree = TCP_WINDOW;
    __atomic_store_n(&c->n_below_high, 0, __ATOMIC_RELAXED);
    c->pend_n = 0;
    c->pipe_pending = 0;
    c->sending = 0;
    kvf_wallet_reset(&c->cr);
    c->ctl_n = 0;
    memset(c->fence_pend, 0, sizeof(c->fence_pend));
    memset(c->fence_sent, 0, sizeof(c->fence_sent));
    c->fd = fd;
    sk_nodelay(fd);
    atomic_fetch_add(&ch->base.ctx->n_sockets, 1);
    atomic_fetch_add(&c->epoch, 1);    /* the caller's hello carried the new epoch */
    c->dead = 0;
    pthread_mutex_unlock(&c->q.mu);
    c->tx_started = pthread_create(&c->tx, NULL, tcp_tx, c) == 0;
    c->rx_started = pthread_create(&c->rx, NULL, tcp_rx, c) == 0;
    atomic_fetch_add(&ch->base.ctx->n_threads, c->tx_started + c->rx_started);
    if (!c->tx_started || !c->rx_started) { tcp_conn_fail(c, KVF_ENOMEM); return KVF_ENOMEM; }
    return KVF_OK;
}

void kvf_tcp_channel_close(kvf_tcp_channel *ch) {
    if (!ch) return;
    atomic_store(&ch->closing, 1);
    channel_fail(ch, KVF_ECLOSED);
    if (ch->ack_fd >= 0) {
        close(ch->ack_fd);
        ch->ack_fd = -1;
        atomic_fetch_sub(&ch->base.ctx->n_sockets, 1);
    }
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        conn_reap(ch, c);
        tcp_conn_close_pipe(c);
        kvf_queue_detach(&c->q);
    }
}

void kvf_tcp_channel_free(kvf_tcp_channel *ch) {
    if (!ch) return;
    kvf_tcp_channel_close(ch);
    for (int i = 0; i < ch->n; i++) kvf_queue_destroy(&ch->conns[i].q);
    free(ch->conns);
    free(ch->ack_buf);
    pthread_mutex_destroy(&ch->ack_mu);
    free(ch);
}
