/* The tcp provider: several connections per peer, each with one sender and
 * one receiver thread; a server thread per accepted data connection.
 *
 * Initiator: slices are queued per connection (least queued bytes first); the
 * sender pops a run of them, gives each an in-flight tag and sends headers
 * and payloads in one sendmsg() straight from registered memory. The receiver
 * reads acks and read responses (payload straight into the destination) and
 * finishes slices by tag.
 *
 * Target: after the session token of an authenticated handshake, each WRITE
 * is checked against the local region table (whole range inside one region
 * with WRITE access) before its payload is received straight into place;
 * acks are coalesced and flushed whenever the receiver would block. */
#define _GNU_SOURCE
#include "kvf.h"
#include "wire.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#define TCP_WINDOW 1024      /* in-flight slices per connection (tag space) */
#define TCP_POP 64           /* slices per sendmsg */
/* Bytes per sendmsg: bounds what is already "on the wire" when a batch is
 * cancelled (its queued slices are dropped, these are not). */
#define TCP_POP_BYTES (4u << 20)
#define RD_BUF (256u << 10)
/* A submitter sends at most this much itself on an idle connection. */
#define TCP_INLINE_BYTES (64u << 10)
#define ACK_BATCH 256
#define FRAME_TIMEOUT_S 10
#define SPLICE_MIN (64u << 10)   /* write payloads from this size are spliced */
#define PIPE_BYTES (1u << 20)
#define KVF_OP_FLUSH 0x100u  /* slice flag (in op): ask the target for its acks now */

/* ------------------------------------------------------------ io helpers */

static int send_iov(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = n > IOV_MAX ? IOV_MAX : n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) { w -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + w; iov->iov_len -= w; }
    }
    return 0;
}

/* send_iov with MSG_MORE: more bytes of the same frame follow at once. */
static int send_iov_more(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = n > IOV_MAX ? IOV_MAX : n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_MORE);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) { w -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + w; iov->iov_len -= w; }
    }
    return 0;
}

/* Sends what the socket takes now. Returns the number of iovecs still
 * (partly) unsent, iov advanced past what went out; -1 on error. */
static int send_iov_nb(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = n > IOV_MAX ? IOV_MAX : n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return n;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) { w -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + w; iov->iov_len -= w; }
    }
    return 0;
}

static int send_all(int fd, const void *p, size_t n) {
    struct iovec v = {(void *)p, n};
    return send_iov(fd, &v, 1);
}

typedef void (*flush_fn)(void *);

/* A buffered reader: small frames come out of one big recv(); large payloads
 * are received straight into their destination. Before any recv() that may
 * block, `flush` runs (the server sends its pending acks then). */
typedef struct {
    int fd;
    char *buf;
    size_t pos, end;
    flush_fn flush;
    void *arg;
    int big;       /* the last payload was large: the next one likely is too */
    int idle_poll; /* wait for a frame with poll(): SO_RCVTIMEO then bounds a frame */
} reader;

static ssize_t rd_recv(reader *r, void *dst, size_t n, int flags) {
    for (;;) {
        ssize_t g = recv(r->fd, dst, n, flags);
        if (g < 0 && errno == EINTR) continue;
        return g;
    }
}

static int rd_fill(reader *r) {
    if (r->pos == r->end) r->pos = r->end = 0;
    else if (r->pos > RD_BUF / 2) {
        memmove(r->buf, r->buf + r->pos, r->end - r->pos);
        r->end -= r->pos;
        r->pos = 0;
    }
    ssize_t g = rd_recv(r, r->buf + r->end, RD_BUF - r->end, 0);
    if (g <= 0) return -1;
    r->end += g;
    return 0;
}

/* Reads exactly n bytes into dst (dst NULL: discard them). */
static int rd_exact(reader *r, void *dst, size_t n) {
    char *d = dst;
    while (n > 0) {
        size_t avail = r->end - r->pos;
        if (avail) {
            size_t k = avail < n ? avail : n;
            if (d) { memcpy(d, r->buf + r->pos, k); d += k; }
            r->pos += k;
            n -= k;
            continue;
        }
        if (d && n >= RD_BUF / 4) {
            /* large remainder: straight into place, no copy */
            ssize_t g = rd_recv(r, d, n, MSG_WAITALL);
            if (g <= 0) return -1;
            d += g;
            n -= g;
            continue;
        }
        if (rd_fill(r)) return -1;
    }
    return 0;
}

/* Reads a frame header. After a large payload, an empty buffer is refilled
 * with exactly one header: filling it would pull the next payload's first
 * quarter-megabyte through the staging buffer (one extra copy). */
