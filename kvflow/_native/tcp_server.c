/* The tcp provider, target side: a thread per accepted data connection.
 *
 * After the session token of an authenticated handshake, each WRITE is
 * checked against the local region table (whole range inside one region
 * with WRITE access) before its payload is received straight into place;
 * acks are coalesced and sent on the session's ack connection. With a
 * receive window (kvf_srv_set_window), each data connection is a holder
 * of the engine's credit pool (credit.c): its grants and recalls go out on
 * the connection itself, and each landed payload gives its bytes back. */
#define _GNU_SOURCE
#include "credit.h"
#include "kvf.h"
#include "sockio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ACK_BATCH 256
/* Longest a frame (hello, payload, read response) may take: a peer that
 * stops in the middle of one is dropped after it. */
#define FRAME_TIMEOUT_S 10
/* How long deregister() lets a payload that is moving into (or out of) the
 * region finish before it cuts that connection off (kvf_srv_quiesce_region).
 * A payload of one slice takes well under a millisecond on a loopback or a
 * datacenter NIC; whatever is still moving after this is a peer that
 * stalled mid-frame, or a write racing the deregister, which may fail. */
#define QUIESCE_GRACE_NS (20 * 1000000ull)
/* A data connection lands bytes only within this long of a look that
 * found it not reset by its initiator (sockio.c: sk_not_reset): an
 * initiator that gave a write up reset the connection and reported the
 * write failed, and the bytes this kernel had already queued must not land
 * when this process runs again (stopped, starved) on memory given to
 * someone else since. One TCP_INFO look per millisecond of a busy
 * connection, one per batch of an idle one. */
#define SRV_FRESH_NS 1000000ull
/* Connections still before their hello: each holds a thread, so a flood
 * of idle or trickling clients is refused past this many. */
#define MAX_PRE_AUTH 64

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
    kvf_credit_holder credit; /* first: the pool's send callback finds the connection from it */
    pthread_mutex_t wmu;      /* serialises writers of fd (its thread; credit frames from any) */
    kvf_ctx *ctx;
    kvf_session *session;
    int index;                /* the initiator's data connection index */
    int pre_auth;             /* counted in ctx->n_pre_auth until its hello is read */
    int fd;
    pthread_t th;
    struct kvf_srv_conn *next;
    kvf_hdr acks[ACK_BATCH];
    int nacks;
    int broken;
    /* Fences (KVF_F_FENCE): `conn` is its hello byte once it is a data
     * connection (-1 before; set and read under ctx->srv_mu); `fenced` says
     * another connection of its session was told its work moved, and
     * apply_mu is held while a payload of this one moves (a write's
     * landing, a read response's sending), so the fence can wait for it. */
    int conn;
    atomic_int fenced;
    pthread_mutex_t apply_mu;
    int pins;                 /* fences and quiesces waiting on it (under srv_mu): not freed before 0 */
    /* The id of the region a payload of this connection is moving into
     * (write) or out of (read response) right now; 0: none. Stored under
     * the table's read lock, in which the region was found, so that a
     * deregister, which removes the region under the write lock and then
     * looks here, finds every payload that could still touch it
     * (kvf_srv_quiesce_region); cleared once the payload has moved. */
    _Atomic uint32_t using_rid;
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
        if (sk_send_all(se->ack_fd, s->acks, s->nacks * sizeof(kvf_hdr))) s->broken = 1;
        sent = 1;
    }
    pthread_mutex_unlock(&se->mu);
    if (!sent) {
        pthread_mutex_lock(&s->wmu);
        if (sk_send_all(s->fd, s->acks, s->nacks * sizeof(kvf_hdr))) s->broken = 1;
        pthread_mutex_unlock(&s->wmu);
    }
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

static void srv_hello_done(kvf_srv_conn *s) {
    if (s->pre_auth) { atomic_fetch_sub(&s->ctx->n_pre_auth, 1); s->pre_auth = 0; }
}

/* Never leave a descriptor number that is about to be closed (and reused)
 * published as the session's ack connection. */
static void srv_unpublish_ack(kvf_srv_conn *s) {
    pthread_mutex_lock(&s->session->mu);
    if (s->session->ack_fd == s->fd) s->session->ack_fd = -1;
    pthread_mutex_unlock(&s->session->mu);
}

/* Reads and checks a connection's hello and answers it. Nothing of this
 * engine's memory is touched before the token matches a session that passed
 * the handshake (and its authentication). 0: accepted, *h holds the hello. */
