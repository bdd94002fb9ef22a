/* Socket helpers shared by the tcp initiator and target (sockio.h). */
#define _GNU_SOURCE
#include "kvf.h"
#include "sockio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <sys/uio.h>
#include <unistd.h>

/* Sends iov[0..n) with sendmsg `flags` (MSG_NOSIGNAL always), advancing
 * iov past what went out. With MSG_DONTWAIT it stops when the socket is
 * full and returns the number of iovecs still (partly) unsent; otherwise it
 * returns 0 once everything is sent. -1 on error. */
int sk_send_iov_flags(int fd, struct iovec *iov, int n, int flags) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = n > IOV_MAX ? IOV_MAX : n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | flags);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (flags & MSG_DONTWAIT) return n;
                int fl = fcntl(fd, F_GETFL);
                /* a blocking socket's EAGAIN is its SO_SNDTIMEO expiring */
                if (fl >= 0 && (fl & O_NONBLOCK) && sk_wait(fd, POLLOUT) == 0) continue;
            }
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) { w -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + w; iov->iov_len -= w; }
    }
    return 0;
}

int sk_send_iov(int fd, struct iovec *iov, int n) { return sk_send_iov_flags(fd, iov, n, 0); }

uint64_t sk_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int sk_send_iov_until(int fd, struct iovec *iov, int n, uint64_t deadline_ns, uint32_t grace_ms) {
    int unheard = 0;
    while (n > 0) {
        if (sk_now_ns() > deadline_ns) {
            if (!grace_ms || !sk_heard(fd, grace_ms, &unheard)) return -1;
            /* still heard: look again in half the grace */
            deadline_ns = sk_now_ns() + (uint64_t)grace_ms * 500000ull;
        }
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = n > IOV_MAX ? IOV_MAX : n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            /* EAGAIN: SO_SNDTIMEO expired; with a grace the deadline decides */
            if (grace_ms && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) { w -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + w; iov->iov_len -= w; }
    }
    return 0;
}

int sk_send_all(int fd, const void *p, size_t n) {
    struct iovec v = {(void *)p, n};
    return sk_send_iov(fd, &v, 1);
}


static ssize_t sk_recv(sk_reader *r, void *dst, size_t n, int flags) {
    for (;;) {
        /* a frame that takes longer than its deadline is dropped, however
         * the peer trickles it (SO_RCVTIMEO bounds one call only); with a
         * grace, only once the peer's kernel has stopped answering too (a
         * stopped or starved peer finishes its frame when it runs again;
         * a host that is gone is also caught by the kernel's keepalive) */
        if (r->deadline_ns && sk_now_ns() > r->deadline_ns) {
            if (!r->grace_ms || !sk_heard(r->fd, r->grace_ms, &r->unheard)) { errno = ETIMEDOUT; return -1; }
            r->deadline_ns = sk_now_ns() + (uint64_t)r->grace_ms * 500000ull;
        }
        ssize_t g = recv(r->fd, dst, n, flags);
        if (g < 0 && errno == EINTR) continue;
        if (g < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !(flags & MSG_DONTWAIT)) {
            if (r->nonblocking && sk_wait(r->fd, POLLIN) == 0) continue;
            /* a blocking socket's SO_RCVTIMEO expired: the same rule */
            if (!r->nonblocking && r->grace_ms && sk_heard(r->fd, r->grace_ms, &r->unheard)) continue;
        }
        return g;
    }
}

int sk_wait(int fd, short events) {
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int k = poll(&p, 1, -1);
        if (k > 0) return 0;    /* ready, or an error/hang-up the next call reports */
        if (k < 0 && errno != EINTR) return -1;
    }
}

static int sk_fill(sk_reader *r) {
    if (r->pos == r->end) r->pos = r->end = 0;
    else if (r->pos > RD_BUF / 2) {
        memmove(r->buf, r->buf + r->pos, r->end - r->pos);
        r->end -= r->pos;
        r->pos = 0;
    }
    ssize_t g = sk_recv(r, r->buf + r->end, RD_BUF - r->end, 0);
    if (g <= 0) return -1;
    r->end += g;
    return 0;
}

/* Before bytes of r go into the caller's memory (r->fresh_ns set): 0 when
 * the connection was seen not reset by its peer within fresh_ns (looked at
 * again, with TCP_INFO, when the last look is older); -1 (ECONNRESET) once
 * it is.
 *
 * Why: an initiator that gives a write up resets its connection
 * (tcp_conn.c: conn_reset) and reports the write failed, and its caller
 * gives the memory to someone else. Linux does not discard what the reset
 * connection's receiver had already received: recv() returns those bytes
 * first and reports the reset after them (tests/test_store_late_bytes.py
 * shows it). A target that was not reading (stopped, starved) would land
 * them on whatever the memory holds by the time it runs again. So bytes
 * move into place only within fresh_ns of a look that found the
 * connection open; a look that itself took longer than fresh_ns (the
 * thread was stopped or descheduled around it) does not count. The look
 * is timed from before the system call: the state it read is at least
 * that recent. What remains: a copy that had started before the reset
 * arrived (a thread stopped inside a memcpy from the staging buffer lands
 * the rest of it, at most RD_BUF, when it runs again), one stopped in the
 * few instructions between its last clock read here and the copy's start,
 * and a reset that never reached this host (lost on the network: the
 * connection looks open). A socket that cannot say (not tcp) counts as
 * open. */