static int rd_header(reader *r, kvf_hdr *h) {
    if (r->pos == r->end && (r->big || r->idle_poll)) {
        /* After a large payload, read exactly one header: filling the
         * buffer would pull the next payload's first quarter-megabyte
         * through it (one extra copy). On the server, first try without
         * blocking: a peer that is silent between frames is idle (flush the
         * acks it may be waiting for, then wait as long as it likes), one
         * that stops inside a frame is dropped by the receive timeout,
         * because the server holds the region table's read lock while a
         * payload lands. */
        char *dst = r->big ? (char *)h : r->buf;
        size_t want = r->big ? sizeof(*h) : RD_BUF;
        ssize_t g = r->idle_poll ? rd_recv(r, dst, want, MSG_DONTWAIT) : -1;
        if (g < 0 && r->idle_poll && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        if (g < 0) {
            if (r->flush) r->flush(r->arg);
            if (r->idle_poll) {
                struct pollfd p = {r->fd, POLLIN, 0};
                while (poll(&p, 1, -1) < 0 && errno == EINTR) {}
            }
            g = 0;
        } else if (g == 0) {
            return -1;   /* orderly close */
        }
        if (!r->big) {
            r->pos = 0;
            r->end = (size_t)g;
            return rd_exact(r, h, sizeof(*h));
        }
        if ((size_t)g < sizeof(*h)) {
            ssize_t k = rd_recv(r, (char *)h + g, sizeof(*h) - g, MSG_WAITALL);
            if (k != (ssize_t)(sizeof(*h) - g)) return -1;
        }
        return 0;
    }
    return rd_exact(r, h, sizeof(*h));
}

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* ------------------------------------------------------------- initiator */

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
    int dead;
    int fail_status;
    int sending;              /* a thread is writing frames to fd (tx or an inline submitter) */
    /* What an inline submitter could not send without blocking: the tx
     * thread sends it before anything else (frames must not interleave). */
    kvf_hdr pend_h[TCP_POP];
    struct iovec pend_iov[2 * TCP_POP];
    struct iovec *pend;
    int pend_n;
    /* A pipe for vmsplice()+splice(): large write payloads go to the socket
     * by page reference instead of being copied into it (the target's ack,
     * which completes the slice, proves the pages were read). -1: none. */
    int pipe_r, pipe_w;
    size_t pipe_cap;
    pthread_t tx, rx;
    int tx_started, rx_started;
} tcp_conn;

struct kvf_tcp_channel {
    kvf_ctx *ctx;
    int n;
    tcp_conn *conns;
    uint64_t slice_size;
    _Atomic int alive;
    int ack_fd;               /* -1: acks come back on each data connection */
    char *ack_buf;            /* partial ack frames between polls */
    size_t ack_len;
};

/* Marks the connection dead and fails every slice it still owns. */
static void conn_fail(tcp_conn *c, int status) {
    kvf_ctx *ctx = c->ch->ctx;
    pthread_mutex_lock(&c->q.mu);
    if (c->dead) { pthread_mutex_unlock(&c->q.mu); return; }
    c->dead = 1;
    c->fail_status = status;
    atomic_store(&c->ch->alive, 0);
    size_t nq = c->q.count, k = 0;
    kvf_slice *fail = malloc((nq + TCP_WINDOW) * sizeof(kvf_slice));
    if (fail) {
        k = kvf_queue_pop_locked(&c->q, fail, nq);
        for (uint32_t t = 0; t < TCP_WINDOW; t++) {
            if (c->state[t] == 1) {
                fail[k++] = c->inflight[t];
                c->state[t] = 0;
                c->free_tags[c->nfree++] = t;
            }
        }
    }
    pthread_cond_broadcast(&c->q.cv);
    pthread_mutex_unlock(&c->q.mu);
    shutdown(c->fd, SHUT_RDWR);   /* wakes the other thread out of send/recv */
    for (size_t i = 0; i < k; i++) kvf_slice_done(ctx, fail[i].slot, status, fail[i].entry);
    atomic_fetch_sub(&ctx->n_slices_inflight, (int64_t)k);
    free(fail);
}

/* Pops up to TCP_POP slices / TCP_POP_BYTES and gives each an in-flight tag;
 * slices of cancelled batches go to `cancelled` instead. Caller holds q.mu
 * and owns c->sending. Returns the number of slices to send. */
static size_t claim_locked(tcp_conn *c, kvf_slice *s, kvf_slice *cancelled, size_t *ncancel) {
    kvf_ctx *ctx = c->ch->ctx;
    size_t max = c->nfree < TCP_POP ? c->nfree : TCP_POP;
    size_t k = 0;
    uint64_t bytes = 0;
    *ncancel = 0;
    while (k < max && c->q.count && bytes < TCP_POP_BYTES) {
        kvf_slice x;
        kvf_queue_pop_locked(&c->q, &x, 1);
        if (kvf_batch_cancelled(ctx, x.slot)) { cancelled[(*ncancel)++] = x; continue; }
        uint32_t tag = c->free_tags[--c->nfree];
        x.tag = tag;
        c->inflight[tag] = x;
        c->state[tag] = 1;
        s[k++] = x;
        bytes += x.len;
    }
    return k;
}