static int srv_hello(kvf_srv_conn *s, kvf_hdr *h) {
    /* The hello must arrive promptly; a silent client is dropped. */
    struct timeval tv = {10, 0};
    setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char hb[sizeof(kvf_hdr)];
    size_t got = 0;
    uint64_t hello_deadline = sk_now_ns() + FRAME_TIMEOUT_S * 1000000000ull;
    while (got < sizeof(hb)) {
        if (sk_now_ns() > hello_deadline) return -1;   /* a trickled hello */
        ssize_t g = recv(s->fd, hb + got, sizeof(hb) - got, 0);
        if (g <= 0) return -1;
        got += g;
    }
    srv_hello_done(s);
    memcpy(h, hb, sizeof(*h));
    uint8_t tok[16];
    memcpy(tok, &h->addr, 8);
    memcpy(tok + 8, &h->aux, 8);
    int ok = h->magic == KVF_MAGIC && h->type == KVF_F_HELLO && h->len == KVF_WIRE_VERSION &&
             (h->tag == KVF_ROLE_DATA || h->tag == KVF_ROLE_ACK);
    if (ok) s->session = session_get(s->ctx, tok);
    ok = ok && s->session;
    kvf_hdr ack = {KVF_MAGIC, KVF_F_HELLO_ACK, ok ? KVF_OK : KVF_EPROTO, 0, 0, 0, 0};
    if (ok && h->tag == KVF_ROLE_DATA && s->ctx->credit) ack.aux = s->ctx->credit->window;
    if (ok && h->tag == KVF_ROLE_DATA) {
        /* findable by a fence before the initiator hears of it: once it
         * has the ack it may send, fail, and have its work fenced */
        pthread_mutex_lock(&s->ctx->srv_mu);
        s->conn = h->status;
        pthread_mutex_unlock(&s->ctx->srv_mu);
    }
    if (ok && h->tag == KVF_ROLE_ACK) {
        /* Publish the ack connection before answering: the initiator opens
         * its data connections only after this hello is acknowledged. */
        pthread_mutex_lock(&s->session->mu);
        if (s->session->ack_fd < 0) s->session->ack_fd = s->fd;
        else ok = 0;                               /* one per session */
        pthread_mutex_unlock(&s->session->mu);
        ack.status = ok ? KVF_OK : KVF_EPROTO;
    }
    if (sk_send_all(s->fd, &ack, sizeof(ack)) || !ok) {
        if (ok && h->tag == KVF_ROLE_ACK) srv_unpublish_ack(s);
        return -1;
    }
    /* From now on the timeout bounds one frame: a peer that stops in the
     * middle of a payload is dropped after it (see sk_read_header). */
    tv.tv_sec = FRAME_TIMEOUT_S;
    setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(s->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sk_nodelay(s->fd);
    return 0;
}

/* A write frame: its payload lands in a registered, writable region, or is
 * read and dropped (the stream stays in sync) and acknowledged with
 * KVF_EREMOTE. Nonzero: the connection failed. */
static int srv_write_frame(kvf_srv_conn *s, sk_reader *r, const kvf_hdr *h) {
    kvf_ctx *ctx = s->ctx;
    int st = KVF_OK, io = 0;
    /* fenced: its work was sent again on another connection, and what is
     * still queued here is older than that and must not land over it */
    if (atomic_load(&s->fenced)) return -1;
    /* The table's read lock is held only to find the region, not while
     * the payload lands: a peer that stalls mid-frame would otherwise hold
     * it for up to FRAME_TIMEOUT_S, and with it every register() and
     * deregister() (the write lock, on the caller's event loop) and, as
     * the lock prefers a waiting writer, every other connection's lookup.
     * The region's id is published in using_rid before the lock is let
     * go, so deregister() finds this payload and waits for it (or cuts it
     * off) before it returns: nothing lands in a region after that. */
    r->deadline_ns = sk_now_ns() + FRAME_TIMEOUT_S * 1000000000ull;
    uint32_t rid = 0;
    pthread_rwlock_rdlock(&ctx->local.lock);
    const kvf_region *rg = kvf_rt_find_locked(&ctx->local, h->addr, h->len);
    if (rg && (rg->access & KVF_ACCESS_WRITE)) {
        rid = rg->id;
        /* taken inside the region lock, so that a fence never waits for
         * this thread's wait for that lock (it prefers writers) */
        pthread_mutex_lock(&s->apply_mu);
        atomic_store(&s->using_rid, rid);
    }
    pthread_rwlock_unlock(&ctx->local.lock);
    if (rid) {
        if (atomic_load(&s->fenced)) io = -1;
        else io = sk_read_exact(r, (void *)(uintptr_t)h->addr, h->len);
        atomic_store(&s->using_rid, 0);
        pthread_mutex_unlock(&s->apply_mu);
    } else st = KVF_EREMOTE;
    r->deadline_ns = 0;
    if (st != KVF_OK && !io) io = sk_read_exact(r, NULL, h->len);
    if (io) return io;
    /* landed (or dropped): its bytes are no longer in flight toward us */
    if (ctx->credit) kvf_credit_landed(ctx->credit, &s->credit, h->len);
    srv_ack(s, h->tag, st);
    if (h->status & KVF_HDR_FLUSH) {
        srv_flush(s);
        r->spin_armed = 1;      /* the batch's last frame here: the next one is a round trip away */
    }
    return 0;
}

/* A read request: the response header, then the bytes of a registered,
 * readable region (or KVF_EREMOTE and no bytes). */
static int srv_read_frame(kvf_srv_conn *s, const kvf_hdr *h) {
    kvf_ctx *ctx = s->ctx;
    srv_flush(s);
    /* As a write's payload (srv_write_frame): the region is found under
     * the table's read lock, and the bytes leave under apply_mu with its
     * id in using_rid, so a deregister() waits for them. */
    pthread_rwlock_rdlock(&ctx->local.lock);
    const kvf_region *rg = kvf_rt_find_locked(&ctx->local, h->addr, h->len);
    int ok = rg && (rg->access & KVF_ACCESS_READ);
    if (ok) {
        pthread_mutex_lock(&s->apply_mu);
        atomic_store(&s->using_rid, rg->id);
    }
    pthread_rwlock_unlock(&ctx->local.lock);
    kvf_hdr resp = {KVF_MAGIC, KVF_F_READ_RESP, ok ? KVF_OK : KVF_EREMOTE, h->tag, 0, ok ? h->len : 0, 0};
    struct iovec v[2] = {{&resp, sizeof(resp)}, {(void *)(uintptr_t)h->addr, ok ? h->len : 0}};
    /* bounded: a deregister of the region may be waiting for it */
    pthread_mutex_lock(&s->wmu);
    int bad = sk_send_iov_until(s->fd, v, ok ? 2 : 1, sk_now_ns() + FRAME_TIMEOUT_S * 1000000000ull,
                                atomic_load(&ctx->srv_grace_ms));
    pthread_mutex_unlock(&s->wmu);
    if (ok) {
        atomic_store(&s->using_rid, 0);
        pthread_mutex_unlock(&s->apply_mu);
    }
    return bad;
}

/* A fence (KVF_F_FENCE) read on s: the initiator's connection `conn` of
 * the same session failed and its work was sent again, starting right
 * after this frame on s. That connection is fenced (it applies nothing
 * more) and shut down here, which wakes its thread if it waits for the
 * rest of a payload that will never come; a payload it is landing ends
 * before this returns (apply_mu), so s reads on only once nothing more of
 * the old connection can land. Without it, frames the target's kernel had
 * already received on the failed connection could be applied after their
 * resent copies were acknowledged, over newer writes to the same bytes. A
 * fence that names no live connection (it ended first), or s itself,
 * changes nothing. */
static void srv_fence(kvf_srv_conn *s, int conn) {
    kvf_ctx *c = s->ctx;
    kvf_srv_conn *hit[KVF_CONN_INDEX_MASK + 1];
    int n = 0;
    pthread_mutex_lock(&c->srv_mu);
    for (kvf_srv_conn *x = c->srv_conns; x && n < KVF_CONN_INDEX_MASK + 1; x = x->next) {
        if (x == s || x->conn != conn || x->session != s->session) continue;
        if (atomic_exchange(&x->fenced, 1) == 0) atomic_fetch_add(&c->n_fenced, 1);
        shutdown(x->fd, SHUT_RDWR);     /* x's thread closes it, under srv_mu, after leaving the list */
        x->pins++;                      /* and frees it only once unpinned */
        hit[n++] = x;
    }
    pthread_mutex_unlock(&c->srv_mu);
    /* Waited for without srv_mu (accepts, hellos and exits go on): x holds
     * apply_mu only while a payload moves, and the shutdown has woken it
     * if it waits for bytes that will not come. */
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&hit[i]->apply_mu);
        pthread_mutex_unlock(&hit[i]->apply_mu);
    }
    if (!n) return;
    pthread_mutex_lock(&c->srv_mu);
    for (int i = 0; i < n; i++) hit[i]->pins--;
    pthread_cond_broadcast(&c->srv_cv);
    pthread_mutex_unlock(&c->srv_mu);
}