static int sk_not_reset(sk_reader *r) {
    for (;;) {
        uint64_t t0 = sk_now_ns();
        if (t0 - r->open_ns <= r->fresh_ns) return 0;
        struct tcp_info ti;
        socklen_t len = sizeof(ti);
        memset(&ti, 0, sizeof(ti));
        int known = getsockopt(r->fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0 &&
                    len >= offsetof(struct tcp_info, tcpi_state) + sizeof(ti.tcpi_state);
        /* TCP_CLOSE: the peer's reset was taken (tcp_reset -> tcp_done); a
         * peer's orderly close (CLOSE_WAIT) leaves what it sent to land */
        if (known && ti.tcpi_state == TCP_CLOSE) { errno = ECONNRESET; return -1; }
        if (sk_now_ns() - t0 <= r->fresh_ns) { r->open_ns = t0; return 0; }
    }
}

/* Reads exactly n bytes into dst (dst NULL: discard them). */
int sk_read_exact(sk_reader *r, void *dst, size_t n) {
    char *d = dst;
    while (n > 0) {
        size_t avail = r->end - r->pos;
        if (d && r->fresh_ns && sk_not_reset(r)) return -1;
        if (avail) {
            size_t k = avail < n ? avail : n;
            if (d) { memcpy(d, r->buf + r->pos, k); d += k; }
            r->pos += k;
            n -= k;
            continue;
        }
        if (d && n >= RD_BUF / 4) {
            /* large remainder: straight into place, no copy */
            ssize_t g;
            if (r->fresh_ns) {
                /* A recv that blocks into place lands whatever arrives while
                 * it waits, and what a reset connection's kernel had queued
                 * when this thread runs again after a stop, all after the
                 * look above: so wait for bytes without taking any (a peek
                 * of one), look again, and take only what is queued then.
                 * (MSG_WAITALL into place landed 5 MB of a reset write here,
                 * tests/test_backpressure.py, 1 run in 3 under load.) */
                char c;
                g = sk_recv(r, &c, 1, MSG_PEEK);
                if (g <= 0) return -1;
                if (sk_not_reset(r)) return -1;
                g = sk_recv(r, d, n, MSG_DONTWAIT);
                if (g < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
            } else {
                g = sk_recv(r, d, n, MSG_WAITALL);
            }
            if (g <= 0) return -1;
            d += g;
            n -= g;
            continue;
        }
        if (sk_fill(r)) return -1;
    }
    return 0;
}

/* Reads a frame header. After a large payload, an empty buffer is refilled
 * with exactly one header: filling it would pull the next payload's first
 * quarter-megabyte through the staging buffer (one extra copy). */
int sk_read_header(sk_reader *r, kvf_hdr *h) {
    if (r->pos == r->end && (r->big || r->idle_poll)) {
        /* After a large payload, read exactly one header: filling the
         * buffer would pull the next payload's first quarter-megabyte
         * through it (one extra copy). On the server, first try without
         * blocking: a peer that is silent between frames is idle (flush the
         * acks it may be waiting for, then wait as long as it likes), one
         * that stops inside a frame is dropped by the receive timeout
         * (a deregister() of the region it writes into cuts it off
         * sooner: kvf_srv_quiesce_region). */
        char *dst = r->big ? (char *)h : r->buf;
        size_t want = r->big ? sizeof(*h) : RD_BUF;
        ssize_t g = r->idle_poll ? sk_recv(r, dst, want, MSG_DONTWAIT) : -1;
        if (g < 0 && r->idle_poll && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        if (g < 0 && r->flush) r->flush(r->arg);
        /* After a batch's last frame, a peer that sends its next batch
         * within spin_ns (the next small write after its ack) finds this
         * thread awake: a wake-up from poll() costs a cross-CPU interrupt,
         * tens of microseconds in a VM. Mid-batch (the sender is slower
         * than this thread) it sleeps at once: looking then would take
         * the CPU the sender needs. */
        int armed = r->spin_armed;
        r->spin_armed = 0;
        if (g < 0 && r->idle_poll && r->spin_ns && armed) {
            uint64_t until = sk_now_ns() + r->spin_ns;
            do {
                sched_yield();
                g = sk_recv(r, dst, want, MSG_DONTWAIT);
                if (g < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
            } while (g < 0 && sk_now_ns() < until);
        }
        if (g < 0) {
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
            return sk_read_exact(r, h, sizeof(*h));
        }
        for (size_t got = (size_t)g; got < sizeof(*h);) {
            ssize_t k = sk_recv(r, (char *)h + got, sizeof(*h) - got, MSG_WAITALL);
            if (k <= 0) return -1;
            got += (size_t)k;
        }
        return 0;
    }
    return sk_read_exact(r, h, sizeof(*h));
}

/* Whether the peer's kernel has left this connection unanswered for
 * grace_ms: no ACK from it for that long while bytes we sent wait for one,
 * or while two probes (zero-window or keepalive) are unanswered. A
 * stopped, starved or paused process's kernel still acknowledges what
 * reaches it, and answers window probes while its receive buffer is full,
 * so this tells a host (or rail) that is gone from a process that is only
 * slow; a closed window alone is never "gone" (its probes are answered:
 * the kernel resets tcpi_probes on each answer). One look can catch the
 * moment between a send after a long silence and its ACK: callers confirm
 * on a second look. 0 also when the socket cannot say (not tcp). */
int sk_unanswered(int fd, uint32_t grace_ms) {
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    memset(&ti, 0, sizeof(ti));
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0 ||
        len < offsetof(struct tcp_info, tcpi_last_ack_recv) + sizeof(ti.tcpi_last_ack_recv))
        return 0;
    if (ti.tcpi_last_ack_recv < grace_ms) return 0;
    return ti.tcpi_unacked > 0 || ti.tcpi_probes >= 2;
}

int sk_heard(int fd, uint32_t grace_ms, int *unheard) {
    int now = sk_unanswered(fd, grace_ms);
    int gone = now && *unheard;
    *unheard = now;
    return !gone;
}

void sk_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}