/* Finishes the slices of cancelled batches that were popped instead of sent. */
static void finish_cancelled(kvf_ctx *ctx, const kvf_slice *cancelled, size_t ncancel) {
    for (size_t i = 0; i < ncancel; i++) {
        kvf_slice_done(ctx, cancelled[i].slot, KVF_ECANCELLED, cancelled[i].entry);
        atomic_fetch_sub(&ctx->n_slices_inflight, 1);
    }
}

/* Frames claimed slices: one header each, and for writes the payload
 * straight from registered memory. Returns the iovec count. */
static int frame_slices(const kvf_slice *s, size_t k, kvf_hdr *h, struct iovec *iov) {
    int niov = 0;
    for (size_t i = 0; i < k; i++) {
        int w = (s[i].op & 0xff) == KVF_OP_WRITE;
        h[i] = (kvf_hdr){KVF_MAGIC, w ? KVF_F_WRITE : KVF_F_READ_REQ,
                         (s[i].op & KVF_OP_FLUSH) ? KVF_HDR_FLUSH : 0, s[i].tag,
                         s[i].remote, s[i].len, 0};
        iov[niov++] = (struct iovec){&h[i], sizeof(kvf_hdr)};
        if (w) iov[niov++] = (struct iovec){(void *)(uintptr_t)s[i].local, s[i].len};
    }
    return niov;
}