/* Called by deregister() once region `rid` is out of the table (no
 * payload can find it any more): waits until no connection moves a
 * payload into or out of it. A payload still moving after
 * QUIESCE_GRACE_NS has its connection shut down, which ends it at once
 * (the initiator sees the connection fail, and what it sends again is
 * refused: the region is gone). So deregister() returns within about
 * the grace, never after a stalled peer's frame deadline, and nothing
 * touches the region's memory after it. The number of connections cut. */
int kvf_srv_quiesce_region(kvf_ctx *c, uint32_t rid) {
    if (!rid) return 0;
    int cut = 0;
    uint64_t deadline = sk_now_ns() + QUIESCE_GRACE_NS;
    /* One connection at a time, found afresh: the region is out of the
     * table, so no payload starts using it any more, and the walk ends
     * once the ones that had found it are done (no allocation). */
    for (;;) {
        kvf_srv_conn *x;
        pthread_mutex_lock(&c->srv_mu);
        for (x = c->srv_conns; x && atomic_load(&x->using_rid) != rid; x = x->next) {}
        if (x) x->pins++;       /* listed, and its socket open, until unpinned */
        pthread_mutex_unlock(&c->srv_mu);
        if (!x) return cut;
        int shut = 0;
        /* using_rid, not apply_mu: once this payload is done the
         * connection may hold apply_mu for its next one, into another
         * region, and that one must not be cut */
        while (atomic_load(&x->using_rid) == rid) {
            if (!shut && sk_now_ns() >= deadline) {
                /* looked at again just before: a payload that ended since
                 * leaves the connection alone (a window of a few
                 * instructions remains, in which a connection that just
                 * moved on to another region is cut: its initiator sends
                 * that work again, behind a fence) */
                if (atomic_load(&x->using_rid) != rid) break;
                shutdown(x->fd, SHUT_RDWR);   /* pinned: the descriptor is still x's */
                atomic_fetch_add(&c->n_cut_off, 1);
                shut = 1;
                cut++;
            }
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&c->srv_mu);
        x->pins--;
        pthread_cond_broadcast(&c->srv_cv);
        pthread_mutex_unlock(&c->srv_mu);
    }
}

/* The pool's way to this connection's initiator (credit.h). */
static int srv_credit_send(kvf_credit_holder *h, const kvf_hdr *frame) {
    kvf_srv_conn *s = (kvf_srv_conn *)h;
    pthread_mutex_lock(&s->wmu);
    int bad = sk_send_all(s->fd, frame, sizeof(*frame));
    pthread_mutex_unlock(&s->wmu);
    return bad;
}

static void srv_loop(kvf_srv_conn *s) {
    kvf_ctx *ctx = s->ctx;
    kvf_hdr h;
    if (srv_hello(s, &h)) return;
    if (h.tag == KVF_ROLE_ACK) {
        /* Nothing ever arrives on it; wait for the initiator to close it. */
        char sink[256];
        ssize_t g;
        while (!atomic_load(&ctx->closing) &&
               ((g = recv(s->fd, sink, sizeof(sink), 0)) > 0 || (g < 0 && (errno == EAGAIN || errno == EINTR)))) {}
        srv_unpublish_ack(s);
        return;
    }
    s->index = h.status;
    if (ctx->credit) {
        s->credit.send = srv_credit_send;
        kvf_credit_join(ctx->credit, &s->credit);
    }
    sk_reader r = {s->fd, NULL, 0, 0, NULL, NULL, 0, 1, 0, 0, atomic_load(&ctx->srv_spin_ns), 0};
    r.buf = malloc(RD_BUF);
    r.grace_ms = atomic_load(&ctx->srv_grace_ms);
    r.fresh_ns = SRV_FRESH_NS;
    r.flush = srv_flush;
    r.arg = s;
    if (!r.buf) return;
    while (!s->broken && !atomic_load(&ctx->closing)) {
        if (sk_read_header(&r, &h)) break;
        r.spin_armed = 0;       /* armed again only by this frame, if it ends a batch */
        if (h.magic != KVF_MAGIC || h.len > KVF_MAX_PAYLOAD) break;   /* garbage: drop the peer */
        /* A credit ask is a bare header in front of the initiator's next
         * write frames: it leaves the guess about the next payload as it
         * was. Taken for a small frame, the next header's read would fill
         * the staging buffer with up to RD_BUF of the payload behind it,
         * copied a second time (with a small window, one ask per grant:
         * +40% of the copying on loopback). */
        if (h.type != KVF_F_CREDIT_ASK && h.type != KVF_F_FENCE) r.big = h.type == KVF_F_WRITE && h.len >= RD_BUF / 4;
        if (h.type == KVF_F_WRITE) {
            if (srv_write_frame(s, &r, &h)) break;
        } else if (h.type == KVF_F_READ_REQ) {
            if (srv_read_frame(s, &h)) break;
            r.spin_armed = (h.status & KVF_HDR_FLUSH) != 0;
        } else if (h.type == KVF_F_CREDIT_ASK && ctx->credit && h.len == 0) {
            kvf_credit_ask(ctx->credit, &s->credit, h.addr, h.aux, h.tag, h.status & KVF_ASK_BLOCKED);
        } else if (h.type == KVF_F_FENCE && h.len == 0) {
            srv_flush(s);       /* acks it holds go first: the fence may wait */
            srv_fence(s, h.status);
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
    kvf_thread_name("kvf-tcp-serve");
    kvf_srv_conn *s = arg;
    kvf_ctx *c = s->ctx;
    srv_loop(s);
    /* before the socket closes: the pool sends on it */
    if (c->credit) kvf_credit_leave(c->credit, &s->credit);
    srv_hello_done(s);
    pthread_mutex_lock(&c->srv_mu);
    /* a fence that found it may still wait on its apply_mu: it stays
     * listed until then (so kvf_srv_shutdown waits for it too), and no
     * fence can find it once this wait is over (srv_mu is held on) */
    while (s->pins) pthread_cond_wait(&c->srv_cv, &c->srv_mu);
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
    pthread_mutex_destroy(&s->wmu);
    pthread_mutex_destroy(&s->apply_mu);
    free(s);
    return NULL;   /* touches nothing of ctx after the unlock: ctx may be freed now */
}

int kvf_srv_serve(kvf_ctx *c, int fd) {
    if (atomic_load(&c->closing)) { close(fd); return KVF_ECLOSED; }
    if (atomic_fetch_add(&c->n_pre_auth, 1) >= MAX_PRE_AUTH) {
        atomic_fetch_sub(&c->n_pre_auth, 1);
        close(fd);
        return KVF_ENOMEM;
    }
    kvf_srv_conn *s = calloc(1, sizeof(*s));
    if (!s) { atomic_fetch_sub(&c->n_pre_auth, 1); close(fd); return KVF_ENOMEM; }
    s->ctx = c;
    s->fd = fd;
    s->pre_auth = 1;
    s->conn = -1;
    pthread_mutex_init(&s->wmu, NULL);
    pthread_mutex_init(&s->apply_mu, NULL);
    pthread_mutex_lock(&c->srv_mu);
    if (pthread_create(&s->th, NULL, srv_thread, s) != 0) {
        pthread_mutex_unlock(&c->srv_mu);
        atomic_fetch_sub(&c->n_pre_auth, 1);
        close(fd);
        pthread_mutex_destroy(&s->wmu);
        pthread_mutex_destroy(&s->apply_mu);
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
int kvf_srv_set_window(kvf_ctx *c, uint64_t window) {
    if (c->credit || c->srv_conns) return KVF_EINVAL;   /* once, before anything is served */
    if (!window) return KVF_OK;
    c->credit = kvf_credit_pool_new(window);
    return c->credit ? KVF_OK : KVF_ENOMEM;
}

void kvf_srv_set_spin(kvf_ctx *c, uint64_t ns) { atomic_store(&c->srv_spin_ns, ns); }

void kvf_srv_set_grace(kvf_ctx *c, uint32_t ms) { atomic_store(&c->srv_grace_ms, ms); }

int kvf_srv_window_stats(kvf_ctx *c, kvf_credit_stats *out) {
    if (!c->credit) return KVF_EINVAL;
    kvf_credit_stats_get(c->credit, out);
    return KVF_OK;
}

void kvf_srv_free_sessions(kvf_ctx *c) {
    kvf_credit_pool_free(c->credit);
    c->credit = NULL;
    while (c->sessions) {
        kvf_session *se = c->sessions;
        c->sessions = se->next;
        pthread_mutex_destroy(&se->mu);
        free(se);
    }
}