/* Moves len bytes at p into the socket by page reference. */
static int splice_payload(tcp_conn *c, const char *p, size_t len, int more) {
    while (len > 0) {
        struct iovec v = {(void *)p, len < c->pipe_cap ? len : c->pipe_cap};
        ssize_t k = vmsplice(c->pipe_w, &v, 1, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        len -= k;
        for (ssize_t done = 0; done < k;) {
            ssize_t m = splice(c->pipe_r, NULL, c->fd, NULL, k - done,
                               SPLICE_F_MOVE | ((more || len) ? SPLICE_F_MORE : 0));
            if (m < 0 && errno == EINTR) continue;
            if (m <= 0) return -1;
            done += m;
        }
    }
    return 0;
}

/* Sends framed slices (blocking): runs of headers and small payloads in one
 * sendmsg each, large write payloads spliced. */
static int send_frames(tcp_conn *c, struct iovec *iov, int niov) {
    if (c->pipe_w < 0) return niov ? send_iov(c->fd, iov, niov) : 0;
    int start = 0;
    for (int i = 0; i < niov; i++) {
        if (iov[i].iov_len < SPLICE_MIN || i == 0 || iov[i - 1].iov_len != sizeof(kvf_hdr))
            continue;
        /* iov[i] is a large payload: its header and everything before it
         * go first (MSG_MORE: the payload follows at once) */
        if (send_iov_more(c->fd, iov + start, i - start)) return -1;
        if (splice_payload(c, iov[i].iov_base, iov[i].iov_len, i + 1 < niov)) return -1;
        start = i + 1;
    }
    return start < niov ? send_iov(c->fd, iov + start, niov - start) : 0;
}

static void *tcp_tx(void *arg) {
    tcp_conn *c = arg;
    kvf_slice s[TCP_POP], cancelled[TCP_POP];
    kvf_hdr h[TCP_POP];
    struct iovec iov[2 * TCP_POP];
    for (;;) {
        pthread_mutex_lock(&c->q.mu);
        while (!c->dead && !c->pend_n && (c->q.count == 0 || c->nfree == 0 || c->sending))
            pthread_cond_wait(&c->q.cv, &c->q.mu);
        if (c->dead) { pthread_mutex_unlock(&c->q.mu); break; }
        c->sending = 1;
        int bad = 0;
        if (c->pend_n) {
            /* the rest of an inline submitter's frames goes first */
            int n = c->pend_n;
            pthread_mutex_unlock(&c->q.mu);
            bad = send_iov(c->fd, c->pend, n);
            pthread_mutex_lock(&c->q.mu);
            c->pend_n = 0;
            c->sending = 0;
            pthread_mutex_unlock(&c->q.mu);
            if (bad) { conn_fail(c, KVF_ELOST); break; }
            continue;
        }
        size_t ncancel;
        size_t k = claim_locked(c, s, cancelled, &ncancel);
        pthread_mutex_unlock(&c->q.mu);
        finish_cancelled(c->ch->ctx, cancelled, ncancel);
        int niov = frame_slices(s, k, h, iov);
        bad = send_frames(c, iov, niov);
        pthread_mutex_lock(&c->q.mu);
        c->sending = 0;
        pthread_mutex_unlock(&c->q.mu);
        if (bad) { conn_fail(c, KVF_ELOST); break; }
    }
    return NULL;
}

/* Takes a tag's slice; want_state 1 frees the tag, 2 keeps it owned by rx. */
static int take_tag(tcp_conn *c, uint32_t tag, kvf_slice *out, int keep) {
    int ok = 0;
    pthread_mutex_lock(&c->q.mu);
    if (tag < TCP_WINDOW && c->state[tag] == 1) {
        *out = c->inflight[tag];
        ok = 1;
        if (keep) c->state[tag] = 2;
        else {
            c->state[tag] = 0;
            if (c->nfree++ == 0) pthread_cond_signal(&c->q.cv);
            c->free_tags[c->nfree - 1] = tag;
        }
    }
    pthread_mutex_unlock(&c->q.mu);
    return ok;
}

static void release_tag(tcp_conn *c, uint32_t tag) {
    pthread_mutex_lock(&c->q.mu);
    c->state[tag] = 0;
    if (c->nfree++ == 0) pthread_cond_signal(&c->q.cv);
    c->free_tags[c->nfree - 1] = tag;
    pthread_mutex_unlock(&c->q.mu);
}

static void *tcp_rx(void *arg) {
    tcp_conn *c = arg;
    kvf_ctx *ctx = c->ch->ctx;
    reader r = {c->fd, malloc(RD_BUF), 0, 0, NULL, NULL, 0, 0};
    int status = KVF_ELOST;
    if (!r.buf) { conn_fail(c, KVF_ENOMEM); return NULL; }
    for (;;) {
        kvf_hdr h;
        if (rd_header(&r, &h)) break;
        if (h.magic != KVF_MAGIC) { status = KVF_EPROTO; break; }
        r.big = h.len >= RD_BUF / 4;
        kvf_slice s;
        if (h.type == KVF_F_WRITE_ACK) {
            if (!take_tag(c, h.tag, &s, 0)) { status = KVF_EPROTO; break; }
            kvf_slice_done(ctx, s.slot, h.status, s.entry);
            atomic_fetch_sub(&ctx->n_slices_inflight, 1);
        } else if (h.type == KVF_F_READ_RESP) {
            if (!take_tag(c, h.tag, &s, 1)) { status = KVF_EPROTO; break; }
            int st = h.status;
            /* a response whose length disagrees with the request cannot be
             * placed safely: drop the connection */
            int fatal = h.len > KVF_MAX_PAYLOAD || (st == KVF_OK && h.len != s.len);
            if (!fatal && h.len) {
                /* a cancelled read's bytes go nowhere: the caller may already
                 * have reused or released the destination */
                void *dst = (st == KVF_OK && !kvf_batch_cancelled(ctx, s.slot))
                                ? (void *)(uintptr_t)s.local : NULL;
                if (rd_exact(&r, dst, h.len)) { fatal = 1; status = KVF_ELOST; }
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
    conn_fail(c, status);
    return NULL;
}

#define ACK_BUF (64u << 10)

kvf_tcp_channel *kvf_tcp_channel_new(kvf_ctx *ctx, const int *fds, int nfds, int ack_fd,
                                     uint64_t slice_size) {
    kvf_tcp_channel *ch = calloc(1, sizeof(*ch));
    if (!ch) return NULL;
    ch->ctx = ctx;
    ch->ack_fd = ack_fd;
    if (ack_fd >= 0) {
        ch->ack_buf = malloc(ACK_BUF);
        if (!ch->ack_buf) { free(ch); return NULL; }
        set_nodelay(ack_fd);
        atomic_fetch_add(&ctx->n_sockets, 1);
    }
    ch->slice_size = slice_size;
    ch->conns = calloc(nfds, sizeof(tcp_conn));
    if (!ch->conns) { free(ch); return NULL; }
    ch->n = nfds;
    atomic_store(&ch->alive, 1);
    for (int i = 0; i < nfds; i++) {
        tcp_conn *c = &ch->conns[i];
        c->ch = ch;
        c->fd = fds[i];
        kvf_queue_init(&c->q);
        for (uint32_t t = 0; t < TCP_WINDOW; t++) c->free_tags[t] = TCP_WINDOW - 1 - t;
        c->nfree = TCP_WINDOW;
        c->pipe_r = c->pipe_w = -1;
        int pfd[2];
        if (pipe2(pfd, O_CLOEXEC) == 0) {
            c->pipe_r = pfd[0];
            c->pipe_w = pfd[1];
            int cap = fcntl(pfd[1], F_SETPIPE_SZ, PIPE_BYTES);
            if (cap < 0) cap = fcntl(pfd[1], F_GETPIPE_SZ);
            c->pipe_cap = cap > 0 ? (size_t)cap : 65536;
        }
        set_nodelay(c->fd);
        atomic_fetch_add(&ctx->n_sockets, 1);
        c->tx_started = pthread_create(&c->tx, NULL, tcp_tx, c) == 0;
        c->rx_started = pthread_create(&c->rx, NULL, tcp_rx, c) == 0;
        atomic_fetch_add(&ctx->n_threads, c->tx_started + c->rx_started);
        if (!c->tx_started || !c->rx_started) conn_fail(c, KVF_ENOMEM);
    }
    return ch;
}

int kvf_tcp_channel_alive(kvf_tcp_channel *ch) { return atomic_load(&ch->alive); }

static void channel_fail(kvf_tcp_channel *ch, int status) {
    for (int i = 0; i < ch->n; i++) conn_fail(&ch->conns[i], status);
}

/* Finishes one write ack: `aux` names the data connection whose tag it is. */
static int ack_one(kvf_tcp_channel *ch, const kvf_hdr *h) {
    if (h->magic != KVF_MAGIC || h->type != KVF_F_WRITE_ACK || h->aux >= (uint64_t)ch->n) return -1;
    tcp_conn *c = &ch->conns[h->aux];
    kvf_slice s;
    if (!take_tag(c, h->tag, &s, 0)) return -1;
    kvf_slice_done(ch->ctx, s.slot, h->status, s.entry);
    atomic_fetch_sub(&ch->ctx->n_slices_inflight, 1);
    return 0;
}

int kvf_tcp_poll_acks(kvf_tcp_channel *ch) {
    if (ch->ack_fd < 0) return -1;
    for (;;) {
        ssize_t g = recv(ch->ack_fd, ch->ack_buf + ch->ack_len, ACK_BUF - ch->ack_len, MSG_DONTWAIT);
        if (g < 0 && errno == EINTR) continue;
        if (g < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (g <= 0) { channel_fail(ch, KVF_ELOST); return -1; }
        ch->ack_len += g;
        size_t off = 0;
        for (; off + sizeof(kvf_hdr) <= ch->ack_len; off += sizeof(kvf_hdr)) {
            kvf_hdr h;
            memcpy(&h, ch->ack_buf + off, sizeof(h));
            if (ack_one(ch, &h)) { channel_fail(ch, KVF_EPROTO); return -1; }
        }
        memmove(ch->ack_buf, ch->ack_buf + off, ch->ack_len - off);
        ch->ack_len -= off;
        if ((size_t)g < ACK_BUF / 2) return 0;   /* drained what was there */
    }
}

int kvf_tcp_submit(kvf_tcp_channel *ch, kvf_region_table *remote, int op,
                   const uint64_t *la, const uint64_t *ra, const uint64_t *len,
                   size_t n, uint64_t *id_out, size_t *bad) {
    kvf_ctx *ctx = ch->ctx;
    *id_out = 0;
    int rc = kvf_validate(ctx, remote, op, la, ra, len, n, bad);
    if (rc) return rc;
    if (!atomic_load(&ch->alive)) { *bad = 0; return KVF_ELOST; }
    kvf_slice *s;
    size_t k = kvf_plan(op, la, ra, len, n, ch->slice_size, &s);
    if (!s) return KVF_ENOMEM;
    rc = kvf_batch_alloc(ctx, k, id_out);
    if (rc) { free(s); return rc; }
    uint32_t slot = (uint32_t)*id_out;
    /* Least-queued-bytes placement. The loads are read without the locks: a
     * stale value only makes placement slightly less even. */
    uint64_t load[64];
    int nc = ch->n < 64 ? ch->n : 64;
    for (int i = 0; i < nc; i++) load[i] = __atomic_load_n(&ch->conns[i].q.bytes, __ATOMIC_RELAXED);
    int *dest = malloc(k * sizeof(int));
    if (!dest) { free(s); for (size_t i = 0; i < k; i++) kvf_slice_done(ctx, slot, KVF_ENOMEM, 0); kvf_batch_release_guard(ctx, *id_out); return KVF_OK; }
    for (size_t i = 0; i < k; i++) {
        int best = 0;
        for (int j = 1; j < nc; j++) if (load[j] < load[best]) best = j;
        dest[i] = best;
        load[best] += s[i].len + 4096;   /* per-slice cost, so tiny slices spread too */
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
        uint64_t bytes = 0;
        pthread_mutex_lock(&c->q.mu);
        for (size_t i = 0; i < k; i++) {
            if (dest[i] != j) continue;
            if (c->dead || kvf_queue_push_locked(&c->q, &s[i]) != KVF_OK) {
                dest[i] = -1;   /* fail it below, outside the lock */
                continue;
            }
            any = 1;
            bytes += s[i].len;
        }
        int status = c->dead ? c->fail_status : KVF_ENOMEM;
        if (any && !c->sending && !c->pend_n && bytes <= TCP_INLINE_BYTES && c->q.count <= TCP_POP &&
            c->nfree >= c->q.count) {
            /* Small work on an idle connection: send it from this thread
             * instead of waking the sender (saves a thread hop per batch).
             * Never blocks: what the socket does not take now is left to
             * the sender thread, so a stalled peer cannot stall the loop. */
            kvf_slice mine[TCP_POP], cancelled[TCP_POP];
            size_t ncancel;
            c->sending = 1;
            size_t m = claim_locked(c, mine, cancelled, &ncancel);
            pthread_mutex_unlock(&c->q.mu);
            finish_cancelled(ctx, cancelled, ncancel);
            int niov = frame_slices(mine, m, c->pend_h, c->pend_iov);
            int left = niov ? send_iov_nb(c->fd, c->pend_iov, niov) : 0;
            pthread_mutex_lock(&c->q.mu);
            c->sending = 0;
            if (left > 0) {
                /* the last `left` iovecs (the first one partly sent) */
                c->pend = c->pend_iov + (niov - left);
                c->pend_n = left;
            }
            int more = c->q.count > 0 || c->pend_n;
            pthread_mutex_unlock(&c->q.mu);
            if (left < 0) conn_fail(c, KVF_ELOST);
            else if (more) pthread_cond_signal(&c->q.cv);
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
    free(s);
    kvf_batch_release_guard(ctx, *id_out);
    return KVF_OK;
}

void kvf_tcp_channel_close(kvf_tcp_channel *ch) {
    if (!ch) return;
    channel_fail(ch, KVF_ECLOSED);
    if (ch->ack_fd >= 0) {
        close(ch->ack_fd);
        ch->ack_fd = -1;
        atomic_fetch_sub(&ch->ctx->n_sockets, 1);
    }
    for (int i = 0; i < ch->n; i++) {
        tcp_conn *c = &ch->conns[i];
        if (c->tx_started) { pthread_join(c->tx, NULL); c->tx_started = 0; atomic_fetch_sub(&ch->ctx->n_threads, 1); }
        if (c->rx_started) { pthread_join(c->rx, NULL); c->rx_started = 0; atomic_fetch_sub(&ch->ctx->n_threads, 1); }
        if (c->fd >= 0) { close(c->fd); c->fd = -1; atomic_fetch_sub(&ch->ctx->n_sockets, 1); }
        if (c->pipe_r >= 0) { close(c->pipe_r); close(c->pipe_w); c->pipe_r = c->pipe_w = -1; }
    }
}

void kvf_tcp_channel_free(kvf_tcp_channel *ch) {
    if (!ch) return;
    kvf_tcp_channel_close(ch);
    for (int i = 0; i < ch->n; i++) kvf_queue_destroy(&ch->conns[i].q);
    free(ch->conns);
    free(ch->ack_buf);
    free(ch);
}

/* ---------------------------------------------------------------- target */

/* An authenticated handshake session: its token, and the ack connection
 * that its data connections' server threads send write acks on. Freed when
 * the last of (registration, connection threads) lets go. */
typedef struct kvf_session {
    uint8_t token[16];
    pthread_mutex_t mu;       /* serialises writers of ack_fd */
    int ack_fd;               /* -1 until (or after) the ack connection */
    int refs;                 /* guarded by ctx->srv_mu */
    int registered;
    struct kvf_session *next;
} kvf_session;

typedef struct kvf_srv_conn {
    kvf_ctx *ctx;
    kvf_session *session;
    int index;                /* the initiator's data connection index */
    int fd;
    pthread_t th;
    struct kvf_srv_conn *next;
    kvf_hdr acks[ACK_BATCH];
    int nacks;
    int broken;
} kvf_srv_conn;

static void srv_flush(void *arg) {
    kvf_srv_conn *s = arg;
    if (s->nacks == 0 || s->broken) return;
    kvf_session *se = s->session;
    int sent = 0;
    pthread_mutex_lock(&se->mu);
    if (se->ack_fd >= 0) {
        /* a broken ack connection is noticed by the initiator (its loop
         * sees the close and fails the channel) */
        if (send_all(se->ack_fd, s->acks, s->nacks * sizeof(kvf_hdr))) s->broken = 1;
        sent = 1;
    }
    pthread_mutex_unlock(&se->mu);
    if (!sent && send_all(s->fd, s->acks, s->nacks * sizeof(kvf_hdr))) s->broken = 1;
    s->nacks = 0;
}

static void srv_ack(kvf_srv_conn *s, uint32_t tag, int status) {
    s->acks[s->nacks++] = (kvf_hdr){KVF_MAGIC, KVF_F_WRITE_ACK, (uint8_t)status, tag, 0, 0,
                                    (uint64_t)s->index};
    if (s->nacks == ACK_BATCH) srv_flush(s);
}

/* Caller holds srv_mu. */
static void session_put_locked(kvf_ctx *c, kvf_session *se) {
    if (--se->refs > 0) return;
    for (kvf_session **pp = &c->sessions; *pp; pp = &(*pp)->next) {
        if (*pp == se) { *pp = se->next; break; }
    }
    pthread_mutex_destroy(&se->mu);
    free(se);
}

static kvf_session *session_get(kvf_ctx *c, const uint8_t *tok) {
    kvf_session *found = NULL;
    pthread_mutex_lock(&c->srv_mu);
    for (kvf_session *se = c->sessions; se && !found; se = se->next) {
        if (se->registered && memcmp(se->token, tok, 16) == 0) { found = se; se->refs++; }
    }
    pthread_mutex_unlock(&c->srv_mu);
    return found;
}

static void srv_loop(kvf_srv_conn *s) {
    kvf_ctx *ctx = s->ctx;
    /* The hello must arrive promptly; a silent client is dropped. */
    struct timeval tv = {10, 0};
    setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    kvf_hdr h;
    reader r = {s->fd, NULL, 0, 0, NULL, NULL, 0, 1};
    char hb[sizeof(kvf_hdr)];
    size_t got = 0;
    while (got < sizeof(hb)) {
        ssize_t g = recv(s->fd, hb + got, sizeof(hb) - got, 0);
        if (g <= 0) return;
        got += g;
    }
    memcpy(&h, hb, sizeof(h));
    uint8_t tok[16];
    memcpy(tok, &h.addr, 8);
    memcpy(tok + 8, &h.aux, 8);
    /* Nothing of this engine's memory is touched before the token matches a
     * session that passed the handshake (and its authentication). */
    int ok = h.magic == KVF_MAGIC && h.type == KVF_F_HELLO && h.len == KVF_WIRE_VERSION &&
             (h.tag == KVF_ROLE_DATA || h.tag == KVF_ROLE_ACK);
    if (ok) s->session = session_get(ctx, tok);
    ok = ok && s->session;
    kvf_hdr ack = {KVF_MAGIC, KVF_F_HELLO_ACK, ok ? KVF_OK : KVF_EPROTO, 0, 0, 0, 0};
    if (ok && h.tag == KVF_ROLE_ACK) {
        /* Publish the ack connection before answering: the initiator opens
         * its data connections only after this hello is acknowledged. */
        pthread_mutex_lock(&s->session->mu);
        if (s->session->ack_fd < 0) s->session->ack_fd = s->fd;
        else ok = 0;                               /* one per session */
        pthread_mutex_unlock(&s->session->mu);
        ack.status = ok ? KVF_OK : KVF_EPROTO;
    }
    if (send_all(s->fd, &ack, sizeof(ack)) || !ok) return;
    /* From now on the timeout bounds one frame: a peer that stops in the
     * middle of a payload is dropped after it (see rd_header). */
    tv.tv_sec = FRAME_TIMEOUT_S;
    setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    set_nodelay(s->fd);
    if (h.tag == KVF_ROLE_ACK) {
        /* Nothing ever arrives on it; wait for the initiator to close it. */
        char sink[256];
        ssize_t g;
        while (!atomic_load(&ctx->closing) &&
               ((g = recv(s->fd, sink, sizeof(sink), 0)) > 0 || (g < 0 && (errno == EAGAIN || errno == EINTR)))) {}
        pthread_mutex_lock(&s->session->mu);
        if (s->session->ack_fd == s->fd) s->session->ack_fd = -1;
        pthread_mutex_unlock(&s->session->mu);
        return;
    }
    s->index = h.status;
    r.buf = malloc(RD_BUF);
    r.flush = srv_flush;
    r.arg = s;
    if (!r.buf) return;
    while (!s->broken && !atomic_load(&ctx->closing)) {
        if (rd_header(&r, &h)) break;
        if (h.magic != KVF_MAGIC || h.len > KVF_MAX_PAYLOAD) break;   /* garbage: drop the peer */
        r.big = h.type == KVF_F_WRITE && h.len >= RD_BUF / 4;
        if (h.type == KVF_F_WRITE) {
            int st = KVF_OK, io = 0;
            /* The read lock is held while the payload lands, so deregister()
             * cannot return while bytes are still being written into it. */
            pthread_rwlock_rdlock(&ctx->local.lock);
            const kvf_region *rg = kvf_rt_find_locked(&ctx->local, h.addr, h.len);
            if (rg && (rg->access & KVF_ACCESS_WRITE))
                io = rd_exact(&r, (void *)(uintptr_t)h.addr, h.len);
            else st = KVF_EREMOTE;
            pthread_rwlock_unlock(&ctx->local.lock);
            if (st != KVF_OK) io = rd_exact(&r, NULL, h.len);   /* keep the stream in sync */
            if (io) break;
            srv_ack(s, h.tag, st);
            if (h.status & KVF_HDR_FLUSH) srv_flush(s);
        } else if (h.type == KVF_F_READ_REQ) {
            srv_flush(s);
            pthread_rwlock_rdlock(&ctx->local.lock);
            const kvf_region *rg = kvf_rt_find_locked(&ctx->local, h.addr, h.len);
            int ok2 = rg && (rg->access & KVF_ACCESS_READ);
            kvf_hdr resp = {KVF_MAGIC, KVF_F_READ_RESP, ok2 ? KVF_OK : KVF_EREMOTE, h.tag, 0, ok2 ? h.len : 0, 0};
            struct iovec v[2] = {{&resp, sizeof(resp)}, {(void *)(uintptr_t)h.addr, ok2 ? h.len : 0}};
            int bad = send_iov(s->fd, v, ok2 ? 2 : 1);
            pthread_rwlock_unlock(&ctx->local.lock);
            if (bad) break;
        } else {
            break;
        }
    }
    srv_flush(s);
    free(r.buf);
}

/* A connection thread cleans up after itself: under srv_mu it leaves the
 * list, closes its socket and detaches, so resources return as soon as a
 * peer goes away. The socket is closed only under srv_mu and only after
 * leaving the list, so kvf_srv_shutdown() never shuts down a descriptor
 * number that was already reused. */
static void *srv_thread(void *arg) {
    kvf_srv_conn *s = arg;
    kvf_ctx *c = s->ctx;
    srv_loop(s);
    pthread_mutex_lock(&c->srv_mu);
    if (s->session) session_put_locked(c, s->session);
    for (kvf_srv_conn **pp = &c->srv_conns; *pp; pp = &(*pp)->next) {
        if (*pp == s) { *pp = s->next; break; }
    }
    close(s->fd);
    atomic_fetch_sub(&c->n_sockets, 1);
    atomic_fetch_sub(&c->n_threads, 1);
    pthread_detach(pthread_self());
    pthread_cond_broadcast(&c->srv_cv);
    pthread_mutex_unlock(&c->srv_mu);
    free(s);
    return NULL;   /* touches nothing of ctx after the unlock: ctx may be freed now */
}

int kvf_srv_serve(kvf_ctx *c, int fd) {
    if (atomic_load(&c->closing)) { close(fd); return KVF_ECLOSED; }
    kvf_srv_conn *s = calloc(1, sizeof(*s));
    if (!s) { close(fd); return KVF_ENOMEM; }
    s->ctx = c;
    s->fd = fd;
    pthread_mutex_lock(&c->srv_mu);
    if (pthread_create(&s->th, NULL, srv_thread, s) != 0) {
        pthread_mutex_unlock(&c->srv_mu);
        close(fd);
        free(s);
        return KVF_ENOMEM;
    }
    atomic_fetch_add(&c->n_sockets, 1);
    atomic_fetch_add(&c->n_threads, 1);
    s->next = c->srv_conns;
    c->srv_conns = s;
    pthread_mutex_unlock(&c->srv_mu);
    return KVF_OK;
}

void kvf_srv_shutdown(kvf_ctx *c) {
    atomic_store(&c->closing, 1);
    pthread_mutex_lock(&c->srv_mu);
    for (kvf_srv_conn *s = c->srv_conns; s; s = s->next) shutdown(s->fd, SHUT_RDWR);
    while (c->srv_conns) pthread_cond_wait(&c->srv_cv, &c->srv_mu);
    pthread_mutex_unlock(&c->srv_mu);
}

int kvf_srv_add_token(kvf_ctx *c, const uint8_t *token) {
    kvf_session *se = calloc(1, sizeof(*se));
    if (!se) return KVF_ENOMEM;
    memcpy(se->token, token, 16);
    pthread_mutex_init(&se->mu, NULL);
    se->ack_fd = -1;
    se->refs = 1;
    se->registered = 1;
    pthread_mutex_lock(&c->srv_mu);
    se->next = c->sessions;
    c->sessions = se;
    pthread_mutex_unlock(&c->srv_mu);
    return KVF_OK;
}

void kvf_srv_remove_token(kvf_ctx *c, const uint8_t *token) {
    pthread_mutex_lock(&c->srv_mu);
    for (kvf_session *se = c->sessions; se; se = se->next) {
        if (se->registered && memcmp(se->token, token, 16) == 0) {
            se->registered = 0;
            session_put_locked(c, se);
            break;
        }
    }
    pthread_mutex_unlock(&c->srv_mu);
}

/* Frees what is left of the session table (every connection thread has
 * ended). */
void kvf_srv_free_sessions(kvf_ctx *c) {
    while (c->sessions) {
        kvf_session *se = c->sessions;
        c->sessions = se->next;
        pthread_mutex_destroy(&se->mu);
        free(se);
    }
}
